'use strict';
// Node.js client of the kvrelay.v1.Relay service (proto/kvrelay/v1/relay.proto),
// with @grpc/grpc-js and @grpc/proto-loader (the .proto is loaded at run time).
// Declarations: client.d.ts.
//
//   const { RelayClient } = require('kvrelay-client');
//   const relay = new RelayClient('127.0.0.1:50051');
//   // or TLS with a token: new RelayClient('relay:50051', { tlsCa: 'ca.pem', token })
//   const r = await relay.publish(turn, { sessionId: 's1', sender: 'planner',
//                                         recipients: ['critic'], policy: 'h2o-head:k=32+obf:p=8' });
//   const msg = await relay.fetch('s1', 'critic', { timeoutMs: 30000 });
//   await relay.ack('s1', 'critic', msg.header.messageId);
//   relay.close();
//
// Every method returns a promise. Errors are the relay's gRPC status (an
// Error with numeric `code` and `details`, see grpc.status) or a RelayError of
// the same shape for what this client checks itself: DATA_LOSS for every
// malformed delivery (out of order or missing chunks, bad sizes, a header
// that describes no valid message, a sentBytes, CRC32C or trailer mismatch),
// INVALID_ARGUMENT, before any call, for arguments that cannot be sent.
// Nothing is retried.
//
// Retrying a publish is safe only with the SAME message id: a re-publish of a
// committed id answers with duplicate = true, while a new id publishes a
// second message. When the outcome is unknown (DEADLINE_EXCEEDED,
// UNAVAILABLE, ...) retry with the id you passed, or, when you passed none,
// with the one the error carries: every error publish() rejects with has
// `messageId`, the id that publish carried (also when it was generated).
// Simplest: choose the id up front with newMessageId().

const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');
const buffer = require('node:buffer');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { crc32c, crc32cCombine } = require('./crc32c');
const { DTYPE_SIZE, nextPos } = require('./safetensors');

/**
 * The contract: the package's copy (`npm pack` puts the repository's
 * relay.proto there), or in the source tree, which has no copy, the
 * repository's own.
 */
const PACKAGED_PROTO_PATH = path.join(__dirname, 'proto', 'kvrelay', 'v1', 'relay.proto');
const DEFAULT_PROTO_PATH = fs.existsSync(PACKAGED_PROTO_PATH) ?
  PACKAGED_PROTO_PATH : path.resolve(__dirname, '../../proto/kvrelay/v1/relay.proto');
/** relay.proto: a Chunk carries 1 .. 1 MiB of tensor bytes. */
const MAX_CHUNK_BYTES = 1 << 20;
const ID_PATTERN = /^[A-Za-z0-9._:-]{1,128}$/;
const STATUS_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([name, code]) => [code, name]));

/** An error this client detected itself, shaped like a gRPC status error. */
class RelayError extends Error {
  constructor(code, details) {
    super(`${STATUS_NAMES[code]}: ${details}`);
    this.name = 'RelayError';
    this.code = code;
    this.details = details;
  }
}

/** "INVALID_ARGUMENT", ... for an error with a gRPC status code; undefined otherwise. */
function statusName(err) {
  return err && typeof err.code === 'number' ? STATUS_NAMES[err.code] : undefined;
}

/** A fresh message id: "m-" and 24 random hex digits. */
function newMessageId() {
  return 'm-' + crypto.randomBytes(12).toString('hex');
}

/** An argument the caller passed that cannot be sent: INVALID_ARGUMENT, before any call. */
function invalid(details) {
  return new RelayError(grpc.status.INVALID_ARGUMENT, details);
}

/**
 * A delivery that does not assemble (out of order, a chunk missing, a bad
 * size, a header that describes no valid message, a sentBytes, CRC32C or
 * trailer mismatch): DATA_LOSS, for the relay sent damaged data and the
 * caller did nothing wrong.
 */
function corrupt(details) {
  return new RelayError(grpc.status.DATA_LOSS, details);
}

function checkId(field, value, { required = true } = {}) {
  if (!required && !value) return;
  if (typeof value !== 'string' || !ID_PATTERN.test(value)) {
    throw invalid(`${field}: ${JSON.stringify(value)}, expected [A-Za-z0-9._:-]{1,128}`);
  }
}

function deadlineAfter(timeoutMs) {
  if (typeof timeoutMs !== 'number' || !Number.isFinite(timeoutMs) || timeoutMs <= 0) {
    throw invalid(`timeoutMs: ${JSON.stringify(timeoutMs)}, expected a positive number of milliseconds`);
  }
  return new Date(Date.now() + timeoutMs);
}

/** The environment variable the token comes from when the `token` option is unset. */
const TOKEN_ENV = 'KVRELAY_TOKEN';

// PEM bytes of a TLS option: a file path, or the bytes themselves.
function pemOption(field, value) {
  if (Buffer.isBuffer(value)) return value;
  if (value instanceof Uint8Array) return Buffer.from(value.buffer, value.byteOffset, value.byteLength);
  if (typeof value !== 'string') {
    throw invalid(`${field}: ${value === null ? 'null' : typeof value}, expected a file path or a Buffer of PEM`);
  }
  try {
    return fs.readFileSync(value);
  } catch (err) {
    throw invalid(`${field}: ${err.message}`);
  }
}

/**
 * The channel credentials for the TLS options: insecure without `tlsCa`,
 * else TLS verifying the relay against `tlsCa`, presenting
 * `tlsCert`/`tlsKey` when given (both or neither).
 */
function channelCredentials({ tlsCa, tlsCert, tlsKey } = {}) {
  const given = (v) => v !== undefined && v !== null && v !== '';
  if (given(tlsCert) !== given(tlsKey)) throw invalid('tlsCert and tlsKey: expected both or neither');
  if (!given(tlsCa)) {
    if (given(tlsCert)) throw invalid('tlsCert: given without tlsCa, expected tlsCa too (it turns TLS on)');
    return grpc.credentials.createInsecure();
  }
  const ca = pemOption('tlsCa', tlsCa);
  if (!ca.includes('-----BEGIN CERTIFICATE-----')) {
    throw invalid(`tlsCa: ${typeof tlsCa === 'string' ? tlsCa : 'Buffer'}: no PEM certificate, expected one or more`);
  }
  return given(tlsCert) ?
    grpc.credentials.createSsl(ca, pemOption('tlsKey', tlsKey), pemOption('tlsCert', tlsCert)) :
    grpc.credentials.createSsl(ca);
}

/**
 * A client interceptor that adds `authorization: Bearer TOKEN` to every
 * call's metadata (on insecure channels too: a relay's local listener is
 * plaintext by design). A token must be visible ASCII (0x21..0x7e); the
 * error says where it is not, never the token.
 */
function bearerInterceptor(token) {
  if (typeof token !== 'string' || token === '') {
    throw invalid(`token: ${typeof token === 'string' ? 'empty' : typeof token}, expected a bearer token string`);
  }
  for (let i = 0; i < token.length; i++) {
    const c = token.charCodeAt(i);
    if (c < 0x21 || c > 0x7e) {
      throw invalid(`token: character ${i} of ${token.length} is U+${c.toString(16).padStart(4, '0')}, ` +
                    'expected visible ASCII (0x21..0x7e)');
    }
  }
  const value = `Bearer ${token}`;
  return (options, nextCall) => new grpc.InterceptingCall(nextCall(options), {
    start(metadata, listener, next) {
      metadata.set('authorization', value);
      next(metadata, listener);
    },
  });
}

/**
 * The first line of the file at `file`, surrounding whitespace trimmed; an
 * empty first line is an error.
 */
function readTokenFile(file) {
  const token = fs.readFileSync(file, 'utf8').split('\n', 1)[0].trim();
  if (!token) throw new Error(`token file ${file}: first line empty, expected the token`);
  return token;
}

/**
 * Loads the Relay service constructor from relay.proto. Field names are
 * camelCase (sessionId), enums strings ('PART_K'), 64-bit integers numbers
 * (byte counts stay far below 2^53), and `kind` names the oneof member set.
 */
function loadRelayService(protoPath = DEFAULT_PROTO_PATH) {
  const definition = protoLoader.loadSync(protoPath, {
    keepCase: false,
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).kvrelay.v1.Relay;
}

// ---- uploads ----------------------------------------------------------------

// Upload order of one layer (relay.proto, "Tensor order"): [part, turn field,
// file-format name, bytes for turn geometry g], then the attention input
// (SCORE_PART, or QUERY_PART when the turn has a queryDtype), then history.
const UPLOAD_PARTS = [
  ['PART_PROMPT_K', 'promptK', 'prompt.k', (g, kv) => g.kvHeads * g.nPrompt * g.headDim * kv],
  ['PART_PROMPT_V', 'promptV', 'prompt.v', (g, kv) => g.kvHeads * g.nPrompt * g.headDim * kv],
  ['PART_GEN_K', 'genK', 'gen.k', (g, kv) => g.kvHeads * g.nGen * g.headDim * kv],
  ['PART_GEN_V', 'genV', 'gen.v', (g, kv) => g.kvHeads * g.nGen * g.headDim * kv],
];
const SCORE_PART = ['PART_PROMPT_SCORE', 'promptScore', 'prompt.score', (g) => g.scoreHeads * g.nPrompt * 4];
const HISTORY_SCORE_PART = ['PART_HISTORY_SCORE', 'historyScore', 'history.score',
                            (g) => g.scoreHeads * g.historyScoreTokens * 4];
const QUERY_PART = ['PART_GEN_Q', 'genQ', 'gen.q', (g, kv, q) => g.scoreHeads * g.nGen * g.headDim * q];
const KV_SIZE = { F32: 4, F16: 2, BF16: 2 };
const HISTORY_PARTS = [
  ['PART_HISTORY_K', 'historyK', 'history.k', (g, kv) => g.kvHeads * g.nHistory * g.headDim * kv],
  ['PART_HISTORY_V', 'historyV', 'history.v', (g, kv) => g.kvHeads * g.nHistory * g.headDim * kv],
  ['PART_HISTORY_POS', 'historyPos', 'history.pos', (g) => g.kvHeads * g.nHistory * 4],
];

/**
 * The TurnGeometry of `turn` and its tensors in upload order; checks that
 * every tensor has the byte length its geometry implies.
 *
 * A turn: { dtype: 'F32'|'F16'|'BF16', kvHeads, scoreHeads, headDim, nPrompt,
 * nGen, nHistory (0), firstAgent (nHistory === 0), promptPos0 (optional),
 * queryDtype (optional), softmaxScale (optional), layers: [{ promptK,
 * promptV, genK, genV, promptScore | genQ[, historyK, historyV, historyPos]
 * }] } with every tensor as little-endian bytes (Uint8Array or Buffer, or
 * another typed array or DataView, taken as its bytes; BF16 as its 16-bit
 * patterns, scores F32, positions I32).
 *
 * The attention input, the same in every layer: without queryDtype the
 * scores, promptScore F32 [scoreHeads, nPrompt]; with queryDtype ('F32' or
 * the K/V dtype) the generated steps' post-RoPE queries instead, genQ
 * [scoreHeads, nGen, headDim] in that dtype, from which the relay computes
 * the scores with softmaxScale as the logit scale (a number in [1e-6, 1e3];
 * unset: 1/sqrt(headDim)). A layer carries exactly one of the two.
 *
 * With promptScore, every layer or none may carry historyScore, F32
 * [scoreHeads, historyScoreTokens]: this agent's attention mass on each
 * history token (finite, >= 0), in the history's token order per KV head.
 * historyScoreTokens is the history's tokens per head: nHistory for an
 * uploaded history (its default then), or with a parentId the parent
 * message's (its header's nHistory + nAnchor + nKept + nGen; required).
 * historyAnchors (optional, only with nHistory > 0): the position ids of the
 * chain's anchors that the uploaded history holds (a fetched message's
 * header.anchorPos), ascending; a history budget (hist=) never drops them.
 */
function planUpload(turn) {
  if (turn === null || typeof turn !== 'object') {
    throw invalid(`turn: ${turn === null ? 'null' : typeof turn}, expected an object (see planUpload)`);
  }
  const kv = KV_SIZE[turn.dtype];
  if (!kv) throw invalid(`turn.dtype: ${JSON.stringify(turn.dtype)}, expected F32, F16 or BF16`);
  if (!Array.isArray(turn.layers) || turn.layers.length === 0) {
    throw invalid('turn.layers: empty, expected at least one layer');
  }
  const queryDtype = checkAttentionInput(turn);
  const scale = turn.softmaxScale ?? undefined;
  if (scale !== undefined && !(typeof scale === 'number' && scale >= 1e-6 && scale <= 1e3)) {
    throw invalid(`turn.softmaxScale: ${typeof scale === 'string' ? JSON.stringify(scale) : scale}, ` +
                  'expected a finite number in [1e-06, 1000] or undefined (1/sqrt(headDim))');
  }
  // `undefined` or `null` take the defaults too (a spread would keep them).
  // firstAgent unset: the chain's first agent exactly when no history is
  // uploaded (a later agent's own first tokens are no anchors).
  const nHistory = turn.nHistory ?? 0;
  const g = { ...turn, nHistory, firstAgent: turn.firstAgent ?? nHistory === 0 };
  for (const f of ['kvHeads', 'scoreHeads', 'headDim', 'nPrompt', 'nGen', 'nHistory']) {
    if (!Number.isSafeInteger(g[f]) || g[f] < 0 || g[f] > 0xffffffff) {
      throw invalid(`turn.${f}: ${g[f]}, expected an integer 0..4294967295`);
    }
  }
  if (typeof g.firstAgent !== 'boolean') {
    throw invalid(`turn.firstAgent: ${JSON.stringify(g.firstAgent)}, expected true or false`);
  }
  const pos0 = g.promptPos0 ?? undefined;
  if (pos0 !== undefined && !(Number.isSafeInteger(pos0) && pos0 >= 0)) {
    throw invalid(`turn.promptPos0: ${typeof pos0 === 'string' ? JSON.stringify(pos0) : pos0}, ` +
                  'expected an integer >= 0 (or undefined: after the history or the parent)');
  }
  const anchors = checkAnchors(turn.historyAnchors, g.nHistory);
  g.historyScoreTokens = checkHistoryScore(turn, queryDtype, g.nHistory);
  const attention = queryDtype ? QUERY_PART : SCORE_PART;
  const parts = UPLOAD_PARTS.concat([attention], g.historyScoreTokens > 0 ? [HISTORY_SCORE_PART] : [],
                                    g.nHistory > 0 ? HISTORY_PARTS : []);
  const q = queryDtype ? KV_SIZE[queryDtype] : 0;
  const tensors = [];
  turn.layers.forEach((layer, l) => {
    for (const [part, field, name, bytes] of parts) {
      let data = layer[field];
      if (ArrayBuffer.isView(data) && !(data instanceof Uint8Array)) {
        data = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
      }
      const want = bytes(g, kv, q);
      if (!(data instanceof Uint8Array) || data.length !== want) {
        if (data == null && part === 'PART_PROMPT_SCORE') {
          throw invalid(`layer.${l}.prompt.score: missing, expected it or layer.${l}.gen.q (the queries)`);
        }
        const got = data instanceof Uint8Array ? `${data.length} bytes` : data == null ? 'missing' : typeof data;
        throw invalid(`layer.${l}.${name}: ${got}, expected ${want} bytes (a Uint8Array or typed array)`);
      }
      tensors.push({ layer: l, part, data });
    }
  });
  const geometry = {
    layers: turn.layers.length,
    kvHeads: g.kvHeads,
    scoreHeads: g.scoreHeads,
    headDim: g.headDim,
    dtype: `DTYPE_${g.dtype}`,
    nPrompt: g.nPrompt,
    nGen: g.nGen,
    nHistory: g.nHistory,
    firstAgent: g.firstAgent,
  };
  if (pos0 !== undefined) geometry.promptPos0 = pos0;
  if (queryDtype) geometry.queryDtype = `DTYPE_${queryDtype}`;
  if (scale !== undefined) geometry.softmaxScale = scale;
  if (anchors.length) geometry.historyAnchors = anchors;
  if (g.historyScoreTokens) geometry.historyScoreTokens = g.historyScoreTokens;
  return { geometry, tensors };
}

/**
 * turn.historyAnchors as a fresh array: ascending distinct integer position
 * ids in [0, 2^31), at most nHistory of them, none without history (unset,
 * null or []: none). Whether every head holds each is the relay's to check.
 */
function checkAnchors(value, nHistory) {
  if (value == null) return [];
  if (!Array.isArray(value) && !(ArrayBuffer.isView(value) && !(value instanceof DataView))) {
    throw invalid(`turn.historyAnchors: ${typeof value === 'string' ? JSON.stringify(value) : typeof value}, ` +
                  'expected an array of position ids');
  }
  const ids = Array.from(value);
  ids.forEach((id, i) => {
    if (!Number.isSafeInteger(id) || id < 0 || id >= 2 ** 31) {
      throw invalid(`turn.historyAnchors[${i}]: ${typeof id === 'string' ? JSON.stringify(id) : id}, ` +
                    'expected an integer position id in [0, 2^31)');
    }
    if (i > 0 && id <= ids[i - 1]) {
      throw invalid(`turn.historyAnchors[${i}]: ${id} after ${ids[i - 1]}, expected ascending distinct position ids`);
    }
  });
  if (ids.length && nHistory === 0) {
    throw invalid(`turn.historyAnchors: ${ids.length} position ids, expected none for a turn without history ` +
                  "(with parentId the relay takes the parent's anchors)");
  }
  if (ids.length > nHistory) {
    throw invalid(`turn.historyAnchors: ${ids.length} position ids, expected at most nHistory = ${nHistory}`);
  }
  return ids;
}

/**
 * The columns of the layers' historyScore, 0 when they carry none:
 * turn.historyScoreTokens, by default nHistory. Checks that every layer or
 * none carries one, never with queries, and that an uploaded history's
 * score covers nHistory tokens; without uploaded history the columns are
 * the parent's tokens per head, which only the relay can check. (Each
 * layer's byte length is checked with the other tensors.)
 */
function checkHistoryScore(turn, queryDtype, nHistory) {
  const given = turn.layers.map((layer) => layer.historyScore != null);
  const n = turn.historyScoreTokens ?? undefined;
  if (n !== undefined && !(Number.isSafeInteger(n) && n >= 0 && n <= 0xffffffff)) {
    throw invalid(`turn.historyScoreTokens: ${typeof n === 'string' ? JSON.stringify(n) : n}, ` +
                  'expected an integer 0..4294967295');
  }
  if (!given.some(Boolean)) {
    if (n) throw invalid(`turn.historyScoreTokens: ${n}, expected 0 or unset (no layer carries a historyScore)`);
    return 0;
  }
  const missing = given.indexOf(false);
  if (missing >= 0) {
    throw invalid(`layer.${missing}.history.score: missing, expected it in every layer or in none ` +
                  `(layer.${given.indexOf(true)} has one)`);
  }
  if (queryDtype) {
    throw invalid('layer.0.history.score: given with layer.0.gen.q, expected none ' +
                  '(the relay computes the mass on the history from the queries)');
  }
  if (!n && nHistory === 0) {
    throw invalid(`turn.historyScoreTokens: ${n === undefined ? 'unset' : n}, expected the parent's tokens per ` +
                  'head (its header\'s nHistory + nAnchor + nKept + nGen) for a historyScore without uploaded history');
  }
  if (nHistory > 0 && n && n !== nHistory) {
    throw invalid(`turn.historyScoreTokens: ${n}, expected nHistory = ${nHistory} (the uploaded history's tokens)`);
  }
  return n || nHistory;
}

/** A historyScore needs a history: uploaded, or the parent's (`parent`: the call has one). */
function checkHistoryScoreHasHistory(geometry, parent) {
  if (geometry.historyScoreTokens && !geometry.nHistory && !parent) {
    throw invalid(`layer.0.history.score: [${geometry.scoreHeads}, ${geometry.historyScoreTokens}] given without ` +
                  'history, expected none (upload the history, or publish with parentId: its columns are then ' +
                  "the parent's tokens per head)");
  }
}

/**
 * An Accounting as this client hands it out: attentionError is the
 * fidelity figure (a number, 0 included) for a turn with queries, null
 * otherwise; proto-loader's marker of the optional field is dropped.
 */
function accountingOf(a) {
  if (a == null) return a;
  const { _attentionError: _marker, attentionError, ...rest } = a;
  return { ...rest, attentionError: typeof attentionError === 'number' ? attentionError : null };
}

/**
 * The dtype of the layers' genQ ('F32' or the K/V dtype), or undefined when
 * they carry promptScore, as turn.queryDtype says (unset, null or ''
 * for promptScore); checks that every layer
 * is an object carrying exactly one of the two, the same one as layer 0.
 */
function checkAttentionInput(turn) {
  const queryDtype = turn.queryDtype === '' || turn.queryDtype == null ? undefined : turn.queryDtype;
  turn.layers.forEach((layer, l) => {
    if (layer === null || typeof layer !== 'object') {
      throw invalid(`turn.layers[${l}]: ${layer === null ? 'null' : typeof layer}, expected an object of tensors`);
    }
    const score = layer.promptScore != null;
    const q = layer.genQ != null;
    if (score && q) {
      throw invalid(`layer.${l}.gen.q: given together with layer.${l}.prompt.score, expected exactly one of the two`);
    }
    if (queryDtype !== undefined && score) {
      throw invalid(`layer.${l}.prompt.score: given, expected layer.${l}.gen.q ` +
                    `(turn.queryDtype is ${JSON.stringify(queryDtype)}: every layer carries the queries)`);
    }
    if (queryDtype === undefined && q) {
      throw invalid(l === 0 ?
        `layer.0.gen.q: dtype unset (turn.queryDtype undefined), expected 'F32' or the K/V dtype ('${turn.dtype}')` :
        `layer.${l}.gen.q: given, expected layer.${l}.prompt.score like layer.0 (every layer carries the same one)`);
    }
  });
  if (queryDtype !== undefined && queryDtype !== 'F32' && queryDtype !== turn.dtype) {
    throw invalid(`layer.0.gen.q: dtype ${JSON.stringify(queryDtype)} (turn.queryDtype), ` +
                  `expected 'F32' or the K/V dtype ('${turn.dtype}')`);
  }
  return queryDtype;
}

/** The requests after the header: every chunk, then the commit trailer. */
function* chunkRequests(tensors) {
  let chunks = 0;
  let bytes = 0;
  let crc = 0;
  for (const { layer, part, data } of tensors) {
    for (let offset = 0; offset < data.length; offset += MAX_CHUNK_BYTES) {
      const piece = data.subarray(offset, offset + MAX_CHUNK_BYTES);
      const pieceCrc = crc32c(piece);
      crc = crc32cCombine(crc, pieceCrc, piece.length);
      chunks++;
      bytes += piece.length;
      yield { chunk: { layer, part, offset, data: piece, crc32c: pieceCrc } };
    }
  }
  yield { commit: { chunks, bytes, crc32c: crc } };
}

// ---- deliveries -------------------------------------------------------------

const DTYPE_NAMES = { DTYPE_F32: 'F32', DTYPE_F16: 'F16', DTYPE_BF16: 'BF16' };

/**
 * A Buffer holding `buf`'s first `filled` bytes and then `data`, for a tensor
 * of `size` bytes being filled: `buf` itself when it has room, else a new one
 * whose length at most doubles (at least to fit data, at most to size), so
 * what is allocated stays within twice what was received and a complete
 * tensor's buffer is exactly its size. REQUIRES: filled + data.length <= size.
 */
function appendBounded(buf, filled, data, size) {
  const need = filled + data.length;
  if (!buf || need > buf.length) {
    const grown = Buffer.alloc(Math.min(size, Math.max(need, 2 * (buf ? buf.length : 0))));
    if (buf) buf.copy(grown, 0, 0, filled);
    buf = grown;
  }
  buf.set(data, filled);
  return buf;
}

/**
 * Rebuilds a message from a delivery stream: header, chunks, trailer. Memory
 * follows the data received, not what the header announces: a tensor's
 * buffer is made on its first chunk and grows (at most doubling, never past
 * the tensor's size) as chunks arrive, so a bogus header costs nothing.
 * Every failure is DATA_LOSS (corrupt).
 */
class Assembler {
  constructor() {
    // [{layer, part, name, dtype, shape, size, data, filled}]: data holds the
    // `filled` bytes received so far (its length is its capacity), null
    // before the first chunk.
    this.slots = null;
    this.done = false;
  }

  add(response) {
    if (this.done) throw corrupt('delivery stream: response after the trailer, expected the end');
    switch (response.kind) {
      case 'header': return this.start(response.header);
      case 'chunk': return this.addChunk(response.chunk);
      case 'trailer': return this.finish(response.trailer);
      default: throw corrupt('delivery stream: empty response, expected header, chunk or trailer');
    }
  }

  start(h) {
    if (this.slots) throw corrupt('header: given twice, expected one');
    for (const f of ['layers', 'kvHeads', 'headDim']) {
      if (!(h[f] >= 1)) throw corrupt(`header.${f}: ${h[f]}, expected >= 1`);
    }
    const dtype = DTYPE_NAMES[h.dtype];
    if (!dtype) throw corrupt(`header.dtype: ${h.dtype}, expected DTYPE_F32, DTYPE_F16 or DTYPE_BF16`);
    const n = h.nHistory + h.nAnchor + h.nKept + h.nGen;
    const next = h.nextPos ?? 0; // unset: a relay before the field
    if (!(Number.isSafeInteger(next) && next >= 0 && next <= 2 ** 31)) {
      throw corrupt(`header.nextPos: ${next}, expected 0..2^31`);
    }
    const H = h.kvHeads;
    const d = h.headDim;
    const bits = h.quantBits;
    let specs;
    if (bits) {
      if (![2, 4, 8].includes(bits)) throw corrupt(`header.quantBits: ${bits}, expected 0, 2, 4 or 8`);
      if (!(h.quantGroup >= 1)) throw corrupt(`header.quantGroup: ${h.quantGroup}, expected >= 1 when quantized`);
      if ((d * bits) % 8) throw corrupt(`header.headDim: ${d}, expected headDim * quantBits a multiple of 8`);
      const groups = Math.ceil(n / h.quantGroup);
      specs = [
        ['PART_K_CODES', 'k.codes', 'U8', [H, n, (d * bits) / 8]],
        ['PART_K_SCALE', 'k.scale', 'F16', [H, groups, d]],
        ['PART_K_ZERO', 'k.zero', 'F16', [H, groups, d]],
        ['PART_V_CODES', 'v.codes', 'U8', [H, n, (d * bits) / 8]],
        ['PART_V_SCALE', 'v.scale', 'F16', [H, n]],
        ['PART_V_ZERO', 'v.zero', 'F16', [H, n]],
      ];
    } else {
      specs = [['PART_K', 'k', dtype, [H, n, d]], ['PART_V', 'v', dtype, [H, n, d]]];
    }
    specs.push(['PART_POS', 'pos', 'I32', [H, n]]);
    let total = 0;
    const slots = [];
    for (let layer = 0; layer < h.layers; layer++) {
      for (const [part, suffix, dt, shape] of specs) {
        const size = shape.reduce((a, b) => a * b, 1) * DTYPE_SIZE[dt];
        total += size;
        if (size > buffer.constants.MAX_LENGTH || total > Number.MAX_SAFE_INTEGER) {
          throw corrupt(`header: layer.${layer}.${suffix} of ${size} bytes, expected a message this process can hold`);
        }
        slots.push({ layer, part, name: `layer.${layer}.${suffix}`, dtype: dt, shape, size, data: null, filled: 0 });
      }
    }
    this.header = { ...h, accounting: accountingOf(h.accounting) };
    this.slots = slots;
    this.total = total;
    this.next = 0;
    this.chunks = 0;
    this.bytes = 0;
    this.crc = 0;
    this.skipComplete();
  }

  skipComplete() {
    while (this.next < this.slots.length && this.slots[this.next].filled === this.slots[this.next].size) this.next++;
  }

  addChunk(c) {
    if (!this.slots) throw corrupt('chunk: before the header, expected a header first');
    const what = `chunk layer ${c.layer} ${c.part} offset ${c.offset}`;
    const slot = this.slots[this.next];
    if (!slot) throw corrupt(`${what}: after every tensor of the message is complete, expected the trailer`);
    if (c.layer !== slot.layer || c.part !== slot.part || c.offset !== slot.filled) {
      throw corrupt(`${what}: out of order, expected chunk layer ${slot.layer} ${slot.part} offset ${slot.filled}`);
    }
    const n = c.data.length;
    if (n < 1 || n > MAX_CHUNK_BYTES || n > slot.size - slot.filled) {
      throw corrupt(`${what}: ${n} data bytes, expected 1..${Math.min(MAX_CHUNK_BYTES, slot.size - slot.filled)} ` +
                    `(${slot.name} has ${slot.size} bytes)`);
    }
    const crc = crc32c(c.data);
    if (crc !== c.crc32c) {
      throw corrupt(`${what}: crc32c ${c.crc32c}, expected ${crc} (computed over the data)`);
    }
    slot.data = appendBounded(slot.data, slot.filled, c.data, slot.size);
    slot.filled += n;
    this.chunks++;
    this.bytes += n;
    this.crc = crc32cCombine(this.crc, crc, n);
    this.skipComplete();
  }

  finish(t) {
    if (!this.slots) throw corrupt('trailer: before the header, expected a header first');
    const slot = this.slots[this.next];
    if (slot) throw corrupt(`trailer: stream ended with ${slot.name} at ${slot.filled} of ${slot.size} bytes`);
    for (const [field, want] of [['chunks', this.chunks], ['bytes', this.bytes], ['crc32c', this.crc]]) {
      if (t[field] !== want) {
        throw corrupt(`trailer.${field}: ${t[field]}, expected ${want} (computed over the chunks received)`);
      }
    }
    const sent = this.header.accounting ? this.header.accounting.sentBytes : 0;
    if (sent !== this.total) {
      throw corrupt(`header.accounting.sentBytes: ${sent}, expected ${this.total} (bytes of the delivered tensors)`);
    }
    this.done = true;
  }

  /** { header, tensors: [{name, layer, part, dtype, shape, data}], nextPos } in delivery order. */
  message() {
    if (!this.done) {
      throw corrupt('delivery stream: ended without a trailer, expected header, chunks, trailer');
    }
    const tensors = this.slots.map(({ name, layer, part, dtype, shape, data }) =>
      ({ name, layer, part, dtype, shape, data: data || Buffer.alloc(0) }));
    return { header: this.header, tensors, nextPos: nextPos({ header: this.header, tensors }) };
  }
}

/** Consumes a Fetch/Compress response stream; cancels the call on a local error. */
async function readDelivery(call) {
  const assembler = new Assembler();
  try {
    for await (const response of call) assembler.add(response);
  } catch (err) {
    if (err instanceof RelayError) {
      call.on('error', () => {}); // the CANCELLED status that cancel() causes
      call.cancel();
    }
    throw err;
  }
  return assembler.message();
}

// ---- the client ---------------------------------------------------------------

class RelayClient {
  #stub;
  #calls = new Set();

  /**
   * @param {string} address "HOST:PORT" or "unix:PATH"
   * @param {{protoPath?: string, tlsCa?: string|Buffer, tlsCert?: string|Buffer, tlsKey?: string|Buffer,
   *          tlsServerName?: string, token?: string, credentials?: grpc.ChannelCredentials,
   *          channelOptions?: Object}} [options]
   *   tlsCa (a PEM file path or its bytes) turns TLS on, verifying the relay's
   *   certificate against it (for the host of `address`, or tlsServerName);
   *   tlsCert/tlsKey are the client certificate and key (both or neither).
   *   Without tlsCa the channel is insecure, unless `credentials` are given
   *   (then no tls* option). `token` (unset or empty: process.env.KVRELAY_TOKEN) is
   *   sent as `authorization: Bearer TOKEN` on every call; unset and no
   *   environment variable: no authorization. Bad options throw a RelayError
   *   (INVALID_ARGUMENT) naming the option.
   */
  constructor(address, { protoPath = DEFAULT_PROTO_PATH, tlsCa, tlsCert, tlsKey, tlsServerName, token,
                         credentials, channelOptions } = {}) {
    if (credentials && [tlsCa, tlsCert, tlsKey].some((v) => v !== undefined && v !== null && v !== '')) {
      throw invalid('credentials: given with tlsCa/tlsCert/tlsKey, expected one or the other');
    }
    const creds = credentials || channelCredentials({ tlsCa, tlsCert, tlsKey });
    const options = { ...channelOptions };
    if (tlsServerName) options['grpc.ssl_target_name_override'] = tlsServerName;
    const bearer = token || process.env[TOKEN_ENV];
    if (bearer) {
      options.interceptors = [...(options.interceptors ?? []), bearerInterceptor(bearer)];
    }
    const Relay = loadRelayService(protoPath);
    this.#stub = new Relay(address, creds, options);
  }

  /** Closes the channel and cancels the calls in flight (they reject with CANCELLED). */
  close() {
    for (const call of this.#calls) call.cancel();
    this.#calls.clear();
    this.#stub.close();
  }

  // Remembers `call` until it ends, for close().
  #track(call) {
    this.#calls.add(call);
    call.on('status', () => this.#calls.delete(call));
    return call;
  }

  /**
   * Uploads `turn` (see planUpload) for `recipients`. `policy` is a pipeline
   * spec ('' = the relay's default for `role`); `parentId` passes history by
   * reference (the turn then carries none and is sent with firstAgent =
   * false, whatever it says). `messageId` is the idempotency
   * key (empty or unset: newMessageId()). Resolves to
   * { messageId, duplicate, accounting }; accounting.attentionError is the
   * fidelity figure for a turn with queries (genQ), null otherwise (also in
   * a delivered header's accounting). Rejects with an error that carries
   * `messageId`: retry with that id (never a fresh one) when the outcome is
   * unknown, and a committed publish answers duplicate = true.
   */
  async publish(turn, options) {
    const { sessionId, sender, recipients, policy = '', role = '', parentId = '', timeoutMs = 120000 } =
      options ?? {};
    // Empty or unset: a fresh id, as the other clients do.
    const messageId = options?.messageId || newMessageId();
    try {
      return await this.#publish(turn, { sessionId, sender, recipients, messageId, policy, role, parentId,
                                         timeoutMs });
    } catch (err) {
      if (err !== null && typeof err === 'object' && Object.isExtensible(err)) err.messageId = messageId;
      throw err;
    }
  }

  async #publish(turn, { sessionId, sender, recipients, messageId, policy, role, parentId, timeoutMs }) {
    checkId('sessionId', sessionId);
    checkId('sender', sender);
    checkId('messageId', messageId);
    checkId('parentId', parentId, { required: false });
    if (typeof role !== 'string' || Buffer.byteLength(role) > 128) {
      throw invalid(`role: ${typeof role === 'string' ? `${Buffer.byteLength(role)} bytes` : typeof role}, ` +
                    'expected a string of at most 128 bytes');
    }
    if (typeof policy !== 'string') throw invalid(`policy: ${typeof policy}, expected a pipeline spec string`);
    if (typeof recipients === 'string') recipients = [recipients];
    if (!Array.isArray(recipients) || recipients.length === 0) {
      throw invalid('recipients: empty, expected 1..64 agents');
    }
    recipients.forEach((r, i) => checkId(`recipients[${i}]`, r));
    const { geometry, tensors } = planUpload(turn);
    checkHistoryScoreHasHistory(geometry, Boolean(parentId));
    // With a parent the turn continues a chain: never the first agent's.
    if (parentId) geometry.firstAgent = false;
    const header = { sessionId, messageId, sender, recipients, role, policy, parentId, geometry };
    const reply = await this.#clientStream('Publish', { header }, tensors, timeoutMs);
    return { messageId: reply.messageId, duplicate: reply.duplicate, accounting: accountingOf(reply.accounting) };
  }

  /**
   * The oldest unacknowledged message for (sessionId, agent), waiting up to
   * `timeoutMs` for one (DEADLINE_EXCEEDED when none arrived). Resolves to
   * { header, tensors, nextPos } with header the MessageHeader (messageId,
   * accounting, nHistory, ...), tensors the message's tensors as
   * little-endian bytes, named as in the message file format (quantized
   * messages stay packed: k.codes, k.scale, ...), and nextPos the position
   * id the receiver's own tokens start at (see nextPos()). With autoAck the relay
   * acknowledges once it sent the trailer, before this client checked it;
   * prefer ack() once the message is safely used.
   */
  async fetch(sessionId, agent, options) {
    const { timeoutMs = 30000, autoAck = false } = options ?? {};
    checkId('sessionId', sessionId);
    checkId('agent', agent);
    const call = this.#track(this.#stub.Fetch({ sessionId, agent, autoAck: Boolean(autoAck) },
                                              { deadline: deadlineAfter(timeoutMs) }));
    return readDelivery(call);
  }

  /**
   * Stateless compression: uploads `turn` (see planUpload) and resolves to
   * the compressed message, { header, tensors, nextPos } as fetch() gives
   * it; the relay stores nothing. `policy` is a required pipeline spec.
   */
  async compress(turn, policy, options) {
    const { timeoutMs = 120000 } = options ?? {};
    if (typeof policy !== 'string' || policy === '') {
      throw invalid(`policy: ${typeof policy === 'string' ? 'empty' : typeof policy}, expected a pipeline spec`);
    }
    const { geometry, tensors } = planUpload(turn);
    checkHistoryScoreHasHistory(geometry, false);
    const deadline = deadlineAfter(timeoutMs);
    const call = this.#track(this.#stub.Compress({ deadline }));
    // The relay answers after the whole upload; an early error ends the
    // reading side first, and the writes stop there.
    return writeUpload(call, readDelivery(call), { header: { policy, geometry } }, tensors);
  }

  /** Acknowledges a delivered message (NOT_FOUND for an unknown one, FAILED_PRECONDITION for one not yet delivered). */
  async ack(sessionId, agent, messageId, options) {
    const { timeoutMs = 10000 } = options ?? {};
    checkId('sessionId', sessionId);
    checkId('agent', agent);
    checkId('messageId', messageId);
    await this.#unary('Ack', { sessionId, agent, messageId }, timeoutMs);
  }

  /** Frees a session; resolves to the number of messages freed. Idempotent. */
  async closeSession(sessionId, options) {
    const { timeoutMs = 10000 } = options ?? {};
    checkId('sessionId', sessionId);
    return (await this.#unary('CloseSession', { sessionId }, timeoutMs)).messagesFreed;
  }

  /** The relay's counters (StatsResponse). */
  async stats(options) {
    const { timeoutMs = 10000 } = options ?? {};
    return this.#unary('Stats', {}, timeoutMs);
  }

  #unary(method, request, timeoutMs) {
    return new Promise((resolve, reject) => {
      this.#track(this.#stub[method](request, { deadline: deadlineAfter(timeoutMs) },
                                     (err, reply) => (err ? reject(err) : resolve(reply))));
    });
  }

  // Sends `first`, the chunks of `tensors` and the commit, honouring the
  // stream's flow control; stops writing as soon as the relay answered (an
  // early error) and resolves/rejects with that answer.
  async #clientStream(method, first, tensors, timeoutMs) {
    const deadline = deadlineAfter(timeoutMs); // INVALID_ARGUMENT before any call
    let call;
    const reply = new Promise((resolve, reject) => {
      call = this.#track(this.#stub[method]({ deadline },
                                            (err, response) => (err ? reject(err) : resolve(response))));
    });
    return writeUpload(call, reply, first, tensors);
  }
}

/**
 * Writes `first`, the chunks of `tensors` and the commit to the upload
 * stream `call`, honouring its flow control, and stops writing as soon as
 * `reply` (the call's answer) settles, e.g. an early error. Resolves or
 * rejects as `reply` does; on a local error cancels the call and rethrows.
 */
async function writeUpload(call, reply, first, tensors) {
  let answered = false;
  let wake = null; // the pending drained()'s resolver
  reply.then(() => { answered = true; }, () => { answered = true; }).then(() => { if (wake) wake(); });
  // One listener and one resolver at a time, however many pauses a long
  // upload takes; an answer ends the wait as a 'drain' does.
  const drained = () => (answered ? Promise.resolve() : new Promise((resolve) => {
    const done = () => { call.off('drain', done); wake = null; resolve(); };
    wake = done;
    call.on('drain', done);
  }));
  try {
    if (!call.write(first)) await drained();
    for (const request of chunkRequests(tensors)) {
      if (answered) break;
      if (!call.write(request)) await drained();
    }
  } catch (err) {
    call.cancel(); // `reply` then rejects with CANCELLED, which the handlers above absorb
    throw err;
  }
  if (!answered) call.end();
  return reply;
}

module.exports = {
  RelayClient,
  RelayError,
  MAX_CHUNK_BYTES,
  DEFAULT_PROTO_PATH,
  TOKEN_ENV,
  loadRelayService,
  channelCredentials,
  bearerInterceptor,
  readTokenFile,
  newMessageId,
  statusName,
  planUpload,
  accountingOf,
  chunkRequests,
  writeUpload,
  Assembler,
  nextPos,
};
