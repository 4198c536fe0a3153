'use strict';
// Offline unit tests of client/node (node:test): CRC32C, chunking, the
// delivery assembler and the credentials options. Run by test_node_client.py as
//   NODE_PATH=<deps>/node_modules node --test unit.test.js
// with KVRELAY_NODE_CLIENT_DIR pointing at client/node.

const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const path = require('node:path');

const dir = process.env.KVRELAY_NODE_CLIENT_DIR || path.resolve(__dirname, '../../../client/node');
const { crc32c, crc32cCombine } = require(path.join(dir, 'crc32c.js'));
const { RelayClient, RelayError, MAX_CHUNK_BYTES, loadRelayService, newMessageId, planUpload, chunkRequests,
        writeUpload, Assembler, readTokenFile, accountingOf } = require(path.join(dir, 'client.js'));
const { EventEmitter } = require('node:events');
const grpc = require('@grpc/grpc-js');
const { readSafetensors, writeSafetensors, readTurnFile, writeMessageFile } = require(path.join(dir, 'safetensors.js'));
const fs = require('node:fs');
const os = require('node:os');

// Bit-at-a-time reference, independent of the table code.
function crcReference(data) {
  let c = 0xffffffff;
  for (const b of data) {
    c ^= b;
    for (let i = 0; i < 8; i++) c = c & 1 ? (c >>> 1) ^ 0x82f63b78 : c >>> 1;
  }
  return ~c >>> 0;
}

test('crc32c: known vectors and the bitwise reference', () => {
  assert.equal(crc32c(Buffer.from('123456789')), 0xe3069283);
  assert.equal(crc32c(Buffer.alloc(0)), 0);
  assert.equal(crc32c(Buffer.alloc(32)), 0x8a9136aa); // RFC 3720 B.4: 32 bytes of zeros
  assert.equal(crc32c(Buffer.alloc(32, 0xff)), 0x62a8ab43); // 32 bytes of 0xff
  for (const n of [1, 7, 8, 9, 63, 1000, 4099]) {
    const d = crypto.randomBytes(n);
    assert.equal(crc32c(d), crcReference(d), `n=${n}`);
  }
});

test('crc32c: extend and combine agree with one pass', () => {
  const d = crypto.randomBytes((1 << 20) + 13);
  const whole = crc32c(d);
  for (const k of [0, 1, 7, 4096, 1 << 20, d.length]) {
    const a = crc32c(d.subarray(0, k));
    const b = crc32c(d.subarray(k));
    assert.equal(crc32c(d.subarray(k), a), whole, `extend at ${k}`);
    assert.equal(crc32cCombine(a, b, d.length - k), whole, `combine at ${k}`);
  }
});

test('crc32cCombine: lengths of 2^29 bytes and more (x^(2^32) is not x mod P)', () => {
  // Values of the C++ Crc32cCombine (core/crc32c.cc) and kvrelay.crc32c_combine
  // (Python) for crcA 0x12345678, crcB 0x9abcdef0.
  const known = [[2 ** 29, 0x9e31cb6e], [2 ** 29 + 7, 0x5d3819c2], [2 ** 32, 0xcf75e6c0],
                 [2 ** 33 + 5, 0x5e623719], [2 ** 40 + 12345, 0xa9cf6671], [Number.MAX_SAFE_INTEGER, 0xbff3d3c9]];
  for (const [len, want] of known) {
    assert.equal(crc32cCombine(0x12345678, 0x9abcdef0, len), want, `lenB ${len}`);
  }
  // Shifting over L1 then L2 zero bytes equals shifting over L1 + L2, also
  // past 32-bit lengths; a shift is not the identity.
  const a = 0x12345678;
  for (const [l1, l2] of [[2 ** 29, 2 ** 29], [2 ** 33 + 5, 2 ** 40 + 12345], [2 ** 31 - 1, 2 ** 31 + 1],
                          [2 ** 50 + 3, 2 ** 52 - 7]]) {
    assert.equal(crc32cCombine(crc32cCombine(a, 0, l1), 0, l2), crc32cCombine(a, 0, l1 + l2), `${l1} + ${l2}`);
  }
  assert.notEqual(crc32cCombine(a, 0, 2 ** 33), a);
  for (const bad of [-1, 1.5, 2 ** 53, NaN]) {
    assert.throws(() => crc32cCombine(0, 0, bad), RangeError, `lenB ${bad}`);
  }
});

function tinyTurn(overrides = {}) {
  const H = 1, d = 4, nPrompt = 3, nGen = 1, S = 2;
  const f32 = (n) => Buffer.from(new Float32Array(n).map((_, i) => i).buffer);
  const layer = () => ({ promptK: f32(H * nPrompt * d), promptV: f32(H * nPrompt * d), genK: f32(H * nGen * d),
                         genV: f32(H * nGen * d), promptScore: f32(S * nPrompt) });
  return { dtype: 'F32', kvHeads: H, scoreHeads: S, headDim: d, nPrompt, nGen, layers: [layer(), layer()], ...overrides };
}

test('planUpload: geometry, order, and the tensor a bad length names', () => {
  const { geometry, tensors } = planUpload(tinyTurn({ promptPos0: 5 }));
  assert.equal(geometry.layers, 2);
  assert.equal(geometry.dtype, 'DTYPE_F32');
  assert.equal(geometry.promptPos0, 5);
  assert.deepEqual(tensors.map((t) => `${t.layer}:${t.part}`), [
    '0:PART_PROMPT_K', '0:PART_PROMPT_V', '0:PART_GEN_K', '0:PART_GEN_V', '0:PART_PROMPT_SCORE',
    '1:PART_PROMPT_K', '1:PART_PROMPT_V', '1:PART_GEN_K', '1:PART_GEN_V', '1:PART_PROMPT_SCORE']);
  const bad = tinyTurn();
  bad.layers[1].genK = bad.layers[1].genK.subarray(4);
  assert.throws(() => planUpload(bad), (e) => e instanceof RelayError &&
    e.code === grpc.status.INVALID_ARGUMENT && /layer\.1\.gen\.k: 12 bytes, expected 16/.test(e.details));
  assert.throws(() => planUpload(tinyTurn({ dtype: 'F64' })), /turn\.dtype/);
});

test('planUpload: typed arrays are taken as their bytes; a missing turn or layer is INVALID_ARGUMENT', () => {
  const t = tinyTurn();
  t.layers[0].promptK = new Float32Array(t.layers[0].promptK.buffer, t.layers[0].promptK.byteOffset, 12);
  const { tensors } = planUpload(t);
  assert.ok(tensors[0].data instanceof Uint8Array);
  assert.deepEqual(Buffer.from(tensors[0].data), Buffer.from(tinyTurn().layers[0].promptK));
  const invalidArg = (re) => (e) => e instanceof RelayError && e.code === grpc.status.INVALID_ARGUMENT && re.test(e.details);
  assert.throws(() => planUpload(undefined), invalidArg(/^turn: undefined, expected an object/));
  assert.throws(() => planUpload(tinyTurn({ layers: [undefined] })), invalidArg(/^turn\.layers\[0\]: undefined/));
  const wide = tinyTurn();
  wide.layers[0].genV = new Float64Array(4);  // 32 bytes where 16 are due
  assert.throws(() => planUpload(wide), invalidArg(/layer\.0\.gen\.v: 32 bytes, expected 16/));
  const noScore = tinyTurn();
  delete noScore.layers[1].promptScore;
  assert.throws(() => planUpload(noScore), invalidArg(/layer\.1\.prompt\.score: missing/));
});

// A 2-layer BF16 turn (H=1, S=2, d=2, 3 prompt and 2 generated tokens) whose
// layers carry genQ in queryDtype instead of scores.
function queryTurn(queryDtype, overrides = {}) {
  const bf16 = (n) => Buffer.from(new Uint16Array(n).fill(0x3f80).buffer); // 1.0
  const genQ = () => (queryDtype === 'F32' ? new Float32Array([1, -1, 0.5, 2, 0, 1, 3, -2]) : bf16(8));
  const layer = () => ({ promptK: bf16(6), promptV: bf16(6), genK: bf16(4), genV: bf16(4), genQ: genQ() });
  return { dtype: 'BF16', kvHeads: 1, scoreHeads: 2, headDim: 2, nPrompt: 3, nGen: 2, queryDtype,
           layers: [layer(), layer()], ...overrides };
}

test('planUpload: genQ in PROMPT_SCORE\'s place, queryDtype and softmaxScale in the geometry', () => {
  for (const queryDtype of ['F32', 'BF16']) {
    const { geometry, tensors } = planUpload(queryTurn(queryDtype, { softmaxScale: 0.125 }));
    assert.equal(geometry.queryDtype, `DTYPE_${queryDtype}`);
    assert.equal(geometry.softmaxScale, 0.125);
    assert.equal(geometry.scoreHeads, 2);
    const q = queryDtype === 'F32' ? 32 : 16;
    assert.deepEqual(tensors.map((t) => `${t.layer}:${t.part}:${t.data.length}`), [
      '0:PART_PROMPT_K:12', '0:PART_PROMPT_V:12', '0:PART_GEN_K:8', '0:PART_GEN_V:8', `0:PART_GEN_Q:${q}`,
      '1:PART_PROMPT_K:12', '1:PART_PROMPT_V:12', '1:PART_GEN_K:8', '1:PART_GEN_V:8', `1:PART_GEN_Q:${q}`]);
  }
  // Scores: no query dtype, no scale unless given; '' and null are unset.
  for (const queryDtype of [undefined, null, '']) {
    const { geometry } = planUpload(tinyTurn({ queryDtype }));
    assert.deepEqual([geometry.queryDtype, geometry.softmaxScale], [undefined, undefined]);
  }
  assert.equal(planUpload(queryTurn('F32', { softmaxScale: null })).geometry.softmaxScale, undefined);
});

test('planUpload: both or neither attention input, a mix, a wrong dtype or size, a bad softmaxScale name it', () => {
  const invalidArg = (re) => (e) => e instanceof RelayError && e.code === grpc.status.INVALID_ARGUMENT && re.test(e.details);
  const score = () => new Float32Array(6);
  const cases = [
    ['both', (t) => { t.layers[0].promptScore = score(); },
     /^layer\.0\.gen\.q: given together with layer\.0\.prompt\.score, expected exactly one of the two$/],
    ['scores in layer 1', (t) => { t.layers[1] = { ...t.layers[1], genQ: undefined, promptScore: score() }; },
     /^layer\.1\.prompt\.score: given, expected layer\.1\.gen\.q \(turn\.queryDtype is "F32": every layer/],
    ['queries in layer 1 of a score turn', (t) => {
      t.queryDtype = undefined;
      t.layers[0] = { ...t.layers[0], genQ: null, promptScore: score() };
    }, /^layer\.1\.gen\.q: given, expected layer\.1\.prompt\.score like layer\.0 \(every layer carries the same one\)$/],
    ['no queryDtype', (t) => { t.queryDtype = undefined; },
     /^layer\.0\.gen\.q: dtype unset \(turn\.queryDtype undefined\), expected 'F32' or the K\/V dtype \('BF16'\)$/],
    ['third dtype', (t) => { t.queryDtype = 'F16'; },
     /^layer\.0\.gen\.q: dtype "F16" \(turn\.queryDtype\), expected 'F32' or the K\/V dtype \('BF16'\)$/],
    ['K/V-dtype bytes sent as F32', (t) => { t.layers[0].genQ = new Uint16Array(8); },
     /^layer\.0\.gen\.q: 16 bytes, expected 32 bytes/],
    ['missing in layer 1', (t) => { delete t.layers[1].genQ; }, /^layer\.1\.gen\.q: missing, expected 32 bytes/],
  ];
  for (const softmaxScale of [-1, 0, NaN, Infinity, '0.5', true]) {
    cases.push([`softmaxScale ${String(softmaxScale)}`, (t) => { t.softmaxScale = softmaxScale; },
                /^turn\.softmaxScale: .*, expected a finite number in \[1e-06, 1000\] or undefined/]);
  }
  for (const [name, edit, re] of cases) {
    const t = queryTurn('F32');
    edit(t);
    assert.throws(() => planUpload(t), invalidArg(re), name);
  }
  const noScore = tinyTurn();
  noScore.layers[1].promptScore = null;
  assert.throws(() => planUpload(noScore),
                invalidArg(/^layer\.1\.prompt\.score: missing, expected it or layer\.1\.gen\.q \(the queries\)$/));
});

test('readTurnFile: gen.q (F32 or the K/V dtype) and softmax_scale; both, a mix, a third dtype name the tensor', async () => {
  const file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'kvrelay-st-')), 'turn.safetensors');
  const tensorsOf = (queryDtype) => queryTurn(queryDtype).layers.flatMap((l, i) => [
    { name: `layer.${i}.prompt.k`, dtype: 'BF16', shape: [1, 3, 2], data: l.promptK },
    { name: `layer.${i}.prompt.v`, dtype: 'BF16', shape: [1, 3, 2], data: l.promptV },
    { name: `layer.${i}.gen.k`, dtype: 'BF16', shape: [1, 2, 2], data: l.genK },
    { name: `layer.${i}.gen.v`, dtype: 'BF16', shape: [1, 2, 2], data: l.genV },
    { name: `layer.${i}.gen.q`, dtype: queryDtype, shape: [2, 2, 2], data: l.genQ },
  ]);
  for (const queryDtype of ['F32', 'BF16']) {
    await writeSafetensors(file, tensorsOf(queryDtype), { softmax_scale: '1.25e-1' });
    const turn = await readTurnFile(file);
    assert.equal(turn.queryDtype, queryDtype);
    assert.equal(turn.softmaxScale, 0.125);
    assert.equal(turn.scoreHeads, 2);
    assert.ok(turn.layers.every((l) => l.promptScore === undefined));
    const want = queryTurn(queryDtype).layers[1].genQ;
    assert.deepEqual(Buffer.from(turn.layers[1].genQ), Buffer.from(want.buffer, want.byteOffset, want.byteLength));
    const { geometry } = planUpload(turn);
    assert.deepEqual([geometry.queryDtype, geometry.softmaxScale], [`DTYPE_${queryDtype}`, 0.125]);
  }
  await writeSafetensors(file, tensorsOf('F32'));
  assert.equal((await readTurnFile(file)).softmaxScale, undefined);

  const score = { name: 'layer.1.prompt.score', dtype: 'F32', shape: [2, 3], data: new Float32Array(6) };
  const cases = [
    ['both', (ts) => [...ts, score], {},
     /layer\.1\.gen\.q: given together with layer\.1\.prompt\.score, expected exactly one of the two/],
    ['mixed', (ts) => [...ts.slice(0, 9), score], {},
     /layer\.1\.prompt\.score: given, expected layer\.1\.gen\.q like layer\.0 \(every layer carries the same one\)/],
    ['neither', (ts) => ts.slice(0, 9), {}, /layer\.1\.prompt\.score: missing, expected it or layer\.1\.gen\.q \(the queries\)/],
    ['third dtype', (ts) => { ts[4] = { ...ts[4], dtype: 'F16', data: new Uint16Array(8) }; return ts; }, {},
     /layer\.0\.gen\.q: dtype F16, expected F32 or BF16 \(the K\/V dtype\)/],
    ['shape', (ts) => { ts[9] = { ...ts[9], shape: [2, 1, 4] }; return ts; }, {},
     /layer\.1\.gen\.q: F32 \[2,1,4\], expected F32 \[2,2,2\] \(from layer\.0\)/],
  ];
  for (const v of ['0', '-1', 'inf', 'NaN', '0x1p-3', '1e999', '']) {
    cases.push([`softmax_scale ${v}`, (ts) => ts, { softmax_scale: v },
                new RegExp(`metadata softmax_scale: "${v}", expected a finite decimal number in \\[1e-06, 1000\\]`)]);
  }
  for (const [name, edit, meta, re] of cases) {
    await writeSafetensors(file, edit(tensorsOf('F32')), meta);
    await assert.rejects(readTurnFile(file), re, name);
  }
});

// Serves `handlers` as the Relay service on a free loopback port and runs
// fn(address); the server is shut down however fn ends.
async function withRelayServer(handlers, fn) {
  const server = new grpc.Server();
  server.addService(loadRelayService().service, handlers);
  const port = await new Promise((resolve, reject) =>
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))));
  try {
    return await fn(`127.0.0.1:${port}`);
  } finally {
    server.forceShutdown();
  }
}

// A stand-in relay whose Publish records each stream's header and its chunks
// as `layer:part:bytes`, and answers reply(header). Runs fn(relay) against it
// and returns the recorded streams in order.
async function recordPublishes(reply, fn) {
  const got = [];
  await withRelayServer({
    Publish(call, callback) {
      const parts = [];
      let header;
      call.on('data', (r) => {
        if (r.header) header = r.header;
        if (r.chunk) parts.push(`${r.chunk.layer}:${r.chunk.part}:${r.chunk.data.length}`);
      });
      call.on('end', () => {
        got.push({ header, parts });
        callback(null, reply(header));
      });
    },
  }, async (addr) => {
    const relay = new RelayClient(addr);
    try {
      await fn(relay);
    } finally {
      relay.close();
    }
  });
  return got;
}

test('publish: GEN_Q chunks, query_dtype and softmax_scale reach the relay', async () => {
  const [q, s] = await recordPublishes((header) => ({ messageId: header.messageId }), async (relay) => {
    await relay.publish(queryTurn('BF16', { softmaxScale: 0.3 }), { sender: 'planner', recipients: ['critic'], sessionId: 's', messageId: 'm-q' });
    await relay.publish(tinyTurn(), { sender: 'planner', recipients: ['critic'], sessionId: 's', messageId: 'm-s' });
  });
  assert.equal(q.header.geometry.queryDtype, 'DTYPE_BF16');
  assert.equal(q.header.geometry.softmaxScale, 0.3);
  assert.deepEqual(q.parts.filter((p) => p.includes('GEN_Q')), ['0:PART_GEN_Q:16', '1:PART_GEN_Q:16']);
  assert.ok(!q.parts.some((p) => p.includes('PROMPT_SCORE')));
  assert.equal(s.header.geometry.queryDtype, 'DTYPE_UNSPECIFIED');
  // Presence on the wire: proto-loader names a set optional field in its synthetic oneof.
  assert.equal(q.header.geometry._softmaxScale, 'softmaxScale');
  assert.equal(s.header.geometry._softmaxScale, undefined);
  assert.equal(s.parts.filter((p) => p.includes('PROMPT_SCORE')).length, 2);
});

test('chunkRequests: 1 MiB chunks, contiguous offsets, trailer over the stream', () => {
  const big = crypto.randomBytes(2 * MAX_CHUNK_BYTES + 5);
  const small = crypto.randomBytes(3);
  const reqs = [...chunkRequests([{ layer: 0, part: 'PART_PROMPT_K', data: big },
                                  { layer: 0, part: 'PART_PROMPT_V', data: Buffer.alloc(0) },
                                  { layer: 0, part: 'PART_GEN_K', data: small }])];
  const chunks = reqs.slice(0, -1).map((r) => r.chunk);
  assert.deepEqual(chunks.map((c) => [c.part, c.offset, c.data.length]), [
    ['PART_PROMPT_K', 0, MAX_CHUNK_BYTES], ['PART_PROMPT_K', MAX_CHUNK_BYTES, MAX_CHUNK_BYTES],
    ['PART_PROMPT_K', 2 * MAX_CHUNK_BYTES, 5], ['PART_GEN_K', 0, 3]]);
  for (const c of chunks) assert.equal(c.crc32c, crc32c(c.data));
  assert.deepEqual(reqs.at(-1), { commit: { chunks: 4, bytes: big.length + 3, crc32c: crc32c(Buffer.concat([big, small])) } });
});

// A stand-in for a client-streaming call whose every write fills the
// buffer: writeUpload then waits for 'drain' (emitted soon after) each time.
class PausingCall extends EventEmitter {
  constructor() { super(); this.writes = []; this.ended = false; this.cancelled = false; this.maxListeners = 0; }
  write(r) {
    this.writes.push(r);
    setImmediate(() => {
      this.maxListeners = Math.max(this.maxListeners, this.listenerCount('drain'));
      this.emit('drain');
    });
    return false;
  }
  end() { this.ended = true; }
  cancel() { this.cancelled = true; }
}

test('writeUpload: every request through flow control, one drain listener at a time; an answer ends a pause', async () => {
  const data = crypto.randomBytes(40 * MAX_CHUNK_BYTES + 1);
  const tensors = [{ layer: 0, part: 'PART_PROMPT_K', data }];
  const call = new PausingCall();
  let answer;
  const reply = new Promise((resolve) => { answer = resolve; });
  const done = writeUpload(call, reply, { header: {} }, tensors);
  for (let i = 0; i < 1000 && !call.ended; i++) await new Promise((r) => setImmediate(r));
  answer('ok');
  assert.equal(await done, 'ok');
  assert.equal(call.writes.length, 43); // header, 41 chunks, commit
  assert.ok(call.ended);
  assert.equal(call.maxListeners, 1);
  assert.equal(call.listenerCount('drain'), 0);

  // An early answer while paused (no 'drain' ever comes): the upload stops.
  const stuck = new PausingCall();
  stuck.write = function write(r) { this.writes.push(r); return false; };
  let early;
  const reply2 = new Promise((resolve, reject) => { early = reject; });
  const done2 = writeUpload(stuck, reply2, { header: {} }, tensors);
  await new Promise((r) => setImmediate(r));
  early(new Error('INVALID_ARGUMENT'));
  await assert.rejects(done2, /INVALID_ARGUMENT/);
  assert.equal(stuck.writes.length, 1);
  assert.ok(!stuck.ended);
  assert.equal(stuck.listenerCount('drain'), 0);
});

// A valid delivery of a 1-layer dense F32 message: H=1, n=2, d=2.
function delivery() {
  const k = Buffer.from(new Float32Array([1, 2, 3, 4]).buffer);
  const v = Buffer.from(new Float32Array([5, 6, 7, 8]).buffer);
  const pos = Buffer.from(new Int32Array([0, 1]).buffer);
  const header = { messageId: 'm', layers: 1, kvHeads: 1, headDim: 2, dtype: 'DTYPE_F32', nHistory: 0, nAnchor: 1,
                   nKept: 0, nGen: 1, quantBits: 0, quantGroup: 0, accounting: { sentBytes: 40 } };
  const chunk = (part, data) => ({ kind: 'chunk', chunk: { layer: 0, part, offset: 0, data, crc32c: crc32c(data) } });
  const all = Buffer.concat([k, v, pos]);
  return [{ kind: 'header', header }, chunk('PART_K', k), chunk('PART_V', v), chunk('PART_POS', pos),
          { kind: 'trailer', trailer: { chunks: 3, bytes: all.length, crc32c: crc32c(all) } }];
}

function assemble(responses) {
  const a = new Assembler();
  for (const r of responses) a.add(r);
  return a.message();
}

test('Assembler: a valid delivery', () => {
  const m = assemble(delivery());
  assert.deepEqual(m.tensors.map((t) => [t.name, t.dtype, t.shape.join('x'), t.data.length]),
                   [['layer.0.k', 'F32', '1x2x2', 16], ['layer.0.v', 'F32', '1x2x2', 16], ['layer.0.pos', 'I32', '1x2', 8]]);
  assert.deepEqual([...new Float32Array(m.tensors[1].data.buffer, m.tensors[1].data.byteOffset, 4)], [5, 6, 7, 8]);
});

test('Assembler: nextPos is the header\'s turn end, at least 1 + every position held', () => {
  assert.equal(assemble(delivery()).nextPos, 2); // no header nextPos (an older relay): positions 0, 1 held
  const ended = delivery();
  ended[0].header.nextPos = 9;
  assert.equal(assemble(ended).nextPos, 9);
  const bad = delivery();
  bad[0].header.nextPos = -1;
  assert.throws(() => assemble(bad), (e) => e instanceof RelayError && e.code === grpc.status.DATA_LOSS &&
                /header.nextPos: -1, expected 0..2\^31/.test(e.details));
});

test('Assembler: every malformed delivery is DATA_LOSS (the relay sent damaged data)', () => {
  const dataLoss = (re) => (e) => e instanceof RelayError && e.code === grpc.status.DATA_LOSS && re.test(e.details);
  const badCrc = delivery();
  badCrc[2].chunk.crc32c ^= 1;
  assert.throws(() => assemble(badCrc), dataLoss(/^chunk layer 0 PART_V offset 0: crc32c /));
  const badTrailer = delivery();
  badTrailer[4].trailer.crc32c ^= 1;
  assert.throws(() => assemble(badTrailer), dataLoss(/^trailer\.crc32c: /));
  const swapped = delivery();
  [swapped[1], swapped[2]] = [swapped[2], swapped[1]];
  assert.throws(() => assemble(swapped), dataLoss(/out of order, expected chunk layer 0 PART_K offset 0/));
  assert.throws(() => assemble(delivery().slice(0, 4)), dataLoss(/ended without a trailer/)); // no trailer
  assert.throws(() => assemble([]), dataLoss(/ended without a trailer/)); // an empty stream
  assert.throws(() => assemble(delivery().slice(0, 3).concat(delivery().slice(4))),
                dataLoss(/^trailer: stream ended with layer\.0\.pos at 0 of 8 bytes$/)); // a missing chunk
  const wrongSize = delivery();
  wrongSize[0].header.accounting.sentBytes = 41;
  assert.throws(() => assemble(wrongSize), dataLoss(/sentBytes: 41, expected 40/));
  // Headers that describe no valid message.
  const noLayers = delivery();
  noLayers[0].header.layers = 0;
  assert.throws(() => assemble(noLayers), dataLoss(/^header\.layers: 0, expected >= 1$/));
  const badBits = delivery();
  badBits[0].header.quantBits = 3;
  assert.throws(() => assemble(badBits), dataLoss(/^header\.quantBits: 3, expected 0, 2, 4 or 8$/));
  const badDtype = delivery();
  badDtype[0].header.dtype = 'DTYPE_UNSPECIFIED';
  assert.throws(() => assemble(badDtype), dataLoss(/^header\.dtype: /));
  // Sizes and sequence.
  const oversized = delivery();
  oversized[1].chunk.data = Buffer.concat([oversized[1].chunk.data, Buffer.alloc(4)]);
  oversized[1].chunk.crc32c = crc32c(oversized[1].chunk.data);
  assert.throws(() => assemble(oversized), dataLoss(/: 20 data bytes, expected 1\.\.16 \(layer\.0\.k has 16 bytes\)$/));
  assert.throws(() => assemble(delivery().slice(1)), dataLoss(/^chunk: before the header/));
  assert.throws(() => assemble(delivery().slice(0, 1).concat(delivery())), dataLoss(/^header: given twice/));
  assert.throws(() => assemble(delivery().slice(0, 4).concat(delivery().slice(3))),
                dataLoss(/after every tensor of the message is complete/));
  assert.throws(() => assemble(delivery().concat(delivery().slice(3, 4))), dataLoss(/response after the trailer/));
  assert.throws(() => assemble(delivery().slice(0, 1).concat([{}])), dataLoss(/empty response/));
});

// A delivery of `tensors` ({layer, part, data} in delivery order) cut into
// chunks whose sizes cycle through `sizes`, then the trailer over them all.
function chunkedDelivery(header, tensors, sizes) {
  const out = [{ kind: 'header', header }];
  let i = 0;
  let bytes = 0;
  let crc = 0;
  for (const { layer, part, data } of tensors) {
    for (let offset = 0; offset < data.length;) {
      const piece = data.subarray(offset, offset + sizes[i++ % sizes.length]);
      const pieceCrc = crc32c(piece);
      out.push({ kind: 'chunk', chunk: { layer, part, offset, data: piece, crc32c: pieceCrc } });
      crc = crc32cCombine(crc, pieceCrc, piece.length);
      bytes += piece.length;
      offset += piece.length;
    }
  }
  out.push({ kind: 'trailer', trailer: { chunks: out.length - 1, bytes, crc32c: crc } });
  return out;
}

test('Assembler: multi-chunk tensors of every size come back byte-exact, each its own size', () => {
  // 2 layers, F16, H=2, d=64, n=11111: k and v are 2,844,416 bytes (3 chunks of
  // 1 MiB, the last partial), pos 88,888; chunk sizes irregular on purpose.
  const header = { messageId: 'm', layers: 2, kvHeads: 2, headDim: 64, dtype: 'DTYPE_F16', nHistory: 3000,
                   nAnchor: 4, nKept: 8100, nGen: 7, quantBits: 0, quantGroup: 0, accounting: {} };
  const n = 11111;
  const want = [];
  for (let layer = 0; layer < 2; layer++) {
    for (const [part, suffix, size] of [['PART_K', 'k', 2 * n * 64 * 2], ['PART_V', 'v', 2 * n * 64 * 2],
                                        ['PART_POS', 'pos', 2 * n * 4]]) {
      want.push({ layer, part, name: `layer.${layer}.${suffix}`, data: crypto.randomBytes(size) });
    }
  }
  header.accounting.sentBytes = want.reduce((s, t) => s + t.data.length, 0);
  for (const sizes of [[MAX_CHUNK_BYTES], [1, 7, 4096, 333333, MAX_CHUNK_BYTES, 65537]]) {
    const m = assemble(chunkedDelivery(header, want, sizes));
    assert.deepEqual(m.tensors.map((t) => t.name), want.map((t) => t.name));
    m.tensors.forEach((t, i) => {
      assert.equal(t.data.length, want[i].data.length, t.name);
      assert.equal(t.data.buffer.byteLength, want[i].data.length, `${t.name}: capacity is the tensor's size`);
      assert.ok(t.data.equals(want[i].data), `${t.name}: bytes differ (chunk sizes ${sizes})`);
    });
  }
});

test('Assembler: a header announcing 16 GiB costs what arrives, and the short stream fails cleanly', () => {
  // 4 layers, F32, H=1, d=128, n=2^22: k and v are 2 GiB each (within
  // buffer.constants.MAX_LENGTH), ~16 GiB in all. 4 MiB of layer.0.k arrive.
  const n = 2 ** 22;
  const tensor = n * 128 * 4;
  const header = { messageId: 'm', layers: 4, kvHeads: 1, headDim: 128, dtype: 'DTYPE_F32', nHistory: 0,
                   nAnchor: n, nKept: 0, nGen: 0, quantBits: 0, quantGroup: 0,
                   accounting: { sentBytes: 4 * (2 * tensor + n * 4) } };
  const received = 4 * MAX_CHUNK_BYTES;
  const data = crypto.randomBytes(received);
  const responses = chunkedDelivery(header, [{ layer: 0, part: 'PART_K', data }], [MAX_CHUNK_BYTES]);
  const a = new Assembler();
  const before = process.memoryUsage().arrayBuffers;
  for (const r of responses.slice(0, -1)) a.add(r);
  const grown = process.memoryUsage().arrayBuffers - before;
  const slot = a.slots[0];
  assert.equal(slot.filled, received);
  // The tensor's buffer follows the data: at most twice what arrived.
  assert.ok(slot.data.length >= received && slot.data.length <= 2 * received,
            `layer.0.k buffer of ${slot.data.length} bytes after ${received} received`);
  assert.ok(slot.data.subarray(0, received).equals(data));
  assert.ok(grown <= 8 * received, `arrayBuffers grew by ${grown} bytes after ${received} received`);
  assert.throws(() => a.add(responses.at(-1)), (e) => e instanceof RelayError &&
    e.code === grpc.status.DATA_LOSS &&
    e.details === `trailer: stream ended with layer.0.k at ${received} of ${tensor} bytes`);
  assert.throws(() => a.message(), (e) => e instanceof RelayError && e.code === grpc.status.DATA_LOSS);
});

// ---- publish: the message id travels with every error --------------------------
test('planUpload: unset defaults, and geometry values the wire cannot carry are INVALID_ARGUMENT', () => {
  const invalidArg = (re) => (e) => e instanceof RelayError && e.code === grpc.status.INVALID_ARGUMENT && re.test(e.details);
  // An explicit undefined/null takes the default like an absent key.
  for (const firstAgent of [undefined, null]) {
    const { geometry } = planUpload(tinyTurn({ firstAgent, nHistory: undefined }));
    assert.deepEqual([geometry.firstAgent, geometry.nHistory, geometry.promptPos0], [true, 0, undefined]);
  }
  assert.equal(planUpload(tinyTurn({ firstAgent: false })).geometry.firstAgent, false);
  // With uploaded history the turn is a later agent's unless it says otherwise.
  const hist = () => ({ historyK: Buffer.alloc(4 * 2 * 4), historyV: Buffer.alloc(4 * 2 * 4),
                        historyPos: Buffer.from(new Int32Array([0, 1]).buffer) });
  const withHistory = (o) => {
    const t = tinyTurn({ nHistory: 2, promptPos0: 2, ...o });
    t.layers = t.layers.map((l) => ({ ...l, ...hist() }));
    return t;
  };
  assert.equal(planUpload(withHistory({})).geometry.firstAgent, false);
  assert.equal(planUpload(withHistory({ firstAgent: true })).geometry.firstAgent, true);
  assert.equal(planUpload(tinyTurn({ promptPos0: null })).geometry.promptPos0, undefined);
  assert.equal(planUpload(tinyTurn({ promptPos0: 2 ** 40 })).geometry.promptPos0, 2 ** 40);
  for (const firstAgent of ['false', 0, 1]) {
    assert.throws(() => planUpload(tinyTurn({ firstAgent })), invalidArg(/^turn\.firstAgent: .*, expected true or false$/));
  }
  for (const promptPos0 of ['abc', '5', 1.5, -1, -0.5, true, NaN, 2 ** 53]) {
    assert.throws(() => planUpload(tinyTurn({ promptPos0 })), invalidArg(/^turn\.promptPos0: .*, expected an integer >= 0/),
                  String(promptPos0));
  }
  // 2^32 + 2 would wrap to 2 in the uint32 field.
  assert.throws(() => planUpload(tinyTurn({ kvHeads: 2 ** 32 + 2, scoreHeads: 2 ** 32 + 2 })),
                invalidArg(/^turn\.kvHeads: 4294967298, expected an integer 0\.\.4294967295$/));
});

test('writeSafetensors: typed arrays and DataViews are written as their bytes', async () => {
  const file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'kvrelay-st-')), 'w.safetensors');
  const f32 = new Float32Array([1, 2, 3, 4]);
  const i32 = new Int32Array([7, 8]);
  await writeSafetensors(file, [{ name: 'x', dtype: 'F32', shape: [4], data: f32 },
                                { name: 'p', dtype: 'I32', shape: [2], data: new DataView(i32.buffer) }], { a: 'b' });
  const { metadata, tensors } = await readSafetensors(file);
  assert.deepEqual(metadata, { a: 'b' });
  assert.deepEqual(Buffer.from(tensors.get('x').data), Buffer.from(f32.buffer));
  assert.deepEqual(Buffer.from(tensors.get('p').data), Buffer.from(i32.buffer));
  await assert.rejects(writeSafetensors(file, [{ name: 'x', dtype: 'F32', shape: [1], data: [1] }]), TypeError);
});

test('readSafetensors: tensors sharing bytes or with a bad shape are refused; gaps are fine', async () => {
  const file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'kvrelay-st-')), 'f.safetensors');
  const write = (header) => {
    const h = Buffer.from(JSON.stringify(header));
    const len = Buffer.alloc(8);
    len.writeBigUInt64LE(BigInt(h.length));
    fs.writeFileSync(file, Buffer.concat([len, h, Buffer.alloc(16)]));
    return file;
  };
  const f32 = (shape, begin, end) => ({ dtype: 'F32', shape, data_offsets: [begin, end] });
  await assert.rejects(readSafetensors(write({ a: f32([2], 0, 8), b: f32([2], 4, 12) })), /a and b: data_offsets overlap/);
  await assert.rejects(readSafetensors(write({ a: f32([-1, -2], 0, 8) })), /shape \[-1,-2\], expected an array of integers >= 0/);
  const { tensors } = await readSafetensors(write({ a: f32([1], 0, 4), b: f32([1], 8, 12) }));
  assert.deepEqual([...tensors.keys()], ['a', 'b']);
  assert.deepEqual(Object.keys(tensors.get('a')), ['dtype', 'shape', 'data']);
});

// A stand-in relay: Publish records each header's message id; session 'down'
// answers UNAVAILABLE, session 'slow' never answers the first upload of an id
// (the caller's deadline passes: the outcome is unknown) and answers a
// re-publish of that id with duplicate = true, as the relay does once committed.
async function withFakeRelay(fn) {
  const seen = [];
  const committed = new Set();
  await withRelayServer({
    Fetch(call) { call.on('error', () => {}); }, // never answers: the caller's deadline or cancel ends it
    Publish(call, callback) {
      let header;
      call.on('data', (r) => { if (r.header) { header = r.header; seen.push(header.messageId); } });
      call.on('error', () => {});
      call.on('end', () => {
        if (header.sessionId === 'down') {
          callback({ code: grpc.status.UNAVAILABLE, details: 'fake relay: going away' });
        } else if (committed.has(header.messageId)) {
          callback(null, { messageId: header.messageId, duplicate: true });
        } else {
          committed.add(header.messageId); // committed, but the answer never comes
        }
      });
    },
  }, async (addr) => {
    const relay = new RelayClient(addr);
    try {
      await fn(relay, seen, Number(addr.split(':')[1]));
    } finally {
      relay.close();
    }
  });
}

const route = { sender: 'planner', recipients: ['critic'] };

test('publish: every error carries the message id the publish sent', async () => {
  await withFakeRelay(async (relay, seen) => {
    // A server error, generated id: the id on the error is the one the relay saw.
    const e1 = await relay.publish(tinyTurn(), { ...route, sessionId: 'down' }).then(
      () => assert.fail('resolved'), (e) => e);
    assert.equal(e1.code, grpc.status.UNAVAILABLE);
    assert.match(e1.messageId, /^m-[0-9a-f]{24}$/);
    assert.deepEqual(seen, [e1.messageId]);
    // The caller's id, chosen up front.
    const id = newMessageId();
    const e2 = await relay.publish(tinyTurn(), { ...route, sessionId: 'down', messageId: id }).then(
      () => assert.fail('resolved'), (e) => e);
    assert.equal(e2.messageId, id);
    assert.equal(seen.at(-1), id);
    // Errors found before any call carry it too.
    const e3 = await relay.publish(tinyTurn({ dtype: 'F64' }), { ...route, sessionId: 's', messageId: 'm-x' }).then(
      () => assert.fail('resolved'), (e) => e);
    assert.ok(e3 instanceof RelayError && e3.code === grpc.status.INVALID_ARGUMENT);
    assert.equal(e3.messageId, 'm-x');
  });
});

test('publish/fetch: one recipient as a string; a timeout that is not a positive number is INVALID_ARGUMENT', async () => {
  await withFakeRelay(async (relay, seen) => {
    const e = await relay.publish(tinyTurn(), { sender: 'planner', recipients: 'critic', sessionId: 'down' }).then(
      () => assert.fail('resolved'), (err) => err);
    assert.equal(e.code, grpc.status.UNAVAILABLE);  // reached the relay: the string was one recipient
    assert.deepEqual(seen, [e.messageId]);
    for (const timeoutMs of ['500', 0, -1, NaN]) {
      const calls = [
        relay.fetch('s', 'critic', { timeoutMs }),
        relay.publish(tinyTurn(), { ...route, sessionId: 's', timeoutMs }),
        relay.ack('s', 'critic', 'm-1', { timeoutMs }),
        relay.stats({ timeoutMs }),
      ];
      for (const call of calls) {
        const f = await call.then(() => assert.fail('resolved'), (err) => err);
        assert.ok(f instanceof RelayError && f.code === grpc.status.INVALID_ARGUMENT, String(f));
        assert.match(f.details, /^timeoutMs: .*, expected a positive number of milliseconds$/);
      }
    }
  });
});

test('publish: an empty or null messageId gets a fresh one; a role that is not a string is INVALID_ARGUMENT', async () => {
  await withFakeRelay(async (relay, seen) => {
    for (const messageId of ['', null, undefined]) {
      const e = await relay.publish(tinyTurn(), { ...route, sessionId: 'down', messageId }).then(
        () => assert.fail('resolved'), (err) => err);
      assert.equal(e.code, grpc.status.UNAVAILABLE, String(e));
      assert.match(e.messageId, /^m-[0-9a-f]{24}$/);
      assert.equal(seen.at(-1), e.messageId);
    }
    for (const role of [{}, 5, 'r'.repeat(129)]) {
      const e = await relay.publish(tinyTurn(), { ...route, sessionId: 's', role }).then(
        () => assert.fail('resolved'), (err) => err);
      assert.ok(e instanceof RelayError && e.code === grpc.status.INVALID_ARGUMENT && /^role: /.test(e.details), String(e));
    }
  });
});

test('compress: a bad policy, turn or timeout is INVALID_ARGUMENT before any call', async () => {
  await withFakeRelay(async (relay) => {
    const invalidArg = (re) => (e) => e instanceof RelayError && e.code === grpc.status.INVALID_ARGUMENT && re.test(e.details);
    await assert.rejects(relay.compress(tinyTurn(), ''), invalidArg(/^policy: empty, expected a pipeline spec/));
    await assert.rejects(relay.compress(tinyTurn(), 5), invalidArg(/^policy: number/));
    await assert.rejects(relay.compress(tinyTurn({ dtype: 'F64' }), 'full'), invalidArg(/^turn\.dtype/));
    await assert.rejects(relay.compress(tinyTurn(), 'full', { timeoutMs: -1 }), invalidArg(/^timeoutMs/));
  });
});

test('close: calls in flight are cancelled, not left to their deadline', async () => {
  await withFakeRelay(async (relay) => {
    const t0 = Date.now();
    const pending = relay.fetch('s', 'critic', { timeoutMs: 20000 }).then(() => assert.fail('resolved'), (e) => e);
    await new Promise((resolve) => setTimeout(resolve, 200));
    relay.close();
    const err = await pending;
    assert.equal(err.code, grpc.status.CANCELLED, String(err));
    assert.ok(Date.now() - t0 < 5000, `took ${Date.now() - t0} ms`);
  });
});

test('publish: a retry with the id from DEADLINE_EXCEEDED is a duplicate, not a second message', async () => {
  await withFakeRelay(async (relay, seen) => {
    const opts = { ...route, sessionId: 'slow', timeoutMs: 800 };
    const err = await relay.publish(tinyTurn(), opts).then(() => assert.fail('resolved'), (e) => e);
    assert.equal(err.code, grpc.status.DEADLINE_EXCEEDED);
    assert.match(err.messageId, /^m-[0-9a-f]{24}$/);
    const r = await relay.publish(tinyTurn(), { ...opts, messageId: err.messageId, timeoutMs: 5000 });
    assert.deepEqual([r.messageId, r.duplicate], [err.messageId, true]);
    assert.deepEqual(seen, [err.messageId, err.messageId]);
  });
});

test('publish: an unreachable relay (UNAVAILABLE) still tells the id', async () => {
  let port;
  await withFakeRelay(async (_relay, _seen, p) => { port = p; });
  const relay = new RelayClient(`127.0.0.1:${port}`); // the stand-in is gone
  try {
    const err = await relay.publish(tinyTurn(), { ...route, sessionId: 's', timeoutMs: 5000 }).then(
      () => assert.fail('resolved'), (e) => e);
    assert.ok([grpc.status.UNAVAILABLE, grpc.status.DEADLINE_EXCEEDED].includes(err.code), String(err));
    assert.match(err.messageId, /^m-[0-9a-f]{24}$/);
  } finally {
    relay.close();
  }
});

// A stand-in relay that records each call's authorization metadata and
// answers UNAUTHENTICATED.
async function withAuthRecorder(fn) {
  const seen = {};
  const record = (method, call) => { (seen[method] ??= []).push(...call.metadata.get('authorization')); };
  const refuse = { code: grpc.status.UNAUTHENTICATED, details: 'recorder' };
  await withRelayServer({
    Stats(call, callback) { record('Stats', call); callback(refuse); },
    Fetch(call) { record('Fetch', call); call.emit('error', refuse); },
    Publish(call, callback) { record('Publish', call); call.on('error', () => {}); callback(refuse); },
  }, (addr) => fn(addr, seen));
}

test('token: sent as authorization on unary and streaming calls over an insecure channel; env is the default', async () => {
  const saved = process.env.KVRELAY_TOKEN;
  try {
    await withAuthRecorder(async (addr, seen) => {
      for (const [options, env, want] of [[{ token: 'tok-1' }, 'from-env', ['Bearer tok-1']],
                                          [{}, 'from-env', ['Bearer from-env']],
                                          [{ token: '' }, 'from-env', ['Bearer from-env']],
                                          [{}, undefined, []]]) {
        if (env === undefined) delete process.env.KVRELAY_TOKEN; else process.env.KVRELAY_TOKEN = env;
        for (const k of Object.keys(seen)) delete seen[k];
        const relay = new RelayClient(addr, options);
        try {
          const codeOf = (p) => p.then(() => assert.fail('resolved'), (e) => e.code);
          assert.equal(await codeOf(relay.stats()), grpc.status.UNAUTHENTICATED);
          assert.equal(await codeOf(relay.fetch('s', 'critic', { timeoutMs: 5000 })), grpc.status.UNAUTHENTICATED);
          assert.equal(await codeOf(relay.publish(tinyTurn(), { ...route, sessionId: 's', timeoutMs: 5000 })),
                       grpc.status.UNAUTHENTICATED);
        } finally {
          relay.close();
        }
        for (const m of ['Stats', 'Fetch', 'Publish']) {
          assert.deepEqual(seen[m], want, `${JSON.stringify(options)} env=${env}: ${m}`);
        }
      }
    });
  } finally {
    if (saved === undefined) delete process.env.KVRELAY_TOKEN; else process.env.KVRELAY_TOKEN = saved;
  }
});

test('credentials options: errors name the option, never the token', () => {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'kvrelay-unit-'));
  try {
    const notPem = path.join(tmp, 'ca.pem');
    fs.writeFileSync(notPem, 'not a certificate\n');
    const cases = [
      [{ token: 'secret\nline' }, /^token: character 6 of 11 is U\+000a, expected visible ASCII/],
      [{ token: 'sec ret' }, /^token: character 3 of 7 is U\+0020/],
      [{ tlsCert: 'c.pem', tlsKey: 'k.pem' }, /^tlsCert: given without tlsCa/],
      [{ tlsCa: notPem, tlsCert: 'c.pem' }, /^tlsCert and tlsKey: expected both or neither/],
      [{ tlsCa: path.join(tmp, 'missing.pem') }, /^tlsCa: ENOENT/],
      [{ tlsCa: notPem }, /no PEM certificate, expected one or more$/],
      [{ tlsCa: Buffer.from('junk') }, /^tlsCa: Buffer: no PEM certificate/],
      [{ tlsCa: 5 }, /^tlsCa: number, expected a file path or a Buffer of PEM$/],
      [{ credentials: grpc.credentials.createInsecure(), tlsCa: notPem }, /^credentials: given with tlsCa/],
    ];
    for (const [options, re] of cases) {
      assert.throws(() => new RelayClient('127.0.0.1:1', options), (e) => {
        assert.ok(e instanceof RelayError && e.code === grpc.status.INVALID_ARGUMENT, String(e));
        assert.match(e.details, re);
        assert.doesNotMatch(e.message, /secret|sec ret/);
        return true;
      }, JSON.stringify(options));
    }
    const tokenFile = path.join(tmp, 'token');
    fs.writeFileSync(tokenFile, '  tok-123 \r\nsecond line\n');
    assert.equal(readTokenFile(tokenFile), 'tok-123');
    fs.writeFileSync(tokenFile, 'tok-456');
    assert.equal(readTokenFile(tokenFile), 'tok-456');
    fs.writeFileSync(tokenFile, ' \nlater\n');
    assert.throws(() => readTokenFile(tokenFile), /first line empty, expected the token/);
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
});

// ---- historyScore, historyAnchors, attentionError ------------------------------------

// tinyTurn with an uploaded history of 4 tokens (positions 0..3), the
// chain's anchors 0 and 2, and a historyScore [2, 4] per layer.
function historyTurn(overrides = {}) {
  const t = tinyTurn({ nHistory: 4, historyAnchors: [0, 2], ...overrides });
  t.layers.forEach((layer, l) => {
    layer.historyK = new Float32Array(16);
    layer.historyV = new Float32Array(16);
    layer.historyPos = new Int32Array([0, 1, 2, 3]);
    layer.historyScore = new Float32Array([0, 0, 9, 9, 0, 0, 9, l]);
  });
  return t;
}

test('planUpload: HISTORY_SCORE after PROMPT_SCORE, before the history; historyAnchors and historyScoreTokens', () => {
  const { geometry, tensors } = planUpload(historyTurn());
  assert.deepEqual([geometry.historyAnchors, geometry.historyScoreTokens, geometry.nHistory, geometry.firstAgent],
                   [[0, 2], 4, 4, false]);
  const layer = (l) => [`${l}:PART_PROMPT_K:48`, `${l}:PART_PROMPT_V:48`, `${l}:PART_GEN_K:16`, `${l}:PART_GEN_V:16`,
    `${l}:PART_PROMPT_SCORE:24`, `${l}:PART_HISTORY_SCORE:32`, `${l}:PART_HISTORY_K:64`, `${l}:PART_HISTORY_V:64`,
    `${l}:PART_HISTORY_POS:16`];
  assert.deepEqual(tensors.map((t) => `${t.layer}:${t.part}:${t.data.length}`), [...layer(0), ...layer(1)]);
  assert.deepEqual(Buffer.from(tensors[14].data), Buffer.from(new Float32Array([0, 0, 9, 9, 0, 0, 9, 1]).buffer));
  // The geometry holds its own anchors.
  const t = historyTurn();
  const g = planUpload(t).geometry;
  t.historyAnchors[0] = 1;
  assert.deepEqual(g.historyAnchors, [0, 2]);
  assert.equal(planUpload(historyTurn({ historyScoreTokens: 4 })).geometry.historyScoreTokens, 4);
  // With a parent (no uploaded history): the parent's tokens per head, given.
  const child = tinyTurn({ historyScoreTokens: 3 });
  child.layers.forEach((l) => { l.historyScore = new Float32Array(6); });
  const c = planUpload(child);
  assert.deepEqual([c.geometry.historyScoreTokens, c.geometry.nHistory, c.geometry.historyAnchors], [3, 0, undefined]);
  assert.deepEqual(c.tensors.filter((x) => x.layer === 0).map((x) => x.part), ['PART_PROMPT_K', 'PART_PROMPT_V',
    'PART_GEN_K', 'PART_GEN_V', 'PART_PROMPT_SCORE', 'PART_HISTORY_SCORE']);
  // None: neither field nor part.
  const plain = planUpload(tinyTurn({ historyAnchors: [], historyScoreTokens: 0 }));
  assert.deepEqual([plain.geometry.historyAnchors, plain.geometry.historyScoreTokens], [undefined, undefined]);
  assert.ok(!plain.tensors.some((x) => x.part === 'PART_HISTORY_SCORE'));
});

test('planUpload: bad historyAnchors and historyScore name the field before any call', async () => {
  const invalidArg = (re) => (e) => e instanceof RelayError && e.code === grpc.status.INVALID_ARGUMENT && re.test(e.details);
  const noHistory = (t) => { t.nHistory = 0; t.layers.forEach((l) => { delete l.historyK; }); };
  const cases = [
    ['descending', (t) => { t.historyAnchors = [2, 1]; },
     /^turn\.historyAnchors\[1\]: 1 after 2, expected ascending distinct position ids$/],
    ['twice', (t) => { t.historyAnchors = [1, 1]; }, /^turn\.historyAnchors\[1\]: 1 after 1/],
    ['negative', (t) => { t.historyAnchors = [-1]; }, /^turn\.historyAnchors\[0\]: -1, expected an integer position id in \[0, 2\^31\)$/],
    ['fraction', (t) => { t.historyAnchors = [0.5]; }, /^turn\.historyAnchors\[0\]: 0\.5, expected an integer/],
    ['string id', (t) => { t.historyAnchors = ['1']; }, /^turn\.historyAnchors\[0\]: "1", expected an integer/],
    ['a string', (t) => { t.historyAnchors = '0,2'; }, /^turn\.historyAnchors: "0,2", expected an array of position ids$/],
    ['more than the history', (t) => { t.historyAnchors = [0, 1, 2, 3, 4]; },
     /^turn\.historyAnchors: 5 position ids, expected at most nHistory = 4$/],
    ['without history', (t) => { noHistory(t); t.layers.forEach((l) => { delete l.historyScore; }); },
     /^turn\.historyAnchors: 2 position ids, expected none for a turn without history \(with parentId/],
    ['score in layer 1 only', (t) => { delete t.layers[0].historyScore; },
     /^layer\.0\.history\.score: missing, expected it in every layer or in none \(layer\.1 has one\)$/],
    ['score short', (t) => { t.layers[1].historyScore = new Float32Array(7); },
     /^layer\.1\.history\.score: 28 bytes, expected 32 bytes/],
    ['tokens other than nHistory', (t) => { t.historyScoreTokens = 5; },
     /^turn\.historyScoreTokens: 5, expected nHistory = 4 \(the uploaded history's tokens\)$/],
    ['tokens without a score', (t) => { t.layers.forEach((l) => { delete l.historyScore; }); t.historyScoreTokens = 4; },
     /^turn\.historyScoreTokens: 4, expected 0 or unset \(no layer carries a historyScore\)$/],
    ['parent-style without tokens', (t) => { noHistory(t); t.historyAnchors = undefined; },
     /^turn\.historyScoreTokens: unset, expected the parent's tokens per head/],
    ['negative tokens', (t) => { t.historyScoreTokens = -1; }, /^turn\.historyScoreTokens: -1, expected an integer/],
  ];
  for (const [name, edit, re] of cases) {
    const t = historyTurn();
    edit(t);
    assert.throws(() => planUpload(t), invalidArg(re), name);
  }
  const q = queryTurn('F32', { historyScoreTokens: 1 });
  q.layers.forEach((l) => { l.historyScore = new Float32Array(2); });
  assert.throws(() => planUpload(q), invalidArg(/^layer\.0\.history\.score: given with layer\.0\.gen\.q, expected none/));

  // A historyScore needs a history: uploaded, or the parent's.
  const orphan = tinyTurn({ historyScoreTokens: 3 });
  orphan.layers.forEach((l) => { l.historyScore = new Float32Array(6); });
  const relay = new RelayClient('127.0.0.1:1');
  try {
    const want = invalidArg(/^layer\.0\.history\.score: \[2, 3\] given without history, expected none \(upload the history, or publish with parentId/);
    await assert.rejects(relay.publish(orphan, { ...route, sessionId: 's' }), want);
    await assert.rejects(relay.compress(orphan, 'full'), want);
  } finally {
    relay.close();
  }
});

test('publish: HISTORY_SCORE chunks, historyScoreTokens and historyAnchors reach the relay', async () => {
  let r;
  const reply = (header) => ({ messageId: header.messageId, accounting: { policy: 'p', attentionError: 0 } });
  const [h, c] = (await recordPublishes(reply, async (relay) => {
    r = await relay.publish(historyTurn(), { ...route, sessionId: 's', messageId: 'm-h' });
    const child = tinyTurn({ historyScoreTokens: 3 });
    child.layers.forEach((l) => { l.historyScore = new Float32Array(6); });
    await relay.publish(child, { ...route, sessionId: 's', messageId: 'm-c', parentId: 'm-p' });
  })).map(({ header, parts }) => ({ header, parts: parts.map((p) => p.replace(/:\d+$/, '')) }));
  assert.deepEqual([h.header.geometry.historyAnchors, h.header.geometry.historyScoreTokens], [[0, 2], 4]);
  assert.deepEqual(h.parts.slice(0, 9), ['0:PART_PROMPT_K', '0:PART_PROMPT_V', '0:PART_GEN_K', '0:PART_GEN_V',
    '0:PART_PROMPT_SCORE', '0:PART_HISTORY_SCORE', '0:PART_HISTORY_K', '0:PART_HISTORY_V', '0:PART_HISTORY_POS']);
  assert.deepEqual([c.header.parentId, c.header.geometry.historyScoreTokens, c.header.geometry.firstAgent,
                    c.header.geometry.historyAnchors], ['m-p', 3, false, []]);
  assert.equal(c.parts.filter((p) => p.endsWith('HISTORY_SCORE')).length, 2);
  // A figure of 0 is a figure, not its absence; proto-loader's marker is gone.
  assert.equal(r.accounting.attentionError, 0);
  assert.ok(!('_attentionError' in r.accounting));
});

test('readTurnFile: history.score and history_anchors; a turn for a parent; history.acc is refused', async () => {
  const file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'kvrelay-st-')), 'turn.safetensors');
  const tensorsOf = ({ history = true, score = true } = {}) => historyTurn().layers.flatMap((l, i) => [
    { name: `layer.${i}.prompt.k`, dtype: 'F32', shape: [1, 3, 4], data: l.promptK },
    { name: `layer.${i}.prompt.v`, dtype: 'F32', shape: [1, 3, 4], data: l.promptV },
    { name: `layer.${i}.gen.k`, dtype: 'F32', shape: [1, 1, 4], data: l.genK },
    { name: `layer.${i}.gen.v`, dtype: 'F32', shape: [1, 1, 4], data: l.genV },
    { name: `layer.${i}.prompt.score`, dtype: 'F32', shape: [2, 3], data: l.promptScore },
    ...(history ? [
      { name: `layer.${i}.history.k`, dtype: 'F32', shape: [1, 4, 4], data: l.historyK },
      { name: `layer.${i}.history.v`, dtype: 'F32', shape: [1, 4, 4], data: l.historyV },
      { name: `layer.${i}.history.pos`, dtype: 'I32', shape: [1, 4], data: l.historyPos }] : []),
    ...(score ? [{ name: `layer.${i}.history.score`, dtype: 'F32', shape: [2, 4], data: l.historyScore }] : []),
  ]);
  await writeSafetensors(file, tensorsOf(), { first_agent: 'false', history_anchors: '0,2' });
  const turn = await readTurnFile(file);
  assert.deepEqual([turn.historyAnchors, turn.historyScoreTokens, turn.nHistory], [[0, 2], 4, 4]);
  assert.deepEqual(Buffer.from(turn.layers[1].historyScore),
                   Buffer.from(new Float32Array([0, 0, 9, 9, 0, 0, 9, 1]).buffer));
  assert.deepEqual([planUpload(turn).geometry.historyScoreTokens, planUpload(turn).geometry.historyAnchors], [4, [0, 2]]);
  await writeSafetensors(file, tensorsOf({ score: false }), { history_anchors: '' });
  const plain = await readTurnFile(file);
  assert.deepEqual([plain.historyAnchors, plain.historyScoreTokens, plain.layers[0].historyScore],
                   [undefined, undefined, undefined]);
  // A turn for a parent: history.score alone, as many columns as it has.
  await writeSafetensors(file, tensorsOf({ history: false }), { first_agent: 'false' });
  const child = await readTurnFile(file);
  assert.deepEqual([child.nHistory, child.historyScoreTokens], [0, 4]);
  const relay = new RelayClient('127.0.0.1:1');
  try {
    await assert.rejects(relay.publish(child, { ...route, sessionId: 's' }), /\[2, 4\] given without history/);
  } finally {
    relay.close();
  }

  const acc = { name: 'layer.0.history.acc', dtype: 'F32', shape: [1, 4], data: new Float32Array(4) };
  const cases = [
    ['anchor not a number', tensorsOf(), '0,x', /metadata history_anchors: item "x" of 1, expected comma-separated position ids/],
    ['negative anchor', tensorsOf(), '-1', /metadata history_anchors: item "-1" of 0/],
    ['anchor past int32', tensorsOf(), '2147483648', /metadata history_anchors: item "2147483648" of 0/],
    ['empty item', tensorsOf(), '0,,2', /metadata history_anchors: item "" of 1/],
    ['score in layer 0 only', tensorsOf().slice(0, 17), '0,2', /layer\.1\.history\.score: missing/],
    ['score in layer 1 only', tensorsOf().filter((t) => t.name !== 'layer.0.history.score'), '0,2',
     /layer\.1\.history\.score: given, expected it in every layer or in none/],
    ['score shape', tensorsOf().map((t) => (t.name === 'layer.0.history.score' ? { ...t, shape: [4, 2] } : t)), '0,2',
     /layer\.0\.history\.score: F32 \[4,2\], expected F32 \[2,4\] \(from layer\.0\)/],
    ['widths differ without history', tensorsOf({ history: false }).map((t) => (t.name === 'layer.1.history.score' ?
      { ...t, shape: [2, 3], data: new Float32Array(6) } : t)), '',
     /layer\.1\.history\.score: F32 \[2,3\], expected F32 \[2,4\] \(from layer\.0\)/],
    ['history.acc', [...tensorsOf(), acc], '0,2', /layer\.0\.history\.acc: not carried by Publish or Compress/],
  ];
  for (const [name, ts, anchors, re] of cases) {
    await writeSafetensors(file, ts, { history_anchors: anchors });
    await assert.rejects(readTurnFile(file), re, name);
  }
});

test('attentionError: a number or null in the accounting, delivered headers too, and in the message file', async () => {
  assert.deepEqual(accountingOf({ policy: 'p', attentionError: 0.25, _attentionError: 'attentionError' }),
                   { policy: 'p', attentionError: 0.25 });
  assert.deepEqual(accountingOf({ policy: 'p' }), { policy: 'p', attentionError: null });
  assert.equal(accountingOf(null), null);
  // Through the wire as proto-loader decodes it: present (0 too) or absent.
  const Publish = loadRelayService().service.Publish;
  const decode = (accounting) => accountingOf(Publish.responseDeserialize(Publish.responseSerialize({ accounting })).accounting);
  assert.equal(decode({ attentionError: 0 }).attentionError, 0);
  assert.equal(decode({ attentionError: 3e-7 }).attentionError, 3e-7);
  assert.equal(decode({}).attentionError, null);
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvrelay-msg-'));
  for (const [figure, want] of [[undefined, undefined], [0.12345678901234568, '0.12345678901234568'], [3e-7, '3e-7']]) {
    const a = new Assembler();
    const k = new Float32Array([1, 2, 3, 4]);
    const pos = new Int32Array([0, 1]);
    const accounting = { sentBytes: 40, policy: 'p', fullBytes: 40, receivedBytes: 0, ratio: 1, compressSeconds: 0,
                         commitSeconds: 0, ...(figure === undefined ? {} : { attentionError: figure, _attentionError: 'attentionError' }) };
    a.add({ kind: 'header', header: { messageId: 'm', layers: 1, kvHeads: 1, headDim: 2, dtype: 'DTYPE_F32', nHistory: 0,
                                      nAnchor: 1, nKept: 0, nGen: 1, quantBits: 0, deliveryAttempt: 1, accounting } });
    let crc = 0;
    for (const [part, data] of [['PART_K', k], ['PART_V', k], ['PART_POS', pos]]) {
      const bytes = Buffer.from(data.buffer);
      a.add({ kind: 'chunk', chunk: { layer: 0, part, offset: 0, data: bytes, crc32c: crc32c(bytes) } });
      crc = crc32cCombine(crc, crc32c(bytes), bytes.length);
    }
    a.add({ kind: 'trailer', trailer: { chunks: 3, bytes: 40, crc32c: crc } });
    const m = a.message();
    assert.equal(m.header.accounting.attentionError, figure === undefined ? null : figure);
    assert.ok(!('_attentionError' in m.header.accounting));
    const file = path.join(dir, 'msg.safetensors');
    await writeMessageFile(file, m);
    const { metadata } = await readSafetensors(file);
    assert.equal(metadata.attention_error, want);
  }
});
