"""results.json -> the markdown table of RESULTS.md."""
import json
import sys

d = json.load(open(sys.argv[1] if len(sys.argv) > 1 else "results.json"))
T = d["tasks"]
c, r = T["continuation"], T["retrieval"]
ntok = {t: T[t]["mean_tokens"] for t in T}
pols = {p["name"]: p for p in d["policies"]}
print(f"samples per task: {d['samples_done']}; mean tokens per turn: continuation {ntok['continuation']:.0f}, "
      f"retrieval {ntok['retrieval']:.0f}; Full: continuation {c['rows']['full']['score']:.3f} (minus mean loss, nats), "
      f"retrieval {r['rows']['full']['score']:.2f}; Gen: {c['rows']['gen']['score']:.3f}, {r['rows']['gen']['score']:.2f}")
print()
print("| policy | bytes % of bf16, packed (cont / retr) | entropy-coded estimate, static tables (empirical) | "
      "continuation gap closed ± se | retrieval gap closed ± se |")
print("|---|---:|---:|---:|---:|")


def f(x, se):
    return "n/a" if x is None else f"{x:.2f} ± {se:.2f}" if se is not None else f"{x:.2f}"


for n in c["rows"]:
    bc, br = c["rows"][n]["bytes"] * 100, r["rows"][n]["bytes"] * 100
    b = f"{bc:.1f}" if abs(bc - br) < 0.05 else f"{bc:.1f} / {br:.1f}"
    e = "–"
    if n in d.get("entropy", {}):
        en = d["entropy"][n]
        nbar = (ntok["continuation"] + ntok["retrieval"]) / 2
        adj = (lambda x: x * (1 - 1 / nbar) + 1 / nbar) if pols[n].get("sink0") else (lambda x: x)
        e = f"{adj(en['static']) * 100:.1f} ({adj(en['empirical']) * 100:.1f})"
    print(f"| `{n}` | {b} | {e} | {f(c['rows'][n]['gap'], c['rows'][n]['se'])} | "
          f"{f(r['rows'][n]['gap'], r['rows'][n]['se'])} |")
print()
print(f"eval wall time {d['eval_seconds'] / 60:.1f} min (run total {d['seconds'] / 60:.1f} min)")
