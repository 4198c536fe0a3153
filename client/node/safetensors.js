'use strict';
// Minimal safetensors I/O for kvrelay turn and message files (docs/FORMAT.md):
// an 8-byte little-endian header length N, N bytes of JSON header, then the
// raw little-endian tensor data.

const fs = require('node:fs/promises');

/** Bytes per element of each safetensors dtype kvrelay uses. */
const DTYPE_SIZE = Object.freeze({ F32: 4, F16: 2, BF16: 2, I32: 4, U8: 1 });

function product(shape) {
  return shape.reduce((a, b) => a * b, 1);
}

/**
 * Parses a safetensors file.
 * @param {string} path
 * @returns {Promise<{metadata: Object<string, string>,
 *                    tensors: Map<string, {dtype: string, shape: number[], data: Buffer}>}>}
 *   `data` are views into one buffer holding the whole file.
 */
async function readSafetensors(path) {
  const buf = await fs.readFile(path);
  const bad = (what) => new Error(`${path}: ${what}`);
  if (buf.length < 8) throw bad(`${buf.length} bytes, expected at least 8 (header length)`);
  const n = buf.readBigUInt64LE(0);
  if (n > BigInt(buf.length - 8)) {
    throw bad(`header length ${n}, expected at most ${buf.length - 8} (file size - 8)`);
  }
  const base = 8 + Number(n);
  let header;
  try {
    header = JSON.parse(buf.toString('utf8', 8, base));
  } catch (e) {
    throw bad(`header: not JSON (${e.message})`);
  }
  const metadata = header.__metadata__ || {};
  delete header.__metadata__;
  const tensors = new Map();
  for (const [name, t] of Object.entries(header)) {
    const size = DTYPE_SIZE[t.dtype];
    if (size === undefined) throw bad(`${name}: dtype ${t.dtype}, expected one of ${Object.keys(DTYPE_SIZE)}`);
    const [begin, end] = t.data_offsets;
    if (!Array.isArray(t.shape) || !t.shape.every((x) => Number.isSafeInteger(x) && x >= 0)) {
      throw bad(`${name}: shape ${JSON.stringify(t.shape)}, expected an array of integers >= 0`);
    }
    const want = product(t.shape) * size;
    if (!(begin >= 0 && end - begin === want && base + end <= buf.length)) {
      throw bad(`${name}: data_offsets [${begin},${end}], expected ${want} bytes within the file`);
    }
    tensors.set(name, { dtype: t.dtype, shape: t.shape, data: buf.subarray(base + begin, base + end), begin, end });
  }
  // Tensors may leave gaps but never share bytes.
  const spans = [...tensors.entries()].filter(([, t]) => t.end > t.begin).sort((a, b) => a[1].begin - b[1].begin);
  for (let i = 1; i < spans.length; i++) {
    if (spans[i][1].begin < spans[i - 1][1].end) throw bad(`${spans[i - 1][0]} and ${spans[i][0]}: data_offsets overlap`);
  }
  for (const t of tensors.values()) {
    delete t.begin;
    delete t.end;
  }
  return { metadata, tensors };
}

/**
 * Writes a safetensors file.
 * @param {string} path
 * @param {Array<{name: string, dtype: string, shape: number[], data: Uint8Array}>} tensors
 * @param {Object<string, string>} [metadata]
 */
async function writeSafetensors(path, tensors, metadata) {
  const header = {};
  if (metadata && Object.keys(metadata).length) header.__metadata__ = metadata;
  // Any typed array or DataView is written as its bytes.
  const bytes = tensors.map((t) => {
    if (!ArrayBuffer.isView(t.data)) throw new TypeError(`${t.name}: data is not a typed array or DataView`);
    return new Uint8Array(t.data.buffer, t.data.byteOffset, t.data.byteLength);
  });
  let offset = 0;
  tensors.forEach((t, i) => {
    header[t.name] = { dtype: t.dtype, shape: t.shape, data_offsets: [offset, offset + bytes[i].length] };
    offset += bytes[i].length;
  });
  let json = JSON.stringify(header);
  json += ' '.repeat((8 - (Buffer.byteLength(json) % 8)) % 8);
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(Buffer.byteLength(json)));
  // Written piece by piece: no second copy of the tensors in memory.
  const file = await fs.open(path, 'w');
  try {
    for (const piece of [len, Buffer.from(json), ...bytes]) {
      for (let done = 0; done < piece.length;) {
        done += (await file.write(piece, done, piece.length - done)).bytesWritten;
      }
    }
  } finally {
    await file.close();
  }
}

/**
 * Reads a turn file (docs/FORMAT.md, "Turn") into the turn object that
 * RelayClient.publish takes. Checks names, dtypes and shapes; the relay
 * checks the values. A file whose layers carry gen.q gives layers with genQ
 * and queryDtype (gen.q's dtype), and its softmax_scale metadata
 * softmaxScale. history.score gives layers with historyScore and
 * historyScoreTokens: nHistory with history, else its columns (a turn for a
 * parent: publish it with parentId); the history_anchors metadata gives
 * historyAnchors. history.acc cannot be uploaded: a file with it is
 * refused, naming it.
 * @param {string} path
 */
async function readTurnFile(path) {
  const { metadata, tensors } = await readSafetensors(path);
  const bad = (what) => new Error(`${path}: ${what}`);
  const get = (name) => {
    const t = tensors.get(name);
    if (!t) throw bad(`${name}: missing`);
    return t;
  };
  const k0 = get('layer.0.prompt.k');
  if (k0.shape.length !== 3) throw bad(`layer.0.prompt.k: shape [${k0.shape}], expected [kv_heads, n_prompt, head_dim]`);
  const [kvHeads, nPrompt, headDim] = k0.shape;
  const dtype = k0.dtype;
  if (!['F32', 'F16', 'BF16'].includes(dtype)) throw bad(`layer.0.prompt.k: dtype ${dtype}, expected F32, F16 or BF16`);
  // The attention input: layer 0's prompt.score or gen.q, the same one in
  // every layer (checked below).
  const queries = tensors.has('layer.0.gen.q');
  const attention = queries ? 'gen.q' : 'prompt.score';
  const attention0 = get(`layer.0.${attention}`);
  if (queries && attention0.dtype !== 'F32' && attention0.dtype !== dtype) {
    throw bad(`layer.0.gen.q: dtype ${attention0.dtype}, expected F32 or ${dtype} (the K/V dtype)`);
  }
  const scoreHeads = attention0.shape[0];
  const nGen = get('layer.0.gen.k').shape[1];
  const hasHistory = tensors.has('layer.0.history.k');
  const nHistory = hasHistory ? get('layer.0.history.k').shape[1] : 0;
  let layers = 0;
  while (tensors.has(`layer.${layers}.prompt.k`)) layers++;
  // history.score: over the uploaded history, or without one over a parent's
  // tokens (as many as its columns).
  const hasHistoryScore = tensors.has('layer.0.history.score');
  let historyScoreTokens = 0;
  if (hasHistoryScore) {
    const hs0 = get('layer.0.history.score');
    if (queries) {
      throw bad('layer.0.history.score: given with layer.0.gen.q, expected none ' +
                '(the relay computes the mass on the history from the queries)');
    }
    if (!hasHistory && hs0.shape.length !== 2) {
      throw bad(`layer.0.history.score: shape [${hs0.shape}], expected [score_heads, tokens]`);
    }
    historyScoreTokens = hasHistory ? nHistory : hs0.shape[1];
  }

  const expect = (name, wantDtype, wantShape) => {
    const t = get(name);
    if (t.dtype !== wantDtype || t.shape.join() !== wantShape.join()) {
      throw bad(`${name}: ${t.dtype} [${t.shape}], expected ${wantDtype} [${wantShape}] (from layer.0)`);
    }
    return t.data;
  };
  const out = [];
  let used = 0;
  for (let l = 0; l < layers; l++) {
    const p = `layer.${l}.`;
    const score = tensors.has(p + 'prompt.score');
    const q = tensors.has(p + 'gen.q');
    if (score && q) throw bad(`${p}gen.q: given together with ${p}prompt.score, expected exactly one of the two`);
    if (!score && !q) throw bad(`${p}prompt.score: missing, expected it or ${p}gen.q (the queries)`);
    if (q !== queries) {
      const [given, want] = q ? ['gen.q', 'prompt.score'] : ['prompt.score', 'gen.q'];
      throw bad(`${p}${given}: given, expected ${p}${want} like layer.0 (every layer carries the same one)`);
    }
    const layer = {
      promptK: expect(p + 'prompt.k', dtype, [kvHeads, nPrompt, headDim]),
      promptV: expect(p + 'prompt.v', dtype, [kvHeads, nPrompt, headDim]),
      genK: expect(p + 'gen.k', dtype, [kvHeads, nGen, headDim]),
      genV: expect(p + 'gen.v', dtype, [kvHeads, nGen, headDim]),
    };
    if (queries) {
      layer.genQ = expect(p + 'gen.q', attention0.dtype, [scoreHeads, nGen, headDim]);
    } else {
      layer.promptScore = expect(p + 'prompt.score', 'F32', [scoreHeads, nPrompt]);
    }
    used += 5;
    if (hasHistory) {
      layer.historyK = expect(p + 'history.k', dtype, [kvHeads, nHistory, headDim]);
      layer.historyV = expect(p + 'history.v', dtype, [kvHeads, nHistory, headDim]);
      layer.historyPos = expect(p + 'history.pos', 'I32', [kvHeads, nHistory]);
      used += 3;
    }
    if (hasHistoryScore) {
      layer.historyScore = expect(p + 'history.score', 'F32', [scoreHeads, historyScoreTokens]);
      used += 1;
    }
    out.push(layer);
  }
  if (used !== tensors.size) {
    const known = new Set();
    for (let l = 0; l < layers; l++) {
      for (const s of ['prompt.k', 'prompt.v', 'gen.k', 'gen.v', attention, 'history.k', 'history.v', 'history.pos',
        ...(hasHistoryScore ? ['history.score'] : [])]) {
        known.add(`layer.${l}.${s}`);
      }
    }
    const extra = [...tensors.keys()].find((n) => !known.has(n));
    if (extra.endsWith('.history.acc')) {
      throw bad(`${extra}: not carried by Publish or Compress, expected none (publish with parentId to keep the ` +
                "parent's acc, or compress offline with kvrelayctl compress)");
    }
    if (extra.endsWith('.history.score')) {
      throw bad(`${extra}: given, expected it in every layer or in none (layer.0 has none)`);
    }
    throw bad(`${extra}: unexpected tensor in a turn of ${layers} layers`);
  }
  const firstAgent = metadata.first_agent ?? 'true';
  if (firstAgent !== 'true' && firstAgent !== 'false') {
    throw bad(`metadata first_agent: ${JSON.stringify(firstAgent)}, expected "true" or "false"`);
  }
  const turn = {
    dtype,
    kvHeads,
    scoreHeads,
    headDim,
    nPrompt,
    nGen,
    nHistory,
    firstAgent: firstAgent === 'true',
    layers: out,
  };
  if (metadata.prompt_pos0 !== undefined) {
    if (!/^\d+$/.test(metadata.prompt_pos0)) {
      throw bad(`metadata prompt_pos0: ${JSON.stringify(metadata.prompt_pos0)}, expected a decimal integer >= 0`);
    }
    turn.promptPos0 = Number(metadata.prompt_pos0);
  }
  if (hasHistoryScore) turn.historyScoreTokens = historyScoreTokens;
  if (metadata.history_anchors !== undefined && metadata.history_anchors !== '') {
    turn.historyAnchors = String(metadata.history_anchors).split(',').map((item, i) => {
      if (!/^\d+$/.test(item) || Number(item) > 2 ** 31 - 1) {
        throw bad(`metadata history_anchors: item ${JSON.stringify(item)} of ${i}, expected comma-separated ` +
                  'position ids (decimal, 0..2^31-1)');
      }
      return Number(item);
    });
  }
  if (queries) turn.queryDtype = attention0.dtype;
  if (metadata.softmax_scale !== undefined) {
    const v = metadata.softmax_scale;
    const scale = Number(v);
    const decimal = typeof v === 'string' && /^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$/.test(v);
    if (!decimal || !(scale >= 1e-6 && scale <= 1e3)) {
      throw bad(`metadata softmax_scale: ${JSON.stringify(v)}, expected a finite decimal number in [1e-06, 1000]`);
    }
    turn.softmaxScale = scale;
  }
  return turn;
}

/**
 * Where the receiver's own tokens start: where the relayed turn ended
 * (header.nextPos), also when its last tokens were evicted, and at least
 * 1 + every position id held (all a relay before that header field tells).
 * @param {{header: Object, tensors: Array}} message
 */
function nextPos(message) {
  let next = (message.header && message.header.nextPos) || 0;
  for (const t of message.tensors) {
    if (t.part !== 'PART_POS') continue;
    const view = new DataView(t.data.buffer, t.data.byteOffset, t.data.byteLength);
    for (let i = 0; i + 4 <= t.data.byteLength; i += 4) next = Math.max(next, view.getInt32(i, true) + 1);
  }
  return next;
}

/**
 * Writes a fetched message as a message file (docs/FORMAT.md, "Message"),
 * with the delivery in its metadata like `kvrelayctl fetch --out`.
 * @param {string} path
 * @param {{header: Object, tensors: Array}} message from RelayClient.fetch
 */
async function writeMessageFile(path, message) {
  const h = message.header;
  const a = h.accounting || { policy: '', fullBytes: 0, sentBytes: 0, receivedBytes: 0, ratio: 0,
                              compressSeconds: 0, commitSeconds: 0 };
  const meta = {
    format: 'kvrelay.message.v2',
    policy: a.policy,
    dtype: h.dtype.replace(/^DTYPE_/, ''),
    n_history: String(h.nHistory),
    n_anchor: String(h.nAnchor),
    n_kept: String(h.nKept),
    n_gen: String(h.nGen),
    full_bytes: String(a.fullBytes),
    sent_bytes: String(a.sentBytes),
    next_pos: String(nextPos(message)),
    anchor_pos: (h.anchorPos || []).join(','),
  };
  if (h.quantBits) {
    meta.quant_bits = String(h.quantBits);
    meta.quant_group = String(h.quantGroup);
    meta.quant_rotate = h.quantRotate ? 'true' : 'false';
  }
  meta.message_id = h.messageId;
  meta.session = h.sessionId;
  meta.from = h.sender;
  if (h.role) meta.role = h.role;
  if (h.parentId) meta.parent_id = h.parentId;
  meta.delivery_attempt = String(h.deliveryAttempt);
  meta.received_bytes = String(a.receivedBytes);
  meta.ratio = a.ratio.toFixed(6);
  meta.compress_seconds = a.compressSeconds.toFixed(6);
  meta.commit_seconds = a.commitSeconds.toFixed(6);
  if (typeof a.attentionError === 'number') meta.attention_error = String(a.attentionError); // reads back exactly
  await writeSafetensors(path, message.tensors, meta);
}

module.exports = { DTYPE_SIZE, readSafetensors, writeSafetensors, readTurnFile, writeMessageFile, nextPos };
