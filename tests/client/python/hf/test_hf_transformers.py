#!/usr/bin/env python3
"""kvrelay.hf on transformers' own models (LlamaForCausalLM and
Qwen3ForCausalLM: GQA with 4 query / 2 KV heads, Qwen3's q/k norms), built
from small seeded random configurations, against a live kvrelay-server.

    .venv/bin/python test_hf_transformers.py --server BIN
    PYTHONPATH=.venv/hf-old .venv/bin/python test_hf_transformers.py --server BIN

ctest runs it twice: with the venv's transformers (5.x: `cache=`, caches
with .layers) and with the older one in .venv/hf-old (4.53: `past_key_values=`,
DynamicCache.key_cache/value_cache). Float32 and bfloat16; eager and SDPA
attention (the same model, its config's attention switched).

Properties, and how exactly each holds (asserted as stated):
1. turn_from_cache on a real DynamicCache after a prompt and generated
   steps: the turn's K/V are the cache's rows bit for bit.
2. `full` through the relay: the recipient's logits equal the original
   cache's BIT FOR BIT (torch.equal), eager and SDPA, float32 and bfloat16:
   the same tensors go through the same computation.
3. `h2o-head` (each head keeps other positions): the recipient's logits
   equal the original model's on the full cache with the evicted rows masked
   out per head (a 4-D additive mask per layer, set on each attention
   module by a forward pre-hook, independent of kvrelay): float32 within
   1e-5 (max abs; the softmax sums run over other lengths; measured 1e-6 to
   5e-6), bfloat16 within 2 bf16 steps at the largest logit (measured: eager
   bit-identical, SDPA one step); eager and SDPA; one new token and three.
4. QueryCapture on the real attention modules under SDPA: the attention
   mass computed (float64) from the captured queries and the cached keys
   equals the eager model's attention mass within 1e-5 (float32); the relay
   keeps the same rows from either.
5. hf.generate on a relayed h2o-head cache: greedy tokens identical to a
   hand loop with explicit position_ids (relayed.position_ids) and the
   logits bit for bit (a cache continued by hand first: the same tokens,
   logits within 1e-5); without the position protection (positions at the
   number of cached rows) the logits differ, and equal those of a plain
   model.generate on the relayed cache bit for bit (what transformers does
   by itself). KVRELAY_HF_TEST_UNPROTECTED=1 runs the main assertions
   without the protection, to show that the test catches it.
6. Batches: PromptAttention.batch gives each row its own eager mass (within
   1e-5; an offset of 0 instead of the row's padding fails it), and
   turns_from_batch on a left-padded batched cache equals the
   one-by-one turns within 1e-5 (float32; the batched matmuls round
   otherwise, measured up to 3e-6); messages_to_batch of messages of
   different lengths (full and h2o-head) gives the one-by-one logits within
   1e-5 (measured up to 4e-6), and hf.generate on the batch the one-by-one
   greedy tokens; eager and SDPA.
7. Limits: a sliding-window configuration (by config under both
   transformers, by the cache's own sliding layers under 5.x), a
   StaticCache, a quantized cache (5.x's fp8 QuantizedCache; 4.53's needs
   quanto or hqq), a configuration of another geometry, a batch given to
   turn_from_cache, bad turns_from_batch masks and misuse of hf.generate
   are ValueErrors naming the thing.
The whole run is bounded (watchdog) and the server is always stopped.
"""
import argparse
import contextlib
import copy
import inspect
import os
import sys
import unittest
from unittest import mock

import numpy as np
import torch
import transformers
from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, StaticCache)

import kvrelay
from kvrelay import hf

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "testlib"))
from kvrelay_testlib import Server, unittest_main  # noqa: E402

ARGS = None
SERVER = None
ADDR = None
WATCHDOG_S = 150
TV = tuple(int(x) for x in transformers.__version__.split(".")[:2])
UNPROTECTED = os.environ.get("KVRELAY_HF_TEST_UNPROTECTED") == "1"

torch.set_num_threads(1)

LAYERS, Q_HEADS, H, D, VOCAB = 2, 4, 2, 16, 97
ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16}
# Tolerances where the computation differs (an attention over the kept rows
# vs over all rows with the evicted ones masked: other reduction lengths).
# float32: 1e-5 absolute on the logits. bfloat16 keeps 8 significant bits,
# so one rounding step of an attention output apart shows in the logits:
# 2 bf16 steps at the largest logit, BF16_STEPS * eps(bf16) * max|logit|.
F32_ATOL = 1e-5
BF16_STEPS = 2


def config(arch, attn="eager", **extra):
    cls, _ = ARCHS[arch]
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
              num_attention_heads=Q_HEADS, num_key_value_heads=H, head_dim=D,
              max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
              tie_word_embeddings=False, attn_implementation=attn, pad_token_id=0,
              bos_token_id=1, eos_token_id=None)
    kw.update(extra)
    return cls(**kw)


_MODELS = {}


def model(arch, dtype=torch.float32, attn="eager"):
    """A seeded random model (one per arch and dtype), its attention set to `attn`."""
    key = (arch, dtype)
    if key not in _MODELS:
        torch.manual_seed({"llama": 11, "qwen3": 12}[arch])
        m = ARCHS[arch][1](config(arch)).to(dtype).eval()
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
        _MODELS[key] = m
    m = _MODELS[key]
    m.config._attn_implementation = attn
    return m


CACHE_KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters \
    else "past_key_values"


def fwd(m, ids, cache=None, **kw):
    """model(input_ids=ids, <cache kwarg>=cache, use_cache=True, **kw) under no_grad."""
    with torch.no_grad():
        return m(input_ids=ids, use_cache=True, **{CACHE_KW: cache}, **kw)


def out_cache(out):
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


def prompt_ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (1, n), generator=g)


def run_agent(m, n_prompt=12, gen=4, seed=0, attentions=False, ids=None):
    """Prompt pass (`ids`, or n_prompt random ids) + `gen` greedy steps.
    Returns (cache, n_prompt, per-step attentions (with attentions=True),
    next token [1, 1], next position)."""
    ids = prompt_ids(n_prompt, seed) if ids is None else ids
    n_prompt = ids.shape[1]
    out = fwd(m, ids)
    steps = []
    for s in range(gen):
        tok = out.logits[:, -1:].argmax(-1)
        out = fwd(m, tok, out_cache(out), position_ids=torch.tensor([[n_prompt + s]]),
                  output_attentions=attentions)
        if attentions:
            steps.append(out.attentions)
    return out_cache(out), n_prompt, steps, out.logits[:, -1:].argmax(-1), n_prompt + gen


def bits(t):
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def close(test, a, b, dtype, what):
    """Asserts a == b within the dtype's stated tolerance; returns the max |a - b|."""
    a, b = a.float(), b.float()
    diff = (a - b).abs().max().item()
    atol = F32_ATOL if dtype == torch.float32 else \
        BF16_STEPS * torch.finfo(torch.bfloat16).eps * b.abs().max().item()
    test.assertLessEqual(diff, atol, f"{what}: max |diff| {diff} > {atol}")
    return diff


class Session:
    n = 0

    @classmethod
    def new(cls, tag):
        cls.n += 1
        return f"hft-{tag}-{cls.n}"


def setUpModule():
    global SERVER, ADDR
    SERVER = Server(ARGS.server, timeout=20)
    ADDR = SERVER.addr


def tearDownModule():
    if SERVER:
        SERVER.stop()


class RelayCase(unittest.TestCase):
    def setUp(self):
        self.c = kvrelay.Client(ADDR)

    def tearDown(self):
        self.c.close()

    def relay(self, turn, policy, session=None, to="critic"):
        session = session or Session.new("r")
        r = self.c.publish(turn, session, "planner", [to], policy=policy)
        m = self.c.fetch(session, to, timeout=20)
        self.c.ack(session, to, m.message_id)
        self.assertEqual(m.message_id, r.message_id)
        return m


# ---- 1 + 2 ----------------------------------------------------------------------

class FullRelayTest(RelayCase):
    def test_turn_from_dynamic_cache(self):
        for arch in ARCHS:
            for dname, dt in DTYPES.items():
                with self.subTest(arch=arch, dtype=dname):
                    m = model(arch, dt)
                    cache, n, steps, _, nxt = run_agent(m, attentions=True)
                    self.assertIsInstance(cache, DynamicCache)
                    scores = hf.prompt_attention_mass(steps, n, kv_heads=H)
                    t = hf.turn_from_cache(cache, n, scores, config=m.config)
                    self.assertEqual(t.geometry(), (dname, H, H, D, n, nxt - n, 0))
                    for (k, v), tl in zip(hf.cache_layers(cache), t.layers, strict=True):
                        self.assertEqual(list(k.shape), [1, H, nxt, D])
                        for have, want in ((tl.prompt_k, k[0, :, :n]), (tl.gen_k, k[0, :, n:]),
                                           (tl.prompt_v, v[0, :, :n]), (tl.gen_v, v[0, :, n:])):
                            self.assertTrue(np.array_equal(have, bits(want).numpy().view(have.dtype)))
                        self.assertGreater(float(tl.score.sum()), 0)

    def test_full_logits_bit_identical(self):
        for arch in ARCHS:
            for dname, dt in DTYPES.items():
                m = model(arch, dt)
                cache, n, _, tok, nxt = run_agent(m)
                msg = self.relay(hf.turn_from_cache(cache, n), "full")
                for attn in ("eager", "sdpa"):
                    with self.subTest(arch=arch, dtype=dname, attn=attn):
                        m = model(arch, dt, attn)
                        rc = hf.message_to_cache(msg, config=m.config)
                        self.assertIsInstance(rc.cache, DynamicCache)
                        self.assertEqual((rc.tokens, rc.next_pos), (nxt, nxt))
                        for q_ids in (tok, torch.cat([tok, prompt_ids(2, 9)], 1)):
                            q = q_ids.shape[1]
                            want = fwd(m, q_ids, copy.deepcopy(cache),
                                       position_ids=torch.arange(nxt, nxt + q).unsqueeze(0))
                            rc = hf.message_to_cache(msg)
                            got = fwd(m, q_ids, rc.cache, position_ids=rc.position_ids(q),
                                      attention_mask=rc.attention_mask(q))
                            self.assertTrue(torch.equal(want.logits, got.logits),
                                            f"q={q}: max diff "
                                            f"{(want.logits - got.logits).abs().max().item()}")


# ---- 3 --------------------------------------------------------------------------

class EvictionMask:
    """Forward pre-hooks on every attention module that replace its
    attention mask with a 4-D additive one [1, q_heads, q, T + q]: causal
    among the q new tokens, every cached row visible EXCEPT, per layer and KV
    head, the rows not in keep[layer][head] (the dtype's lowest value, as
    transformers masks). The reference for an evicting policy, built without
    kvrelay."""

    def __init__(self, m, keep, T):
        self.m, self.keep, self.T, self.handles = m, keep, T, []

    def __enter__(self):
        attn = [mod for mod in self.m.modules() if hasattr(mod, "q_proj") and hasattr(mod, "k_proj")]
        for layer, mod in enumerate(attn):
            self.handles.append(mod.register_forward_pre_hook(
                lambda mod, args, kw, layer=layer: (args, {**kw, "attention_mask": self.mask(layer, kw)}),
                with_kwargs=True))
        return self

    def mask(self, layer, kw):
        x = kw["hidden_states"]
        q, T, dt = x.shape[1], self.T, x.dtype
        low = torch.finfo(dt).min
        visible = torch.zeros(Q_HEADS, q, T + q, dtype=torch.bool)
        for qh in range(Q_HEADS):
            visible[qh, :, self.keep[layer][qh // (Q_HEADS // H)]] = True
        visible[:, :, T:] = torch.ones(q, q, dtype=torch.bool).tril()
        return torch.zeros(1, Q_HEADS, q, T + q, dtype=dt).masked_fill(~visible.unsqueeze(0), low)

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


class H2OHeadTest(RelayCase):
    def test_logits_equal_the_masked_original(self):
        k = 4
        report = []
        for arch in ARCHS:
            for dname, dt in DTYPES.items():
                m = model(arch, dt, "eager")
                cache, n, steps, tok, nxt = run_agent(m, n_prompt=16, gen=4, attentions=True)
                scores = hf.prompt_attention_mass(steps, n)  # per query head
                msg = self.relay(hf.turn_from_cache(cache, n, scores), f"h2o-head:k={k}")
                rc = hf.message_to_cache(msg)
                self.assertEqual(rc.next_pos, nxt)
                self.assertLess(rc.tokens, nxt)
                # Heads keep different positions (what makes the per-head mask matter).
                self.assertFalse(torch.equal(rc.positions[:, 0], rc.positions[:, 1]))
                keep = rc.positions.tolist()
                for attn in ("eager", "sdpa"):
                    m = model(arch, dt, attn)
                    for q_ids in (tok, torch.cat([tok, prompt_ids(2, 9)], 1)):
                        q = q_ids.shape[1]
                        with self.subTest(arch=arch, dtype=dname, attn=attn, q=q):
                            with EvictionMask(m, keep, nxt):
                                want = fwd(m, q_ids, copy.deepcopy(cache),
                                           position_ids=torch.arange(nxt, nxt + q).unsqueeze(0))
                            rc = hf.message_to_cache(msg)
                            got = fwd(m, q_ids, rc.cache, position_ids=rc.position_ids(q),
                                      attention_mask=rc.attention_mask(q))
                            diff = close(self, got.logits, want.logits, dt, "logits")
                            report.append(f"{arch}/{dname}/{attn}/q={q}: "
                                          f"{'bit-identical' if diff == 0 else f'{diff:.2g}'}")
                            # The mask matters: the unmasked original gives other logits.
                            full = fwd(m, q_ids, copy.deepcopy(cache),
                                       position_ids=torch.arange(nxt, nxt + q).unsqueeze(0))
                            self.assertGreater((full.logits.float() - want.logits.float()).abs().max().item(),
                                               0.1)
        print("\n  h2o-head vs masked original: " + "; ".join(report), file=sys.stderr)


# ---- 4 --------------------------------------------------------------------------

class QueryCaptureTest(RelayCase):
    def test_sdpa_queries_give_the_eager_mass(self):
        gen = 4
        for arch in ARCHS:
            with self.subTest(arch=arch):
                m = model(arch, torch.float32, "sdpa")
                ids = prompt_ids(12, 3)
                n = ids.shape[1]
                out = fwd(m, ids)
                toks = []
                with hf.QueryCapture(m) as cap:
                    for s in range(gen):
                        tok = out.logits[:, -1:].argmax(-1)
                        toks.append(tok)
                        out = fwd(m, tok, out_cache(out), position_ids=torch.tensor([[n + s]]))
                for mod in m.modules():  # the wrapping is gone after the with-block
                    self.assertNotIn("forward", mod.__dict__)
                cache_q = out_cache(out)
                queries = cap.queries()
                self.assertEqual(queries[0].shape, (Q_HEADS, gen, D))
                self.assertEqual(cap.softmax_scale, D ** -0.5)
                # The eager model on the same tokens: its attention mass on the prompt.
                m = model(arch, torch.float32, "eager")
                out = fwd(m, ids)
                steps = []
                for s, tok in enumerate(toks):
                    out = fwd(m, tok, out_cache(out), position_ids=torch.tensor([[n + s]]),
                              output_attentions=True)
                    steps.append(out.attentions)
                eager = hf.prompt_attention_mass(steps, n)
                keys = hf.cache_layers(cache_q)
                for layer in range(LAYERS):
                    kk = keys[layer][0][0].double()  # [H, T, d]
                    qq = torch.from_numpy(queries[layer]).double()
                    mass = torch.zeros(Q_HEADS, n, dtype=torch.float64)
                    for t in range(gen):
                        for qh in range(Q_HEADS):
                            w = torch.softmax(kk[qh // (Q_HEADS // H), :n + t + 1] @ qq[qh, t]
                                              * cap.softmax_scale, dim=0)
                            mass[qh] += w[:n]
                    diff = np.abs(mass.numpy() - eager[layer]).max()
                    self.assertLess(diff, 1e-5, f"layer {layer}: |mass from queries - eager| = {diff}")
                # The relay keeps the same rows from the queries as from the eager mass.
                a = self.c.compress(hf.turn_from_cache(cache_q, n, eager), "h2o-head:k=4")
                b = self.c.compress(hf.turn_from_cache(cache_q, n, queries=queries,
                                                       softmax_scale=cap.softmax_scale), "h2o-head:k=4")
                for la, lb in zip(a.layers, b.layers, strict=True):
                    self.assertTrue(np.array_equal(la.pos, lb.pos))


# ---- 5 --------------------------------------------------------------------------

def storage_positions(n_relayed):
    """What transformers does by itself: positions continue at the number of
    cached rows (the protection removed), as hf._relayed_position_ids's stand-in."""
    def positions(next_pos, tail_mask, q_len):
        start = n_relayed + tail_mask.shape[1] - q_len
        return (start + torch.arange(q_len)).unsqueeze(0).expand(tail_mask.shape[0], -1)
    return positions


class GenerateTest(RelayCase):
    NEW = 6

    def hand_loop(self, m, rc, ids):
        """Greedy decoding step by step with explicit position ids. The LM
        head runs on the last token only (logits_to_keep=1), as generate's
        does: on all q it would be another matmul shape, rounded otherwise."""
        out = fwd(m, ids, rc.cache, position_ids=rc.position_ids(ids.shape[1]),
                  attention_mask=rc.attention_mask(ids.shape[1]), logits_to_keep=1)
        toks, logits = [], []
        q = ids.shape[1]
        for s in range(self.NEW):
            logits.append(out.logits[:, -1])
            tok = out.logits[:, -1:].argmax(-1)
            toks.append(tok)
            if s + 1 < self.NEW:
                q += 1
                pos = (rc.next_pos_tensor().unsqueeze(1) + q - 1)
                out = fwd(m, tok, out_cache(out), position_ids=pos, attention_mask=rc.attention_mask(q))
        return torch.cat([ids] + toks, 1), torch.stack(logits, 1)

    def generate(self, m, rc, ids, protect=True):
        patch = contextlib.nullcontext() if protect else \
            mock.patch.object(hf, "_relayed_position_ids", storage_positions(rc.tokens))
        with patch, torch.no_grad():
            out = hf.generate(m, rc, ids, max_new_tokens=self.NEW, do_sample=False,
                              return_dict_in_generate=True, output_logits=True)
        return out.sequences, torch.stack(out.logits, 1)

    def test_generate_continues_at_next_pos(self):
        for arch in ARCHS:
            m = model(arch, torch.float32, "eager")
            cache, n, steps, tok, nxt = run_agent(m, n_prompt=16, gen=4, attentions=True)
            msg = self.relay(hf.turn_from_cache(cache, n, hf.prompt_attention_mass(steps, n)),
                             "h2o-head:k=4")
            for attn in ("eager", "sdpa"):
                with self.subTest(arch=arch, attn=attn):
                    m = model(arch, torch.float32, attn)
                    ids = torch.cat([tok, prompt_ids(2, 5)], 1)
                    rc = hf.message_to_cache(msg)
                    self.assertGreater(rc.next_pos, rc.tokens)  # the case that needs the protection
                    want_seq, want_logits = self.hand_loop(m, rc, ids)
                    rc = hf.message_to_cache(msg)
                    seq, logits = self.generate(m, rc, ids, protect=not UNPROTECTED)
                    self.assertEqual(seq.tolist(), want_seq.tolist())
                    self.assertTrue(torch.equal(logits, want_logits),
                                    f"max diff per step {(logits - want_logits).abs().amax((0, 2)).tolist()}")
                    self.assertEqual(int(rc.cache.get_seq_length()), rc.tokens + ids.shape[1] + self.NEW - 1)
                    # A cache continued by hand first (rows past the relayed ones):
                    # generate goes on from there, the same tokens (logits within
                    # 1e-5: the first token went through a forward of its own).
                    rc = hf.message_to_cache(msg)
                    fwd(m, ids[:, :1], rc.cache, position_ids=rc.position_ids(1),
                        attention_mask=rc.attention_mask(1))
                    seq_c, logits_c = self.generate(m, rc, ids[:, 1:], protect=not UNPROTECTED)
                    self.assertEqual(seq_c.tolist(), want_seq[:, 1:].tolist())
                    close(self, logits_c, want_logits, torch.float32, "continued cache")
                    # Without the protection the logits differ: the test can tell.
                    seq_u, logits_u = self.generate(m, hf.message_to_cache(msg), ids, protect=False)
                    self.assertGreater((logits_u - want_logits).abs().max().item(), 1e-3)
                    # ... and the stand-in is what a plain model.generate on the
                    # relayed cache does (placeholder ids for the cached rows).
                    rc = hf.message_to_cache(msg)
                    with torch.no_grad():
                        plain = m.generate(torch.cat([torch.zeros(1, rc.tokens, dtype=torch.long), ids], 1),
                                           attention_mask=rc.attention_mask(ids.shape[1]),
                                           **{CACHE_KW: rc.cache}, max_new_tokens=self.NEW,
                                           do_sample=False, return_dict_in_generate=True,
                                           output_logits=True)
                    self.assertTrue(torch.equal(torch.stack(plain.logits, 1), logits_u))
                    self.assertEqual(plain.sequences[:, rc.tokens:].tolist(), seq_u.tolist())


# ---- 6 --------------------------------------------------------------------------

class BatchTest(RelayCase):
    LENS = (9, 14)

    def test_batched_equals_one_by_one(self):
        gen = 3
        for arch in ARCHS:
            for attn in ("eager", "sdpa"):
                with self.subTest(arch=arch, attn=attn):
                    m = model(arch, torch.float32, attn)
                    prompts = [prompt_ids(n, 20 + i) for i, n in enumerate(self.LENS)]
                    T0 = max(self.LENS)
                    # Left padding, positions from the mask (as generate does).
                    ids = torch.stack([torch.nn.functional.pad(p[0], (T0 - p.shape[1], 0)) for p in prompts])
                    mask = torch.stack([torch.nn.functional.pad(torch.ones(p.shape[1], dtype=torch.long),
                                                                (T0 - p.shape[1], 0)) for p in prompts])
                    pos = (mask.cumsum(-1) - 1).clamp(min=0)
                    out = fwd(m, ids, attention_mask=mask, position_ids=pos)
                    eager = attn == "eager"
                    acc = hf.PromptAttention.batch(mask, list(self.LENS), kv_heads=H) if eager else None
                    for s in range(gen):
                        tok = out.logits[:, -1:].argmax(-1)
                        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
                        out = fwd(m, tok, out_cache(out), attention_mask=mask,
                                  position_ids=pos[:, -1:] + s + 1, output_attentions=eager)
                        for a in acc or ():
                            a.add(out.attentions)
                    turns = hf.turns_from_batch(out_cache(out), mask, list(self.LENS),
                                                scores=[a.scores() for a in acc] if eager else None,
                                                config=m.config)
                    singles, kv_diff = [], 0.0
                    for p, t in zip(prompts, turns):
                        c1, n1, steps1, _, _ = run_agent(m, gen=gen, ids=p, attentions=eager)
                        t1 = hf.turn_from_cache(
                            c1, n1, hf.prompt_attention_mass(steps1, n1, kv_heads=H) if eager else None)
                        if eager:  # the batch's per-row mass is each sequence's own
                            for la, lb in zip(t.layers, t1.layers):
                                np.testing.assert_allclose(la.score, lb.score, rtol=0, atol=F32_ATOL,
                                                           err_msg="score")
                        singles.append(t1)
                        self.assertEqual(t.geometry(), t1.geometry())
                        for la, lb in zip(t.layers, t1.layers):
                            for f in ("prompt_k", "prompt_v", "gen_k", "gen_v"):
                                np.testing.assert_allclose(getattr(la, f), getattr(lb, f), rtol=0,
                                                           atol=F32_ATOL, err_msg=f)
                                kv_diff = max(kv_diff, float(np.abs(getattr(la, f) - getattr(lb, f)).max()))
                    # Different lengths after relaying: full (9 + 3) and h2o-head (4 + 4 + 3).
                    msgs = [self.relay(singles[0], "full"), self.relay(singles[1], "h2o-head:k=4")]
                    rb = hf.messages_to_batch(msgs, config=m.config)
                    self.assertEqual(rb.lengths, [self.LENS[0] + gen, 4 + 4 + gen])
                    self.assertEqual(rb.next_pos, [n + gen for n in self.LENS])
                    new = prompt_ids(2, 31).expand(2, -1)
                    got = fwd(m, new, rb.cache, position_ids=rb.position_ids(2),
                              attention_mask=rb.attention_mask(2))
                    logit_diff = 0.0
                    for b, msg in enumerate(msgs):
                        rc = hf.message_to_cache(msg)
                        one = fwd(m, new[b:b + 1], rc.cache, position_ids=rc.position_ids(2),
                                  attention_mask=rc.attention_mask(2))
                        logit_diff = max(logit_diff, close(self, got.logits[b:b + 1], one.logits,
                                                           torch.float32, f"row {b}"))
                    print(f"\n  batched vs one by one, {arch}/{attn}: turn K/V max |diff| {kv_diff:.2g}, "
                          f"logits {logit_diff:.2g}", file=sys.stderr)
                    # hf.generate on the batch: each row's greedy tokens as alone.
                    with torch.no_grad():
                        seq = hf.generate(m, hf.messages_to_batch(msgs), new, max_new_tokens=4,
                                          do_sample=False)
                        for b, msg in enumerate(msgs):
                            one = hf.generate(m, hf.message_to_cache(msg), new[b:b + 1],
                                              max_new_tokens=4, do_sample=False)
                            self.assertEqual(seq[b].tolist(), one[0].tolist())


# ---- 7 --------------------------------------------------------------------------

class LimitsTest(RelayCase):
    def test_sliding_window(self):
        cfg = config("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=1)
        torch.manual_seed(0)
        m = Qwen3ForCausalLM(cfg).eval()
        cache = out_cache(fwd(m, prompt_ids(8, 1)))
        with self.assertRaisesRegex(ValueError, r"config\.layer_types\[1\]: 'sliding_attention', "
                                                r"expected 'full_attention'"):
            hf.turn_from_cache(cache, 8, config=m.config)
        if TV >= (4, 56):  # the cache itself says so (4.53 keeps every token, masks by config only)
            with self.assertRaisesRegex(ValueError, r"cache layer 1: a sliding-window layer"):
                hf.turn_from_cache(cache, 8)
        full_cache, n, _, _, _ = run_agent(model("qwen3"))
        msg = self.c.compress(hf.turn_from_cache(full_cache, n), "full")
        with self.assertRaisesRegex(ValueError, r"config\.layer_types\[1\]: 'sliding_attention', "
                                                r"expected 'full_attention'"):
            hf.message_to_cache(msg, config=m.config)

    def test_static_cache(self):
        m = model("llama")
        if TV >= (4, 56):
            sc = StaticCache(config=m.config, max_cache_len=32)
        else:
            sc = StaticCache(config=m.config, max_batch_size=1, max_cache_len=32, dtype=torch.float32)
        fwd(m, prompt_ids(8, 1), sc)
        with self.assertRaisesRegex(ValueError, r"cache layer 0: 32 tokens in its key tensor, but "
                                                r"StaticCache\.get_seq_length\(0\) is 8"):
            hf.turn_from_cache(sc, 8)

    def test_quantized_cache(self):
        # transformers >= 5 quantizes to fp8 without an extra backend: its
        # layers keep the tokens in _quantized_keys, the key tensor is empty.
        # (4.53's QuantizedCache needs quanto or hqq, not installed: its
        # stand-in is test_hf.py's.)
        if not hasattr(transformers, "QuantizedCache") or TV < (5, 0):
            self.skipTest(f"transformers {transformers.__version__}: no backend-free QuantizedCache")
        m = model("llama")
        qc = transformers.QuantizedCache(backend="fp8", config=m.config)
        fwd(m, prompt_ids(8, 1), qc)
        fwd(m, prompt_ids(1, 2), qc)
        with self.assertRaisesRegex(ValueError, r"cache layer 0: 0 tokens in its key tensor, but "
                                                r"QuantizedCache\.get_seq_length\(0\) is 9"):
            hf.turn_from_cache(qc, 8)

    def test_other_geometry(self):
        cache, n, _, _, _ = run_agent(model("llama"))
        msg = self.c.compress(hf.turn_from_cache(cache, n), "full")
        with self.assertRaisesRegex(ValueError, r"config\.num_key_value_heads: 4, expected 2"):
            hf.message_to_cache(msg, config=config("llama", num_key_value_heads=4))
        with self.assertRaisesRegex(ValueError, r"config\.num_hidden_layers: 3, expected 2"):
            hf.turn_from_cache(cache, n, config=config("llama", num_hidden_layers=3))

    def test_batch_errors(self):
        m = model("llama")
        out = fwd(m, torch.cat([prompt_ids(6, 1), prompt_ids(6, 2)]))
        cache = out_cache(out)
        with self.assertRaisesRegex(ValueError, r"cache layer 0 key: batch 2, expected 1 \(a turn is one "
                                                r"sequence; turns_from_batch splits a batch\)"):
            hf.turn_from_cache(cache, 6)
        with self.assertRaisesRegex(ValueError, r"attention_mask: shape \[2, 5\], expected \[2, 6\]"):
            hf.turns_from_batch(cache, torch.ones(2, 5), 6)
        with self.assertRaisesRegex(ValueError, r"n_prompt: 3 rows, expected 2"):
            hf.turns_from_batch(cache, torch.ones(2, 6), [6, 6, 6])
        mask = torch.tensor([[1] * 6, [0, 0] + [1] * 4])
        with self.assertRaisesRegex(ValueError, r"row 1: n_history \+ n_prompt: 0 \+ 6 = 6, expected <= "
                                                r"the cache's 4 tokens"):
            hf.turns_from_batch(cache, mask, 6)
        t = hf.turns_from_batch(cache, mask, [6, 4])
        self.assertEqual([x.geometry()[4] for x in t], [6, 4])

    def test_generate_misuse(self):
        cache, n, _, tok, _ = run_agent(model("llama"))
        msg = self.c.compress(hf.turn_from_cache(cache, n), "full")
        m = model("llama")
        with self.assertRaisesRegex(ValueError, r"relayed\.cache: tuple, expected a transformers Cache"):
            hf.generate(m, hf.message_to_cache(msg, cache_format="legacy"), tok)
        with self.assertRaisesRegex(ValueError, r"position_ids: given, expected none"):
            hf.generate(m, hf.message_to_cache(msg), tok, position_ids=torch.tensor([[0]]))
        with self.assertRaisesRegex(ValueError, r"input_ids: shape \[2, 1\], expected \[1, q\]"):
            hf.generate(m, hf.message_to_cache(msg), tok.expand(2, 1))
        with self.assertRaisesRegex(ValueError, r"messages\[1\]: kv_heads 2, head_dim 8"):
            other = kvrelay.Message(layers=[kvrelay.MessageLayer(
                k=np.ones((H, 3, 8), np.float32), v=np.zeros((H, 3, 8), np.float32),
                pos=np.array([[0, 1, 2]] * H, np.int32))] * LAYERS,
                dtype="F32", kv_heads=H, head_dim=8, n_history=0, n_anchor=3, n_kept=0, n_gen=0)
            hf.messages_to_batch([msg, other])


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--expect-transformers", default="",
                    help="fail unless transformers' version starts with this (e.g. 4.53: the "
                         "run that puts .venv/hf-old first on PYTHONPATH)")
    ARGS, rest = ap.parse_known_args()
    if not (transformers.__version__ + ".").startswith(ARGS.expect_transformers.rstrip(".") + ".") \
            and ARGS.expect_transformers:
        sys.exit(f"transformers {transformers.__version__} from {transformers.__file__}, expected "
                 f"{ARGS.expect_transformers} (PYTHONPATH={os.environ.get('PYTHONPATH', '')})")
    print(f"transformers {transformers.__version__} ({transformers.__file__}), torch {torch.__version__}",
          file=sys.stderr)
    sys.exit(unittest_main(rest, WATCHDOG_S))


if __name__ == "__main__":
    main()
