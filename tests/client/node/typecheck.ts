// The Node client's public API as a TypeScript user writes it, type-checked
// (tsc --noEmit --strict, never run) by test_node_client.py twice: against
// client/node's declarations, and as installed from the package's tarball.
// Each `@ts-expect-error` line is a misuse the declarations must refuse
// (tsc fails on one they accept).

import {
  DEFAULT_PROTO_PATH, MAX_CHUNK_BYTES, RelayClient, RelayError, TOKEN_ENV, accountingOf, bearerInterceptor,
  channelCredentials, chunkRequests, loadRelayService, newMessageId, nextPos, planUpload, readTokenFile, statusName,
} from 'kvrelay-client';
import type {
  Accounting, Message, MessageHeader, PublishError, PublishResult, RelayClientOptions, StatsResponse, StatusName,
  Turn, TurnLayer,
} from 'kvrelay-client';
import {
  DTYPE_SIZE, readSafetensors, readTurnFile, writeMessageFile, writeSafetensors,
} from 'kvrelay-client/safetensors';
import { crc32c, crc32cCombine } from 'kvrelay-client/crc32c';

const KV = 2;
const SCORE = 4;
const DIM = 16;
const PROMPT = 8;
const GEN = 2;

function syntheticTurn(): Turn {
  const kv = (n: number) => new Float32Array(KV * n * DIM).fill(0.5);
  const layer: TurnLayer = {
    promptK: kv(PROMPT), promptV: kv(PROMPT), genK: kv(GEN), genV: kv(GEN),
    promptScore: new Float32Array(SCORE * PROMPT).fill(1 / PROMPT),
  };
  return { dtype: 'F32', kvHeads: KV, scoreHeads: SCORE, headDim: DIM, nPrompt: PROMPT, nGen: GEN, layers: [layer] };
}

async function exchange(relay: RelayClient, turn: Turn): Promise<Message> {
  const messageId = newMessageId();
  let published: PublishResult;
  try {
    published = await relay.publish(turn, {
      sessionId: 's1', sender: 'planner', recipients: ['critic'], messageId, policy: 'h2o-head:k=32+obf:p=8',
      timeoutMs: 120_000,
    });
  } catch (err) {
    const code: StatusName | undefined = statusName(err);
    if (code === 'UNAVAILABLE' || code === 'DEADLINE_EXCEEDED') {
      // The outcome is unknown: retry with the same id.
      const again = err as PublishError;
      published = await relay.publish(turn, { sessionId: 's1', sender: 'planner', recipients: 'critic',
                                              messageId: again.messageId });
    } else {
      throw err;
    }
  }
  const a: Accounting | null = published.accounting;
  if (a !== null && a.attentionError !== null) console.log(a.attentionError.toFixed(6), a.ratio, a.policy);
  console.log(published.messageId, published.duplicate);

  const msg = await relay.fetch('s1', 'critic', { timeoutMs: 30_000 });
  const h: MessageHeader = msg.header;
  for (const t of msg.tensors) {
    const bytes: Buffer = t.data;
    console.log(t.name, t.layer, t.part, t.dtype, t.shape.join('x'), bytes.length);
  }
  console.log(h.nHistory + h.nAnchor + h.nKept + h.nGen, h.quantBits, h.anchorPos, msg.nextPos === nextPos(msg));
  await relay.ack('s1', 'critic', h.messageId);
  return msg;
}

async function main(): Promise<void> {
  const options: RelayClientOptions = {
    tlsCa: 'ca.pem', tlsCert: Buffer.from('cert'), tlsKey: 'agent.key', tlsServerName: 'relay',
    token: readTokenFile('planner.token'), channelOptions: { 'grpc.max_receive_message_length': 8 << 20 },
  };
  const relay = new RelayClient('127.0.0.1:50051', options);
  try {
    const turn = await readTurnFile('turn.safetensors');
    turn.historyAnchors = [0, 1];
    const msg = await exchange(relay, turn);
    await writeMessageFile('msg.safetensors', msg);
    const compressed: Message = await relay.compress(syntheticTurn(), 'int4:group=32', { timeoutMs: 60_000 });
    const freed: number = await relay.closeSession('s1');
    const stats: StatsResponse = await relay.stats();
    console.log(compressed.tensors.length, freed, stats.messagesAcked, stats.version);
  } catch (err) {
    if (err instanceof RelayError) console.log(err.code, err.details, err.messageId);
    else if (statusName(err) !== undefined) console.log(statusName(err));
    throw err;
  } finally {
    relay.close();
  }

  const { geometry, tensors } = planUpload(syntheticTurn());
  console.log(geometry.dtype, geometry.historyAnchors?.length, tensors[0].part);
  for (const request of chunkRequests(tensors)) {
    if ('chunk' in request) console.log(request.chunk.crc32c <= MAX_CHUNK_BYTES);
    else console.log(request.commit.bytes);
  }
  const acc: Accounting = accountingOf({ policy: 'full' });
  console.log(acc.attentionError, accountingOf(null), DEFAULT_PROTO_PATH, TOKEN_ENV, loadRelayService().serviceName);
  console.log(channelCredentials({ tlsCa: 'ca.pem' }), bearerInterceptor('t0ken'));

  const file = await readSafetensors('turn.safetensors');
  const k = file.tensors.get('layer.0.prompt.k');
  if (k) console.log(k.dtype, DTYPE_SIZE[k.dtype] * k.shape.reduce((x, y) => x * y, 1) === k.data.length);
  await writeSafetensors('copy.safetensors', [{ name: 'x', dtype: 'F32', shape: [2], data: new Float32Array(2) }],
                         file.metadata);
  console.log(crc32cCombine(crc32c(Buffer.from('ab')), crc32c(Buffer.from('c')), 1) === crc32c(Buffer.from('abc')));

  // Misuses the declarations refuse.
  // @ts-expect-error publish needs its options (sessionId, sender, recipients)
  await relay.publish(syntheticTurn());
  // @ts-expect-error recipients are agent ids
  await relay.publish(syntheticTurn(), { sessionId: 's', sender: 'a', recipients: [1] });
  // @ts-expect-error a session id is a string
  await relay.fetch(1, 'critic');
  // @ts-expect-error ack resolves to nothing
  const acked: number = await relay.ack('s1', 'critic', 'm-1');
  // @ts-expect-error the K/V dtype is F32, F16 or BF16
  const badTurn: Turn = { ...syntheticTurn(), dtype: 'I32' };
  // @ts-expect-error no such method
  relay.subscribe('s1');
  // @ts-expect-error attentionError may be null
  console.log(acc.attentionError.toFixed(3), acked, badTurn);
}

main().catch((err: unknown) => {
  console.error(err);
  process.exitCode = 1;
});
