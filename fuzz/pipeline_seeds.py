#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_pipeline (fuzz/corpus/pipeline/).

pipeline_fuzzer.cc reads its choices with FuzzedDataProvider, which takes
each integer from the end of the input: a choice in [lo, hi] with
hi - lo < 256 is one byte b read as lo + b % (hi - lo + 1). A seed is the
list of choices in the order the fuzzer makes them, reversed. The seeds
are the overflow cases (keys and queries whose products overflow float32,
scores whose group sums do) and ordinary turns with history.

usage: fuzz/pipeline_seeds.py [OUT_DIR]
"""
import os
import random
import sys


class Seed:
    def __init__(self):
        self.choices = []

    def pick(self, lo, hi, v):
        assert lo <= v <= hi and hi - lo < 256
        self.choices.append(v - lo)

    def flag(self, b):
        self.choices.append(1 if b else 0)

    def bytes(self):
        return bytes(reversed(self.choices))


KINDS = ["full", "gen", "h2o-head", "h2o-layer", "h2o-auto"]
VALUE_SCALES = [1.0, 1e-30, 1e-40, 1e4, 1e17, 1e19, 1e20, 3e38]


def selector(s, queries, kind, k=None, hist=None):
    s.pick(0, 4, KINDS.index(kind))
    if kind == "full":
        return
    s.flag(False)  # sinks
    if kind == "gen":
        return
    s.flag(k is not None)
    if k is not None:
        s.pick(0, 40, k)
    s.flag(False)  # recent
    s.flag(False)  # pool
    if queries:
        s.flag(False)  # window
    s.flag(hist is not None)
    if hist is not None:
        s.pick(0, 12, hist)
    if kind == "h2o-auto":
        s.flag(False)  # tau


def tensor(s, rng, count, scale, mode):
    s.pick(0, 7, VALUE_SCALES.index(scale))
    s.pick(0, 2, mode)
    for _ in range(count):
        if mode == 0:
            s.pick(0, 12, rng.randrange(13))
        else:
            s.pick(-8, 8, rng.randrange(-8, 9))
            if mode == 2:
                s.pick(0, 255, rng.randrange(256))


def seed(name, rng, queries, kind, k=None, hist=None, obf=False, quant=None, dtype=0, heads=2, group=2,
         d_log2=4, n_prompt=40, n_gen=4, n_hist=0, anchor=False, hist_acc=False, hist_score=False,
         scale_index=None, kq=(1.0, 2), score=(1.0, 2)):
    s = Seed()
    s.flag(queries)
    selector(s, queries, kind, k, hist)
    if kind.startswith("h2o"):
        s.flag(obf)
        if obf:
            s.pick(1, 6, 2)       # p
            s.flag(True)          # mode=fast
            s.flag(False)         # inject=uniform
            s.pick(0, 3, 0)       # scale=ad_over_as
            s.pick(1, 12, 4)      # iters
    s.flag(quant is not None)
    if quant is not None:
        s.pick(0, 2, quant)       # int8, int4, int2
        s.pick(1, 40, 8)          # group
        s.flag(False)             # rotate=none
    s.pick(0, 2, dtype)
    s.pick(1, 2, 1)               # layers
    s.pick(1, 3, heads)
    s.pick(1, 3, group)
    s.pick(0, 4, d_log2)
    s.pick(0, 48, n_prompt)
    s.pick(0, 6, n_gen)
    s.pick(0, 10, n_hist)
    s.flag(True)                  # q_dtype F32
    if n_hist:
        s.flag(anchor)
        s.flag(hist_acc)
        if not queries:
            s.flag(hist_score)
    s.flag(True)                  # first_agent
    s.pick(0, 3, 1)               # prompt_pos0 - 2 n_hist
    if queries:
        s.flag(scale_index is not None)
        if scale_index is not None:
            s.pick(0, 5, scale_index)
    d = 1 << d_log2
    for part, n in (("prompt_k", n_prompt), ("prompt_v", n_prompt), ("gen_k", n_gen), ("gen_v", n_gen),
                    ("history_k", n_hist), ("history_v", n_hist)):
        big = part in ("prompt_k", "gen_k", "history_k")
        tensor(s, rng, heads * n * d, kq[0] if big else 1.0, kq[1] if big else 2)
    if queries:
        tensor(s, rng, heads * group * n_gen * d, kq[0], kq[1])
    else:
        tensor(s, rng, heads * group * n_prompt, score[0], score[1])
    if n_hist and hist_acc:
        tensor(s, rng, heads * n_hist, 1.0, 2)
    if n_hist and hist_score:
        tensor(s, rng, heads * group * n_hist, score[0], score[1])
    return name, s.bytes()


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus", "pipeline")
    os.makedirs(out, exist_ok=True)
    rng = random.Random(26)
    seeds = [
        # q.k overflows float32: NaN attention once broke the selection.
        seed("overflow_h2o_head", rng, True, "h2o-head", k=8, kq=(1e20, 2)),
        seed("overflow_h2o_layer_bf16", rng, True, "h2o-layer", k=8, dtype=2, kq=(1e19, 2)),
        seed("overflow_auto_obf_scale", rng, True, "h2o-auto", k=6, obf=True, kq=(1e17, 2), scale_index=5),
        seed("overflow_int4", rng, True, "h2o-head", k=8, quant=1, kq=(1e20, 1)),
        # A group's sum of float32 scores overflows float32.
        seed("score_sum_overflow", rng, False, "h2o-head", k=8, group=3, score=(3e38, 0)),
        seed("history_score_overflow", rng, False, "h2o-layer", k=4, hist=2, n_hist=6, anchor=True,
             hist_acc=True, hist_score=True, score=(3e38, 0)),
        # Ordinary turns with history, the budget, OBF and quantization.
        seed("history_queries", rng, True, "h2o-head", k=5, hist=3, n_hist=8, anchor=True, hist_acc=True,
             obf=True, quant=2),
        seed("edges_f16", rng, False, "h2o-head", k=8, dtype=1, kq=(1.0, 0), score=(1.0, 0)),
        seed("subnormal", rng, True, "h2o-layer", k=8, kq=(1e-40, 2)),
    ]
    for name, data in seeds:
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print(f"pipeline_seeds: {len(seeds)} seeds in {out}")


if __name__ == "__main__":
    main()
