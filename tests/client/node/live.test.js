'use strict';
// Tests of client/node against a live relay (node:test): they run only when
// KVRELAY_LIVE_ADDR names one, and skip otherwise. test_node_client.py starts
// a kvrelay-server and runs each of them as
//   KVRELAY_LIVE_ADDR=HOST:PORT NODE_PATH=<deps>/node_modules \
//       node --test --test-name-pattern=NAME live.test.js
// with KVRELAY_NODE_CLIENT_DIR pointing at client/node.

const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');

const dir = process.env.KVRELAY_NODE_CLIENT_DIR || path.resolve(__dirname, '../../../client/node');
const { RelayClient, newMessageId, statusName } = require(path.join(dir, 'client.js'));

const ADDR = process.env.KVRELAY_LIVE_ADDR;
const skip = ADDR ? false : 'KVRELAY_LIVE_ADDR not set: no live relay';

const LAYERS = 2;
const KV = 2;
const SCORE = 4;
const DIM = 16;

// A deterministic generator (mulberry32) and its normal deviates (Box-Muller).
function rng(seed) {
  let a = seed >>> 0;
  const uniform = () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const normal = () => Math.sqrt(-2 * Math.log(1 - uniform())) * Math.cos(2 * Math.PI * uniform());
  return { uniform, normal };
}

/**
 * An F32 turn (2 layers, 2 KV heads, 4 score heads, headDim 16) with random
 * K/V and scores, and an uploaded history at positions 0..nHistory-1 in
 * every head when nHistory > 0; with queries, random F32 genQ instead of
 * scores.
 */
function randomTurn(seed, nPrompt, nGen, nHistory = 0, { queries = false } = {}) {
  const r = rng(seed);
  const normal = (n) => Float32Array.from({ length: n }, r.normal);
  const kv = KV * DIM;
  const layers = [];
  for (let l = 0; l < LAYERS; l++) {
    const layer = { promptK: normal(kv * nPrompt), promptV: normal(kv * nPrompt), genK: normal(kv * nGen),
                    genV: normal(kv * nGen) };
    if (queries) layer.genQ = normal(SCORE * nGen * DIM);
    else layer.promptScore = Float32Array.from({ length: SCORE * nPrompt }, r.uniform);
    if (nHistory > 0) {
      layer.historyK = normal(kv * nHistory);
      layer.historyV = normal(kv * nHistory);
      layer.historyPos = Int32Array.from({ length: KV * nHistory }, (_, i) => i % nHistory);
    }
    layers.push(layer);
  }
  return { dtype: 'F32', kvHeads: KV, scoreHeads: SCORE, headDim: DIM, nPrompt, nGen, nHistory,
           queryDtype: queries ? 'F32' : undefined, layers };
}

/**
 * A historyScore [SCORE, n]: 100 on the columns cols[h] of the score heads
 * reading KV head h (GQA), 0 elsewhere: those tokens outweigh any prompt
 * token's score.
 */
function massOn(n, cols) {
  const hs = new Float32Array(SCORE * n);
  const group = SCORE / KV;
  for (let q = 0; q < SCORE; q++) for (const c of cols[Math.floor(q / group)]) hs[q * n + c] = 100;
  return hs;
}

/** Per layer, per head: the position ids of a delivered message. */
function positions(m) {
  const h = m.header;
  const n = h.nHistory + h.nAnchor + h.nKept + h.nGen;
  return m.tensors.filter((t) => t.part === 'PART_POS').map((t) => {
    const pos = new Int32Array(t.data.buffer, t.data.byteOffset, t.data.byteLength / 4);
    return Array.from({ length: h.kvHeads }, (_, head) => Array.from(pos.subarray(head * n, (head + 1) * n)));
  });
}

/** Per layer, per head: the sorted position ids of the message's history part. */
function historySets(m) {
  return positions(m).map((heads) => heads.map((row) => row.slice(0, m.header.nHistory).sort((a, b) => a - b)));
}

const session = (name) => `node-live-${name}-${newMessageId().slice(2, 10)}`;

async function withRelay(fn) {
  const relay = new RelayClient(ADDR);
  try {
    await fn(relay);
  } finally {
    relay.close();
  }
}

async function publishFetch(relay, turn, options) {
  const r = await relay.publish(turn, { timeoutMs: 60000, ...options });
  const m = await relay.fetch(options.sessionId, options.recipients[0], { timeoutMs: 30000, autoAck: true });
  assert.equal(m.header.messageId, r.messageId);
  return [r, m];
}

test('live attentionError: a figure for a turn with queries (publish, delivery, compress), null for scores',
     { skip }, async () => {
  await withRelay(async (relay) => {
    const s = session('attention-error');
    const route = { sessionId: s, sender: 'planner', recipients: ['critic'], policy: 'h2o-head:k=2' };
    const q = randomTurn(60, 12, 4, 0, { queries: true });
    const [r, m] = await publishFetch(relay, q, route);
    const e = r.accounting.attentionError;
    assert.equal(typeof e, 'number');
    assert.ok(e > 0, `attention_error ${e}, want > 0 (k=2 of 12 changes the output)`);
    assert.equal(m.header.accounting.attentionError, e);
    const c = await relay.compress(q, 'h2o-head:k=2');
    assert.equal(c.header.accounting.attentionError, e);
    const [r2, m2] = await publishFetch(relay, randomTurn(61, 12, 4), route);
    assert.deepEqual([r2.accounting.attentionError, m2.header.accounting.attentionError], [null, null]);
  });
});

test('live historyAnchors: a history budget keeps them in every head; one the history lacks is INVALID_ARGUMENT',
     { skip }, async () => {
  await withRelay(async (relay) => {
    const route = { sessionId: session('anchors'), sender: 'planner', recipients: ['critic'],
                    policy: 'h2o-head:k=4,hist=2' };
    // History ids 0..11, the prompt from 30: 20 is an id the history does not hold.
    const turn = { ...randomTurn(70, 12, 3, 12), historyAnchors: [3, 7], promptPos0: 30 };
    const [, m] = await publishFetch(relay, turn, route);
    assert.deepEqual([m.header.nHistory, m.header.anchorPos], [4, [3, 7]]);
    positions(m).forEach((heads, l) => heads.forEach((row, h) => {
      const held = row.slice(0, 4);
      assert.ok(held.includes(3) && held.includes(7), `layer.${l} head ${h}: history ${held}`);
    }));
    const err = await relay.publish({ ...turn, historyAnchors: [3, 20] }, route).then(
      () => assert.fail('resolved'), (e) => e);
    assert.equal(statusName(err), 'INVALID_ARGUMENT', String(err));
    assert.match(err.details, /history_anchors.*\b20\b/);
  });
});

// NEEDS a relay that accepts PART_HISTORY_SCORE.
test('live historyScore, uploaded history: the tokens it weighs are the ones hist=2 keeps', { skip }, async () => {
  await withRelay(async (relay) => {
    const turn = { ...randomTurn(80, 10, 3, 12), historyAnchors: [0, 2] };
    turn.layers.forEach((l) => { l.historyScore = massOn(12, [[9, 11], [9, 11]]); });
    const [, m] = await publishFetch(relay, turn, { sessionId: session('history-score'), sender: 'planner',
                                                    recipients: ['critic'], policy: 'h2o-head:k=4,hist=2' });
    assert.equal(m.header.nHistory, 4);
    historySets(m).forEach((heads, l) => heads.forEach((held, h) => {
      assert.deepEqual(held, [0, 2, 9, 11], `layer.${l} head ${h}`);
    }));
  });
});

// NEEDS a relay that accepts PART_HISTORY_SCORE. With a parent the history
// is the parent message: historyScore's columns are its tokens per head, in
// its order. Mass on each head's last two tokens (the parent's generated
// ones, of no importance otherwise) makes hist=2 keep them besides the
// chain's anchors; without the mass it keeps others; other columns than the
// parent's tokens are FAILED_PRECONDITION.
test('live historyScore with a parent: the parent tokens it weighs are the ones hist=2 keeps', { skip }, async () => {
  await withRelay(async (relay) => {
    const s = session('parent-score');
    const [, parent] = await publishFetch(relay, randomTurn(90, 12, 3), { sessionId: s, sender: 'planner',
                                                                          recipients: ['critic'], policy: 'h2o-head:k=4' });
    const h = parent.header;
    const n = h.nHistory + h.nAnchor + h.nKept + h.nGen;
    assert.deepEqual(h.anchorPos, [0, 1, 2, 3]);
    const pos = positions(parent);
    const route = { sessionId: s, sender: 'critic', recipients: ['judge'], policy: 'h2o-head:k=4,hist=2',
                    parentId: h.messageId };
    const child = (columns) => {
      const t = randomTurn(91, 10, 2);
      if (columns) {
        t.historyScoreTokens = columns;
        t.layers.forEach((l) => { l.historyScore = massOn(columns, [[n - 2, n - 1], [n - 2, n - 1]]); });
      }
      return t;
    };
    const [, m] = await publishFetch(relay, child(n), route);
    assert.deepEqual([m.header.nHistory, m.header.parentId], [6, h.messageId]);
    const got = historySets(m);
    got.forEach((heads, l) => heads.forEach((held, hd) => {
      const want = [0, 1, 2, 3, pos[l][hd][n - 2], pos[l][hd][n - 1]].sort((a, b) => a - b);
      assert.deepEqual(held, want, `layer.${l} head ${hd}`);
    }));
    const [, plain] = await publishFetch(relay, child(0), route);
    assert.notDeepEqual(historySets(plain), got, 'the historyScore changed nothing');
    const err = await relay.publish(child(n + 1), route).then(() => assert.fail('resolved'), (e) => e);
    assert.equal(statusName(err), 'FAILED_PRECONDITION', String(err));
    assert.match(err.details, new RegExp(`history_score_tokens: ${n + 1}\\b`));
  });
});
