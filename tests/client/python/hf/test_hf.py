#!/usr/bin/python3
"""kvrelay.hf (the HF transformers adapter) with a tiny torch decoder
against a real kvrelay-server.

    .venv/bin/python test_hf.py --server BIN [--example examples/latentmas_chain.py]

Runs in the project venv against the installed kvrelay package (ctest's
fixture kvrelay_python_package). Needs torch; transformers is used only for
the DynamicCache checks (the real models are test_hf_transformers.py's).
Relayed caches are taken as legacy tuples (cache_format="legacy"), the
tiny decoder's own format. The model is examples/tiny_decoder.py: a randomly initialised
Llama/Qwen-style decoder (RoPE, GQA with 4 query / 2 KV heads, RMSNorm,
SwiGLU, 3 layers) taking a legacy tuple cache and explicit position ids.

Checks:
- `full` through the live relay: the fetched cache gives logits bit-identical
  (torch.equal) to passing the original cache, for F32 and BF16; also for an
  agent continuing from a relayed cache (history by parent, and uploaded).
- `h2o-head:k=8`: the fetched per-head positions equal the anchors + top-k
  indices computed independently (numpy) from the attention mass the helper
  returned, + the generated positions; the kept K/V rows are the original
  rows; the model runs on it with positions continuing at the original
  length, its logits are finite and equal to those on a cache gathered by
  hand from the original.
- The attention-mass helper against a hand-computed sum over steps, queries
  and grouped heads (random tensors and the model's own attentions).
- Errors: wrong dims, batch > 1, dtypes differing across layers, and more,
  each a ValueError naming the problem.
- Duck-typed caches (key_cache/value_cache, .layers[i].keys/.values,
  to_legacy_cache); message_to_cache gives a real DynamicCache, the legacy
  tuple without transformers, and wraps with stand-in transformers
  modules (from_legacy_cache, update()); stand-ins of a pre-allocated StaticCache (zero
  padding past get_seq_length()) and a QuantizedCache (only the residual as
  tensors) are refused with a ValueError naming the mismatch.
- examples/latentmas_chain.py runs once against the live relay.
The whole run is bounded (watchdog) and the server is always stopped.
"""
import argparse
import math
import os
import re
import subprocess
import sys
import types
import unittest

import numpy as np
import torch

import kvrelay
from kvrelay import hf

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "examples"))
sys.path.insert(0, os.path.join(REPO, "tests", "testlib"))
from tiny_decoder import CONFIG, TinyDecoder, encode  # noqa: E402
from kvrelay_testlib import Server, unittest_main  # noqa: E402

ARGS = None
SERVER = None
ADDR = None
WATCHDOG_S = 120
H, Q_HEADS, LAYERS = CONFIG["num_key_value_heads"], CONFIG["num_attention_heads"], \
    CONFIG["num_hidden_layers"]

torch.set_num_threads(1)


def setUpModule():
    global SERVER, ADDR
    SERVER = Server(ARGS.server, timeout=20)
    ADDR = SERVER.addr


def tearDownModule():
    if SERVER:
        SERVER.stop()


# ---- helpers ---------------------------------------------------------------------

PROMPT = "Plan: add the two numbers, check the carry."   # 43 byte tokens


def run_turn(model, prompt=PROMPT, gen=5, relayed=None, kv_heads=None):
    """Prompt pass + `gen` greedy steps (one token each) with attentions.
    Returns (cache, n_prompt, per-step attentions, next token ids [1, 1],
    next position id)."""
    ids = encode(prompt)
    n = ids.shape[1]
    past = relayed.cache if relayed else None
    n_hist = relayed.tokens if relayed else 0
    p0 = relayed.next_pos if relayed else 0
    out = model(input_ids=ids, past_key_values=past,
                position_ids=torch.arange(p0, p0 + n).unsqueeze(0),
                attention_mask=torch.ones(1, n_hist + n))
    steps = []
    for s in range(gen):
        tok = out.logits[:, -1:].argmax(-1)
        out = model(input_ids=tok, past_key_values=out.past_key_values,
                    position_ids=torch.tensor([[p0 + n + s]]), output_attentions=True)
        steps.append(out.attentions)
    return out.past_key_values, n, steps, out.logits[:, -1:].argmax(-1), p0 + n + gen


def bits(t):
    """Bit patterns of a tensor, for exact comparisons (NaN-safe)."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def topk_kept(score, k, sinks):
    """Independent H2O selection on one KV head's scores: anchors 0..sinks-1,
    then the k highest-scoring candidates (ties to the lower position),
    ascending."""
    n = score.shape[0]
    cand = np.arange(sinks, n)
    order = np.lexsort((cand, -score[sinks:].astype(np.float64)))
    return np.concatenate([np.arange(sinks), np.sort(cand[order[:k]])])


class Session:
    n = 0

    @classmethod
    def new(cls, tag):
        cls.n += 1
        return f"hf-{tag}-{cls.n}"


# ---- offline ---------------------------------------------------------------------

class AttentionMassTest(unittest.TestCase):
    def test_random_against_hand_sum(self):
        g = torch.Generator().manual_seed(5)
        n_hist, n_prompt, q_heads, kv_heads = 3, 7, 6, 2
        steps = []
        kv_len = n_hist + n_prompt + 2
        for s, q_len in enumerate([1, 2, 1]):
            steps.append(tuple(torch.rand(1, q_heads, q_len, kv_len + s, generator=g)
                               for _ in range(2)))
        per_q = hf.prompt_attention_mass(steps, n_prompt, prompt_start=n_hist)
        per_kv = hf.prompt_attention_mass(steps, n_prompt, prompt_start=n_hist, kv_heads=kv_heads)
        group = q_heads // kv_heads
        for l in range(2):
            self.assertEqual(per_q[l].dtype, np.float32)
            self.assertEqual(per_q[l].shape, (q_heads, n_prompt))
            self.assertEqual(per_kv[l].shape, (kv_heads, n_prompt))
            for h in range(q_heads):
                for j in range(n_prompt):
                    want = 0.0
                    for st in steps:
                        a = st[l]
                        for qi in range(a.shape[2]):
                            want += float(a[0, h, qi, n_hist + j])
                    self.assertAlmostEqual(float(per_q[l][h, j]), want, places=5)
            for kh in range(kv_heads):
                for j in range(n_prompt):
                    want = sum(float(st[l][0, q, qi, n_hist + j]) for st in steps
                               for q in range(kh * group, (kh + 1) * group)
                               for qi in range(st[l].shape[2]))
                    self.assertAlmostEqual(float(per_kv[l][kh, j]), want, places=5)
        # The columns before the prompt: the mass on the relayed history.
        hist_q = hf.PromptAttention(n_prompt, prompt_start=n_hist)
        hist_kv = hf.PromptAttention(n_prompt, prompt_start=n_hist, kv_heads=kv_heads)
        for st in steps:
            hist_q.add(st)
            hist_kv.add(st)
        for l in range(2):
            want = np.zeros((q_heads, n_hist))
            for st in steps:
                a = st[l].double().numpy()
                want += a[0, :, :, :n_hist].sum(axis=1)
            got_q, got_kv = hist_q.history_scores()[l], hist_kv.history_scores()[l]
            self.assertEqual((got_q.dtype, got_q.shape, got_kv.shape),
                             (np.float32, (q_heads, n_hist), (kv_heads, n_hist)))
            np.testing.assert_allclose(got_q, want, rtol=1e-6)
            np.testing.assert_allclose(got_kv, want.reshape(kv_heads, group, n_hist).sum(axis=1), rtol=1e-6)

    def test_model_attentions(self):
        model = TinyDecoder(seed=1)
        _, n, steps, _, _ = run_turn(model, gen=3)
        s = hf.prompt_attention_mass(steps, n, kv_heads=H)
        for l in range(LAYERS):
            a = [st[l].double() for st in steps]
            want = sum(x[0, :, :, :n].sum(dim=1) for x in a)             # [q_heads, n]
            want = want.reshape(H, Q_HEADS // H, n).sum(dim=1).numpy()
            np.testing.assert_allclose(s[l], want, rtol=1e-6, atol=1e-7)
            # The steps' attention rows sum to 1; the prompt holds most of it.
            self.assertLessEqual(s[l].sum(), 3 * Q_HEADS * (1 + 1e-5))
            self.assertGreater(s[l].sum(), 0)

    def test_errors(self):
        acc = hf.PromptAttention(4, kv_heads=2)
        with self.assertRaisesRegex(ValueError, r"attentions layer 0: batch 2, expected 1"):
            acc.add((torch.rand(2, 4, 1, 5),))
        with self.assertRaisesRegex(ValueError, r"attentions layer 0: shape \[4, 1, 5\], expected 4-D"):
            acc.add((torch.rand(4, 1, 5),))
        with self.assertRaisesRegex(ValueError, r"3 query heads, expected a multiple of kv_heads=2"):
            acc.add((torch.rand(1, 3, 1, 5),))
        with self.assertRaisesRegex(ValueError, r"kv_len 3, expected >= prompt_start \+ n_prompt = 4"):
            acc.add((torch.rand(1, 4, 1, 3),))
        with self.assertRaisesRegex(ValueError, r"no steps added"):
            acc.scores()
        acc.add((torch.rand(1, 4, 1, 5),))
        with self.assertRaisesRegex(ValueError, r"attentions: 2 layers, expected 1"):
            acc.add((torch.rand(1, 4, 1, 6),) * 2)
        with self.assertRaisesRegex(ValueError, r"None: the model ran without eager"):
            acc.add((None,))


class CacheConversionTest(unittest.TestCase):
    def cache(self, dtype=torch.float32, layers=2, tokens=9):
        g = torch.Generator().manual_seed(2)
        return tuple((torch.randn(1, H, tokens, 8, generator=g).to(dtype),
                      torch.randn(1, H, tokens, 8, generator=g).to(dtype)) for _ in range(layers))

    def test_turn_split_and_dtypes(self):
        for dt, name in ((torch.float32, "F32"), (torch.float16, "F16"), (torch.bfloat16, "BF16")):
            c = self.cache(dt)
            t = hf.turn_from_cache(c, 6)
            self.assertEqual(t.geometry(), (name, H, H, 8, 6, 3, 0))
            self.assertTrue(t.first_agent)
            self.assertIsNone(t.prompt_pos0)
            for (k, v), tl in zip(c, t.layers):
                self.assertTrue(np.array_equal(tl.prompt_k, bits(k[0, :, :6]).numpy().view(tl.prompt_k.dtype)))
                self.assertTrue(np.array_equal(tl.gen_v, bits(v[0, :, 6:]).numpy().view(tl.gen_v.dtype)))
                self.assertEqual(tl.score.dtype, np.float32)

    def test_turn_owns_its_tensors(self):
        # One KV head: each [1, 1, n, d] slice is already contiguous on the
        # CPU, so without a copy the turn would alias the cache.
        for dt in (torch.float32, torch.bfloat16):
            c = tuple((torch.randn(1, 1, 9, 8).to(dt), torch.randn(1, 1, 9, 8).to(dt)) for _ in range(2))
            t = hf.turn_from_cache(c, 9)
            before = [tl.prompt_k.copy() for tl in t.layers]
            for k, v in c:
                k.zero_()
                v.zero_()
            for b, tl in zip(before, t.layers):
                self.assertTrue(np.array_equal(b, tl.prompt_k))
                self.assertTrue(np.any(tl.prompt_k != 0))

    def test_history_split(self):
        c = self.cache(tokens=12)
        pos = torch.tensor([[0, 1, 7], [0, 5, 7]]).expand(2, H, 3)   # [layers, H, 3]
        rc = hf.RelayedCache(cache=None, positions=pos, tokens=3, next_pos=20)
        t = hf.turn_from_cache(c, 6, history=rc)
        self.assertEqual(t.geometry()[4:], (6, 3, 0))
        self.assertEqual((t.first_agent, t.prompt_pos0), (False, 20))
        t2 = hf.turn_from_cache(c, 6, history=rc, include_history=True)
        self.assertEqual(t2.geometry()[4:], (6, 3, 3))
        self.assertTrue(np.array_equal(t2.layers[1].history_pos, pos[1].numpy()))
        self.assertTrue(np.array_equal(t2.layers[0].history_k, c[0][0][0, :, :3].numpy()))
        self.assertTrue(np.array_equal(t2.layers[0].prompt_k, c[0][0][0, :, 3:9].numpy()))
        self.assertIsNone(t2.history_anchors)  # no message: no anchors known
        # Uploading a fetched message as history carries the chain's anchors.
        rcm = hf.RelayedCache(cache=None, positions=pos, tokens=3, next_pos=20,
                              message=types.SimpleNamespace(message_id="m1", anchor_pos=[0, 7]))
        self.assertEqual(hf.turn_from_cache(c, 6, history=rcm, include_history=True).history_anchors, [0, 7])
        self.assertIsNone(hf.turn_from_cache(c, 6, history=rcm).history_anchors)  # by parent: the relay's
        # History positions without a RelayedCache: the prompt starts after the
        # largest (the relay refuses history ids at or past prompt_pos0).
        t3 = hf.turn_from_cache(c, 6, include_history=True, n_history=3, history_positions=pos)
        self.assertEqual((t3.first_agent, t3.prompt_pos0), (False, 8))
        t4 = hf.turn_from_cache(c, 6, include_history=True, n_history=3, history_positions=pos, prompt_pos0=30)
        self.assertEqual(t4.prompt_pos0, 30)

    def test_errors(self):
        c = self.cache()
        cases = [
            (((c[0][0][0], c[0][1][0]),), r"cache layer 0 key: shape \[2, 9, 8\], expected 4-D"),
            (((c[0][0].expand(2, -1, -1, -1), c[0][1].expand(2, -1, -1, -1)),),
             r"cache layer 0 key: batch 2, expected 1"),
            ((c[0], (c[1][0].half(), c[1][1].half())),
             r"cache layer 1 key: dtype torch.float16, expected torch.float32 \(layer 0's"),
            ((c[0], (c[1][0][:, :, :5], c[1][1][:, :, :5])),
             r"cache layer 1 key: shape \[1, 2, 5, 8\], expected \[1, 2, 9, 8\]"),
            (((c[0][0], c[0][1][:, :, :4]),), r"cache layer 0 value: shape \[1, 2, 4, 8\], expected"),
            (((c[0][0].double(), c[0][1].double()),),
             r"cache layer 0 key: dtype torch.float64, expected torch.float32, torch.float16"),
            (((c[0][0], c[0][1].half()),), r"cache layer 0 value: dtype torch.float16, expected"),
            ((), r"cache: no layers"),
            ((c[0][0],), r"cache layer 0: Tensor, expected a \(key, value\) pair"),
            (object(), r"cache: object, expected a legacy tuple cache"),
        ]
        for cache, msg in cases:
            with self.subTest(msg=msg), self.assertRaisesRegex(ValueError, msg):
                hf.turn_from_cache(cache, 2)
        with self.assertRaisesRegex(ValueError, r"n_history \+ n_prompt: 0 \+ 10 = 10, expected <= the cache's 9"):
            hf.turn_from_cache(c, 10)
        with self.assertRaisesRegex(ValueError, r"scores layer 1: shape \[3, 4\], expected \[score_heads, 4\]"):
            hf.turn_from_cache(c, 4, [np.zeros((2, 4), np.float32), np.zeros((3, 4), np.float32)])
        with self.assertRaisesRegex(ValueError, r"scores: 1 layers, expected 2"):
            hf.turn_from_cache(c, 4, [np.zeros((2, 4), np.float32)])
        with self.assertRaisesRegex(ValueError, r"cache_format"):
            hf.message_to_cache(kvrelay.Message([], "F32", 1, 1, 0, 0, 0, 0), cache_format="x")
        s4 = [np.zeros((2, 4), np.float32)] * 2
        with self.assertRaisesRegex(ValueError, r"history_scores: given without a history, expected None"):
            hf.turn_from_cache(c, 4, s4, history_scores=[np.zeros((2, 0), np.float32)] * 2)
        with self.assertRaisesRegex(ValueError, r"history_scores: given with queries, expected None"):
            hf.turn_from_cache(c, 4, n_history=3, queries=[np.zeros((2, 2, 8), np.float32)] * 2,
                               history_scores=[np.zeros((2, 3), np.float32)] * 2)
        with self.assertRaisesRegex(ValueError, r"history_scores: given without scores, expected the prompt's"):
            hf.turn_from_cache(c, 4, n_history=3, history_scores=[np.zeros((2, 3), np.float32)] * 2)
        with self.assertRaisesRegex(ValueError, r"history_scores: 1 layers, expected 2"):
            hf.turn_from_cache(c, 4, s4, n_history=3, history_scores=[np.zeros((2, 3), np.float32)])
        with self.assertRaisesRegex(ValueError, r"history_scores layer 1: shape \[2, 4\], expected \[2, 3\] "
                                                r"\(the scores' heads, n_history\)"):
            hf.turn_from_cache(c, 4, s4, n_history=3,
                               history_scores=[np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32)])

    def test_duck_typed_caches(self):
        c = self.cache(torch.bfloat16)
        want = hf.turn_from_cache(c, 5)

        class Old:  # transformers 4.36 .. 4.55
            key_cache = [k for k, _ in c]
            value_cache = [v for _, v in c]

        class Layer:
            def __init__(self, k, v):
                self.keys, self.values = k, v

        class New:  # transformers >= 4.56
            layers = [Layer(k, v) for k, v in c]

        class Legacy:
            def to_legacy_cache(self):
                return c

        for cache in (Old(), New(), Legacy(), list(c)):
            with self.subTest(kind=type(cache).__name__):
                t = hf.turn_from_cache(cache, 5)
                for a, b in zip(t.layers, want.layers):
                    for f in ("prompt_k", "prompt_v", "gen_k", "gen_v"):
                        self.assertTrue(np.array_equal(getattr(a, f), getattr(b, f)), f)
        sliding = New()
        sliding.layers[1].is_sliding = True
        with self.assertRaisesRegex(ValueError, r"cache layer 1: a sliding-window layer"):
            hf.cache_layers(sliding)

    def test_seq_length_must_match_the_tensors(self):
        # Stand-ins for transformers caches whose tensors are not the tokens:
        # StaticCache pre-allocates max_cache_len rows (zeros past the tokens
        # seen; get_seq_length() counts the non-zero rows of head 0),
        # QuantizedCache keeps only the unquantized residual as tensors (an
        # empty 1-D tensor right after the prompt pass). Both as the newer
        # .layers[i].keys/.values and the older key_cache/value_cache.
        c = self.cache(tokens=9)
        max_len = 16

        def padded(t):
            z = torch.zeros(1, H, max_len, 8)
            z[:, :, :t.shape[2]] = t
            return z

        class Layer:
            def __init__(self, k, v):
                self.keys, self.values = k, v

        class StaticCache:  # transformers >= 4.56
            layers = [Layer(padded(k), padded(v)) for k, v in c]

            def get_seq_length(self, layer_idx=0):
                return self.layers[layer_idx].keys[0, 0].any(dim=-1).sum()  # a 0-d tensor, as HF's

        class OldStaticCache:  # transformers 4.38 .. 4.55
            key_cache = [padded(k) for k, _ in c]
            value_cache = [padded(v) for _, v in c]

            def get_seq_length(self, layer_idx=0):
                return self.key_cache[layer_idx][0, 0].any(dim=-1).sum()

        class QuantizedCache:  # 7 tokens quantized, 2 in the residual
            layers = [Layer(k[:, :, 7:], v[:, :, 7:]) for k, v in c]

            def get_seq_length(self, layer_idx=0):
                return 9

        class FreshQuantizedCache:  # after the prompt pass: nothing left as tensors
            key_cache = [torch.zeros(0) for _ in c]
            value_cache = [torch.zeros(0) for _ in c]

            def get_seq_length(self):  # no layer index
                return 9

        class LegacyOnly:  # to_legacy_cache() of a pre-allocated cache
            def to_legacy_cache(self):
                return tuple((padded(k), padded(v)) for k, v in c)

            def get_seq_length(self, layer_idx=0):
                return 9

        for cache, msg in (
                (StaticCache(), r"cache layer 0: 16 tokens in its key tensor, but "
                                r"StaticCache\.get_seq_length\(0\) is 9; expected them equal"),
                (OldStaticCache(), r"cache layer 0: 16 tokens .* OldStaticCache\.get_seq_length\(0\) is 9"),
                (QuantizedCache(), r"cache layer 0: 2 tokens .* QuantizedCache\.get_seq_length\(0\) is 9"),
                (FreshQuantizedCache(), r"cache layer 0: 0 tokens .*get_seq_length\(0\) is 9"),
                (LegacyOnly(), r"cache layer 0: 16 tokens .* LegacyOnly\.get_seq_length\(0\) is 9")):
            with self.subTest(kind=type(cache).__name__):
                with self.assertRaisesRegex(ValueError, msg) as cm:
                    hf.turn_from_cache(cache, 5)
                self.assertIn("DynamicCache", str(cm.exception))
                self.assertIn("legacy (key, value) tuples", str(cm.exception))

        # A layer other than 0 disagreeing is named.
        skewed = StaticCache()
        skewed.get_seq_length = lambda layer_idx=0: 9 if layer_idx == 0 else 8
        skewed.layers = [Layer(k, v) for k, v in c]
        with self.assertRaisesRegex(ValueError, r"cache layer 1: 9 tokens .*get_seq_length\(1\) is 8"):
            hf.cache_layers(skewed)

        # A full StaticCache (every row used) and caches whose count matches
        # are the tokens: accepted, bit for bit.
        want = hf.turn_from_cache(c, 5)
        full = StaticCache()
        full.layers = [Layer(k, v) for k, v in c]

        class DynamicCache:  # old-style, with get_seq_length
            key_cache = [k for k, _ in c]
            value_cache = [v for _, v in c]

            def get_seq_length(self, layer_idx=0):
                return self.key_cache[layer_idx].shape[-2]

        for cache in (full, DynamicCache()):
            with self.subTest(kind="ok " + type(cache).__name__):
                t = hf.turn_from_cache(cache, 5)
                for a, b in zip(t.layers, want.layers):
                    for f in ("prompt_k", "prompt_v", "gen_k", "gen_v"):
                        self.assertTrue(np.array_equal(getattr(a, f), getattr(b, f)), f)

    def test_dynamic_cache_wrapping(self):
        m = kvrelay.Message(layers=[kvrelay.MessageLayer(
            k=np.ones((H, 3, 8), np.float32), v=np.zeros((H, 3, 8), np.float32),
            pos=np.array([[0, 1, 5], [0, 2, 5]], np.int32))] * 2,
            dtype="F32", kv_heads=H, head_dim=8, n_history=0, n_anchor=3, n_kept=0, n_gen=0)
        # transformers importable: a real DynamicCache holding the message's rows.
        from transformers import DynamicCache
        got = hf.message_to_cache(m).cache
        self.assertIsInstance(got, DynamicCache)
        self.assertEqual(int(got.get_seq_length()), 3)
        for (k, v), ml in zip(hf.cache_layers(got), m.layers):
            self.assertTrue(torch.equal(k[0], torch.from_numpy(ml.k)))
            self.assertTrue(torch.equal(v[0], torch.from_numpy(ml.v)))
        # transformers not importable (None in sys.modules makes the import fail).
        saved = sys.modules.get("transformers")
        sys.modules["transformers"] = None
        try:
            rc = hf.message_to_cache(m)
            self.assertIsInstance(rc.cache, tuple)  # no transformers: the legacy tuple
            with self.assertRaisesRegex(ImportError, "needs transformers"):
                hf.message_to_cache(m, cache_format="dynamic")
        finally:
            sys.modules["transformers"] = saved
        self.assertEqual((rc.tokens, rc.next_pos), (3, 6))
        self.assertEqual(list(rc.positions.shape), [2, H, 3])
        self.assertEqual(rc.position_ids(2).tolist(), [[6, 7]])
        self.assertEqual(rc.attention_mask(2).shape, (1, 5))
        self.assertEqual(rc.cache_position(2).tolist(), [3, 4])

        # A stand-in transformers module: with from_legacy_cache (<= 4.5x) and
        # without it (update() per layer).
        class WithLegacy:
            @classmethod
            def from_legacy_cache(cls, legacy):
                o = cls()
                o.legacy = legacy
                return o

        class UpdateOnly:
            def __init__(self):
                self.kv = []

            def update(self, k, v, i):
                assert len(self.kv) == i
                self.kv.append((k, v))

        for cls in (WithLegacy, UpdateOnly):
            fake = types.ModuleType("transformers")
            fake.DynamicCache = cls
            sys.modules["transformers"] = fake
            try:
                got = hf.message_to_cache(m, cache_format="auto").cache
                self.assertIsInstance(got, cls)
                pairs = got.legacy if cls is WithLegacy else got.kv
                self.assertEqual(len(pairs), 2)
                self.assertEqual(list(pairs[0][0].shape), [1, H, 3, 8])
                self.assertIsInstance(hf.message_to_cache(m, cache_format="legacy").cache, tuple)
            finally:
                sys.modules["transformers"] = saved

    def test_import_kvrelay_does_not_import_torch(self):
        code = ("import sys, kvrelay; assert 'torch' not in sys.modules; "
                "import kvrelay.hf; assert 'torch' not in sys.modules; print('ok')")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=30, env=os.environ)
        self.assertEqual((p.returncode, p.stdout.strip()), (0, "ok"), p.stderr)


# ---- through the live relay -----------------------------------------------------------

class QueryCaptureTest(unittest.TestCase):
    """Scores from captured queries (no eager attention, no output_attentions)
    against the eager attention mass, and the relayed messages of both."""

    def capture_turn(self, model, gen=5):
        ids = encode(PROMPT)
        n = ids.shape[1]
        out = model(input_ids=ids, position_ids=torch.arange(n).unsqueeze(0))
        cap = hf.QueryCapture(model)
        with cap:
            for s in range(gen):
                tok = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=tok, past_key_values=out.past_key_values,
                            position_ids=torch.tensor([[n + s]]))
        return out.past_key_values, n, cap

    def test_queries_give_the_eager_mass_and_the_same_message(self):
        model = TinyDecoder(seed=6)  # float32: eager attention's own rounding stays below 1e-6
        cache_q, n, cap = self.capture_turn(model)
        for layer in model.layers:  # the wrapping is gone after the with-block
            self.assertNotIn("forward", layer.self_attn.__dict__)
        cache, n2, steps, _, _ = run_turn(model, gen=5)
        self.assertEqual(n, n2)
        for (k1, v1), (k2, v2) in zip(cache_q, cache):
            self.assertTrue(torch.equal(k1, k2) and torch.equal(v1, v2))
        eager = hf.prompt_attention_mass(steps, n)  # per query head
        queries = cap.queries()
        self.assertEqual(queries[0].shape, (Q_HEADS, 5, CONFIG["head_dim"]))
        self.assertIsNone(cap.softmax_scale)  # tiny_decoder divides by sqrt(head_dim)
        group = Q_HEADS // H
        for l in range(LAYERS):
            keys = cache[l][0][0].double()  # [H, T, d]
            q = torch.from_numpy(queries[l]).double()
            mass = torch.zeros(Q_HEADS, n, dtype=torch.float64)
            for t in range(q.shape[1]):
                for qh in range(Q_HEADS):
                    k = keys[qh // group, :n + t + 1]
                    w = torch.softmax(k @ q[qh, t] / math.sqrt(CONFIG["head_dim"]), dim=0)
                    mass[qh] += w[:n]
            diff = np.abs(mass.numpy() - eager[l]).max()
            self.assertLess(diff, 1e-5, f"layer {l}: |mass from queries - eager mass| = {diff}")
        c = kvrelay.Client(ADDR)
        try:
            t_eager = hf.turn_from_cache(cache, n, eager)
            t_q = hf.turn_from_cache(cache_q, n, queries=queries, softmax_scale=cap.softmax_scale)
            self.assertIsNotNone(t_q.layers[0].gen_q)
            self.assertIsNone(t_q.layers[0].score)
            for policy in ("h2o-head:k=8", "h2o-layer:k=8,recent=2+obf:p=4"):
                with self.subTest(policy=policy):
                    a, b = c.compress(t_eager, policy), c.compress(t_q, policy)
                    for la, lb in zip(a.layers, b.layers, strict=True):
                        self.assertTrue(np.array_equal(la.pos, lb.pos), "kept positions differ")
                        self.assertTrue(np.array_equal(la.k, lb.k))
                        if "obf" not in policy:
                            self.assertTrue(np.array_equal(la.v, lb.v))
                        else:  # OBF's weights use the scores: float32 noise only
                            np.testing.assert_allclose(la.v, lb.v, rtol=1e-4, atol=1e-5)
            # window= scores with the last steps only: accepted with queries.
            w = c.compress(t_q, "h2o-head:k=8,window=2")
            self.assertEqual(w.n_kept, 8)
        finally:
            c.close()

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "has no attention modules with q_proj and k_proj"):
            hf.QueryCapture(torch.nn.Linear(2, 2))
        model = TinyDecoder(seed=7)
        cap = hf.QueryCapture(model)
        with self.assertRaisesRegex(ValueError, "no calls captured"):
            cap.queries()
        cache, n, cap = self.capture_turn(model, gen=3)
        q = cap.queries()
        with self.assertRaisesRegex(ValueError, "scores and queries: both given"):
            hf.turn_from_cache(cache, n, [np.zeros((Q_HEADS, n), np.float32)] * LAYERS, queries=q)
        with self.assertRaisesRegex(ValueError, r"queries layer 0: shape \[4, 2, 16\], expected \[score_heads, 3, 16\]"):
            hf.turn_from_cache(cache, n, queries=[x[:, :2] for x in q])
        with self.assertRaisesRegex(ValueError, r"queries: 2 layers, expected 3"):
            hf.turn_from_cache(cache, n, queries=q[:2])


class RelayTest(unittest.TestCase):
    def setUp(self):
        self.c = kvrelay.Client(ADDR)

    def tearDown(self):
        self.c.close()

    def relay(self, turn, policy, session, parent="", sender="planner", to="critic"):
        r = self.c.publish(turn, session, sender, [to], policy=policy, parent_id=parent)
        m = self.c.fetch(session, to, timeout=20)
        self.c.ack(session, to, m.message_id)
        self.assertEqual(m.message_id, r.message_id)
        return m, r

    def test_full_bit_identical_logits(self):
        for dt, name in ((torch.float32, "F32"), (torch.bfloat16, "BF16")):
            with self.subTest(dtype=name):
                model = TinyDecoder(seed=3).to(dt)
                cache, n, steps, tok, nxt = run_turn(model)
                turn = hf.turn_from_cache(cache, n, hf.prompt_attention_mass(steps, n, kv_heads=H))
                self.assertEqual(turn.dtype, name)
                sess = Session.new("full")
                m, r = self.relay(turn, "full", sess)
                self.assertEqual(r.accounting.full_bytes, r.accounting.sent_bytes)
                rc = hf.message_to_cache(m, cache_format="legacy")
                self.assertIsInstance(rc.cache, tuple)
                T = cache[0][0].shape[2]
                self.assertEqual((rc.tokens, rc.next_pos, nxt), (T, T, T))
                self.assertTrue(torch.equal(rc.positions, torch.arange(T).expand(LAYERS, H, T)))
                for (k0, v0), (k1, v1) in zip(cache, rc.cache):
                    self.assertEqual(k1.dtype, dt)
                    self.assertTrue(torch.equal(bits(k0), bits(k1)))
                    self.assertTrue(torch.equal(bits(v0), bits(v1)))
                direct = model(input_ids=tok, past_key_values=cache, position_ids=torch.tensor([[T]]))
                relayed = model(input_ids=tok, past_key_values=rc.cache,
                                position_ids=rc.position_ids(1), attention_mask=rc.attention_mask(1))
                self.assertTrue(torch.equal(direct.logits, relayed.logits))
                for (a, b), (c, d) in zip(direct.past_key_values, relayed.past_key_values):
                    self.assertTrue(torch.equal(bits(a), bits(c)) and torch.equal(bits(b), bits(d)))

                # The next agent continues from the relayed cache; its turn goes
                # up with the parent (history by reference) and, separately,
                # with the history uploaded: both messages equal its own cache.
                cache2, n2, steps2, tok2, nxt2 = run_turn(model, "Critic: check it.", gen=4,
                                                          relayed=rc)
                scores2 = hf.prompt_attention_mass(steps2, n2, prompt_start=rc.tokens)
                t2 = hf.turn_from_cache(cache2, n2, scores2, history=rc)
                self.assertEqual((t2.first_agent, t2.prompt_pos0), (False, T))
                m2, _ = self.relay(t2, "full", sess, parent=m.message_id, sender="critic",
                                   to="refiner")
                t3 = hf.turn_from_cache(cache2, n2, scores2, history=rc, include_history=True)
                m3 = self.c.compress(t3, "full")
                for mm in (m2, m3):
                    rc2 = hf.message_to_cache(mm, cache_format="legacy")
                    T2 = cache2[0][0].shape[2]
                    self.assertEqual((rc2.tokens, rc2.next_pos, nxt2), (T2, T2, T2))
                    self.assertTrue(torch.equal(rc2.positions,
                                                torch.arange(T2).expand(LAYERS, H, T2)))
                    a = model(input_ids=tok2, past_key_values=cache2,
                              position_ids=torch.tensor([[T2]]))
                    b = model(input_ids=tok2, past_key_values=rc2.cache,
                              position_ids=rc2.position_ids(1),
                              attention_mask=rc2.attention_mask(1))
                    self.assertTrue(torch.equal(a.logits, b.logits))
                self.c.close_session(sess)

    def test_h2o_head_positions_and_continuation(self):
        k, sinks = 8, 4
        for dt in (torch.float32, torch.bfloat16):
            with self.subTest(dtype=str(dt)):
                model = TinyDecoder(seed=4).to(dt)
                cache, n, steps, tok, nxt = run_turn(model, gen=5)
                T = cache[0][0].shape[2]
                n_gen = T - n
                # Per query head: the relay reduces the groups itself.
                scores = hf.prompt_attention_mass(steps, n)
                self.assertEqual(scores[0].shape, (Q_HEADS, n))
                sess = Session.new("h2o")
                m, r = self.relay(hf.turn_from_cache(cache, n, scores), f"h2o-head:k={k}", sess)
                self.assertLess(r.accounting.sent_bytes, r.accounting.full_bytes)
                self.assertEqual((m.n_anchor, m.n_kept, m.n_gen), (sinks, k, n_gen))
                rc = hf.message_to_cache(m, cache_format="legacy")
                self.assertEqual((rc.tokens, rc.next_pos), (sinks + k + n_gen, T))
                gathered = []
                for l in range(LAYERS):
                    # Independent reduction: sum consecutive query-head pairs.
                    red = scores[l].astype(np.float64).reshape(H, Q_HEADS // H, n).sum(axis=1)
                    want = np.stack([np.concatenate([topk_kept(red[h], k, sinks),
                                                     np.arange(n, T)]) for h in range(H)])
                    self.assertTrue(np.array_equal(rc.positions[l].numpy(), want), f"layer {l}")
                    idx = torch.from_numpy(want)
                    k0, v0 = cache[l]
                    kg = torch.stack([k0[0, h, idx[h]] for h in range(H)]).unsqueeze(0)
                    vg = torch.stack([v0[0, h, idx[h]] for h in range(H)]).unsqueeze(0)
                    self.assertTrue(torch.equal(bits(kg), bits(rc.cache[l][0])))
                    self.assertTrue(torch.equal(bits(vg), bits(rc.cache[l][1])))
                    gathered.append((kg, vg))
                # Heads kept different prompt tokens (the case positions exist for).
                self.assertFalse(torch.equal(rc.positions[:, 0], rc.positions[:, 1]))
                out = model(input_ids=tok, past_key_values=rc.cache,
                            position_ids=rc.position_ids(1), attention_mask=rc.attention_mask(1))
                self.assertTrue(torch.isfinite(out.logits).all())
                ref = model(input_ids=tok, past_key_values=tuple(gathered),
                            position_ids=torch.tensor([[T]]))
                self.assertTrue(torch.equal(out.logits, ref.logits))
                # Positions matter: continuing at the kept-row count instead
                # of the original length gives other logits.
                wrong = model(input_ids=tok, past_key_values=rc.cache,
                              position_ids=torch.tensor([[rc.tokens]]))
                self.assertFalse(torch.equal(out.logits, wrong.logits))
                # Several new tokens at once, continuing positions T, T+1, ...
                ids = encode("ok?")
                out3 = model(input_ids=ids, past_key_values=rc.cache,
                             position_ids=rc.position_ids(3), attention_mask=rc.attention_mask(3))
                self.assertTrue(torch.isfinite(out3.logits).all())
                self.assertEqual(out3.past_key_values[0][0].shape[2], rc.tokens + 3)
                self.c.close_session(sess)

    def test_history_scores_steer_the_history_budget(self):
        # The critic continues the planner's relayed cache with eager
        # attention and sends its mass on the history (history_scores) with
        # the parent. Under hist=4 every head keeps the chain's anchors plus
        # the 4 history tokens of highest accumulated importance: the
        # planner's prompt mass (the parent's acc; its generated tokens have
        # none) plus the critic's history mass, summed over each KV head's
        # query heads. Ties go to the earlier token.
        k, sinks, hist = 8, 4, 4
        policy = f"h2o-head:k={k},hist={hist}"
        model = TinyDecoder(seed=8)
        cache, n, steps, _, _ = run_turn(model, gen=5)
        sess = Session.new("hist")
        s1 = hf.prompt_attention_mass(steps, n)  # per query head, as sent
        m, _ = self.relay(hf.turn_from_cache(cache, n, s1), policy, sess)
        rc = hf.message_to_cache(m, cache_format="legacy")
        cache2, n2, steps2, _, _ = run_turn(model, "Critic: check it.", gen=4, relayed=rc)
        acc = hf.PromptAttention(n2, prompt_start=rc.tokens)
        for st in steps2:
            acc.add(st)
        hs = acc.history_scores()
        self.assertEqual(hs[0].shape, (Q_HEADS, rc.tokens))
        t2 = hf.turn_from_cache(cache2, n2, acc.scores(), history=rc, history_scores=hs)
        m2, _ = self.relay(t2, policy, sess, parent=m.message_id, sender="critic", to="refiner")
        self.assertEqual(m2.n_history, sinks + hist)
        rc2 = hf.message_to_cache(m2, cache_format="legacy")
        steered = False
        for l in range(LAYERS):
            # The planner's mass per KV head (float64 sums, rounded once), as
            # its prompt tokens' acc; the critic's likewise, added to it.
            red1 = s1[l].astype(np.float64).reshape(H, Q_HEADS // H, n).sum(axis=1).astype(np.float32)
            mass = hs[l].astype(np.float64).reshape(H, Q_HEADS // H, rc.tokens).sum(axis=1)
            for h in range(H):
                held = rc.positions[l, h].numpy()
                parent_acc = np.array([red1[h, p] if p < n else 0.0 for p in held], np.float32)
                total = (parent_acc.astype(np.float64) + mass[h]).astype(np.float32)
                want = held[topk_kept(total, hist, sinks)]
                got = rc2.positions[l, h, :sinks + hist].numpy()
                self.assertTrue(np.array_equal(got, want), f"layer {l} head {h}: {got} != {want}")
                steered |= not np.array_equal(want, held[topk_kept(parent_acc, hist, sinks)])
        # The critic's mass changed what some head keeps: without it the test
        # could not tell a relay that ignores history.score.
        self.assertTrue(steered)
        self.c.close_session(sess)

    def test_quantized_message(self):
        model = TinyDecoder(seed=6).to(torch.bfloat16)
        cache, n, steps, tok, _ = run_turn(model, gen=3)
        turn = hf.turn_from_cache(cache, n, hf.prompt_attention_mass(steps, n, kv_heads=H))
        m = self.c.compress(turn, "h2o-head:k=8+obf:p=4+int8")
        self.assertEqual(m.quant_bits, 8)
        rc = hf.message_to_cache(m, cache_format="legacy")
        self.assertEqual(rc.cache[0][0].dtype, torch.bfloat16)
        out = model(input_ids=tok, past_key_values=rc.cache, position_ids=rc.position_ids(1),
                    attention_mask=rc.attention_mask(1))
        self.assertTrue(torch.isfinite(out.logits).all())
        rc32 = hf.message_to_cache(m, dtype=torch.float32, cache_format="legacy")
        self.assertTrue(torch.equal(rc32.cache[0][0], torch.from_numpy(m.layers[0].k).unsqueeze(0)))

    def test_example_chain(self):
        if not ARGS.example:
            self.skipTest("--example not given")
        cmd = [sys.executable, ARGS.example, "--addr", ADDR, "--model", "tiny", "--latent-steps", "4",
               "--answer-tokens", "3", "--policy", "h2o-head:k=8+obf:p=4"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=os.environ)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        hops = re.findall(r"^(\d)\s+(\w+) -> (\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)",
                          p.stdout, re.M)
        self.assertEqual([h[1:3] for h in hops], [("planner", "critic"), ("critic", "refiner"),
                                                  ("refiner", "judger")], p.stdout)
        for h in hops:
            full, sent, ratio = int(h[5]), int(h[6]), float(h[7])
            self.assertLess(sent, full)
            self.assertAlmostEqual(ratio, full / sent, places=2)
        tot = re.search(r"totals: hops=3 full_bytes=(\d+) sent_bytes=(\d+)", p.stdout)
        self.assertIsNotNone(tot, p.stdout)
        self.assertEqual(int(tot.group(1)), sum(int(h[5]) for h in hops))
        self.assertIn("judger: received", p.stdout)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--example", default=os.path.join(REPO, "examples", "latentmas_chain.py"),
                    help="examples/latentmas_chain.py to run once against the relay ('' skips)")
    ARGS, rest = ap.parse_known_args()
    sys.exit(unittest_main(rest, WATCHDOG_S))


if __name__ == "__main__":
    main()
