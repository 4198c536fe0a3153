"""Feasibility probe: a calibrated PCA codec (KVTC-style) for kvrelay's eval.

Per layer, KV head and kind (K / V): a mean and a PCA basis learned offline on
calibration turns (different data than the evaluated samples), a bit
allocation over the principal components (greedy marginal-return = reverse
water-filling on measured distortion curves), Gaussian Lloyd-Max scalar
quantization of each component scaled by its calibrated std, 0-bit
components dropped (decoded as the mean).

Evaluation goes through kvrelay.eval's own path: agent_a -> turn ->
OfflineRelay (`kvrelayctl compress --decode`) for full / gen /
full+lloyd:bits=2; the PCA policies take the `full` message (bf16, every
token: anchors, prompt, generated), encode+decode every row of every layer
and head, and hand the message (decoded, rounded to bf16 by
message_to_cache) to float32_cache -> agent_b -> score, like the eval.

    .venv/bin/python bench/fidelity/pca_probe/pca_probe.py --samples 100 --calib 60 --out results.json
"""
import argparse
import copy
import heapq
import json
import math
import os
import random
import sys
import time

import numpy as np

BMAX = 8


# ---- Gaussian Lloyd-Max codebooks ----------------------------------------------------

def gaussian_lloyd(bits, iters=300):
    """Lloyd-Max levels of N(0,1) with 2^bits levels (numerical, fine grid)."""
    x = np.linspace(-9, 9, 200001)
    p = np.exp(-x * x / 2)
    p /= p.sum()
    L = 2 ** bits
    c = np.quantile(np.random.default_rng(0).standard_normal(200000), (np.arange(L) + 0.5) / L)
    for _ in range(iters):
        t = (c[1:] + c[:-1]) / 2
        idx = np.searchsorted(t, x)
        w = np.bincount(idx, p, L)
        s = np.bincount(idx, p * x, L)
        c = np.where(w > 0, s / np.maximum(w, 1e-300), c)
    return c.astype(np.float64)


CODEBOOKS = {b: gaussian_lloyd(b) for b in range(1, BMAX + 1)}
THRESH = {b: (c[1:] + c[:-1]) / 2 for b, c in CODEBOOKS.items()}


def quantize(u, b):
    """codes of u (already divided by sigma) with b bits."""
    return np.searchsorted(THRESH[b], u)


# Vectorized quantizer for mixed bits: a lookup on a fine grid of u (step
# 18/65536 = 0.00027 sigma; a value closer than that to a threshold may take
# the neighbouring code), codes[b, cell] and levels CB[b, code] (b = 0: 0).
GRID_LO, GRID_N = -9.0, 65536
GRID_STEP = 18.0 / GRID_N
_cells = GRID_LO + (np.arange(GRID_N) + 0.5) * GRID_STEP
LUT = np.zeros((BMAX + 1, GRID_N), np.int16)
CB = np.zeros((BMAX + 1, 2 ** BMAX))
for _b in range(1, BMAX + 1):
    LUT[_b] = np.searchsorted(THRESH[_b], _cells)
    CB[_b, :2 ** _b] = CODEBOOKS[_b]


def quantize_mixed(u, bvec):
    """u [n, d], bvec [d] bits per column -> (codes [n, d] (-1 where 0 bits), levels [n, d])."""
    g = np.clip(((u - GRID_LO) / GRID_STEP).astype(np.int64), 0, GRID_N - 1)
    codes = LUT[bvec[None, :], g].astype(np.int64)
    q = CB[bvec[None, :], codes]
    codes[:, bvec == 0] = -1
    return codes, q


# ---- RoPE (HF Llama rotate_half convention) ------------------------------------------

def rope_cos_sin(pos, inv_freq):
    ang = pos.astype(np.float64)[..., None] * inv_freq[None, :].astype(np.float64)  # [..., d/2]
    ang = np.concatenate([ang, ang], -1)
    return np.cos(ang), np.sin(ang)


def rot_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def unrope(k, cos, sin):
    return k * cos - rot_half(k) * sin


def rope(k, cos, sin):
    return k * cos + rot_half(k) * sin


# ---- calibration ---------------------------------------------------------------------

def cache_of(model, torch, hf, prompt_ids, n_gen):
    """A's cache (bf16-rounded, float32 numpy [L, H, T, d] K and V) after the
    prompt and n_gen greedy steps, as eval.agent_a builds it (no attention
    capture needed for calibration)."""
    ids = torch.tensor([prompt_ids])
    n = ids.shape[1]
    out = model(input_ids=ids, position_ids=torch.arange(n).unsqueeze(0), use_cache=True, logits_to_keep=1)
    for s in range(n_gen):
        nxt = int(out.logits[0, -1].argmax())
        out = model(input_ids=torch.tensor([[nxt]]), **{hf.cache_kwarg(model): hf.output_cache(out)},
                    position_ids=torch.tensor([[n + s]]), use_cache=True)
    pairs = hf.cache_layers(hf.output_cache(out))
    K = np.stack([k[0].to(torch.bfloat16).float().numpy() for k, _ in pairs])
    V = np.stack([v[0].to(torch.bfloat16).float().numpy() for _, v in pairs])
    return K, V


def calibration_data(tok, ev, n_calib, eval_samples_max, seed):
    """Continuation windows NOT among the evaluated ones (seed 0, up to
    eval_samples_max), and retrieval fact sheets from another seed."""
    texts, _ = ev.reference_text()
    w = 192 + 16
    windows = []
    for text in texts:
        ids = tok(text, add_special_tokens=False).input_ids
        windows += [ids[s:s + w] for s in range(0, len(ids) - w + 1, w)]
    used = set()
    for k in sorted({eval_samples_max, 100, 50}):
        for p in random.Random(0).sample(windows, k):
            used.add(tuple(p))
    rest = [p for p in windows if tuple(p) not in used]
    random.Random(seed).shuffle(rest)
    cont = [p[:192] for p in rest[:n_calib]]
    ret = [s[0] for s in ev.retrieval_samples(tok, n_calib, 12, seed + 7919)]
    ev_ret = {tuple(s[0]) for s in ev.retrieval_samples(tok, max(eval_samples_max, 100), 12, 0)}
    ret = [r for r in ret if tuple(r) not in ev_ret]
    return cont, ret


class Profile:
    """Per (layer, head, kind) mean, basis, variances and distortion curves.
    kinds: 0 = K post-RoPE, 1 = K pre-RoPE, 2 = V."""

    def __init__(self, X, sub=4000, seed=0):
        # X: list over kinds of [L, H, N, d]
        L, H, N, d = X[0].shape
        self.L, self.H, self.d = L, H, d
        self.mu = np.zeros((3, L, H, d))
        self.U = np.zeros((3, L, H, d, d))
        self.lam = np.zeros((3, L, H, d))
        self.D = np.zeros((3, L, H, d, BMAX + 1))      # MSE per component per bits (calibration)
        self.P = {}                                    # calibration code distributions, filled lazily
        rng = np.random.default_rng(seed)
        sel = rng.choice(N, min(sub, N), replace=False)
        self.sub = {}
        for kind in range(3):
            for l in range(L):
                for h in range(H):
                    x = X[kind][l, h].astype(np.float64)
                    mu = x.mean(0)
                    xc = x - mu
                    C = xc.T @ xc / len(x)
                    lam, U = np.linalg.eigh(C)
                    o = np.argsort(lam)[::-1]
                    lam, U = np.maximum(lam[o], 1e-12), U[:, o]
                    self.mu[kind, l, h], self.U[kind, l, h], self.lam[kind, l, h] = mu, U, lam
                    c = xc[sel] @ U                       # [sub, d]
                    self.sub[kind, l, h] = c
                    sig = np.sqrt(lam)
                    self.D[kind, l, h, :, 0] = (c ** 2).mean(0)
                    for b in range(1, BMAX + 1):
                        u = c / sig
                        q = CODEBOOKS[b][quantize(u, b)] * sig
                        self.D[kind, l, h, :, b] = ((c - q) ** 2).mean(0)

    def energy_report(self):
        out = {}
        for kind, name in ((0, "K post-RoPE"), (1, "K pre-RoPE"), (2, "V")):
            lam = self.lam[kind]
            frac = np.cumsum(lam, -1) / lam.sum(-1, keepdims=True)
            out[name] = {f"top{r}": float(frac[..., r - 1].mean()) for r in (4, 8, 16, 32)}
        return out


# ---- bit allocation ------------------------------------------------------------------

def greedy(Dcurves, weights, budget):
    """Dcurves: [M, d, BMAX+1] for M units; weights [M]; budget bits (per row,
    summed over the M units). Greedy marginal-return allocation (optimal for
    convex curves; reverse water-filling in the Gaussian case)."""
    M, d, _ = Dcurves.shape
    bits = np.zeros((M, d), np.int64)
    heap = []
    for m in range(M):
        for i in range(d):
            g = weights[m] * (Dcurves[m, i, 0] - Dcurves[m, i, 1])
            heap.append((-g, m, i))
    heapq.heapify(heap)
    spent = 0
    while spent < budget and heap:
        g, m, i = heapq.heappop(heap)
        b = bits[m, i] + 1
        bits[m, i] = b
        spent += 1
        if b < BMAX:
            heapq.heappush(heap, (-weights[m] * (Dcurves[m, i, b] - Dcurves[m, i, b + 1]), m, i))
    return bits


def allocate(prof, cfg):
    """bits [2 (K,V), L, H, d] for a policy config."""
    L, H, d = prof.L, prof.H, prof.d
    kk = 1 if cfg["rope"] == "pre" else 0
    DK, DV = prof.D[kk], prof.D[2]                          # [L, H, d, B+1]
    # bits per (unit, row) on average; a raw bf16 sink token (sink0) is paid
    # for out of the budget at 0.7% of full (its share at ~148 tokens per turn)
    per_row = (cfg["budget"] - (0.007 if cfg.get("sink0") else 0.0)) * 16 * d - 0.7
    side = 16 if cfg.get("rowscale") else 0
    scope = cfg["scope"]
    bits = np.zeros((2, L, H, d), np.int64)
    if scope == "lh":   # every (layer, head, kind) the same budget
        for t, D in enumerate((DK, DV)):
            for l in range(L):
                for h in range(H):
                    bits[t, l, h] = greedy(D[l, h][None], np.ones(1), int(math.floor(per_row - side)))[0]
        return bits
    # pooled scopes
    D = np.stack([DK, DV])                                   # [2, L, H, d, B+1]
    tot = D[..., 0].sum(-1)                                  # [2, L, H] total variance per unit
    if scope == "global_abs":
        w = np.ones_like(tot)
    elif scope == "global_rel":
        w = 1.0 / tot
    else:
        raise ValueError(scope)
    kf = cfg.get("kfrac")
    if kf is None:
        budget = int(math.floor((per_row - side) * 2 * L * H))
        b = greedy(D.reshape(-1, d, BMAX + 1), w.reshape(-1), budget)
        return b.reshape(2, L, H, d)
    for t in range(2):
        budget = int(math.floor((per_row * 2 * (kf if t == 0 else 1 - kf) - side) * L * H))
        bits[t] = greedy(D[t].reshape(-1, d, BMAX + 1), w[t].reshape(-1), budget).reshape(L, H, d)
    return bits


# ---- codec ---------------------------------------------------------------------------

def encode_decode(x, prof, kind, l, h, b, rowscale):
    """x: [n, d] float64 (pre-RoPE keys already un-rotated if kind==1).
    returns (decoded [n, d], codes [n, d] with -1 for dropped)."""
    mu, U, lam = prof.mu[kind, l, h], prof.U[kind, l, h], prof.lam[kind, l, h]
    sig = np.sqrt(lam)
    c = (x - mu) @ U
    s = np.ones((len(x), 1))
    if rowscale:   # fp16 per-row scale: rms of the row's coefficients vs the calibrated one
        s = np.sqrt((c ** 2).sum(1, keepdims=True) / lam.sum())
        s = np.maximum(s.astype(np.float16).astype(np.float64), 1e-6)
    u = c / (sig * s)
    codes, q = quantize_mixed(u, b)
    chat = q * sig * s
    return chat @ U.T + mu, codes


def codec_message(m_full, prof, cfg, bits, inv_freq, hist):
    """A copy of the full message with every K/V row encoded and decoded."""
    from kvrelay import types
    m = copy.copy(m_full)
    layers = []
    kk = 1 if cfg["rope"] == "pre" else 0
    raw0 = cfg.get("sink0", False)
    for l, ml in enumerate(m_full.layers):
        K = types.to_f32(ml.k, m_full.dtype).astype(np.float64)
        V = types.to_f32(ml.v, m_full.dtype).astype(np.float64)
        Kd, Vd = np.empty_like(K), np.empty_like(V)
        for h in range(K.shape[0]):
            pos = np.asarray(ml.pos[h])
            k = K[h]
            if kk == 1:
                cos, sin = rope_cos_sin(pos, inv_freq)
                k = unrope(k, cos, sin)
            kd, kc = encode_decode(k, prof, kk, l, h, bits[0, l, h], cfg.get("rowscale"))
            vd, vc = encode_decode(V[h], prof, 2, l, h, bits[1, l, h], cfg.get("rowscale"))
            if kk == 1:
                kd = rope(kd, cos, sin)
            if raw0:
                z = pos == 0
                kd[z], vd[z] = K[h][z], V[h][z]
                kc, vc = kc[~z], vc[~z]
            Kd[h], Vd[h] = kd, vd
            if hist is not None:
                for t, cds in ((0, kc), (1, vc)):
                    d = cds.shape[1]
                    idx = (cds + 256 * np.arange(d))[cds >= 0]
                    hist[t, l, h] += np.bincount(idx, minlength=256 * d).reshape(d, 256)
        # float32 arrays: message_to_cache rounds them to the message dtype (bf16)
        layers.append(types.MessageLayer(k=Kd.astype(np.float32), v=Vd.astype(np.float32), pos=ml.pos))
    m.layers = layers
    return m


def packed_ratio(bits, n_tokens, cfg, L, H, d):
    """sent bytes / full bf16 bytes for one message of n_tokens rows per head."""
    # a layer's codes for one token (every head, K and V, and any row scales)
    # packed contiguously, rounded up to whole bytes
    per_layer_bits = bits.sum(-1).sum((0, 2)) + (16 * 2 * H if cfg.get("rowscale") else 0)  # [L]
    per_tok = np.ceil(per_layer_bits / 8).sum()
    full_tok = 2 * L * H * d * 2
    n_raw = 1 if cfg.get("sink0") else 0
    return ((n_tokens - n_raw) * per_tok + n_raw * full_tok) / (n_tokens * full_tok)


def entropy_bits_per_token(hist, bits, cfg, static=None):
    """Order-0 entropy of each component's codes over the evaluated rows,
    summed over components: bits per token (+ row scales uncompressed).
    static: calibration histograms -> cross-entropy with a static table
    (what an entropy coder with tables in the profile would spend)."""
    h = hist.astype(np.float64)
    n = h.sum(-1, keepdims=True)
    on = (bits > 0) & (n[..., 0] > 0)
    p = h / np.maximum(n, 1)
    if static is None:
        lg = np.where(h > 0, np.log2(np.where(h > 0, p, 1)), 0)
        e = -(p * lg).sum(-1)
    else:
        valid = np.arange(256)[None, None, None, None, :] < (2 ** bits)[..., None]
        q = np.where(valid, static + 0.5, 0)
        q = q / np.maximum(q.sum(-1, keepdims=True), 1e-300)
        e = -(p * np.log2(np.where(valid, q, 1))).sum(-1)
    tot = float(e[on].sum())
    L, H = bits.shape[1], bits.shape[2]
    if cfg.get("rowscale"):
        tot += 16 * 2 * L * H
    return tot


def calib_hist(prof, bits, cfg):
    """code histograms of the calibration subsample under this allocation."""
    kk = 1 if cfg["rope"] == "pre" else 0
    out = np.zeros(bits.shape + (256,), np.int64)
    for t, kind in ((0, kk), (1, 2)):
        for l in range(prof.L):
            for h in range(prof.H):
                c = prof.sub[kind, l, h]
                sig = np.sqrt(prof.lam[kind, l, h])
                s = 1.0
                if cfg.get("rowscale"):
                    s = np.sqrt((c ** 2).sum(1, keepdims=True) / prof.lam[kind, l, h].sum())
                u = c / (sig * s)
                for i in np.nonzero(bits[t, l, h])[0]:
                    out[t, l, h, i] = np.bincount(quantize(u[:, i], bits[t, l, h, i]), minlength=256)[:256]
    return out


# ---- main ----------------------------------------------------------------------------

VARIANTS = {
    "post,lh": {"rope": "post", "scope": "lh"},
    "pre,lh": {"rope": "pre", "scope": "lh"},
    "pre,lh,rowscale": {"rope": "pre", "scope": "lh", "rowscale": True},
    "pre,global_abs": {"rope": "pre", "scope": "global_abs"},
    "pre,global_rel": {"rope": "pre", "scope": "global_rel"},
    "pre,rel,k=0.5": {"rope": "pre", "scope": "global_rel", "kfrac": 0.5},
    "pre,rel,k=0.35": {"rope": "pre", "scope": "global_rel", "kfrac": 0.35},
    "pre,rel,k=0.65": {"rope": "pre", "scope": "global_rel", "kfrac": 0.65},
    "pre,global_rel,rowscale": {"rope": "pre", "scope": "global_rel", "rowscale": True},
    "pre,global_rel,sink0": {"rope": "pre", "scope": "global_rel", "sink0": True},
    "pre,global_rel,rowscale,sink0": {"rope": "pre", "scope": "global_rel", "rowscale": True, "sink0": True},
    "pre,rel,k=0.35,rowscale,sink0": {"rope": "pre", "scope": "global_rel", "kfrac": 0.35, "rowscale": True,
                                      "sink0": True},
    "post,global_rel,rowscale": {"rope": "post", "scope": "global_rel", "rowscale": True},
    "post,global_rel,rowscale,sink0": {"rope": "post", "scope": "global_rel", "rowscale": True, "sink0": True},
}


def policies(budgets, variants):
    """variants: keys of VARIANTS (run at every budget) or BUDGET:KEY (at that budget only)."""
    P = []
    for v in variants:
        bs = budgets
        if ":" in v:
            b, v = v.split(":", 1)
            bs = [float(b)]
        for B in bs:
            P.append(dict(VARIANTS[v], name=f"pca{int(round(B * 100))}:{v}", budget=B))
    return P


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--calib", type=int, default=60, help="calibration turns per task")
    ap.add_argument("--calib-seed", type=int, default=4242)
    ap.add_argument("--budgets", default="0.10,0.15,0.20")
    ap.add_argument("--kvrelayctl", default="build/bin/kvrelayctl")
    ap.add_argument("--baselines", default="full,gen,full+lloyd:bits=2")
    ap.add_argument("--variants", default="post,lh;pre,lh;pre,global_rel;pre,global_rel,rowscale;pre,global_rel,sink0",
                    help="';'-separated keys of VARIANTS")
    ap.add_argument("--out", default="results.json")
    a = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    from kvrelay import eval as ev, hf, models
    t0 = time.perf_counter()
    model, tok = models.load("smollm2")
    kv_heads = model.config.num_key_value_heads
    inv_freq = model.model.rotary_emb.inv_freq.double().numpy()
    assert float(model.model.rotary_emb.attention_scaling) == 1.0
    print(f"model {time.perf_counter() - t0:.1f}s", flush=True)

    # calibration (cached: the profile depends only on --calib and --calib-seed)
    import pickle
    pf = f"profile_c{a.calib}_s{a.calib_seed}.pkl"
    if os.path.exists(pf):
        prof = pickle.load(open(pf, "rb"))
        print(f"profile loaded from {pf}", flush=True)
    else:
        prof = fit_profile(a, tok, ev, model, torch, hf, inv_freq)
        pickle.dump(prof, open(pf, "wb"))
    print(f"profile (shared offline, not counted): {prof_size(prof)}", flush=True)
    run_eval(a, prof, model, tok, ev, hf, torch, inv_freq, kv_heads, t0)


def prof_size(prof):
    """bytes per model of what a codec profile ships: mean + basis (fp16) + per-component std (fp16)
    per (layer, head, kind) plus the bit allocation (1 byte per component)."""
    L, H, d = prof.L, prof.H, prof.d
    units = 2 * L * H
    b = units * (d * 2 + d * d * 2 + d * 2 + d)
    return f"{units} bases of {d}x{d}: {b} bytes ({b / 2**20:.2f} MiB) in fp16"


def fit_profile(a, tok, ev, model, torch, hf, inv_freq):
    t1 = time.perf_counter()
    cont, ret = calibration_data(tok, ev, a.calib, a.samples, a.calib_seed)
    Ks, Kp, Vs = [], [], []
    with torch.no_grad():
        for p in cont + ret:
            K, V = cache_of(model, torch, hf, p, 4)
            T = K.shape[2]
            cos, sin = rope_cos_sin(np.arange(T), inv_freq)
            Ks.append(K)
            Kp.append(unrope(K.astype(np.float64), cos, sin).astype(np.float32))
            Vs.append(V)
    X = [np.concatenate(x, 2) for x in (Ks, Kp, Vs)]
    del Ks, Kp, Vs
    print(f"calibration: {len(cont)} + {len(ret)} turns, {X[0].shape[2]} rows per head, "
          f"{time.perf_counter() - t1:.1f}s", flush=True)
    t1 = time.perf_counter()
    prof = Profile(X)
    del X
    print(f"profile fitted {time.perf_counter() - t1:.1f}s; energy {json.dumps(prof.energy_report())}", flush=True)
    return prof


def run_eval(a, prof, model, tok, ev, hf, torch, inv_freq, kv_heads, t0):

    budgets = [float(x) for x in a.budgets.split(",")]
    pols = policies(budgets, a.variants.split(";"))
    L, H, d = prof.L, prof.H, prof.d
    allocs, hists = {}, {}
    for p in pols:
        allocs[p["name"]] = allocate(prof, p)
        hists[p["name"]] = np.zeros((2, L, H, d, 256), np.int64)
        b = allocs[p["name"]]
        print(f"  {p['name']}: K bits/row {b[0].sum(-1).mean():.1f}, V {b[1].sum(-1).mean():.1f}, "
              f"K comps kept {(b[0] > 0).sum(-1).mean():.1f}, V {(b[1] > 0).sum(-1).mean():.1f}, "
              f"max bits {b.max()}", flush=True)

    # evaluation, as kvrelay.eval.run
    baselines = a.baselines.split(",")
    names = baselines + [p["name"] for p in pols]
    data = {"continuation": ev.continuation_samples(tok, a.samples, 192, 16, 0),
            "retrieval": ev.retrieval_samples(tok, a.samples, 12, 0, 4)}
    relay = ev.OfflineRelay(a.kvrelayctl, 1)
    res = {t: {"scores": {n: [] for n in names}, "ratios": {n: [] for n in names}, "ntok": []} for t in data}
    t_eval = time.perf_counter()

    def dump(i):
        out = {"args": vars(a), "samples_done": i, "seconds": time.perf_counter() - t0,
               "eval_seconds": time.perf_counter() - t_eval,
               "energy": prof.energy_report(), "policies": pols, "tasks": {}}
        for t, r in res.items():
            rows = {}
            for n in names:
                g, se = ev.gap_closed(r["scores"][n], r["scores"]["full"], r["scores"]["gen"])
                rows[n] = {"gap": g, "se": se, "score": float(np.mean(r["scores"][n])),
                           "bytes": float(np.mean(r["ratios"][n]))}
            out["tasks"][t] = {"rows": rows, "mean_tokens": float(np.mean(r["ntok"])), "per_sample": r["scores"]}
        ent = {}
        for p in pols:
            b = allocs[p["name"]]
            full_tok = 2 * L * H * d * 16
            e_emp = entropy_bits_per_token(hists[p["name"]], b, p)
            e_sta = entropy_bits_per_token(hists[p["name"]], b, p, static=calib_hist_cache[p["name"]])
            ent[p["name"]] = {"empirical": e_emp / full_tok, "static": e_sta / full_tok,
                              "packed_codes": (b.sum() + (32 * L * H if p.get("rowscale") else 0)) / full_tok}
        out["entropy"] = ent
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        return out

    TIM = {"A": 0.0, "codec": 0.0, "B": 0.0}
    calib_hist_cache = {p["name"]: calib_hist(prof, allocs[p["name"]], p) for p in pols}
    try:
        for i in range(a.samples):
            for task, ds in data.items():
                s = ds[i]
                r = res[task]
                with torch.no_grad():
                    tt = time.perf_counter()
                    turn, _ = ev.agent_a(model, torch, hf, s[0], 4, kv_heads)
                    TIM["A"] += time.perf_counter() - tt
                    relay.load(turn)
                    m_full = None
                    for n in names:
                        tt = time.perf_counter()
                        if n in baselines:
                            m = relay.compress(n)
                            ratio = m.accounting.sent_bytes / m.accounting.full_bytes
                            if n == "full":
                                m_full = m
                                r["ntok"].append(m.tokens)
                                m = copy.copy(m)
                        else:
                            p = next(q for q in pols if q["name"] == n)
                            m = codec_message(m_full, prof, p, allocs[n], inv_freq, hists[n])
                            ratio = packed_ratio(allocs[n], m_full.tokens, p, L, H, d)
                        r["ratios"][n].append(ratio)
                        TIM["codec"] += time.perf_counter() - tt
                        tt = time.perf_counter()
                        relayed = ev.float32_cache(torch, hf, hf.message_to_cache(m))
                        if task == "continuation":
                            logits = ev.agent_b(model, torch, relayed, s[1])
                            r["scores"][n].append(ev.score_continuation(torch, logits, s[1]))
                        else:
                            logits = ev.agent_b(model, torch, relayed, s[1] + s[2][:-1])
                            r["scores"][n].append(ev.score_retrieval(torch, logits, s[1], s[2]))
                        TIM["B"] += time.perf_counter() - tt
            if (i + 1) % 5 == 0 or i + 1 == a.samples or i < 2:
                out = dump(i + 1)
                print(f"{i + 1}/{a.samples} {time.perf_counter() - t_eval:.0f}s "
                      + " ".join(f"{k} {v:.0f}s" for k, v in TIM.items()), flush=True)
    finally:
        relay.close()
    out = dump(a.samples)
    for t in out["tasks"]:
        print(t)
        for n, row in out["tasks"][t]["rows"].items():
            print(f"  {n:40s} bytes {row['bytes'] * 100:5.1f}%  gap {row['gap']}  se {row['se']}")


if __name__ == "__main__":
    main()
