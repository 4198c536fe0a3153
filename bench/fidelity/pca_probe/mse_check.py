"""Calibration-set relative MSE (sum distortion / sum variance) of K (pre-RoPE) and V per allocation,
from the profile's measured distortion curves; vs Gaussian Lloyd-Max at 2, 3, 4 bits per coordinate."""
import pickle, sys, numpy as np
sys.argv = ["x"]
import pca_probe as pp
import __main__; __main__.Profile = pp.Profile
prof = pickle.load(open("profile_c60_s4242.pkl", "rb"))
for b in (1, 2, 3, 4):
    print(f"scalar Lloyd-Max N(0,1) {b} bits: rel MSE {((np.random.default_rng(0).standard_normal(200000) - pp.CODEBOOKS[b][pp.quantize(np.random.default_rng(0).standard_normal(200000), b)])**2).mean():.4f}")
lam = prof.lam
for kind, nm in ((0, "K post"), (1, "K pre"), (2, "V")):
    l = lam[kind]
    gain = 0.5 * np.log2(l.mean(-1) / np.exp(np.log(l).mean(-1)))
    print(f"{nm}: PCA coding gain 0.5*log2(AM/GM) = {gain.mean():.2f} bits/elem (layer-head mean, min {gain.min():.2f}, max {gain.max():.2f})")
for B in (0.10, 0.15, 0.20):
    for v in ("post,lh", "pre,lh", "pre,global_rel", "pre,global_abs"):
        cfg = dict(pp.VARIANTS[v], budget=B)
        bits = pp.allocate(prof, cfg)
        kk = 1 if cfg["rope"] == "pre" else 0
        out = []
        for t, kind in ((0, kk), (1, 2)):
            D = prof.D[kind]
            dist = np.take_along_axis(D, bits[t][..., None], -1)[..., 0]
            rel = dist.sum(-1) / D[..., 0].sum(-1)
            out.append(f"{'KV'[t]} rel MSE mean {rel.mean():.4f} (worst layer-head {rel.max():.4f})")
        print(f"pca{int(B*100)}:{v}: " + "; ".join(out))
