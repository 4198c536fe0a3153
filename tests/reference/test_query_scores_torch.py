#!/usr/bin/env python3
"""kvrelay_ref.query_scores (FORMAT.md step 0) against torch eager attention.

Run:
    .venv/bin/python tests/reference/test_query_scores_torch.py [-v]

Needs numpy and torch (the project venv has both); without torch
the tests are skipped.  Everything is float64 on the CPU, with fixed seeds.

The torch side is written the way a decoder's eager attention computes the
weights of the generated tokens (Hugging Face's `eager_attention_forward`):
the KV cache holds [history; prompt; gen], `repeat_kv` expands the H KV heads
to the S query heads (score head q reads KV head q // (S/H)), the logits are
`matmul(q, k^T) * scaling`, a causal mask adds the dtype's lowest value to the
keys a step must not see (generated step t sees history + prompt + gen
0..t), and `softmax(dim=-1, dtype=float64)`.  It is checked twice: as one
chunk of n_gen query rows with the mask, and step by step as a decoder
produces them (step t against the first n_history + n_prompt + t + 1 keys of
the cache, no mask).  The score of prompt token j is the sum over the steps
in the window (the last `window` ones) of the weight on key n_history + j.

Tolerance: |reference - torch| <= 1e-10 (absolute; the scores are at most
n_gen <= 12) -- both are float64, so only summation order differs.

Cases: GQA groups S/H = 1, 4, 5 (several seeds each), the default scale
1/sqrt(d) and non-default softmax_scale values, window = none / 1 / some /
n_gen / more than n_gen, with and without history, n_prompt and n_gen down
to 0, large logits (max-subtraction), and turns stored in BF16 / F16 / F32
(gen.q in F32 or the K/V dtype) read back through kvrelay_ref's safetensors
path and compress(), whose layer scores and reduced A[h] / A_layer must match
torch's from the same stored values.
"""

import math
import os
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvrelay_ref as ref  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

TOL = 1e-10
SEEDS = 6  # per (group, scale) combination


# ---------------------------------------------------------------------------
# torch eager attention (float64)
# ---------------------------------------------------------------------------

def repeat_kv(x, n_rep):
    """[b, H, M, d] -> [b, H * n_rep, M, d] (Hugging Face's repeat_kv)."""
    b, h, m, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, m, d).reshape(b, h * n_rep, m, d)


def torch_chunk_weights(q, hk, pk, gk, scale):
    """One forward over the n_gen generated tokens with the cache
    [history; prompt] already filled: [S, n_gen, M] weights."""
    S, ng, d = q.shape
    H, nh = hk.shape[0], hk.shape[1]
    n = pk.shape[1]
    keys = torch.cat([hk, pk, gk], dim=1)[None]          # [1, H, M, d]
    keys = repeat_kv(keys, S // H)                        # [1, S, M, d]
    M = keys.shape[2]
    attn = torch.matmul(q[None], keys.transpose(2, 3)) * scale   # [1, S, ng, M]
    # Query row t has absolute position nh + n + t; it sees keys 0..nh+n+t.
    mask = torch.full((ng, M), torch.finfo(torch.float64).min, dtype=torch.float64)
    mask = torch.triu(mask, diagonal=nh + n + 1)
    attn = attn + mask[None, None]
    return torch.nn.functional.softmax(attn, dim=-1, dtype=torch.float64)[0]


def torch_decode_weights(q, hk, pk, gk, scale):
    """Step by step, as a decoder generates: step t appends gen key t to the
    cache and attends over the whole cache so far.  [S, n_gen, M], 0 past m_t."""
    S, ng, d = q.shape
    H = hk.shape[0]
    cache = torch.cat([hk, pk], dim=1)[None]              # [1, H, nh + n, d]
    M = cache.shape[2] + ng
    out = torch.zeros((S, ng, M), dtype=torch.float64)
    for t in range(ng):
        cache = torch.cat([cache, gk[None, :, t:t + 1]], dim=2)
        keys = repeat_kv(cache, S // H)
        attn = torch.matmul(q[None, :, t:t + 1], keys.transpose(2, 3)) * scale  # [1, S, 1, m_t]
        w = torch.nn.functional.softmax(attn, dim=-1, dtype=torch.float64)
        out[:, t, :cache.shape[2]] = w[0, :, 0]
    return out


def scores_from_weights(W, nh, n, window):
    ng = W.shape[1]
    t0 = 0 if window is None else max(0, ng - window)
    return W[:, t0:, nh:nh + n].sum(dim=1)


# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------

def random_qk(rng, H, g, d, nh, n, ng, qmul=1.0):
    ch = np.exp(0.5 * rng.standard_normal(d))  # per-channel outliers, as in real keys
    hk, pk, gk = (rng.standard_normal((H, x, d)) * ch for x in (nh, n, ng))
    q = rng.standard_normal((H * g, ng, d)) * ch * qmul
    return q, hk, pk, gk


def windows_for(rng, ng):
    ws = [None, 1, ng + 3]
    if ng >= 1:
        ws.append(ng)
    if ng >= 3:
        ws.append(int(rng.integers(2, ng)))
    return ws


@unittest.skipIf(torch is None, "torch is not installed")
class QueryScoresVsTorch(unittest.TestCase):
    def compare(self, what, got, want):
        got = np.asarray(got)
        want = np.asarray(want)
        self.assertEqual(got.shape, want.shape, what)
        if got.size:
            err = float(np.max(np.abs(got - want)))
            self.assertLessEqual(err, TOL, "%s: max |ref - torch| = %.3g" % (what, err))

    def check_one(self, ctx, q, hk, pk, gk, scale, windows):
        nh, n = hk.shape[1], pk.shape[1]
        tq, thk, tpk, tgk = (torch.from_numpy(np.ascontiguousarray(x)) for x in (q, hk, pk, gk))
        torch_scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[2])
        Wc = torch_chunk_weights(tq, thk, tpk, tgk, torch_scale)
        Wd = torch_decode_weights(tq, thk, tpk, tgk, torch_scale)
        W = ref.query_weights(q, hk, pk, gk, scale)
        self.compare(ctx + " weights vs chunk", W, Wc.numpy())
        self.compare(ctx + " weights vs decode", W, Wd.numpy())
        for w in windows:
            s = ref.query_scores(q, hk, pk, gk, scale, w)
            self.compare("%s window=%s vs chunk" % (ctx, w), s, scores_from_weights(Wc, nh, n, w).numpy())
            self.compare("%s window=%s vs decode" % (ctx, w), s, scores_from_weights(Wd, nh, n, w).numpy())
        return 1

    def test_gqa_groups_scales_windows(self):
        count = 0
        for g in (1, 4, 5):
            for scale_kind in ("default", "custom"):
                for seed in range(SEEDS):
                    rng = np.random.default_rng(10007 * g + 101 * seed + (scale_kind == "custom"))
                    H = int(rng.integers(1, 4))
                    d = int(rng.choice([8, 16, 64, 128]))
                    nh = int(rng.integers(0, 24)) if seed % 3 else 0
                    n = int(rng.integers(1, 60)) if seed != 1 else 0
                    ng = int(rng.integers(1, 13)) if seed != 2 else 0
                    q, hk, pk, gk = random_qk(rng, H, g, d, nh, n, ng, qmul=float(rng.uniform(0.5, 3.0)))
                    scale = None if scale_kind == "default" else float(rng.choice(
                        [1.0, 0.37, 0.0883883476, float(rng.uniform(0.01, 2.0))]))
                    ctx = "g=%d H=%d d=%d nh=%d n=%d ng=%d scale=%s seed=%d" % (g, H, d, nh, n, ng, scale, seed)
                    count += self.check_one(ctx, q, hk, pk, gk, scale, windows_for(rng, ng))
        self.assertEqual(count, 3 * 2 * SEEDS)

    def test_large_logits(self):
        # Logits in the hundreds: weights nearly one-hot; exp without the max
        # subtracted would overflow past ~709.
        for seed in range(4):
            rng = np.random.default_rng(777 + seed)
            q, hk, pk, gk = random_qk(rng, 2, 4, 32, 5, 30, 6, qmul=60.0)
            self.check_one("large logits seed=%d" % seed, q, hk, pk, gk, 2.0, [None, 2])

    def test_duplicate_keys_tie_exactly(self):
        # Equal keys get exactly equal scores (the only source of exact ties).
        rng = np.random.default_rng(4242)
        q, hk, pk, gk = random_qk(rng, 2, 2, 16, 3, 20, 5)
        pk[:, 11] = pk[:, 4]
        s = ref.query_scores(q, hk, pk, gk)
        self.assertTrue(np.array_equal(s[:, 11], s[:, 4]))
        self.check_one("duplicate keys", q, hk, pk, gk, None, [None, 3])

    def test_stored_dtypes_through_compress(self):
        """Turn files in BF16/F16/F32 with gen.q (F32 or the K/V dtype):
        kvrelay_ref reads the stored values and compress() must give torch's
        scores of the same values, and A[h] / A_layer their group sums."""
        tdt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
        for i, (dtype, qd, scale) in enumerate((("BF16", "BF16", None), ("BF16", "F32", 0.25),
                                                ("F16", "F16", 0.125), ("F16", "F32", None),
                                                ("F32", "F32", 0.3))):
            rng = np.random.default_rng(31337 + i)
            L, H, g, d, nh, n, ng = 2, 2, 4 if i % 2 else 5, 32, 4 + i, 25, 7
            tensors, meta = {}, {"first_agent": "false", "prompt_pos0": str(nh + 3)}
            if scale is not None:
                meta["softmax_scale"] = ref.softmax_scale_str(scale)
            stored = []  # per layer: torch tensors of the stored values
            for l in range(L):
                q, hk, pk, gk = random_qk(rng, H, g, d, nh, n, ng, qmul=2.0)
                hv, pv, gv = (rng.standard_normal((H, x, d)) for x in (nh, n, ng))
                t = {}
                for nm, arr, dt in (("gen.q", q, qd), ("history.k", hk, dtype), ("prompt.k", pk, dtype),
                                    ("gen.k", gk, dtype), ("history.v", hv, dtype),
                                    ("prompt.v", pv, dtype), ("gen.v", gv, dtype)):
                    x = torch.from_numpy(arr).to(tdt[dt])  # torch rounds to the stored dtype
                    if dt == "BF16":
                        raw = x.view(torch.int16).numpy().view(np.uint16)
                    else:
                        raw = x.numpy()
                    tensors["layer.%d.%s" % (l, nm)] = (dt, raw)
                    t[nm] = x.to(torch.float64)
                tensors["layer.%d.history.pos" % l] = ("I32", np.tile(np.arange(nh, dtype=np.int32), (H, 1)))
                stored.append(t)
            with tempfile.TemporaryDirectory() as td:
                path = os.path.join(td, "turn.safetensors")
                ref.write_safetensors(path, tensors, meta)
                turn = ref.Turn.load(path)
            self.assertTrue(turn.has_query)
            self.assertEqual(turn.q_dtype, qd)
            sc = scale if scale is not None else 1.0 / math.sqrt(d)
            for w in (None, 1, 4, ng, 1 << 24):
                for sel in ("h2o-head", "h2o-layer"):
                    spec = "%s:k=6,sinks=2" % sel + ("" if w is None else ",window=%d" % w)
                    m = ref.compress(turn, spec)
                    for l in range(L):
                        t = stored[l]
                        Wc = torch_chunk_weights(t["gen.q"], t["history.k"], t["prompt.k"], t["gen.k"], sc)
                        ts = scores_from_weights(Wc, nh, n, w)                  # [S, n]
                        tA = ts.reshape(H, g, n).sum(dim=1)
                        ctx = "%s/%s scale=%s %s layer %d" % (dtype, qd, scale, spec, l)
                        self.compare(ctx + " scores", m.layers[l].score, ts.numpy())
                        self.compare(ctx + " A[h]", m.layers[l].A, tA.numpy())
                        self.compare(ctx + " A_layer", m.layers[l].A_layer, tA.sum(dim=0).numpy())


if __name__ == "__main__":
    prog = unittest.main(exit=False, verbosity=2 if "-v" in sys.argv else 1)
    sys.exit(0 if prog.result.wasSuccessful() else 1)
