#!/usr/bin/env node
'use strict';
// kvrelay-example: publishes one turn file to a relay, fetches the composed
// message as the recipient, writes it as a message file and acknowledges it.
//
//   node example.js --addr 127.0.0.1:50051 --in turn.safetensors --out msg.safetensors \
//       [--policy SPEC] [--session S] [--from planner] [--to critic] [--id MSGID] \
//       [--parent MSGID] [--timeout SECONDS] [--proto relay.proto] \
//       [--tls-ca FILE [--tls-cert FILE --tls-key FILE]] [--token-file FILE]
//
// --parent continues a relayed cache: the turn goes with the parent message's
// id (of the same session, delivered to --from) in place of a history, and
// the relay composes it on the message it holds. The turn file may then carry
// history.score over the parent's tokens.
//
// --tls-ca turns TLS on; the token (first line of --token-file, else
// $KVRELAY_TOKEN) goes with every call as "authorization: Bearer TOKEN".
//
// Exit status: 0 ok, 1 a failed call or bad file, 2 usage error. Errors print
// as "kvrelay-example: STEP: CODE: details", e.g.
// "kvrelay-example: publish: INVALID_ARGUMENT: header.policy '...': ...".

const { parseArgs } = require('node:util');
const { RelayClient, DEFAULT_PROTO_PATH, newMessageId, readTokenFile, statusName } = require('./client');
const { readTurnFile, writeMessageFile } = require('./safetensors');

const USAGE = 'usage: example.js --addr HOST:PORT --in TURN.safetensors --out MSG.safetensors ' +
              '[--policy SPEC] [--session S] [--from AGENT] [--to AGENT] [--id MSGID] [--parent MSGID] ' +
              '[--timeout SECONDS] [--proto PATH] [--tls-ca FILE [--tls-cert FILE --tls-key FILE]] ' +
              '[--token-file FILE]';

class StepError extends Error {
  constructor(step, cause) {
    super(`${step}: ${statusName(cause) ? `${statusName(cause)}: ${cause.details}` : cause.message}`, { cause });
  }
}

async function step(name, promise) {
  try {
    return await promise;
  } catch (err) {
    throw new StepError(name, err);
  }
}

async function run(opts) {
  const timeoutMs = Number(opts.timeout) * 1000;
  const turn = await step('read turn', readTurnFile(opts.in));
  let token;
  if (opts['token-file']) {
    try {
      token = readTokenFile(opts['token-file']);
    } catch (err) {
      throw new StepError('read token', err);
    }
  }
  let relay;
  try {
    relay = new RelayClient(opts.addr, { protoPath: opts.proto, tlsCa: opts['tls-ca'], tlsCert: opts['tls-cert'],
                                         tlsKey: opts['tls-key'], token });
  } catch (err) {
    throw new StepError('dial', err);
  }
  try {
    const published = await step('publish', relay.publish(turn, {
      sessionId: opts.session,
      sender: opts.from,
      recipients: [opts.to],
      messageId: opts.id || newMessageId(),
      policy: opts.policy,
      parentId: opts.parent,
      timeoutMs,
    }));
    const a = published.accounting;
    // attention_error: the fidelity figure, for a turn with queries only.
    const figure = a.attentionError === null ? '' : ` attention_error=${a.attentionError}`;
    console.log(`published message_id=${published.messageId} duplicate=${published.duplicate} ` +
                `policy=${a.policy} full_bytes=${a.fullBytes} sent_bytes=${a.sentBytes} ratio=${a.ratio.toFixed(3)}` +
                figure);

    const message = await step('fetch', relay.fetch(opts.session, opts.to, { timeoutMs }));
    // Fetch delivers the oldest unacknowledged message: one left by an earlier
    // run is not ours to write or acknowledge.
    if (message.header.messageId !== published.messageId) {
      throw new Error(`fetch: got message ${message.header.messageId}, expected ${published.messageId} (the one ` +
                      `just published): session ${opts.session} holds an older unacknowledged message for ` +
                      `${opts.to}; fetch it with kvrelayctl, or use another --session`);
    }
    // Acknowledge only once the message is safely on disk.
    await step('write message', writeMessageFile(opts.out, message));
    const h = message.header;
    await step('ack', relay.ack(opts.session, opts.to, h.messageId, { timeoutMs }));
    console.log(`fetched message_id=${h.messageId} delivery_attempt=${h.deliveryAttempt} layers=${h.layers} ` +
                `history=${h.nHistory} anchor=${h.nAnchor} kept=${h.nKept} gen=${h.nGen} ` +
                `quant_bits=${h.quantBits} tensors=${message.tensors.length} acked=true out=${opts.out}`);
  } finally {
    relay.close();
  }
}

async function main() {
  let opts;
  try {
    ({ values: opts } = parseArgs({
      options: {
        addr: { type: 'string' },
        in: { type: 'string' },
        out: { type: 'string' },
        policy: { type: 'string', default: '' },
        session: { type: 'string', default: 'node-example' },
        from: { type: 'string', default: 'planner' },
        to: { type: 'string', default: 'critic' },
        id: { type: 'string' },
        parent: { type: 'string', default: '' },
        timeout: { type: 'string', default: '60' },
        proto: { type: 'string', default: DEFAULT_PROTO_PATH },
        'tls-ca': { type: 'string' },
        'tls-cert': { type: 'string' },
        'tls-key': { type: 'string' },
        'token-file': { type: 'string' },
      },
      strict: true,
    }));
    for (const f of ['addr', 'in', 'out']) if (!opts[f]) throw new Error(`missing required flag --${f}`);
    if (Boolean(opts['tls-cert']) !== Boolean(opts['tls-key'])) {
      throw new Error('flags --tls-cert and --tls-key: expected both or neither');
    }
    if (opts['tls-cert'] && !opts['tls-ca']) throw new Error('flag --tls-cert needs --tls-ca (which turns TLS on)');
    if (!(Number(opts.timeout) > 0 && Number.isFinite(Number(opts.timeout)))) throw new Error(`flag --timeout: "${opts.timeout}", expected seconds > 0`);
  } catch (err) {
    console.error(`kvrelay-example: ${err.message}\n${USAGE}`);
    return 2;
  }
  try {
    await run(opts);
    return 0;
  } catch (err) {
    console.error(`kvrelay-example: ${err.message}`);
    return 1;
  }
}

main().then((code) => { process.exitCode = code; });
