#!/usr/bin/python3
"""End-to-end check of `kvrelayctl compress` against the numpy reference.

Run:
    /usr/bin/python3 tests/reference/test_reference.py --kvrelayctl build/bin/kvrelayctl [-v]
    (--seeds N changes the number of random seeds, default 60)

Only the standard library and numpy are used.  Each case writes a random turn
(.safetensors) in a temporary directory, runs

    kvrelayctl compress --policy SPEC --in TURN --out MSG [--decode]

and compares the message with tests/reference/kvrelay_ref.py.

Tolerances (all relative to quantities of the row being compared):
  * K, positions, history/anchor/generated rows, and every row of a policy
    without OBF: bit-identical.
  * OBF mode=exact, kept candidate rows: for each element,
        |a - b| <= 1e-5 * max(|b|, rowscale) + ulp_dtype(max(|a|, |b|))
    where b is the reference float64 value before rounding and rowscale =
    max(||b_row||, ||v_orig_row||, ||increment_row||) / sqrt(d), i.e. the RMS
    magnitude of the operands of V_t + delta.  The ulp term allows the one
    rounding to the output dtype to land on either neighbour (1 ulp for
    BF16/F16, negligible for F32).
  * OBF mode=fast vs the exact reference, per row:
        ||a - b||_2 <= 1e-3 * max(||b_row||, ||v_orig_row||) + ||ulp_dtype(b_row)||_2
                       + 10 * conv * |coef_t * factor| * ||rbar||
    with conv = (sigma_{m+1}(R) / sigma_p(R))^(2*iters), m = p + oversample:
    the convergence factor of `iters` steps of subspace iteration.  It is
    negligible unless R's spectrum has no gap after sigma_p (then 12
    iterations cannot converge and a correct fast path can be ~1e-3 off).
  * Quantized (packed) output, decoded here in float64 from the CLI's own
    codes/scales/zeros, against the CLI's unquantized message x (same policy
    without the quantizer stage):  in the (rotated) quantization domain,
        |e_i| <= s_i / 2 + 1e-6 * (||x_row||_2 + |z_i|)
    (the second term only absorbs float32 rounding of the C++ rotation and
    arithmetic).  Zero points must equal the reference's exactly without
    rotation, scales within 1 fp16 ulp (f32 division before directed
    rounding); with rotation, within 1 fp16 ulp plus the float32 rotation
    error 4*log2(d)*2^-24*||x_row||_2 carried through min/max and the scale
    formula.  Codes must equal the
    reference's wherever the stats agree and the value is not within 1e-3
    (+ f32 slack) of a rounding tie.
  * `--decode` output vs the packed output decoded here: 1 ulp of the output
    dtype + 1e-6 * (||row||_2 + |zero|) for float32 arithmetic.
  * Metadata n_history, n_anchor, n_kept, n_gen, full_bytes, sent_bytes: exact.
    With window=, the policy metadata's selector stage must be the canonical
    form (window= after pool, FORMAT.md "Policy specs").

Turns with gen.q instead of prompt.score (1 random seed in 3, and the
QueryScoreCases class).  The reference computes the scores of FORMAT.md
step 0 in float64; kvrelay computes dot products and exponentials in float32
(accumulating in float64), documented as matching to "about 1e-6 relative".
That precision depends on the logits: a float32 dot product is off by about
sqrt(d) * 2^-24 * sum_c |q_c k_c| (rounding errors of a random walk), the
softmax weight's relative error is about the logit's absolute one.  So for
layer l we assume every kvrelay score is within
        eps_l = max(1e-5, 4 * sqrt(d) * 2^-24 * B_l)
relative of ours, B_l = softmax_scale * max over score heads, steps and keys
of sum_c |q_c| |k_c| (query_eps(); 1e-5 is 10x the documented precision, and
a float32 emulation of step 0 -- BLAS and sequential dot products -- stayed
within 0.97 * sqrt(d) * 2^-24 * B_l, up to 7e-6, on the random cases), plus
QUERY_ABS = 1e-30 absolute for weights that float32 flushes or rounds near its
smallest normal.  Then:
  * Selection.  For each top-k decision (h2o-head: each layer and head, on
    A[h]; h2o-layer: each layer, on A_layer) with k smaller than the top-k
    range, let p_k and p_k+1 be the k-th and (k+1)-th largest selection
    scores P (after pooling) in the range.  If
        |p_k - p_k+1| < eps_l * max(|p_k|, |p_k+1|) + QUERY_ABS
    the reference's set is ambiguous at kvrelay's precision.  There, and only
    there, a different kept set from kvrelayctl is accepted when it is a
    plausible top-k: the recent window is kept, exactly k positions of the
    range, and min over kept j of P_j (1 + eps_l) + QUERY_ABS >= max over
    dropped j of P_j (1 - eps_l) - QUERY_ABS.  The reference is then
    recomputed with kvrelayctl's set for that head / layer (compress(...,
    kept_override)), so its rows and positions are still compared as above
    (bit-exact, OBF within tolerance); -v prints each such case.  Elsewhere
    the kept positions must be identical.  (Exact ties, e.g. from equal keys,
    are inside this rule: a gap of 0 is ambiguous unless both scores are 0.)
  * OBF uses A[h] in w_j, in `factor` and in the `attn` coefficients: with
    every A[h][j] within eps = eps_l relative, `factor` and coef_t move
    by at most 2 eps relative each, and rbar by at most 2 eps max_j ||R_j||
    (deleted j; the weights' relative changes have a spread of 2 eps).  So
    the increment of kept row t moves by at most
        eps * (4 ||add_t|| + 2 |coef_t * factor| * max_j ||R_j||_2)
    which is added to the exact-OBF tolerance of every element of that row
    and to the fast-OBF row tolerance (inject=uniform has coef_t = 1; scale=
    none has factor = 1; prompt.score turns add nothing).  The fall-backs at
    sum w <= 1e-12 and sum a <= 1e-12 are assumed not to be straddled (the
    random scores are attention masses far above 1e-12, or exactly 0 when
    n_gen = 0).
  * Quantized output is checked against kvrelayctl's own unquantized
    message, so it needs nothing new.

Accumulated importance, hist=K, h2o-auto, fidelity (FORMAT.md steps 3a, 5,
5a, 6 and "Fidelity"; classes HistorySeeds, HistoryBudget, AutoGranularity,
Fidelity, Chains, and every other case's acc / anchor_pos / attention_error).
Every message is `kvrelay.message.v2` with layer.{l}.acc F32 [H, n] and
anchor_pos; granularity only under h2o-auto; attention_error only on gen.q
turns.  --hist-seeds N sets the number of random history seeds (default
seeds / 3).
  * anchor_pos, granularity, n_history after hist=K, kept history positions
    and their rows: exact (bit-identical rows).
  * acc, prompt.score turns: every input is an exact float32 and kvrelay
    rounds a float64 value once, so acc must be fl32 of the reference's
    float64 value; 1 float32 ulp is allowed (a rounding boundary or another
    float64 summation order).  Measured: every value exact.
  * acc, gen.q turns: |cli - ref| <= query_eps * mass + ulp_f32 + QUERY_ABS,
    mass = this agent's attention on the token (the received history.acc is
    exact; the mass is a sum of weights each within query_eps relative).
    Measured: at most 0.46 of that tolerance.
  * History ranking (step 5a): prompt.score turns must keep exactly the
    reference's set, or the one a float64 (unrounded) reading of acc keeps;
    gen.q turns may keep any set that keys within the acc tolerance would
    keep (plausible_hist_choice), exact ties (no mass) going to the earlier
    token.  A followed set is composed by the reference and compared as usual.
  * Granularity (step 3a): a layer whose mean entropy is within
    1e-9 relative of tau (gen.q turns: + 4 query_eps (1 + 1 / ln c), see
    gran_band()) may go either way; kvrelayctl's choice is then followed.
  * attention_error: the reference evaluates FORMAT.md's definition in
    float64 on the keys and values kvrelayctl wrote (dense output, or the
    --decode output of a quantized policy: the codes decoded into the turn's
    dtype, which is what the recipient holds), so only the figure's own
    arithmetic is compared:
        |cli - ref| <= 1e-4 * ref + F + (unit of the last printed digit) / 2
    F = mean over layers, score heads and steps of
        eps_l ((1 + e_t) sum_i w_i ||v_i|| (full) + sum_i w_i ||v_i|| (msg)) / ||o_full||,
    eps_l = 2^-24 (sqrt(d) B_l + sqrt(M) + 8) (fidelity_eps()): the first-
    order change of a step's error when the float32 weights and output sums
    are eps_l off.  A float32 emulation (numpy float32 dots, exps, sums)
    stayed within 1e-6 relative and 0.0033 F of the float64 figure;
    kvrelayctl within 0.0017 of the tolerance.
  * Determinism: FORMAT.md fixes how every number is computed and nothing
    there depends on threads or memory layout, so the same turn and policy
    must give a bit-identical message for --threads 1, 2, 4, 8 and turn
    files under paths of other lengths (class Determinism).

lloyd and demote (FORMAT.md steps 6a and 7b; classes LloydDemote,
LloydRandomSeeds, LloydRejections).  Each policy runs three times: packed,
the base policy without demote and quantizer (checked as above; its dense
values are what the quantizer saw), and --decode.  While kvrelayctl refuses
a stage with "unknown stage" naming lloyd or demote, that policy is SKIPPED
(printed, and the test reported as skipped); any other failure is an error.
  * Names, dtypes, shapes and metadata exactly as FORMAT.md: the packed
    lloyd tensors (k.scale/v.scale [H, n] row norms, or keys=channel
    k.scale/k.zero [H, ceil(n/group), d]), layer.{l}.demoted.{k,v}.codes,
    .norm [H, n_demoted, ...], pos and acc [H, n + n_demoted] (the main
    part, then the demoted tokens);
    quant_bits, quant_scheme=lloyd, quant_seed, quant_keys (quant_group with
    keys=channel; quant_scheme absent or int for intB); n_demoted and
    demote_bits with demoted tokens (absent, or n_demoted=0, without); the
    policy metadata's lloyd and demote stages in their canonical forms
    lloyd:bits=B,keys=row,seed=S, lloyd:bits=B,keys=channel,group=G,seed=S
    and demote:bits=B; sent_bytes with the demoted codes, 2-byte norms and
    4-byte positions.  Demoted positions: exactly the reference's (after
    following an ambiguous top-k as above); their acc like the kept tokens'.
  * Row norms (main part and demoted tokens): exactly fp16(||x||_2) of the
    float64 norm, round to nearest even, as FORMAT.md computes it.  A float32
    norm would be allowed 1 fp16 ulp, but FORMAT.md rules it out, so the
    only difference accepted is 1 ulp where the float64 norm lies within
    1e-12 relative of the two values' midpoint (another float64 summation
    order).
  * keys=channel means and rms: FORMAT.md fixes their rounding (fp16 of the
    mean; the rms about the fp16 mean, at least 2^-24) but not the
    arithmetic of the means, so each may be 1 fp16 ulp plus a float32 sum's
    error (c 2^-24 max|x| for the mean of c tokens, (c + 4) 2^-23 rms for
    the rms, taken about kvrelay's own mean) from the float64 reference.
  * Codes: u is recomputed here in float64 from kvrelay's own norms / stats
    and must lie in the cell of kvrelay's code widened by eps,
        t_{c-1} - eps <= u < t_c + eps,
    i.e. codes equal the exact float64 decision wherever |u - t_j| > eps for
    every threshold, and may take the neighbouring code within eps: kvrelay
    compares float32 u with float32 thresholds.  Row form: eps = 2^-22
    (log2(d) sqrt(d) + 3 |u| + 1) -- log2(d) float32 butterfly stages of the
    unnormalized transform each round values of at most sqrt(d) ||x||_2,
    i.e. log2(d) sqrt(d) 2^-24 in units of u, plus the roundings of
    float32(1 / nu), the product and the threshold (3 |u| 2^-24), times 4
    as a margin: about 1e-5 at d = 64.
    keys=channel: eps = 2^-22 (3 |u| + (|x| + |mu|) / sigma + 1) (a float32
    subtraction and division).  A float32 emulation (butterfly transform,
    float32 u, thresholds and channel sums) stayed inside on 1812016 codes
    (none took the neighbouring code; 4 of 57360 channel stats were 1 fp16
    ulp off the float64 reference).
  * Decoded values: every element lies in its code's cell (above); the
    --decode file against the packed codes decoded here in float64: 1 ulp
    of the dtype + 1e-6 ||row||_2 (row form: float32 inverse rotation) or
    1e-6 (|mu| + |sigma c|) (keys=channel); with demote, the demoted tokens
    merged into the kept ones by ascending position (n_kept + n_demoted kept
    tokens, positions and acc merged alike), a dense main part bit-exact.
  * attention_error (gen.q turns): as above, on the --decode file, i.e. with
    the demoted tokens decoded and merged (the message "as the recipient
    holds it"); a mismatch also prints the figure without them.
  * lloyd:layers=KV.KV... (LloydDemote.test_layer_bits, the layers= policies
    of LloydRandomSeeds from a generator of their own, LloydRejections):
    every check above with layer l's keys at Bk bits and its values at Bv
    (layer.{l}.k.codes [H, n, d*Bk/8], v.codes [H, n, d*Bv/8], codes and
    norms with the same bounds); quant_bits = layer 0's Bk; quant_layer_bits
    exactly the layers= value unless every layer has one B for keys and
    values (then absent; see kvrelay_ref.py on FORMAT.md's wording), absent
    on int and dense messages; the policy's lloyd stage
    lloyd:keys=row,seed=S,layers=... (keys=channel: keys=channel,group=G,
    seed=S,layers=...); sent_bytes with each tensor's own code bytes.
    Refused, naming layers: bits with layers, an entry other than two digits
    1..4, an empty entry, a count other than the turn's layers; refused: a
    layer's bits that head_dim cannot take (d * B not a multiple of 8).
"""

import math
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvrelay_ref as ref  # noqa: E402


def _pop_arg(name, default=None):
    val = default
    argv = sys.argv
    i = 1
    while i < len(argv):
        if argv[i] == name and i + 1 < len(argv):
            val = argv[i + 1]
            del argv[i:i + 2]
        elif argv[i].startswith(name + "="):
            val = argv[i].split("=", 1)[1]
            del argv[i]
        else:
            i += 1
    return val


KVRELAYCTL = _pop_arg("--kvrelayctl", os.environ.get("KVRELAYCTL"))
VERBOSE = "-v" in sys.argv[1:]
# Scores from gen.q (module docstring): the relative precision assumed of
# kvrelay's float32-computed scores is query_eps(case, l) =
# max(QUERY_EPS_MIN, QUERY_EPS_DOT * sqrt(d) * 2^-24 * B_l), and QUERY_ABS an
# absolute floor for weights that float32 flushes or rounds near its smallest
# normal (2^-126 per summed weight; 1e-30 is far above any sum of them).
QUERY_EPS_MIN = 1e-5
QUERY_EPS_DOT = 4.0
QUERY_ABS = 1e-30
N_SEEDS = int(_pop_arg("--seeds", "60"))
MAX_REPORT = 6  # detail lines per tensor

NOTES = []  # informational observations printed at the end


def note(msg):
    if msg not in NOTES:
        NOTES.append(msg)


# ---------------------------------------------------------------------------
# case construction
# ---------------------------------------------------------------------------

class Case(object):
    def __init__(self, name, tensors, meta):
        self.name = name
        self.tensors = tensors
        self.meta = meta
        self.turn = ref.Turn(tensors, meta)
        self.path = None

    def write(self, tmpdir):
        safe = "".join(c if c.isalnum() else "_" for c in self.name)
        self.path = os.path.join(tmpdir, safe + ".turn.safetensors")
        ref.write_safetensors(self.path, self.tensors, self.meta)
        return self.path


def heavy_scores(rng, S, n, zeros=False):
    kind = rng.integers(0, 3)
    if kind == 0:
        x = rng.exponential(size=(S, n)) ** 2
    elif kind == 1:
        x = rng.pareto(1.3, size=(S, n))
    else:
        x = rng.lognormal(0.0, 2.0, size=(S, n))
    if zeros:
        x[rng.random((S, n)) < 0.3] = 0.0
    # Attention-like: each row sums to (number of steps) * U(0.5, 1).
    tot = x.sum(axis=1, keepdims=True)
    tot[tot == 0] = 1.0
    x = x / tot * rng.uniform(0.5, 10.0, size=(S, 1))
    return x.astype(np.float32)


def build_case(name, rng, L, H, g, d, n_prompt, n_gen, dtype, n_hist=None,
               first_agent=None, prompt_pos0=None, scores=None, values=None,
               zeros=False, query=None, softmax_scale=None, queries=None, keys=None,
               hist_anchors=None, hist_acc=None, hist_score=None):
    """n_hist None: no history tensors.  first_agent None: metadata key absent
    (default true).  prompt_pos0 None: key absent (default n_history).

    query: None (the turn carries prompt.score) or (q_dtype, qmul): the turn
    carries gen.q in q_dtype instead, random queries with the keys' channel
    scales times qmul (or `queries[l]` when given).  softmax_scale: None (key
    absent) or the metadata string.  keys: optional per-layer prompt keys.

    History extras (FORMAT.md steps 5 / 5a), drawn after everything else so
    that cases without them draw what they drew before:
      hist_anchors: None, or a list of position ids (below max(prompt_pos0,
        n_hist)) that every head's history holds once, written as the
        history_anchors metadata; the other ids of each head stay random.
      hist_acc: None, "random" (exponential masses, some exactly 0), "ties"
        (small integers: many exact ties) or a per-layer list -> history.acc.
      hist_score: None, True (heavy-tailed, like prompt.score) or a per-layer
        list -> history.score (prompt.score turns only)."""
    layers, hist, hpos = [], [], []
    nh = n_hist or 0
    p0 = prompt_pos0 if prompt_pos0 is not None else nh
    for l in range(L):
        ch = np.exp(0.5 * rng.standard_normal(d))  # per-channel key scale (outliers)
        lay = {
            "pk": rng.standard_normal((H, n_prompt, d)) * ch,
            "pv": rng.standard_normal((H, n_prompt, d)),
            "gk": rng.standard_normal((H, n_gen, d)) * ch,
            "gv": rng.standard_normal((H, n_gen, d)),
        }
        if query is None:
            lay["score"] = heavy_scores(rng, H * g, n_prompt, zeros) if scores is None else scores[l]
        else:
            lay["q"] = (rng.standard_normal((H * g, n_gen, d)) * ch * query[1] if queries is None
                        else queries[l])
        if keys is not None:
            lay["pk"] = keys[l]
        if values is not None:
            lay["pv"] = values[l]
        layers.append(lay)
        if n_hist is not None:
            hist.append((rng.standard_normal((H, nh, d)) * ch, rng.standard_normal((H, nh, d))))
            ph = np.zeros((H, nh), dtype=np.int64)
            for h in range(H):
                hi = max(p0, nh)
                ph[h] = np.sort(rng.choice(hi, size=nh, replace=False)) if nh else []
            hpos.append(ph)
    hacc = hsc = None
    if n_hist is not None and hist_anchors is not None:
        anchors = sorted(int(x) for x in hist_anchors)
        hi = max(p0, nh)
        others = np.array([x for x in range(hi) if x not in set(anchors)], dtype=np.int64)
        for l in range(L):
            for h in range(H):
                hpos[l][h] = np.sort(np.concatenate([anchors, rng.choice(others, nh - len(anchors),
                                                                          replace=False)]))
    if n_hist is not None and hist_acc is not None:
        if isinstance(hist_acc, str):
            hacc = []
            for l in range(L):
                if hist_acc == "ties":
                    a = rng.integers(0, 4, (H, nh)).astype(np.float64)
                else:
                    a = rng.exponential(size=(H, nh)) * rng.uniform(0.5, 5.0)
                    a[rng.random((H, nh)) < 0.1] = 0.0
                hacc.append(a.astype(np.float32))
        else:
            hacc = hist_acc
    if n_hist is not None and hist_score is not None:
        hsc = [heavy_scores(rng, H * g, nh) for _ in range(L)] if hist_score is True else hist_score
    tensors = ref.make_turn_tensors(layers, dtype, hist if n_hist is not None else None,
                                    hpos if n_hist is not None else None,
                                    q_dtype=None if query is None else query[0],
                                    history_acc=hacc, history_score=hsc)
    meta = {}
    if n_hist is not None and hist_anchors is not None:
        meta["history_anchors"] = ref.format_id_list(sorted(hist_anchors))
    if first_agent is not None:
        meta["first_agent"] = "true" if first_agent else "false"
    if prompt_pos0 is not None:
        meta["prompt_pos0"] = str(prompt_pos0)
    if softmax_scale is not None:
        meta["softmax_scale"] = softmax_scale
    return Case(name, tensors, meta)


def random_query_setup(seed, dtype, d):
    """Whether random seed `seed` carries gen.q instead of prompt.score (1 seed
    in 3), and how: (query, softmax_scale) for build_case, or (None, None).

    Drawn from a generator of its own, so that a prompt.score seed draws
    exactly the numbers it drew before gen.q existed (same turn, same
    policies)."""
    qrng = np.random.default_rng(700000 + seed)
    if qrng.random() >= 1.0 / 3.0:
        return None, None
    q_dtype = str(qrng.choice(["F32", dtype]))
    qmul = float(qrng.uniform(0.5, 2.0))
    r = qrng.random()
    if r < 0.45:
        scale = None                                   # default 1/sqrt(d)
    elif r < 0.6:
        scale = "0.125"
    else:                                              # a config-style decimal
        scale = ref.softmax_scale_str(round(float(qrng.uniform(0.5, 1.5)) / math.sqrt(d), 10))
    return (q_dtype, qmul), scale


def window_rng_for(case, seed):
    """A generator for window= draws, only for cases with gen.q (None else)."""
    return np.random.default_rng(800000 + seed) if case.turn.has_query else None


def random_case(seed):
    rng = np.random.default_rng(1000 + seed)
    L = int(rng.integers(1, 4))
    H = int(rng.integers(1, 5))
    g = int(rng.choice([1, 2, 3]))
    d = int(rng.choice([8, 16, 32, 64]))
    n_prompt = int(rng.integers(0, 81)) if rng.random() > 0.05 else int(rng.integers(0, 4))
    n_gen = int(rng.integers(0, 11))
    n_hist = int(rng.integers(0, 21)) if rng.random() < 0.4 else None
    first_agent = [None, True, False][int(rng.integers(0, 3))]
    nh = n_hist or 0
    r = rng.random()
    if r < 0.4:
        pos0 = None
    elif r < 0.9:
        pos0 = nh + int(rng.integers(0, 500))
    else:
        pos0 = 2 ** 31 - 1 - n_prompt - n_gen - int(rng.integers(0, 3))
    dtype = str(rng.choice(["F32", "F32", "F32", "BF16", "F16"]))
    zeros = dtype != "F16" and rng.random() < 0.2
    name = "seed%d" % seed
    query, scale = random_query_setup(seed, dtype, d)
    c = build_case(name, rng, L, H, g, d, n_prompt, n_gen, dtype, n_hist, first_agent, pos0,
                   zeros=zeros, query=query, softmax_scale=scale)
    c.desc = ("L=%d H=%d S=%d d=%d n_prompt=%d n_gen=%d n_hist=%s first_agent=%s "
              "prompt_pos0=%s dtype=%s" % (L, H, H * g, d, n_prompt, n_gen, n_hist,
                                           first_agent, pos0, dtype))
    if query is not None:
        c.desc += " scores=gen.q(%s, x%.3g) softmax_scale=%s" % (query[0], query[1], scale)
    return c, rng


def random_window(wrng, n_gen):
    r = wrng.random()
    if r < 0.5 and n_gen >= 1:
        return int(wrng.integers(1, n_gen + 1))
    if r < 0.8:
        return n_gen + int(wrng.integers(1, 6))
    return int(wrng.choice([1, ref.WINDOW_MAX]))


def random_selector(rng, name, wrng=None, n_gen=0):
    """wrng: None, or (gen.q cases only) a generator that sometimes adds window=."""
    params = []
    if name == "gen":
        if rng.random() < 0.6:
            params.append("sinks=%d" % rng.integers(0, 7))
    else:
        if rng.random() < 0.85:
            params.append("k=%d" % (rng.integers(1, 41) if rng.random() < 0.85 else rng.integers(60, 200)))
        if rng.random() < 0.7:
            params.append("sinks=%d" % rng.integers(0, 7))
        if rng.random() < 0.4:
            params.append("recent=%d" % rng.integers(0, 9))
        if wrng is not None and name.startswith("h2o-") and wrng.random() < 0.5:
            params.append("window=%d" % random_window(wrng, n_gen))
    rng.shuffle(params)
    return name + (":" + ",".join(params) if params else "")


def random_obf(rng, mode="exact"):
    params = []
    if rng.random() < 0.8:
        params.append("p=%d" % rng.integers(1, 13))
    if mode == "fast":
        params.append("mode=fast")
        if rng.random() < 0.3:
            params.append("iters=%d" % rng.integers(12, 30))
        if rng.random() < 0.3:
            params.append("oversample=%d" % rng.integers(10, 20))
    elif rng.random() < 0.3:
        params.append("mode=exact")
    if rng.random() < 0.7:
        params.append("inject=%s" % rng.choice(["uniform", "attn"]))
    if rng.random() < 0.8:
        params.append("scale=%s" % rng.choice(["ad_over_as", "ad_frac", "ad", "none"]))
    rng.shuffle(params)
    return "obf" + (":" + ",".join(params) if params else "")


def random_quant(rng):
    bits = int(rng.choice([8, 4, 2]))
    params = []
    if rng.random() < 0.7:
        params.append("group=%d" % rng.choice([1, 3, 8, 32, 64, 128]))
    if bits != 8 and rng.random() < 0.6:
        params.append("rotate=%s" % rng.choice(["none", "hadamard"]))
    return "int%d" % bits + (":" + ",".join(params) if params else "")


def random_policies(rng, wrng=None, n_gen=0):
    """wrng (gen.q cases only): sometimes adds window= to the h2o selectors."""
    pols = ["full", random_selector(rng, "gen")]
    for sel in ("h2o-layer", "h2o-head"):
        s = random_selector(rng, sel, wrng, n_gen)
        pols.append(s)
        if rng.random() < 0.75:
            pols.append(s + "+" + random_obf(rng))
        if rng.random() < 0.3:
            pols.append(s + "+" + random_obf(rng, "fast"))
    if rng.random() < 0.45:
        base = random_selector(rng, str(rng.choice(["full", "gen", "h2o-layer", "h2o-head"])), wrng, n_gen)
        if base.startswith("full"):
            base = "full"
        elif base.startswith("h2o") and rng.random() < 0.5:
            base += "+" + random_obf(rng)
        pols.append(base + "+" + random_quant(rng))
    return pols


# ---------------------------------------------------------------------------
# running the CLI
# ---------------------------------------------------------------------------

def run_cli(case, spec, out_path, decode=False, extra=()):
    cmd = [KVRELAYCTL, "compress", "--policy", spec, "--in", case.path, "--out", out_path]
    if decode:
        cmd.append("--decode")
    cmd += list(extra)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    return p.returncode, (p.stdout + p.stderr).decode("utf-8", "replace").strip()


def fmt_row_diff(a, b):
    return "cli=%s ref=%s" % (np.array2string(a, precision=8, max_line_width=200, threshold=8),
                              np.array2string(b, precision=8, max_line_width=200, threshold=8))


# ---------------------------------------------------------------------------
# comparisons
# ---------------------------------------------------------------------------

def split_spec(spec):
    stages = spec.split("+")
    base = [s for s in stages if not s.split(":")[0].startswith("int")]
    return "+".join(base)


def check_meta(errs, ctx, case, refm, meta, pol, quant_packed, decoded=False):
    turn = case.turn
    nd = refm.n_demoted or 0

    def want(key, val):
        if key not in meta:
            errs.append("%s metadata %r missing (want %r)" % (ctx, key, str(val)))
            return
        if str(meta[key]) != str(val):
            errs.append("%s metadata %s=%r, reference %r" % (ctx, key, meta[key], str(val)))

    want("format", "kvrelay.message.v2")
    if not meta.get("policy"):
        errs.append("%s metadata 'policy' missing or empty" % ctx)
    else:
        try:
            canon = ref.parse_policy(meta["policy"])
            mine = dict(pol)
            if canon != mine:
                errs.append("%s metadata policy=%r does not parse to the same pipeline as the spec "
                            "(%r vs %r)" % (ctx, meta["policy"], canon, mine))
        except Exception as e:  # noqa: BLE001
            errs.append("%s metadata policy=%r is not a parsable spec: %s" % (ctx, meta["policy"], e))
        selp = pol["selector"]
        if (selp.get("window") is not None or selp.get("hist") is not None
                or selp["name"] == "h2o-auto"):
            want_sel = ref.canonical_selector(selp)
            got_sel = meta["policy"].split("+")[0]
            if selp["name"] == "h2o-auto" and got_sel != want_sel:
                # "The shortest decimal form that reads back as the same
                # float64": the reference writes it without an exponent
                # (0.0001); a form with one (1e-04) that is no longer and
                # reads back the same is accepted too.
                want_tau = "tau=" + ref.shortest_decimal(selp["tau"])
                for item in got_sel.split(":", 1)[-1].split(","):
                    if item.startswith("tau="):
                        try:
                            same = (float(item[4:]) == selp["tau"] and len(item) <= len(want_tau)
                                    and "_" not in item)
                        except ValueError:
                            same = False
                        if same:
                            got_sel = got_sel.replace(item, want_tau, 1)
                        break
            if got_sel != want_sel:
                errs.append("%s metadata policy=%r: selector stage %r, canonical form %r (k, sinks, "
                            "recent, tau (h2o-auto, always, shortest decimal), pool (not 1), window "
                            "(given), hist (given))" % (ctx, meta["policy"], got_sel, want_sel))
        # The lloyd and demote stages in their canonical forms.
        stages = {st.split(":")[0]: st for st in meta["policy"].split("+")}
        canon_st = []
        if pol.get("demote") is not None:
            canon_st.append(("demote", ref.canonical_demote(pol["demote"])))
        if pol["quant"] is not None and pol["quant"]["scheme"] == "lloyd":
            canon_st.append(("lloyd", ref.canonical_lloyd(pol["quant"])))
        for nm, want_st in canon_st:
            if stages.get(nm) != want_st:
                errs.append("%s metadata policy=%r: %s stage %r, canonical form %r"
                            % (ctx, meta["policy"], nm, stages.get(nm), want_st))
    if meta.get("dtype", "").upper() != turn.dtype:
        errs.append("%s metadata dtype=%r, turn dtype %s" % (ctx, meta.get("dtype"), turn.dtype))
    want("n_history", refm.n_history)
    want("n_gen", refm.n_gen)
    if pol["selector"]["name"] == "full":
        # Ambiguity: `full` has no sinks parameter.  Accept the default-sinks split
        # or no anchors, as long as anchors + kept = the whole prompt.
        try:
            na, nk = int(meta.get("n_anchor")), int(meta.get("n_kept"))
            if na + nk != turn.n_prompt or na not in (refm.n_anchor, 0):
                errs.append("%s full: n_anchor=%s n_kept=%s, want n_anchor in {%d,0} and sum %d"
                            % (ctx, na, nk, refm.n_anchor, turn.n_prompt))
            elif na != refm.n_anchor:
                note("full: CLI reports n_anchor=0, n_kept=n_prompt (reference uses default sinks=4)")
        except (TypeError, ValueError):
            errs.append("%s full: bad n_anchor/n_kept metadata %r/%r"
                        % (ctx, meta.get("n_anchor"), meta.get("n_kept")))
    else:
        want("n_anchor", refm.n_anchor)
        # Decoded to dense, the demoted tokens are kept tokens.
        want("n_kept", refm.n_kept + (nd if decoded else 0))
    # anchor_pos (FORMAT.md step 6): the history's chain anchors plus, for
    # the first agent, its own anchors (under `full`, those of the n_anchor
    # split kvrelayctl reports).
    n_own = refm.n_anchor
    if pol["selector"]["name"] == "full":
        try:
            n_own = int(meta.get("n_anchor"))
        except (TypeError, ValueError):
            pass
    want("anchor_pos", ref.format_id_list(list(turn.history_anchors)
                                          + [turn.prompt_pos0 + j for j in range(n_own)]))
    if pol["selector"]["name"] == "h2o-auto":
        want("granularity", ",".join(refm.granularity))
        for gr in refm.granularity:
            STATS["gran_" + gr] += 1
    elif "granularity" in meta:
        errs.append("%s metadata granularity=%r on a policy other than h2o-auto" % (ctx, meta["granularity"]))
    if turn.has_query:
        ae = meta.get("attention_error")
        try:
            ok = ae is not None and math.isfinite(float(ae)) and float(ae) >= 0
        except ValueError:
            ok = False
        if not ok:
            errs.append("%s metadata attention_error=%r: want a decimal number >= 0 on a gen.q turn"
                        % (ctx, ae))
    elif "attention_error" in meta:
        errs.append("%s metadata attention_error=%r on a prompt.score turn (no figure there)"
                    % (ctx, meta["attention_error"]))
    want("full_bytes", refm.full_bytes)
    if decoded:
        dense = turn.L * ref.dense_layer_bytes(turn.H, refm.n + nd, turn.d, turn.dtype)
        sb = meta.get("sent_bytes")
        if sb == str(refm.sent_bytes) == str(dense):
            pass
        elif sb == str(refm.sent_bytes):
            note("--decode: sent_bytes keeps the quantized accounting")
        elif sb == str(dense):
            note("--decode: sent_bytes is recomputed for the dense decoded tensors")
        else:
            errs.append("%s --decode metadata sent_bytes=%r, want %d (quantized) or %d (dense)"
                        % (ctx, sb, refm.sent_bytes, dense))
    else:
        want("sent_bytes", refm.sent_bytes)
    q = pol["quant"]
    if quant_packed and q["scheme"] == "int":
        want("quant_bits", q["bits"])
        want("quant_group", q["group"])
        rot = str(meta.get("quant_rotate", "<missing>")).lower()
        if rot not in (("true", "hadamard", "1") if q["rotate"] else ("false", "none", "0")):
            errs.append("%s metadata quant_rotate=%r, want %s" % (ctx, meta.get("quant_rotate"), q["rotate"]))
        if meta.get("quant_scheme", "int") != "int":
            errs.append("%s metadata quant_scheme=%r on an int quantizer (int or absent)"
                        % (ctx, meta.get("quant_scheme")))
    elif quant_packed:
        # lloyd:layers=: quant_bits is layer 0's keys' bits, quant_layer_bits
        # every layer's (absent when every layer has B for keys and values).
        want("quant_bits", ref.lloyd_bits(q, 0)[0])
        qlb = ref.lloyd_layer_bits_meta(q, turn.L)
        if qlb is not None:
            want("quant_layer_bits", qlb)
        elif "quant_layer_bits" in meta:
            errs.append("%s metadata quant_layer_bits=%r, want absent (every layer has %d bits for keys and "
                        "values)" % (ctx, meta["quant_layer_bits"], ref.lloyd_bits(q, 0)[0]))
        want("quant_scheme", "lloyd")
        want("quant_seed", q["seed"])
        want("quant_keys", q["keys"])
        if q["keys"] == "channel":
            want("quant_group", q["group"])
        for key in ("quant_group", "quant_rotate"):
            if key in meta and not (key == "quant_group" and q["keys"] == "channel"):
                note("lloyd keys=%s: metadata %s=%s (FORMAT.md gives it no meaning there)"
                     % (q["keys"], key, meta[key]))
    elif not decoded:
        for key in ("quant_bits", "quant_group", "quant_rotate", "quant_layer_bits"):
            if key in meta:
                errs.append("%s unquantized message has metadata %s" % (ctx, key))
    if quant_packed and q["scheme"] == "int" and "quant_layer_bits" in meta:
        errs.append("%s metadata quant_layer_bits=%r on an int quantizer (lloyd only)"
                    % (ctx, meta["quant_layer_bits"]))
    if decoded and "quant_layer_bits" in meta:
        note("--decode: the dense file keeps metadata quant_layer_bits")
    # Demotion (step 6a): n_demoted and demote_bits with demoted tokens;
    # decoded to dense there is no demoted part.
    dm = pol.get("demote")
    if dm is not None and not decoded and nd:
        want("n_demoted", nd)
        want("demote_bits", dm["bits"])
    else:
        if meta.get("n_demoted", "0") != "0":
            errs.append("%s metadata n_demoted=%r, want absent or 0 (%s)"
                        % (ctx, meta["n_demoted"], "decoded to dense" if decoded else "no demoted tokens"))
        if "demote_bits" in meta and (dm is None or meta["demote_bits"] != str(dm["bits"])):
            errs.append("%s metadata demote_bits=%r without demotion" % (ctx, meta["demote_bits"]))


def check_names(errs, ctx, case, refm, tensors, packed, pol, decoded=False):
    """Tensor names, dtypes and shapes (FORMAT.md "Message (output)"): dense
    or packed (int or lloyd), the demoted part, pos and acc over n +
    n_demoted; a --decode file (decoded=True) holds n + n_demoted dense
    tokens."""
    turn = case.turn
    H, d, n = turn.H, turn.d, refm.n
    nd = refm.n_demoted or 0
    dm = pol.get("demote")
    n_errs = len(errs)
    want, optional = {}, set()
    for l in range(turn.L):
        nt = n + nd if decoded else n
        # pos and acc cover the main part, then the demoted tokens.
        want["layer.%d.pos" % l] = ("I32", (H, n + nd))
        want["layer.%d.acc" % l] = ("F32", (H, n + nd))
        if packed:
            q = pol["quant"]
            ng = -(-n // q["group"]) if n else 0
            # lloyd:layers=: the layer's keys' and values' bits.
            bk, bv = ref.lloyd_bits(q, l) if q["scheme"] == "lloyd" else (q["bits"], q["bits"])
            for x, b in (("k", bk), ("v", bv)):
                want["layer.%d.%s.codes" % (l, x)] = ("U8", (H, n, d * b // 8))
            if q["scheme"] == "lloyd":
                want["layer.%d.v.scale" % l] = ("F16", (H, n))
                if q["keys"] == "channel":
                    want["layer.%d.k.scale" % l] = ("F16", (H, ng, d))
                    want["layer.%d.k.zero" % l] = ("F16", (H, ng, d))
                else:
                    want["layer.%d.k.scale" % l] = ("F16", (H, n))
            else:
                want["layer.%d.k.scale" % l] = ("F16", (H, ng, d))
                want["layer.%d.k.zero" % l] = ("F16", (H, ng, d))
                want["layer.%d.v.scale" % l] = ("F16", (H, n))
                want["layer.%d.v.zero" % l] = ("F16", (H, n))
        else:
            want["layer.%d.k" % l] = (turn.dtype, (H, nt, d))
            want["layer.%d.v" % l] = (turn.dtype, (H, nt, d))
        if dm is not None and not decoded:
            dem = {}
            for x in ("k", "v"):
                dem["layer.%d.demoted.%s.codes" % (l, x)] = ("U8", (H, nd, d * dm["bits"] // 8))
                dem["layer.%d.demoted.%s.norm" % (l, x)] = ("F16", (H, nd))
            want.update(dem)
            if nd == 0:
                optional.update(dem)
    got = {k: (v[0], tuple(v[1].shape)) for k, v in tensors.items()}
    for k in sorted(set(want) | set(got)):
        if k not in got:
            if k not in optional:
                errs.append("%s tensor %s missing (want %s %s)" % (ctx, k, want[k][0], want[k][1]))
        elif k not in want:
            errs.append("%s unexpected tensor %s %s %s" % (ctx, k, got[k][0], got[k][1]))
        elif got[k] != want[k]:
            errs.append("%s tensor %s is %s %s, want %s %s" % (ctx, k, got[k][0], got[k][1],
                                                            want[k][0], want[k][1]))
    return len(errs) == n_errs   # names and shapes right (earlier errors aside)


def row_label(lay, h, t):
    """Row t of head h along the message's token axis; rows past the main
    part are the demoted tokens (layer.{l}.acc holds both)."""
    if t >= lay.pos.shape[1]:
        return "row %d (demoted %d, pos %d)" % (t, t - lay.pos.shape[1], lay.dem_pos[h, t - lay.pos.shape[1]])
    return "row %d (%s, pos %d)" % (t, lay.part[t], lay.pos[h, t])


def check_pos(errs, ctx, refm, tensors, l):
    """layer.{l}.pos: the main part, then (with demote) the demoted tokens."""
    lay = refm.layers[l]
    got = tensors["layer.%d.pos" % l][1].astype(np.int64)
    want = lay.pos
    if refm.n_demoted and got.shape[1] == lay.pos.shape[1] + refm.n_demoted:
        want = np.concatenate([lay.pos, lay.dem_pos], axis=1)
    for h in range(got.shape[0]):
        if not np.array_equal(got[h], want[h]):
            bad = np.nonzero(got[h] != want[h])[0]
            errs.append("%s layer %d head %d tensor layer.%d.pos: %d mismatches, first at %s: "
                        "cli=%d ref=%d\n      cli=%s\n      ref=%s"
                        % (ctx, l, h, l, len(bad), row_label(lay, h, bad[0]), got[h, bad[0]],
                           want[h, bad[0]], got[h].tolist(), want[h].tolist()))


def check_acc(errs, ctx, case, refm, tensors, l, order=None):
    """layer.{l}.acc (FORMAT.md step 5) against the reference's float64 acc.

    prompt.score turns: every input is an exact float32 (history.acc,
    history.score, prompt.score) and the float64 sums are exact to ~1e-16,
    so kvrelay's value must be the float32 rounding of the reference's; one
    float32 ulp is allowed (a rounding boundary, or another float64 summation
    order):  |cli - fl32(ref)| <= ulp_f32(fl32(ref)).
    gen.q turns: the mass part (this agent's attention on the token) carries
    the relative precision query_eps() of the scores (each weight is within
    it, and the masses are sums of weights); the received part (history.acc)
    is exact:  |cli - ref| <= query_eps * mass + ulp_f32(ref) + QUERY_ABS.
    order: a file decoded to dense, whose acc is the main part's and the
    demoted tokens' merged in this order (ref.merge_order())."""
    lay = refm.layers[l]
    got = tensors["layer.%d.acc" % l][1].astype(np.float64)
    acc64, acc32, mass64 = lay.acc64, lay.acc, lay.acc_mass64
    label = lambda h, t: row_label(lay, h, t)  # noqa: E731
    if order is not None:
        acc64, acc32, mass64 = (np.stack([a[h][order[h]] for h in range(a.shape[0])])
                                for a in (acc64, acc32, mass64))
        label = lambda h, t: "decoded row %d = %s" % (t, row_label(lay, h, order[h][t]))  # noqa: E731
    want32 = acc32.astype(np.float64)
    if case.turn.has_query:
        eps = query_eps(case, l)
        tol = eps * np.abs(mass64) + ref.ulp(acc64, "F32") + QUERY_ABS
        diff = np.abs(got - acc64)
        what = "query_eps %.2g * mass + 1 ulp" % eps
    else:
        tol = ref.ulp(want32, "F32")
        diff = np.abs(got - want32)
        what = "1 float32 ulp of fl32(ref)"
    bad = ~(diff <= tol)   # NaN counts as bad
    if got.size:
        key = "acc_query" if case.turn.has_query else "acc_score"
        STATS[key + "_values"] += got.size
        if case.turn.has_query:
            STATS["acc_query_worst"] = max(STATS["acc_query_worst"], float(np.max(diff / tol)))
        else:
            STATS["acc_score_ulp"] += int(np.count_nonzero(diff > 0))
    for h in range(got.shape[0]):
        if bad[h].any():
            idx = np.nonzero(bad[h])[0]
            lines = ["      %s: cli=%.9g ref=%.12g (fl32 %.9g, mass %.9g) |diff|=%.3g tol=%.3g"
                     % (label(h, t), got[h, t], acc64[h, t], want32[h, t], mass64[h, t],
                        diff[h, t], tol[h, t]) for t in idx[:MAX_REPORT]]
            errs.append("%s layer %d head %d tensor layer.%d.acc: %d values beyond %s\n%s"
                        % (ctx, l, h, l, len(idx), what, "\n".join(lines)))


def decimal_quantum(text):
    """The unit of the last digit of a decimal string ('0.0123' -> 1e-4,
    '1.5e-03' -> 1e-4, '2' -> 1)."""
    t = str(text).strip().lower()
    mant, _, ex = t.partition("e")
    digits = len(mant.split(".", 1)[1]) if "." in mant else 0
    return 10.0 ** ((int(ex) if ex else 0) - digits)


def fidelity_eps(case, l):
    """Relative precision assumed of kvrelay's float32 attention weights and
    outputs in layer l (FORMAT.md "Fidelity": dot products, weights and
    outputs in float32): 2^-24 * (sqrt(d) * B_l + sqrt(M) + 8), with B_l the
    logit bound of query_eps() (a float32 logit is off by about sqrt(d) *
    2^-24 * B_l, and a weight by that relative), M = n_history + n_prompt +
    n_gen the most keys a step sees (the output's float32 sum of M terms;
    sqrt(M): rounding errors of a random walk) and 8 for the exponentials
    and the normalization."""
    turn = case.turn
    M = turn.n_history + turn.n_prompt + turn.n_gen
    return 2.0 ** -24 * (math.sqrt(turn.d) * logit_bound(turn, l) + math.sqrt(M) + 8.0)


def check_attention_error(errs, ctx, case, kv, metas, window, alt_kv=None):
    """metadata attention_error (FORMAT.md "Fidelity") against the float64
    figure of the message kvrelayctl wrote (kv: per layer float64 (K, V) as
    the recipient holds them: the dense tensors, or the --decode ones).

    Tolerance: |cli - ref| <= 1e-4 * ref + F + q/2, q the unit of the last
    digit printed, and
        F = mean over layers, score heads and steps of
            eps_l * ((1 + e_t) * sum_i w_i ||v_i|| (full) + sum_i w_i ||v_i|| (msg)) / ||o_full||
    with eps_l = fidelity_eps(): a relative error eps of the float32 weights
    and output sums moves each output by at most eps * sum_i w_i ||v_i||, and
    e = ||o_msg - o_full|| / ||o_full|| by at most (||d_msg|| + (1 + e)
    ||d_full||) / ||o_full|| (first order); the mean of the steps' errors moves
    by at most the mean of these.  1e-4 relative is a margin for float32
    implementations (vectorized exp, blocked sums) beyond that model: a
    float32 emulation of the figure (numpy float32 dot products, exp, sums)
    stayed within 1e-6 relative and 0.003 F of the float64 figure on the
    random cases of the tests."""
    info = ref.attention_error(case.turn, kv, window)
    want = info["figure"]
    F = 0.0
    if case.turn.n_gen:
        for l in range(case.turn.L):
            nf = info["nfull"][l]
            term = ((1.0 + info["steps"][l]) * info["sfull"][l] + info["smsg"][l]) / np.where(nf > 0, nf, np.inf)
            F += fidelity_eps(case, l) * float(np.mean(term))
        F /= case.turn.L
    for label, meta in metas:
        text = meta.get("attention_error")
        if text is None:
            continue  # check_meta reports it
        try:
            got = float(text)
        except ValueError:
            continue
        tol = 1e-4 * want + F + decimal_quantum(text) / 2
        STATS["fidelity_checked"] += 1
        ratio = abs(got - want) / tol if tol > 0 else (0.0 if got == want else np.inf)
        STATS["fidelity_worst"] = max(STATS["fidelity_worst"], ratio)
        if not abs(got - want) <= tol:
            hint = ""
            if alt_kv is not None:
                alt = ref.attention_error(case.turn, alt_kv, window)["figure"]
                hint = ("; without the demoted tokens the figure would be %.9g (%s)"
                        % (alt, "matches" if abs(got - alt) <= tol else "no match either"))
            errs.append("%s%s metadata attention_error=%s, reference %.9g (|diff| %.3g > tol %.3g = 1e-4 ref "
                        "+ F %.3g + last digit/2; layers %s)%s"
                        % (ctx, label, text, want, abs(got - want), tol, F,
                           ", ".join("%.6g" % x for x in info["layers"]), hint))


def check_bitexact(errs, ctx, name, l, h, got, want, lay, dtype, rows=None):
    """got/want: storage arrays [n, d] of one head."""
    g = np.ascontiguousarray(got)
    w = np.ascontiguousarray(want)
    if rows is not None:
        g, w = g[rows], w[rows]
    else:
        rows = np.arange(g.shape[0])
    if g.tobytes() == w.tobytes():
        return
    neq = np.any(g.view(np.uint8).reshape(g.shape[0], -1) != w.view(np.uint8).reshape(w.shape[0], -1), axis=1)
    bad = np.nonzero(neq)[0]
    lines = []
    for i in bad[:MAX_REPORT]:
        t = rows[i]
        lines.append("      %s: %s" % (row_label(lay, h, t),
                                       fmt_row_diff(ref.to_f64(g[i], dtype), ref.to_f64(w[i], dtype))))
    errs.append("%s layer %d head %d tensor %s: %d rows differ from the expected bit-exact rows\n%s"
                % (ctx, l, h, name, len(bad), "\n".join(lines)))


def logit_bound(turn, l):
    """B_l = softmax_scale * max over score heads q, steps t and keys i of
    sum_c |q_tc| |k_ic| (stored values, every key of the head's cache): the
    largest magnitude a float32 logit (or its dot product's partial sums) can
    reach in layer l."""
    dt = turn.dtype
    q = np.abs(ref.to_f64(turn.arr("layer.%d.gen.q" % l), turn.q_dtype))
    parts = ["prompt.k", "gen.k"] + (["history.k"] if turn.has_history else [])
    keys = np.abs(np.concatenate([ref.to_f64(turn.arr("layer.%d.%s" % (l, p)), dt) for p in parts], axis=1))
    g = turn.S // turn.H
    best = 0.0
    for h in range(turn.H):
        qh = q[h * g:(h + 1) * g].reshape(-1, turn.d)
        if qh.size and keys.shape[1]:
            best = max(best, float(np.max(keys[h] @ qh.T)))
    return best * turn.softmax_scale


def query_eps(case, l):
    """Relative precision assumed of kvrelay's scores of layer l (gen.q turns):
    max(QUERY_EPS_MIN, QUERY_EPS_DOT * sqrt(d) * 2^-24 * B_l)."""
    cache = case.__dict__.setdefault("_query_eps", {})
    if l not in cache:
        turn = case.turn
        cache[l] = max(QUERY_EPS_MIN, QUERY_EPS_DOT * math.sqrt(turn.d) * 2.0 ** -24 * logit_bound(turn, l))
    return cache[l]


def query_score_slack(lay, h, add, eps):
    """Extra OBF tolerance per kept row for scores from gen.q (see the module
    docstring): eps * (4 ||add_t|| + 2 |coef_t * factor| max_j ||R_j||)."""
    info = lay.obf[h]
    if info is None:
        return np.zeros(add.shape[0])
    R = info["R"]
    maxr = float(np.max(np.linalg.norm(R, axis=1))) if R.size else 0.0
    return eps * (4.0 * np.linalg.norm(add, axis=1)
                  + 2.0 * np.abs(info["coef"] * info["factor"]) * maxr)


def check_v_obf(errs, ctx, l, h, a, lay, dtype, obf, query_eps=None):
    """a: [n, d] float64 CLI values of head h; checks kept candidate rows.
    query_eps: for a gen.q turn, the relative precision of kvrelay's scores."""
    rows = np.nonzero(lay.part == "kept")[0]
    if rows.size == 0:
        return
    b = lay.v64[h, rows]
    vo = lay.vorig64[h, rows]
    add = lay.add64[h, rows]
    aa = a[rows]
    d = a.shape[1]
    u = ref.ulp(np.maximum(np.abs(aa), np.abs(b)), dtype)
    fast = obf["mode"] == "fast"
    qslack = query_score_slack(lay, h, add, query_eps) if query_eps else np.zeros(rows.size)
    if not fast:
        rowscale = np.maximum.reduce([np.linalg.norm(b, axis=1), np.linalg.norm(vo, axis=1),
                                      np.linalg.norm(add, axis=1)]) / math.sqrt(d)
        tol = 1e-5 * np.maximum(np.abs(b), rowscale[:, None]) + u + qslack[:, None]
        err = np.abs(aa - b)
        viol = err > tol
        if viol.any():
            bad = np.argwhere(viol)
            worst = np.unravel_index(np.argmax(err / tol), err.shape)
            lines = []
            for (i, j) in [tuple(worst)] + [tuple(x) for x in bad[:MAX_REPORT - 1]]:
                t = rows[i]
                lines.append("      %s col %d: cli=%.9g ref=%.9g orig=%.9g |diff|=%.3g tol=%.3g"
                             % (row_label(lay, h, t), j, aa[i, j], b[i, j], vo[i, j], err[i, j], tol[i, j]))
            info = lay.obf[h]
            extra = ""
            if info is not None:
                extra = " (ref: rank(Q)=%d, |C|=%d, factor=%.6g, ||delta||=%.6g)" % (
                    info["Q"].shape[1], info["C"].shape[0], info["factor"], np.linalg.norm(info["delta"]))
            else:
                extra = " (ref skipped this head: ||R||_F <= 1e-10)"
            errs.append("%s layer %d head %d tensor layer.%d.v: %d elements beyond the exact-OBF "
                        "tolerance%s; worst first:\n%s" % (ctx, l, h, l, len(bad), extra, "\n".join(lines)))
    else:
        err = np.linalg.norm(aa - b, axis=1)
        tol = (1e-3 * np.maximum(np.linalg.norm(b, axis=1), np.linalg.norm(vo, axis=1)) + np.linalg.norm(u, axis=1)
               + qslack)
        info = lay.obf[h]
        if info is not None:
            # Subspace iteration converges like (sigma_{m+1} / sigma_p)^(2 iters)
            # with m = p + oversample directions; where the eigengap is that poor,
            # allow 10x that factor of |coef_t * factor| * ||rbar|| on top.
            sr = info["sigma_R"]
            p, m = obf["p"], min(obf["p"] + obf["oversample"], a.shape[1])
            conv = 0.0
            if m < len(sr) and p - 1 < len(sr) and sr[p - 1] > 0:
                conv = (sr[m] / sr[p - 1]) ** (2 * obf["iters"])
            tol = tol + 10.0 * conv * np.abs(info["coef"]) * abs(info["factor"]) * np.linalg.norm(info["rbar"])
        viol = err > tol
        if viol.any():
            bad = np.nonzero(viol)[0]
            lines = []
            for i in bad[:MAX_REPORT]:
                lines.append("      %s: ||diff||=%.3g tol=%.3g ||ref||=%.4g ||ref-orig||=%.4g"
                             % (row_label(lay, h, rows[i]), err[i], tol[i], np.linalg.norm(b[i]),
                                np.linalg.norm(b[i] - vo[i])))
            errs.append("%s layer %d head %d tensor layer.%d.v: %d rows beyond the fast-vs-exact "
                        "tolerance 1e-3:\n%s" % (ctx, l, h, l, len(bad), "\n".join(lines)))


def compare_dense(case, refm, tensors, meta, pol, ctx, fidelity=True):
    """fidelity=False: attention_error is checked elsewhere (with demoted
    tokens, on the file decoded to dense)."""
    errs = []
    check_meta(errs, ctx, case, refm, meta, pol, False)
    if not check_names(errs, ctx, case, refm, tensors, False, pol):
        return errs
    turn = case.turn
    obf = pol["obf"]
    if turn.has_query and fidelity:
        kv = [(ref.to_f64(tensors["layer.%d.k" % l][1], turn.dtype),
               ref.to_f64(tensors["layer.%d.v" % l][1], turn.dtype)) for l in range(turn.L)]
        check_attention_error(errs, ctx, case, kv, [("", meta)], pol["selector"].get("window"))
    for l in range(turn.L):
        lay = refm.layers[l]
        check_pos(errs, ctx, refm, tensors, l)
        check_acc(errs, ctx, case, refm, tensors, l)
        k = tensors["layer.%d.k" % l][1]
        v = tensors["layer.%d.v" % l][1]
        for h in range(turn.H):
            check_bitexact(errs, ctx, "layer.%d.k" % l, l, h, k[h], lay.k[h], lay, turn.dtype)
            if obf is None:
                check_bitexact(errs, ctx, "layer.%d.v" % l, l, h, v[h], lay.v[h], lay, turn.dtype)
                continue
            fixed = np.nonzero(lay.part != "kept")[0]
            check_bitexact(errs, ctx, "layer.%d.v (history/anchor/gen rows)" % l, l, h, v[h], lay.v[h],
                           lay, turn.dtype, rows=fixed)
            s, n = refm.n_anchor, turn.n_prompt
            n_del = (n - s) - len(lay.kept[h])
            if len(lay.kept[h]) == 0 or n_del == 0:
                check_bitexact(errs, ctx, "layer.%d.v (OBF must skip: nothing %s)"
                               % (l, "kept" if not lay.kept[h] else "deleted"), l, h, v[h], lay.v[h],
                               lay, turn.dtype)
            else:
                check_v_obf(errs, ctx, l, h, ref.to_f64(v[h], turn.dtype), lay, turn.dtype, obf,
                            query_eps=query_eps(case, l) if turn.has_query else None)
    return errs


def f16_ord(x):
    b = np.asarray(x, dtype=np.float16).view(np.int16).astype(np.int64)
    return np.where(b < 0, -(b & 0x7FFF), b)


def compare_packed(case, refm, tensors, meta, pol, ctx, xk_all, xv_all):
    """xk_all/xv_all: per layer float64 [H, n, d] of the CLI's unquantized message."""
    errs = []
    check_meta(errs, ctx, case, refm, meta, pol, True)
    if not check_names(errs, ctx, case, refm, tensors, True, pol):
        return errs, None
    turn = case.turn
    q = pol["quant"]
    if q["scheme"] == "lloyd":
        decoded = []
        for l in range(turn.L):
            check_pos(errs, ctx, refm, tensors, l)
            check_acc(errs, ctx, case, refm, tensors, l)
            decoded.append(compare_lloyd_layer(errs, ctx, refm.layers[l], l, tensors, q, xk_all[l], xv_all[l]))
        return errs, decoded
    bits, group, rot = q["bits"], q["group"], q["rotate"]
    d = turn.d
    Hd = ref.hadamard(d) if rot else np.eye(d)
    decoded = []
    for l in range(turn.L):
        lay = refm.layers[l]
        check_pos(errs, ctx, refm, tensors, l)
        check_acc(errs, ctx, case, refm, tensors, l)
        t = lambda nm: tensors["layer.%d.%s" % (l, nm)][1]  # noqa: E731
        ck = ref.unpack_codes(t("k.codes"), bits, d)
        cv = ref.unpack_codes(t("v.codes"), bits, d)
        ks, kz, vs, vz = t("k.scale"), t("k.zero"), t("v.scale"), t("v.zero")
        for nm, arr in (("k.scale", ks), ("k.zero", kz), ("v.scale", vs), ("v.zero", vz)):
            if not np.all(np.isfinite(arr.astype(np.float64))):
                errs.append("%s layer %d tensor layer.%d.%s has non-finite values" % (ctx, l, l, nm))
        for nm, sc in (("k.scale", ks), ("v.scale", vs)):
            if np.any(sc.astype(np.float64) < ref.F16_MIN_SUBNORMAL):
                errs.append("%s layer %d tensor layer.%d.%s has scales below the smallest fp16 subnormal"
                            % (ctx, l, l, nm))
        yk, yv, sk, sv = ref.dequantize_layer(ck, cv, ks, kz, vs, vz, group, rot)
        n = ck.shape[1]
        zk = ref.expand_k_stat(kz, n, group)
        zv = np.broadcast_to(vz.astype(np.float64)[:, :, None], cv.shape)
        # --decode tolerance: 1 ulp of the dtype + 1e-6 (||row||_2 + |zero|).
        decoded.append({"k": yk, "v": yv, "ulps": 1.0,
                        "slack_k": 1e-6 * (np.linalg.norm(yk, axis=2, keepdims=True) + np.abs(zk)),
                        "slack_v": 1e-6 * (np.linalg.norm(yv, axis=2, keepdims=True) + np.abs(zv))})
        rq = ref.quantize_layer(xk_all[l], xv_all[l], bits, group, rot)
        for nm, y, x, s_el, z_el, cref, ccli, sc_c, sc_r, z_c, z_r in (
                ("k", yk, xk_all[l], sk, zk, rq["codes_k"], ck, ks, rq["k_scale"], kz, rq["k_zero"]),
                ("v", yv, xv_all[l], sv, zv, rq["codes_v"], cv, vs, rq["v_scale"], vz, rq["v_zero"])):
            e = (y - x) @ Hd
            xn = np.linalg.norm(x, axis=2, keepdims=True)
            tol = s_el / 2 + 1e-6 * (xn + np.abs(z_el))
            viol = np.abs(e) > tol
            for h in range(x.shape[0]):
                if viol[h].any():
                    bad = np.argwhere(viol[h])
                    lines = ["      %s col %d: decoded=%.9g x=%.9g err(%s domain)=%.3g scale/2=%.3g code=%d"
                             % (row_label(lay, h, i), j, y[h, i, j], x[h, i, j],
                                "rotated" if rot else "original", e[h, i, j], s_el[h, i, j] / 2,
                                ccli[h, i, j]) for (i, j) in bad[:MAX_REPORT]]
                    errs.append("%s layer %d head %d tensor layer.%d.%s.codes: %d elements with "
                                "|x_hat - x| > scale/2\n%s" % (ctx, l, h, l, nm, len(bad), "\n".join(lines)))
            # Stats vs the reference quantizer applied to the CLI's unquantized x.
            # Without rotation the inputs of min/max are exact, so zero must be
            # identical and scale within 1 fp16 ulp (f32 division before the
            # directed rounding).  With rotation the C++ rotates in float32:
            # each rotated element may differ from our float64 one by
            # eps_rot = 4 log2(d) 2^-24 ||x_row||_2, which can move lo/hi across
            # an fp16 grid point; we allow that in value space.
            levels = (1 << bits) - 1
            xr = rq["xk"] if nm == "k" else rq["xv"]
            rown = np.linalg.norm(x, axis=2)  # [H, n]
            if rot:
                eps_row = 4.0 * math.log2(d) * 2.0 ** -24 * rown
            else:
                eps_row = np.zeros_like(rown)
            if nm == "k":
                ngk = z_c.shape[1]
                eps_stat = np.zeros(z_c.shape[:2])
                for gi in range(ngk):
                    eps_stat[:, gi] = eps_row[:, gi * group:(gi + 1) * group].max(axis=1)
                eps_stat = eps_stat[:, :, None]
            else:
                eps_stat = eps_row
            zc64, zr64 = z_c.astype(np.float64), z_r.astype(np.float64)
            sc64, sr64 = sc_c.astype(np.float64), sc_r.astype(np.float64)
            if not rot:
                zbad = zc64 != zr64
                sbad = np.abs(f16_ord(sc_c) - f16_ord(sc_r)) > 1
            else:
                zbad = np.abs(zc64 - zr64) > ref.ulp(zr64, "F16") + eps_stat
                stol = (2 * ref.ulp(np.maximum(sc64, sr64), "F16")
                        + (np.abs(zc64 - zr64) + 2 * eps_stat) / levels)
                sbad = np.abs(sc64 - sr64) > stol
            if zbad.any() or sbad.any():
                lines = []
                for what, badm, cc, rr in (("zero", zbad, zc64, zr64), ("scale", sbad, sc64, sr64)):
                    for idx in np.argwhere(badm)[:MAX_REPORT]:
                        idx = tuple(idx)
                        lines.append("      %s at %s: cli=%r ref=%r" % (what, idx, cc[idx], rr[idx]))
                errs.append("%s layer %d tensor layer.%d.%s.zero/scale differ from the reference stats "
                            "(%d zeros, %d scales)\n%s" % (ctx, l, l, nm, zbad.sum(), sbad.sum(),
                                                          "\n".join(lines)))
            # Codes, where both stats agree and the value is not near a rounding tie.
            same = (f16_ord(z_c) == f16_ord(z_r)) & (f16_ord(sc_c) == f16_ord(sc_r))
            if nm == "k":
                same_el = np.repeat(same, group, axis=1)[:, :n, :] if n else np.zeros(ck.shape, bool)
            else:
                same_el = np.broadcast_to(same[:, :, None], cv.shape)
            u = (xr - z_el) / s_el
            frac = np.abs(u - np.floor(u) - 0.5)
            eps_el = eps_row[:, :, None] + 2.0 ** -23 * (np.abs(xr) + np.abs(z_el))
            safe = same_el & (frac > 1e-3 + eps_el / s_el)
            badc = safe & (cref != ccli)
            if badc.any():
                bad = np.argwhere(badc)
                lines = ["      head %d %s col %d: cli code=%d ref code=%d (x=%.9g zero=%.9g scale=%.9g)"
                         % (hh, row_label(lay, hh, i), j, ccli[hh, i, j], cref[hh, i, j], xr[hh, i, j],
                            z_el[hh, i, j], s_el[hh, i, j]) for (hh, i, j) in bad[:MAX_REPORT]]
                errs.append("%s layer %d tensor layer.%d.%s.codes: %d codes differ from the reference\n%s"
                            % (ctx, l, l, nm, len(bad), "\n".join(lines)))
    return errs, decoded


def compare_decoded(case, refm, tensors, meta, pol, ctx, decoded, packed=None, dem_decoded=None):
    """The --decode file against the packed file decoded here: per layer
    decoded[l] = {'k', 'v': float64 [H, n, d], 'slack_k', 'slack_v', 'ulps'}
    (tolerance ulps * ulp_dtype + slack; a dense main part has 0 and 0: bit-
    exact).  With demoted tokens (dem_decoded, the same per layer for the
    demoted part, and the packed tensors for their positions) the expected
    file merges them into the kept tokens by ascending position."""
    errs = []
    check_meta(errs, ctx, case, refm, meta, pol, False, decoded=True)
    if not check_names(errs, ctx, case, refm, tensors, False, pol, decoded=True):
        return errs
    turn = case.turn
    nb, nk = refm.n_history + refm.n_anchor, refm.n_kept
    for l in range(turn.L):
        lay = refm.layers[l]
        dec = decoded[l]
        H, n, d = dec["k"].shape
        exp = {}
        for nm in ("k", "v"):
            exp[nm] = (dec[nm], np.broadcast_to(dec["slack_" + nm], (H, n, d)),
                       np.full((H, n, 1), dec["ulps"]))
        if dem_decoded is not None and refm.n_demoted:
            dd = dem_decoded[l]
            ppos = packed["layer.%d.pos" % l][1]
            cli_order = ref.merge_order(ppos[:, :n], ppos[:, n:], nb, nk)
            for nm in ("k", "v"):
                y, sl, um = exp[nm]
                nd = dd[nm].shape[1]
                exp[nm] = (ref.merge_demoted(y, dd[nm], cli_order),
                           ref.merge_demoted(sl, np.broadcast_to(dd["slack_" + nm], (H, nd, d)), cli_order),
                           ref.merge_demoted(um, np.full((H, nd, 1), dd["ulps"]), cli_order))
            order = ref.merge_order(lay.pos, lay.dem_pos, nb, nk)
            want_pos = ref.merge_demoted(lay.pos, lay.dem_pos, order)
            got_pos = tensors["layer.%d.pos" % l][1].astype(np.int64)
            for h in range(H):
                if not np.array_equal(got_pos[h], want_pos[h]):
                    bad = np.nonzero(got_pos[h] != want_pos[h])[0]
                    errs.append("%s layer %d head %d tensor layer.%d.pos (decoded, demoted merged by position): "
                                "%d mismatches, first at row %d: cli=%d ref=%d\n      cli=%s\n      ref=%s"
                                % (ctx, l, h, l, len(bad), bad[0], got_pos[h, bad[0]], want_pos[h, bad[0]],
                                   got_pos[h].tolist(), want_pos[h].tolist()))
            check_acc(errs, ctx, case, refm, tensors, l, order=order)
        else:
            check_pos(errs, ctx, refm, tensors, l)
            check_acc(errs, ctx, case, refm, tensors, l)
        pos = tensors["layer.%d.pos" % l][1]
        for nm in ("k", "v"):
            y, sl, um = exp[nm]
            a = ref.to_f64(tensors["layer.%d.%s" % (l, nm)][1], turn.dtype)
            tol = um * ref.ulp(np.maximum(np.abs(a), np.abs(y)), turn.dtype) + sl
            viol = ~(np.abs(a - y) <= tol)
            for h in range(a.shape[0]):
                if viol[h].any():
                    bad = np.argwhere(viol[h])
                    lines = ["      row %d (pos %d) col %d: --decode=%.9g packed-decoded=%.9g tol=%.3g"
                             % (i, pos[h, i], j, a[h, i, j], y[h, i, j], tol[h, i, j])
                             for (i, j) in bad[:MAX_REPORT]]
                    errs.append("%s layer %d head %d tensor layer.%d.%s (--decode): %d elements differ "
                                "from decoding the packed codes\n%s"
                                % (ctx, l, h, l, nm, len(bad), "\n".join(lines)))
    return errs


# ---------------------------------------------------------------------------
# lloyd (FORMAT.md step 7b) and demotion (step 6a)
# ---------------------------------------------------------------------------

def lloyd_cells(errs, ctx, what, u, codes, eps, bits, labels, x=None):
    """Each code's cell must hold its u: t_{c-1} - eps <= u < t_c + eps.
    That is: the code is the exact float64 decision wherever u is more than
    eps from every threshold, and one of the two neighbouring codes within
    eps of one (kvrelay compares float32 u with float32 thresholds)."""
    t = np.concatenate([[-np.inf], ref.lloyd_thresholds(bits), [np.inf]])
    codes = np.asarray(codes)
    ok = (u >= t[codes] - eps) & (u < t[codes + 1] + eps)
    exact = ref.lloyd_code(u, bits)
    STATS["lloyd_codes"] += codes.size
    near = ok & (exact != codes)
    STATS["lloyd_codes_near"] += int(np.count_nonzero(near))
    if VERBOSE and near.any():
        for idx in np.argwhere(near)[:MAX_REPORT]:
            idx = tuple(idx)
            tj = t[max(codes[idx], exact[idx])]
            print("note: %s %s: %s col %d: cli code %d, exact decision %d: u=%.9g, threshold %.9g (|u - t| = %.3g "
                  "<= eps %.3g)" % (ctx, what, labels(idx), idx[-1], codes[idx], exact[idx], u[idx], tj,
                                    abs(u[idx] - tj), eps[idx] if np.ndim(eps) else eps), file=sys.stderr)
    if not ok.all():
        bad = np.argwhere(~ok)
        lines = []
        for idx in bad[:MAX_REPORT]:
            idx = tuple(idx)
            lines.append("      %s col %d: cli code=%d ref code=%d u=%.9g (cell of cli's code [%.9g, %.9g), "
                         "eps %.2g)%s" % (labels(idx), idx[-1], codes[idx], exact[idx], u[idx], t[codes[idx]],
                                          t[codes[idx] + 1], eps[idx] if np.ndim(eps) else eps,
                                          "" if x is None else " x=%.9g" % x[idx]))
        errs.append("%s %s: %d codes outside their cell (codes differ from the exact decision away from "
                    "the thresholds)\n%s" % (ctx, what, len(bad), "\n".join(lines)))


def row_u_eps(u, d):
    """How far kvrelay's float32 u of the row form may be from ours: the
    unnormalized transform of sigma * x by log2(d) float32 butterfly stages,
    each rounding values no larger than sqrt(d) ||x||_2, i.e. log2(d)
    sqrt(d) 2^-24 ||x||, and log2(d) sqrt(d) 2^-24 on u after the factor
    1 / nu; then float32(1 / nu)'s rounding, the product, and the float32
    threshold: 3 |u| 2^-24.  Times 4 as a margin: 2^-22 (log2(d) sqrt(d) +
    3 |u| + 1) (about 1.2e-5 at d = 64)."""
    return 2.0 ** -22 * (math.log2(d) * math.sqrt(d) + 3.0 * np.abs(u) + 1.0)


def check_lloyd_rows(errs, ctx, what, x, codes_u8, norm, bits, seed, labels):
    """Row form (FORMAT.md step 7b).  x [H, m, d] float64: the rows that were
    quantized; codes_u8 [H, m, d*bits/8] and norm [H, m] fp16: kvrelay's.

    Norms: exactly fp16(||x||_2) of the float64 norm (FORMAT.md computes it
    in float64 and rounds to nearest even; a float32 computation, which it
    rules out, would be up to 1 fp16 ulp off); a different summation order
    is accepted only where the norm lies within 1e-12 of the midpoint of the
    two fp16 values.  Codes: decided on u computed here from kvrelay's norm,
    within row_u_eps() (lloyd_cells()).  Returns the decoded rows (float64,
    from kvrelay's codes and norms) and their --decode tolerance."""
    H, m, d = x.shape
    ccli = ref.unpack_codes(codes_u8, bits, d)
    nu = np.asarray(norm, dtype=np.float16)
    nu64 = nu.astype(np.float64)
    bad_nu = ~np.isfinite(nu64) | (nu64 < 0)
    if bad_nu.any():
        errs.append("%s %s norm: %d non-finite or negative" % (ctx, what, int(bad_nu.sum())))
        return None
    try:
        rr = ref.lloyd_quantize_rows(x, bits, seed, what)
    except ValueError as e:
        errs.append("%s %s: kvrelayctl wrote a message the reference refuses: %s" % (ctx, what, e))
        return None
    diff = nu64 != rr["norm"].astype(np.float64)
    STATS["lloyd_norms"] += nu.size
    if diff.any():
        mid = (nu64 + rr["norm"].astype(np.float64)) / 2
        one = np.abs(f16_ord(nu) - f16_ord(rr["norm"])) == 1
        at_mid = one & (np.abs(rr["norm64"] - mid) <= 1e-12 * rr["norm64"])
        STATS["lloyd_norm_mid"] += int(np.count_nonzero(diff & at_mid))
        bad = np.argwhere(diff & ~at_mid)
        if bad.size:
            lines = ["      %s: cli=%r ref=%r (||x||_2 = %.12g, %d fp16 ulp)"
                     % (labels(tuple(i)), float(nu64[tuple(i)]), float(rr["norm"][tuple(i)]),
                        rr["norm64"][tuple(i)], abs(int(f16_ord(nu)[tuple(i)]) - int(f16_ord(rr["norm"])[tuple(i)])))
                     for i in bad[:MAX_REPORT]]
            errs.append("%s %s norm: %d of %d differ from fp16(||x||_2) (round to nearest even of the float64 "
                        "norm)\n%s" % (ctx, what, len(bad), nu.size, "\n".join(lines)))
    u, _ = ref.lloyd_row_u(x, nu, seed)
    lloyd_cells(errs, ctx, what + " codes", u, ccli, row_u_eps(u, d), bits,
                lambda idx: labels(idx[:2]), x=None)
    y = ref.lloyd_dequantize_rows(ccli, nu, bits, seed)
    # --decode: float32 inverse rotation, 1e-6 ||row||_2 (log2(d) 2^-24 per
    # butterfly stage) + 1 ulp of the dtype.
    return {"y": y, "slack": 1e-6 * np.linalg.norm(y, axis=2, keepdims=True)}


def check_lloyd_channel(errs, ctx, what_mean, what_rms, what_codes, x, codes_u8, mean, rms, bits, group, labels):
    """keys=channel (FORMAT.md step 7b).  x [H, n, d] float64 keys; kvrelay's
    codes, means and rms.  FORMAT.md fixes the rounding (fp16 of the mean,
    sigma about the fp16 mean) but not the arithmetic of the means: with
    float32 sums of c tokens the mean is within c 2^-24 max|x| of ours and
    the rms within (c + 4) 2^-23 of itself, so each may be 1 fp16 ulp plus
    that away from the float64 reference (counted when not exact; the rms
    is compared with the rms about kvrelay's own mean).  Codes: u = (x - mu)
    / sigma from kvrelay's stats, within 2^-22 (3 |u| + (|x| + |mu|) / sigma
    + 1) (a float32 subtraction and division, float32 thresholds, margin 4)."""
    H, n, d = x.shape
    ccli = ref.unpack_codes(codes_u8, bits, d)
    mu_c, sg_c = np.asarray(mean, np.float16), np.asarray(rms, np.float16)
    if not (np.all(np.isfinite(mu_c.astype(np.float64))) and np.all(np.isfinite(sg_c.astype(np.float64)))):
        errs.append("%s %s/%s: non-finite values" % (ctx, what_mean, what_rms))
        return None
    if np.any(sg_c.astype(np.float64) < ref.F16_MIN_SUBNORMAL):
        errs.append("%s %s: values below the smallest fp16 subnormal" % (ctx, what_rms))
    try:
        rr = ref.lloyd_quantize_keys_channel(x, bits, group, what_codes)
    except ValueError as e:
        errs.append("%s %s: kvrelayctl wrote a message the reference refuses: %s" % (ctx, what_codes, e))
        return None
    ng = mu_c.shape[1]
    cnt = np.array([min(n, (gi + 1) * group) - gi * group for gi in range(ng)], dtype=np.float64)[None, :, None]
    mx = np.zeros((H, ng, d))
    rms_c_exact = np.zeros((H, ng, d))
    for gi in range(ng):
        blk = x[:, gi * group:min(n, (gi + 1) * group), :]
        mx[:, gi] = np.max(np.abs(blk), axis=1)
        rms_c_exact[:, gi] = np.sqrt(np.mean((blk - mu_c[:, gi].astype(np.float64)[:, None, :]) ** 2, axis=1))
    mu_r = rr["mean"].astype(np.float64)
    tol_mu = ref.ulp(np.maximum(np.abs(mu_c.astype(np.float64)), np.abs(mu_r)), "F16") + cnt * 2.0 ** -24 * mx
    want_sg = np.maximum(rms_c_exact.astype(np.float16), np.float16(ref.F16_MIN_SUBNORMAL)).astype(np.float64)
    tol_sg = (ref.ulp(np.maximum(sg_c.astype(np.float64), want_sg), "F16")
              + (cnt + 4) * 2.0 ** -23 * rms_c_exact)
    STATS["chan_stats"] += 2 * mu_c.size
    STATS["chan_stats_inexact"] += int(np.count_nonzero(mu_c.astype(np.float64) != mu_r)
                                       + np.count_nonzero(sg_c != rr["rms"]))
    for nm, got, want, tol in ((what_mean, mu_c.astype(np.float64), mu_r, tol_mu),
                               (what_rms, sg_c.astype(np.float64), want_sg, tol_sg)):
        bad = np.argwhere(~(np.abs(got - want) <= tol))
        if bad.size:
            lines = ["      head %d group %d channel %d: cli=%r ref=%r tol=%.3g" % (i[0], i[1], i[2], got[tuple(i)],
                                                                               want[tuple(i)], tol[tuple(i)])
                     for i in bad[:MAX_REPORT]]
            errs.append("%s %s: %d values beyond 1 fp16 ulp + float32 summation of the float64 reference\n%s"
                        % (ctx, nm, len(bad), "\n".join(lines)))
    u = ref.lloyd_channel_u(x, mu_c, sg_c, group)
    mux = ref.expand_k_stat(mu_c, n, group)
    sgx = ref.expand_k_stat(sg_c, n, group)
    eps = 2.0 ** -22 * (3.0 * np.abs(u) + (np.abs(x) + np.abs(mux)) / sgx + 1.0)
    lloyd_cells(errs, ctx, what_codes, u, ccli, eps, bits, lambda idx: labels(idx[:2]), x=x)
    y = ref.lloyd_dequantize_keys_channel(ccli, mu_c, sg_c, bits, group)
    # --decode: mu + sigma c in float32: 1e-6 (|mu| + |sigma c|) + 1 ulp.
    return {"y": y, "slack": 1e-6 * (np.abs(mux) + np.abs(y - mux))}


def compare_lloyd_layer(errs, ctx, lay, l, tensors, q, xk, xv):
    """The main part of one layer under lloyd: kvrelay's codes and stats
    against its own unquantized message (xk, xv [H, n, d] float64), the
    keys with the layer's keys' bits and the values with its values' bits
    (lloyd:layers=; else the stage's bits for both)."""
    t = lambda nm: tensors["layer.%d.%s" % (l, nm)][1]  # noqa: E731
    labels = lambda idx: "head %d %s" % (idx[0], row_label(lay, idx[0], idx[1]))  # noqa: E731
    bk, bv = ref.lloyd_bits(q, l)
    out = {"k": None, "v": None, "ulps": 1.0, "slack_k": 0.0, "slack_v": 0.0}
    rv = check_lloyd_rows(errs, ctx, "layer %d tensor layer.%d.v.codes/v.scale (%d bits)" % (l, l, bv), xv,
                          t("v.codes"), t("v.scale"), bv, q["seed"], labels)
    if q["keys"] == "channel":
        rk = check_lloyd_channel(errs, ctx, "layer %d tensor layer.%d.k.zero (mean)" % (l, l),
                                 "layer %d tensor layer.%d.k.scale (rms)" % (l, l),
                                 "layer %d tensor layer.%d.k.codes (%d bits)" % (l, l, bk), xk, t("k.codes"),
                                 t("k.zero"), t("k.scale"), bk, q["group"], labels)
    else:
        rk = check_lloyd_rows(errs, ctx, "layer %d tensor layer.%d.k.codes/k.scale (%d bits)" % (l, l, bk), xk,
                              t("k.codes"), t("k.scale"), bk, q["seed"], labels)
    if rk is None or rv is None:
        return None
    out["k"], out["slack_k"] = rk["y"], rk["slack"]
    out["v"], out["slack_v"] = rv["y"], rv["slack"]
    return out


def compare_demoted(errs, ctx, case, refm, tensors, pol):
    """The demoted part (FORMAT.md step 6a): positions (layer.{l}.pos after the
    main part, checked by check_pos) exactly the reference's (the top-k
    range's candidates not kept, ascending); here K and V in row
    form with the demotion's bits and the message's seed, checked like the
    main part's rows (check_lloyd_rows) against the turn's own values.
    Returns per layer the decoded rows for the --decode comparison."""
    turn = case.turn
    bits, seed = pol["demote"]["bits"], ref.message_seed(pol)
    out = []
    for l, lay in enumerate(refm.layers):
        t = lambda nm: tensors["layer.%d.demoted.%s" % (l, nm)][1]  # noqa: E731
        if refm.n_demoted == 0:
            out.append(None)
            continue
        got = tensors["layer.%d.pos" % l][1][:, refm.n:].astype(np.int64)
        if not np.array_equal(got, lay.dem_pos):
            out.append(None)   # check_pos reports the positions
            continue
        labels = lambda idx: "head %d demoted row %d (pos %d)" % (idx[0], idx[1], lay.dem_pos[idx[0], idx[1]])  # noqa: E731,B023
        dec = {"ulps": 1.0}
        for x, arr in (("k", lay.dem_k), ("v", lay.dem_v)):
            r = check_lloyd_rows(errs, ctx, "layer %d tensor layer.%d.demoted.%s.codes/norm" % (l, l, x),
                                 ref.to_f64(arr, turn.dtype), t(x + ".codes"), t(x + ".norm"), bits, seed, labels)
            if r is None:
                dec = None
                break
            dec[x], dec["slack_" + x] = r["y"], r["slack"]
        out.append(dec)
    return out


STATS = {"cli_runs": 0, "policies": 0, "query_policies": 0, "ambiguous_followed": 0,
         "hist_policies": 0, "auto_policies": 0, "hist_ambiguous_followed": 0, "gran_ambiguous_followed": 0,
         "fidelity_checked": 0, "fidelity_worst": 0.0, "acc_query_values": 0, "acc_query_worst": 0.0,
         "acc_score_values": 0, "acc_score_ulp": 0, "gran_head": 0, "gran_layer": 0,
         "lloyd_policies": 0, "demote_policies": 0, "lloyd_codes": 0, "lloyd_codes_near": 0, "lloyd_norms": 0,
         "lloyd_norm_mid": 0, "chan_stats": 0, "chan_stats_inexact": 0, "demoted_tokens": 0,
         "skipped_unknown_stage": 0}


def topk_ambiguity(a, s, n, sel, eps):
    """The reference's selection of one score vector `a` (A[h] or A_layer) at
    float32-query-score precision.  Returns None when the top-k range is
    taken whole (k >= its size: no score decides), else (P, e, p_k, p_k1,
    ambiguous): the pooled selection scores, the end of the top-k range, the
    k-th and (k+1)-th largest of P over it, and whether they differ by less
    than eps relative (+ the float32 underflow floor QUERY_ABS)."""
    rw = min(sel["recent"], n - s)
    e = n - rw
    k = sel["k"]
    if k >= e - s:
        return None
    P = ref.pool_scores(a, s, e, sel["pool"])
    top = np.sort(P[s:e])[::-1]
    pk, pk1 = float(top[k - 1]), float(top[k])
    amb = abs(pk - pk1) < eps * max(abs(pk), abs(pk1)) + QUERY_ABS
    return P, e, pk, pk1, amb


def plausible_choice(P, s, e, n, k, chosen, eps):
    """Is `chosen` (kept prompt indices) the top-k (ties to the lower position)
    of some P' within eps relative (+ QUERY_ABS) of P, plus the recent
    window e..n-1?"""
    chosen = list(chosen)
    if chosen != sorted(set(chosen)) or chosen[len(chosen) - (n - e):] != list(range(e, n)):
        return False
    top = chosen[:len(chosen) - (n - e)]
    if len(top) != k or any(not s <= j < e for j in top):
        return False
    out = [j for j in range(s, e) if j not in set(top)]
    lo_in = min(P[j] * (1 + eps) + QUERY_ABS for j in top)
    hi_out = max(P[j] * (1 - eps) - QUERY_ABS for j in out) if out else -np.inf
    return lo_in >= hi_out


def gran_band(case, l, lay, tau, s):
    """Half-width of the band around tau where h2o-auto's choice of layer l is
    ambiguous (FORMAT.md step 3a).  prompt.score turns: 1e-9 relative (the
    float64 entropy's rounding, and a log() other than ours).  gen.q turns:
    with every A[h][j] within eps = query_eps() relative, every p_j moves by
    at most 2 eps relative, e_h = -sum p ln p / ln c by at most
    2 eps (sum_j p_j |ln p_j + 1|) / ln c <= 2 eps (e_h + 1 / ln c); we use
    4 eps (1 + 1 / ln c), c >= 2 (c < 2 gives e_h = 1 exactly)."""
    band = 1e-9 * max(abs(tau), abs(lay.mean_entropy)) + 1e-15
    c = case.turn.n_prompt - s
    if case.turn.has_query and c >= 2:
        band += 4.0 * query_eps(case, l) * (1.0 + 1.0 / math.log(c))
    return band


def hist_key_slack(case, l, lay):
    """[H, c] uncertainty of the history ranking keys (FORMAT.md step 5a) on
    a gen.q turn: a candidate's acc is history.acc (exact) plus a mass
    within query_eps() relative, then rounded to float32 (2 float32 ulps
    cover the rounding of ours and of kvrelay's); h2o-layer keys add the
    heads' slacks.  Candidates with no mass (n_gen = 0) are exact, so their
    ties are true ties (the earlier token)."""
    eps = query_eps(case, l)
    H = case.turn.H
    c = lay.hist_keys.shape[1]
    u = np.zeros((H, c))
    for h in range(H):
        cand = lay.hist_split[h][1]
        m = lay.hist_mass64[h, cand]
        u[h] = np.where(m > 0, eps * m + 2 * ref.ulp(lay.hist_acc64[h, cand], "F32") + QUERY_ABS, 0.0)
    if lay.gran == "layer":
        u = np.tile(u.sum(axis=0), (H, 1))
    return u


def plausible_hist_choice(keys, slack, split, K, chosen, same_ranks):
    """Is `chosen` (per head, kept history indices) the anchors plus the K
    candidates that step 5a keeps for some keys within `slack` of ours
    (ties to the earlier token)?  Taking every kept key at its top and every
    dropped one at its bottom satisfies all pairs at once if any keys do, so
    each kept r and dropped r' must have k_r + u_r > k_r' - u_r', or equal
    with r < r'.  same_ranks: h2o-layer (the same ranks in every head)."""
    ranks_all = []
    for h, (anc, cand) in enumerate(split):
        ch = list(chosen[h])
        if ch != sorted(set(ch)) or not set(anc) <= set(ch):
            return False
        kc = [i for i in ch if i not in set(anc)]
        if len(kc) != K or any(i not in set(cand) for i in kc):
            return False
        ranks = [cand.index(i) for i in kc]
        ranks_all.append(ranks)
        out = [r for r in range(len(cand)) if r not in set(ranks)]
        for r in ranks:
            hi = keys[h, r] + slack[h, r]
            for r2 in out:
                lo = keys[h, r2] - slack[h, r2]
                if hi < lo or (hi == lo and r > r2):
                    return False
    return not same_ranks or all(r == ranks_all[0] for r in ranks_all)


def follow_ambiguous_selection(case, pol, refm, tensors, ctx, meta=None):
    """Where the reference's choice is ambiguous at kvrelay's precision, follow
    kvrelayctl's (any other difference is left for the comparisons):

    * h2o-auto granularity (step 3a): a layer whose mean entropy lies within
      gran_band() of tau may be chosen either way; kvrelayctl's choice
      (metadata granularity) is followed.
    * Prompt top-k (gen.q turns only): kvrelay computes the scores in float32
      (FORMAT.md step 0), so where the reference's top-k is ambiguous at that
      precision (the k-th and (k+1)-th largest selection scores differ by
      less than query_eps() relative) kvrelay may keep another, equally valid
      set.  Where it did, and its set is a plausible top-k of scores within
      query_eps() of ours, the reference is recomputed with kvrelayctl's set
      for that head (h2o-head) or layer (h2o-layer).
    * History budget (hist=K, step 5a).  prompt.score turns: every input is
      exact, so the only freedom is whether the ranking reads the float32 acc
      (the reference) or the float64 value before rounding (FORMAT.md says
      "ranked by their acc after step 5"); kvrelayctl's set is followed when
      it is the float64 reading's.  gen.q turns: a set that some keys within
      hist_key_slack() of ours would keep is followed (plausible_hist_choice;
      exact ties among candidates without mass still go to the earlier
      token).  Per head (head granularity) or layer.
    The recomputed reference's rows are still compared bit-exactly (OBF
    within tolerance) against its composition of the followed sets."""
    turn = case.turn
    sel = pol["selector"]
    if not sel["name"].startswith("h2o-"):
        return refm
    H, L = turn.H, turn.L
    gran_override = {}
    if sel["name"] == "h2o-auto" and meta is not None:
        cli_gran = str(meta.get("granularity", "")).split(",")
        if len(cli_gran) == L:
            for l, lay in enumerate(refm.layers):
                if cli_gran[l] != lay.gran and cli_gran[l] in ("head", "layer"):
                    band = gran_band(case, l, lay, sel["tau"], refm.n_anchor)
                    if abs(lay.mean_entropy - sel["tau"]) <= band:
                        gran_override[l] = cli_gran[l]
                        STATS["gran_ambiguous_followed"] += 1
                        msg = ("%s layer %d: mean entropy %.12g within %.2g of tau=%r; following "
                               "kvrelayctl's granularity %s" % (ctx, l, lay.mean_entropy, band, sel["tau"],
                                                               cli_gran[l]))
                        if VERBOSE:
                            print("note:", msg, file=sys.stderr)
                        note("h2o-auto: some layers with entropy at tau followed kvrelayctl's choice "
                             "(details with -v)")
        if gran_override:
            refm = ref.compress(turn, pol, gran_override=gran_override, with_error=False)
    nh, s, nk, n = refm.n_history, refm.n_anchor, refm.n_kept, turn.n_prompt
    override = {}
    hist_override = {}
    for l, lay in enumerate(refm.layers):
        got = tensors.get("layer.%d.pos" % l)
        if got is None or got[1].shape != (H, refm.n + (refm.n_demoted or 0)):
            return refm  # check_names reports it
        # History budget.
        K = sel.get("hist")
        if K is not None and lay.hist_keys is not None:
            hpos = turn.arr("layer.%d.history.pos" % l)
            cli_h = []
            for h in range(H):
                where = {int(p): i for i, p in enumerate(hpos[h])}
                if len(where) != hpos.shape[1]:
                    cli_h = None  # repeated ids: not followed
                    break
                cli_h.append([where.get(int(p), -1) for p in got[1][h, :nh]])
            if cli_h is not None and any(cli_h[h] != lay.hist_kept[h] for h in range(H)):
                units = [[h] for h in range(H)] if lay.gran == "head" else [list(range(H))]
                new = [list(x) for x in lay.hist_kept]
                if turn.has_query:
                    slack = hist_key_slack(case, l, lay)
                    eps = query_eps(case, l)
                else:
                    alt = ref.history_budget(lay.hist_keys64, lay.hist_split, K)
                    eps = 0.0
                for heads in units:
                    if all(cli_h[h] == lay.hist_kept[h] for h in heads):
                        continue
                    if turn.has_query:
                        sub_split = [lay.hist_split[h] for h in heads]
                        if not plausible_hist_choice(lay.hist_keys[heads], slack[heads], sub_split, K,
                                                     [cli_h[h] for h in heads], lay.gran == "layer"):
                            continue
                    elif any(cli_h[h] != alt[h] for h in heads):
                        continue
                    for h in heads:
                        new[h] = cli_h[h]
                    hist_override[l] = new
                    STATS["hist_ambiguous_followed"] += 1
                    msg = ("%s layer %d %s: history ranking ambiguous (query_eps %.2g, or float32 vs float64 "
                           "acc); following "
                           "kvrelayctl's kept history %s (reference %s)"
                           % (ctx, l, "layer" if lay.gran == "layer" else "head %d" % heads[0], eps,
                              [cli_h[h] for h in heads], [lay.hist_kept[h] for h in heads]))
                    if VERBOSE:
                        print("note:", msg, file=sys.stderr)
                    note("hist=K: some ambiguous history rankings followed kvrelayctl's choice "
                         "(details with -v)")
        # Prompt top-k (gen.q turns).
        if not turn.has_query:
            continue
        cli = [[int(x) - turn.prompt_pos0 for x in got[1][h, nh + s:nh + s + nk]] for h in range(H)]
        if all(cli[h] == lay.kept[h] for h in range(H)):
            continue
        units = [(h, lay.A[h], [h]) for h in range(H)] if lay.gran == "head" \
            else [(None, lay.A_layer, list(range(H)))]
        new = [list(x) for x in lay.kept]
        for who, a, heads in units:
            if all(cli[h] == lay.kept[h] for h in heads):
                continue
            if any(cli[h] != cli[heads[0]] for h in heads):
                continue  # h2o-layer with different sets per head: reported by the comparison
            eps = query_eps(case, l)
            amb = topk_ambiguity(a, s, n, sel, eps)
            if amb is None or not amb[4]:
                continue
            P, e, pk, pk1, _ = amb
            if not plausible_choice(P, s, e, n, sel["k"], cli[heads[0]], eps):
                continue
            for h in heads:
                new[h] = cli[h]
            override[l] = new
            STATS["ambiguous_followed"] += 1
            mine, theirs = set(lay.kept[heads[0]]), set(cli[heads[0]])
            msg = ("%s layer %d %s: reference top-k ambiguous at float32 precision (k-th %.9g, (k+1)-th "
                   "%.9g, relative gap %.2g < %.2g); following kvrelayctl's set (reference only %s, "
                   "kvrelayctl only %s)" % (ctx, l, "layer" if who is None else "head %d" % who, pk, pk1,
                                            abs(pk - pk1) / max(abs(pk), abs(pk1), 1e-300), eps,
                                            sorted(mine - theirs), sorted(theirs - mine)))
            if VERBOSE:
                print("note:", msg, file=sys.stderr)
            note("gen.q turns: some ambiguous top-k selections followed kvrelayctl's choice "
                 "(details with -v)")
    if not override and not hist_override:
        return refm
    return ref.compress(turn, pol, kept_override=override, hist_override=hist_override,
                        gran_override=gran_override, with_error=False)


def run_and_read(case, spec, out, ctx, decode=False):
    """Runs the CLI once; ((tensors, meta), []) or (None, [error])."""
    rc, text = run_cli(case, spec, out, decode=decode)
    STATS["cli_runs"] += 1
    if rc != 0:
        return None, ["%s%s kvrelayctl exited %d: %s" % (ctx, " --decode:" if decode else "", rc, text[-2000:])]
    return ref.read_safetensors(out), []


class StageUnknown(Exception):
    """kvrelayctl does not know the lloyd or demote stage yet."""


def unknown_stage(text):
    return "unknown stage" in text and ("lloyd" in text or "demote" in text)


def base_spec(spec):
    """The spec without its demote and quantizer stages (the main part's
    values before quantization)."""
    keep = [st for st in spec.split("+")
            if not st.split(":")[0].startswith("int") and st.split(":")[0] not in ("lloyd", "demote")]
    return "+".join(keep)


def check_policy_lloyd(case, spec, tmpdir):
    """A policy with lloyd or demote: the packed run first (StageUnknown when
    kvrelayctl does not know the stage), then the base policy (checked as
    usual; its dense message is what the quantizer saw), the packed message
    (metadata, names, positions, acc, the main part's codes and stats, the
    demoted part), and the --decode run (merged by position); on gen.q turns
    attention_error from the --decode file."""
    ctx = "[%s] policy=%r:" % (case.name, spec)
    pol = ref.parse_policy(spec)
    turn = case.turn
    packed_path = os.path.join(tmpdir, "msg.packed.safetensors")
    rc, text = run_cli(case, spec, packed_path)
    STATS["cli_runs"] += 1
    if rc != 0:
        if unknown_stage(text):
            raise StageUnknown(text.strip().splitlines()[-1] if text.strip() else text)
        return ["%s kvrelayctl exited %d: %s" % (ctx, rc, text[-2000:])]
    STATS["policies"] += 1
    STATS["lloyd_policies"] += pol["quant"] is not None and pol["quant"]["scheme"] == "lloyd"
    STATS["demote_policies"] += pol["demote"] is not None
    if turn.has_query:
        STATS["query_policies"] += 1
    base = base_spec(spec)
    errs = check_policy(case, base, tmpdir)
    if errs:
        return errs + ["%s (base policy %r failed; lloyd/demote checks skipped)" % (ctx, base)]
    bt, _ = ref.read_safetensors(os.path.join(tmpdir, "msg.safetensors"))
    xk = [ref.to_f64(bt["layer.%d.k" % l][1], turn.dtype) for l in range(turn.L)]
    xv = [ref.to_f64(bt["layer.%d.v" % l][1], turn.dtype) for l in range(turn.L)]
    tensors, meta = ref.read_safetensors(packed_path)
    try:
        refm = ref.compress(turn, pol, with_error=False)
    except ValueError as e:
        return ["%s kvrelayctl accepted what the reference refuses: %s" % (ctx, e)]
    refm = follow_ambiguous_selection(case, pol, refm, tensors, ctx, meta)
    STATS["demoted_tokens"] += turn.L * turn.H * (refm.n_demoted or 0)
    if pol["quant"] is None:
        errs = compare_dense(case, refm, tensors, meta, pol, ctx, fidelity=False)
        decoded = [{"k": xk[l], "v": xv[l], "ulps": 0.0, "slack_k": 0.0, "slack_v": 0.0} for l in range(turn.L)]
    else:
        errs, decoded = compare_packed(case, refm, tensors, meta, pol, ctx, xk, xv)
    if not check_names([], ctx, case, refm, tensors, pol["quant"] is not None, pol):
        return errs  # names or shapes (reported above): nothing more to compare
    dem = None
    if pol["demote"] is not None:
        dem = compare_demoted(errs, ctx, case, refm, tensors, pol)
    dec_path = os.path.join(tmpdir, "msg.decoded.safetensors")
    got, run_errs = run_and_read(case, spec, dec_path, ctx, decode=True)
    if got is None:
        return errs + run_errs
    if (decoded is not None and all(x is not None for x in decoded)
            and (dem is None or refm.n_demoted == 0 or all(x is not None for x in dem))):
        errs += compare_decoded(case, refm, got[0], got[1], pol, ctx + " --decode", decoded, packed=tensors,
                                dem_decoded=dem)
    else:
        errs.append("%s --decode not compared (the packed message has errors above)" % ctx)
    if turn.has_query and all(("layer.%d.%s" % (l, x)) in got[0] and got[0]["layer.%d.%s" % (l, x)][1].shape[1]
                              == refm.n + (refm.n_demoted or 0) for l in range(turn.L) for x in ("k", "v")):
        kv = [(ref.to_f64(got[0]["layer.%d.k" % l][1], turn.dtype),
               ref.to_f64(got[0]["layer.%d.v" % l][1], turn.dtype)) for l in range(turn.L)]
        alt = None
        if refm.n_demoted:
            # The reading without the demoted tokens, to name it on a mismatch.
            dpos = [set(int(p) for p in lay.dem_pos.ravel()) for lay in refm.layers]
            keep = [[np.array([int(p) not in dpos[l] for p in got[0]["layer.%d.pos" % l][1][h]])
                     for h in range(turn.H)] for l in range(turn.L)]
            alt = [tuple(np.stack([kv[l][i][h][keep[l][h]] for h in range(turn.H)]) for i in (0, 1))
                   for l in range(turn.L)]
        check_attention_error(errs, ctx, case, kv, [(" (packed)", meta), (" --decode", got[1])],
                              pol["selector"].get("window"), alt_kv=alt)
    return errs


def check_policy(case, spec, tmpdir):
    """Runs the CLI for `spec` on `case` and returns a list of error strings."""
    ctx = "[%s] policy=%r:" % (case.name, spec)
    pol = ref.parse_policy(spec)
    if pol["demote"] is not None or (pol["quant"] is not None and pol["quant"]["scheme"] == "lloyd"):
        return check_policy_lloyd(case, spec, tmpdir)
    STATS["policies"] += 1
    if case.turn.has_query:
        STATS["query_policies"] += 1
    if pol["selector"].get("hist") is not None:
        STATS["hist_policies"] += 1
    if pol["selector"]["name"] == "h2o-auto":
        STATS["auto_policies"] += 1
    out = os.path.join(tmpdir, "msg.safetensors")
    if pol["quant"] is None:
        refm = ref.compress(case.turn, pol, with_error=False)
        got, errs = run_and_read(case, spec, out, ctx)
        if got is None:
            return errs
        refm = follow_ambiguous_selection(case, pol, refm, got[0], ctx, got[1])
        return compare_dense(case, refm, got[0], got[1], pol, ctx)
    # Quantized: unquantized run (x), packed run, --decode run.
    base = split_spec(spec)
    errs = check_policy(case, base, tmpdir)
    if errs:
        return errs + ["%s (unquantized base %r failed; quantized checks skipped)" % (ctx, base)]
    bt, _ = ref.read_safetensors(out)
    xk = [ref.to_f64(bt["layer.%d.k" % l][1], case.turn.dtype) for l in range(case.turn.L)]
    xv = [ref.to_f64(bt["layer.%d.v" % l][1], case.turn.dtype) for l in range(case.turn.L)]
    refm = ref.compress(case.turn, pol, with_error=False)
    got, errs = run_and_read(case, spec, out, ctx)
    if got is None:
        return errs
    refm = follow_ambiguous_selection(case, pol, refm, got[0], ctx, got[1])
    packed_meta = got[1]
    errs, decoded = compare_packed(case, refm, got[0], got[1], pol, ctx, xk, xv)
    if decoded is None:
        return errs
    got, run_errs = run_and_read(case, spec, out, ctx, decode=True)
    if got is None:
        return errs + run_errs
    errs += compare_decoded(case, refm, got[0], got[1], pol, ctx + " --decode", decoded)
    if case.turn.has_query and all(("layer.%d.%s" % (l, x)) in got[0] for l in range(case.turn.L)
                                   for x in ("k", "v")):
        # The recipient's keys and values: the codes decoded into the turn's
        # dtype, i.e. what --decode writes (itself checked against the codes).
        kv = [(ref.to_f64(got[0]["layer.%d.k" % l][1], case.turn.dtype),
               ref.to_f64(got[0]["layer.%d.v" % l][1], case.turn.dtype)) for l in range(case.turn.L)]
        check_attention_error(errs, ctx, case, kv, [(" (packed)", packed_meta), (" --decode", got[1])],
                              pol["selector"].get("window"))
    return errs


class CliTestCase(unittest.TestCase):
    def setUp(self):
        if not KVRELAYCTL or not os.access(KVRELAYCTL, os.X_OK):
            self.skipTest("kvrelayctl not found (pass --kvrelayctl PATH)")
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = self._tmp.name
        self.skipped = []
        self.ran = 0

    def tearDown(self):
        self._tmp.cleanup()

    def run_case(self, case, specs):
        case.write(self.tmp)
        all_errs = []
        for spec in specs:
            try:
                errs = check_policy(case, spec, self.tmp)
            except StageUnknown as e:
                # kvrelayctl without the lloyd / demote stages.
                self.skipped.append("%s %s (%s)" % (case.name, spec, e))
                STATS["skipped_unknown_stage"] += 1
                continue
            self.ran += 1
            if errs:
                desc = getattr(case, "desc", "")
                all_errs.append("---- %s %s policy=%r\n%s" % (case.name, desc, spec, "\n".join(errs)))
        return all_errs

    def assert_no_errors(self, errs):
        if errs:
            text = "\n".join(errs)
            if len(text) > 60000:
                text = text[:60000] + "\n... (truncated)"
            self.fail("\n" + text)
        if self.skipped:
            print("\nSKIPPED %d lloyd/demote policies: kvrelayctl does not know the stage (%s)"
                  % (len(self.skipped), self.skipped[0].split(" (", 1)[-1].rstrip(")")), file=sys.stderr)
            if VERBOSE:
                for x in self.skipped:
                    print("  skipped:", x, file=sys.stderr)
            if not self.ran:
                self.skipTest("kvrelayctl: unknown stage lloyd/demote (%d policies)" % len(self.skipped))


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------

class ReferenceSelfTest(unittest.TestCase):
    def test_selftest(self):
        self.assertGreater(ref.selftest(verbose=False), 100)


class RandomSeeds(CliTestCase):
    def test_random_seeds(self):
        errs = []
        for seed in range(N_SEEDS):
            case, rng = random_case(seed)
            errs += self.run_case(case, random_policies(rng, window_rng_for(case, seed), case.turn.n_gen))
        self.assert_no_errors(errs)


def pool_policies(rng, n_prompt, wrng=None, n_gen=0):
    """h2o-layer and h2o-head with pool = 1, 3, 5, 7 and one window wider than
    the prompt (so wider than the top-k range), each alone and with OBF.
    wrng (gen.q cases only): sometimes adds window=."""
    pols = []
    big = 2 * n_prompt + 1 + 2 * int(rng.integers(0, 5))
    for sel in ("h2o-layer", "h2o-head"):
        for pool in (1, 3, 5, 7, big):
            params = ["k=%d" % rng.integers(1, 25), "pool=%d" % pool]
            if rng.random() < 0.5:
                params.append("sinks=%d" % rng.integers(0, 7))
            if rng.random() < 0.4:
                params.append("recent=%d" % rng.integers(0, 9))
            if wrng is not None and wrng.random() < 0.4:
                params.append("window=%d" % random_window(wrng, n_gen))
            rng.shuffle(params)
            s = sel + ":" + ",".join(params)
            pols.append(s)
            pols.append(s + "+" + random_obf(rng))
    return pols


class RandomPoolSeeds(CliTestCase):
    """pool=K max-pools the selection score over the top-k range (FORMAT.md
    step 3); kept positions must match exactly, OBF values within the usual
    tolerances (OBF weights use the unpooled scores)."""

    def test_random_pool_seeds(self):
        errs = []
        for seed in range(max(4, N_SEEDS // 5)):
            case, rng = random_case(5000 + seed)
            case.name = "pool_seed%d" % seed
            errs += self.run_case(case, pool_policies(rng, case.turn.n_prompt,
                                                      window_rng_for(case, 5000 + seed), case.turn.n_gen))
        self.assert_no_errors(errs)

    def test_pool_recent_and_ties(self):
        rng = np.random.default_rng(23)
        errs = []
        c = build_case("pool_recent", rng, 2, 2, 2, 16, 40, 3, "F32", n_hist=3)
        errs += self.run_case(c, ["h2o-layer:k=4,recent=5,pool=3+obf", "h2o-head:k=4,recent=5,pool=7+obf:inject=attn",
                                  "h2o-head:k=6,recent=40,pool=5+obf", "h2o-layer:k=3,sinks=0,pool=81+obf"])
        sc = [rng.integers(0, 3, (3, 40)).astype(np.float32) for _ in range(2)]
        c = build_case("pool_ties", rng, 2, 3, 1, 8, 40, 2, "BF16", scores=sc)
        errs += self.run_case(c, ["h2o-layer:k=7,pool=3", "h2o-head:k=7,pool=5+obf", "h2o-head:k=9,recent=3,pool=3+obf"])
        self.assert_no_errors(errs)


def _rank_deficient_case(rng, dtype, name):
    """Kept rows (highest scores for every score head) are duplicated / exact
    integer linear combinations, so V_keep has rank 3 < k = 6 < d."""
    H, g, d, n, s = 2, 2, 16, 30, 2
    keep = [5, 9, 10, 17, 22, 28]
    layers_v, layers_s = [], []
    for _ in range(2):
        pv = rng.standard_normal((H, n, d))
        sc = heavy_scores(rng, H * g, n).astype(np.float64) * 0.1
        for h in range(H):
            a = rng.integers(-4, 5, d).astype(np.float64)
            b = rng.integers(-4, 5, d).astype(np.float64)
            c = rng.integers(-4, 5, d).astype(np.float64)
            pv[h, keep] = np.stack([a, b, a, a + b, 2 * b - a, c - a])
        for i, j in enumerate(keep):
            sc[:, j] = 5.0 + i  # the highest scores: always kept with k=6
        layers_v.append(pv)
        layers_s.append(sc.astype(np.float32))
    case = build_case(name, rng, 2, H, g, d, n, 3, dtype, first_agent=True, scores=layers_s,
                      values=layers_v)
    # Sanity: the reference sees rank 3.
    m = ref.compress(case.turn, "h2o-head:k=6,sinks=%d+obf" % s)
    for lay in m.layers:
        for h in range(H):
            assert lay.kept[h] == keep, lay.kept[h]
            assert lay.obf[h]["Q"].shape[1] == 3, lay.obf[h]["Q"].shape
    return case


class EdgeCases(CliTestCase):
    def test_full_identity_all_dtypes(self):
        rng = np.random.default_rng(7)
        errs = []
        for dt in ref.FLOAT_DTYPES:
            c = build_case("full_" + dt, rng, 2, 3, 2, 16, 23, 4, dt, n_hist=5, first_agent=False,
                           prompt_pos0=100)
            errs += self.run_case(c, ["full"])
            # Explicit identity: message == concatenation of the inputs.
            msg, _ = ref.read_safetensors(os.path.join(self.tmp, "msg.safetensors"))
            for l in range(2):
                for part in ("k", "v"):
                    want = np.concatenate([c.tensors["layer.%d.history.%s" % (l, part)][1],
                                           c.tensors["layer.%d.prompt.%s" % (l, part)][1],
                                           c.tensors["layer.%d.gen.%s" % (l, part)][1]], axis=1)
                    got = msg.get("layer.%d.%s" % (l, part))
                    if got is None or got[1].tobytes() != want.tobytes():
                        errs.append("[full_%s] layer.%d.%s is not the bit-exact concatenation "
                                    "[history; prompt; gen]" % (dt, l, part))
        self.assert_no_errors(errs)

    def test_rank_deficient_vkeep(self):
        rng = np.random.default_rng(11)
        errs = []
        for dt in ("F32", "BF16", "F16"):
            c = _rank_deficient_case(rng, dt, "rankdef_" + dt)
            specs = ["h2o-head:k=6,sinks=2+obf", "h2o-layer:k=6,sinks=2+obf:p=3,inject=attn",
                     "h2o-head:k=6,sinks=2+obf:p=20,scale=none"]
            if dt == "F32":
                specs.append("h2o-head:k=6,sinks=2+obf:mode=fast")
            errs += self.run_case(c, specs)
        self.assert_no_errors(errs)

    def test_k_at_least_candidates(self):
        rng = np.random.default_rng(12)
        c = build_case("k_ge_cand", rng, 2, 2, 1, 16, 20, 3, "F32")
        self.assert_no_errors(self.run_case(c, [
            "h2o-head:k=16+obf", "h2o-layer:k=16,sinks=4+obf", "h2o-head:k=100+obf:inject=attn",
            "h2o-layer:k=17+obf"]))

    def test_prompt_shorter_than_sinks(self):
        rng = np.random.default_rng(13)
        errs = []
        for n in (0, 1, 3):
            for fa in (True, False):
                c = build_case("short%d_%s" % (n, fa), rng, 1, 2, 2, 8, n, 2, "F32", first_agent=fa)
                errs += self.run_case(c, ["full", "gen", "h2o-layer:k=2+obf", "h2o-head:k=1,recent=2+obf",
                                          "h2o-head:k=2+int4"])
        self.assert_no_errors(errs)

    def test_all_zero_scores(self):
        rng = np.random.default_rng(14)
        H, g, n = 2, 3, 25
        zeros = [np.zeros((H * g, n), np.float32)] * 2
        c = build_case("zero_scores", rng, 2, H, g, 16, n, 4, "F32", scores=zeros)
        specs = []
        for sel in ("h2o-layer", "h2o-head"):
            for inj in ("uniform", "attn"):
                for sc in ("ad_over_as", "ad_frac", "ad", "none"):
                    specs.append("%s:k=5+obf:inject=%s,scale=%s" % (sel, inj, sc))
        specs.append("h2o-head:k=5,recent=3")
        self.assert_no_errors(self.run_case(c, specs))

    def test_tied_scores(self):
        rng = np.random.default_rng(15)
        H, g, n = 3, 1, 40
        sc = [rng.integers(0, 3, (H * g, n)).astype(np.float32) for _ in range(2)]
        c = build_case("ties", rng, 2, H, g, 8, n, 2, "F32", scores=sc)
        self.assert_no_errors(self.run_case(c, ["h2o-layer:k=7", "h2o-head:k=7", "h2o-head:k=9,recent=3+obf",
                                                "h2o-layer:k=1,sinks=0"]))

    def test_d_less_than_k(self):
        rng = np.random.default_rng(16)
        errs = []
        for dt in ("F32", "BF16"):
            c = build_case("d_lt_k_" + dt, rng, 2, 2, 1, 8, 40, 3, dt)
            errs += self.run_case(c, ["h2o-head:k=12+obf", "h2o-layer:k=8+obf:p=8", "h2o-head:k=12+obf:mode=fast"])
        self.assert_no_errors(errs)

    def test_recent_window(self):
        rng = np.random.default_rng(17)
        c = build_case("recent", rng, 2, 2, 2, 16, 30, 3, "F32", n_hist=4)
        self.assert_no_errors(self.run_case(c, [
            "h2o-layer:k=3,recent=5", "h2o-head:k=3,recent=5+obf", "h2o-head:k=3,recent=40+obf",
            "h2o-layer:k=40,recent=5+obf", "h2o-head:recent=1,k=1,sinks=0+obf:inject=attn"]))

    def test_every_obf_option(self):
        rng = np.random.default_rng(18)
        errs = []
        for dt in ("F32", "BF16"):
            c = build_case("obf_opts_" + dt, rng, 2, 2, 2, 16, 50, 4, dt, n_hist=3)
            specs = []
            for sel in ("h2o-layer", "h2o-head"):
                for inj in ("uniform", "attn"):
                    for sc in ("ad_over_as", "ad_frac", "ad", "none"):
                        specs.append("%s:k=10+obf:p=4,inject=%s,scale=%s" % (sel, inj, sc))
            if dt == "F32":
                for sel in ("h2o-layer", "h2o-head"):
                    specs.append("%s:k=10+obf:p=4,mode=fast" % sel)
                    specs.append("%s:k=10+obf:p=4,mode=fast,inject=attn,scale=ad_frac,iters=20,oversample=12" % sel)
            errs += self.run_case(c, specs)
        self.assert_no_errors(errs)

    def test_p_larger_than_residual_rank(self):
        rng = np.random.default_rng(19)
        errs = []
        # 10 kept rows of d=16 -> residual rank <= 6 < p=12.
        c = build_case("p_gt_rank_a", rng, 1, 2, 1, 16, 40, 2, "F32")
        errs += self.run_case(c, ["h2o-head:k=10+obf:p=12", "h2o-layer:k=10+obf:p=16,inject=attn"])
        # Only 2 deleted rows -> rank(R) <= 2 < p=8.
        c = build_case("p_gt_rank_b", rng, 1, 2, 1, 32, 20, 2, "F32")
        errs += self.run_case(c, ["h2o-head:k=14+obf:p=8", "h2o-layer:k=14+obf"])
        self.assert_no_errors(errs)

    def test_history_positions_and_pos0(self):
        rng = np.random.default_rng(20)
        errs = []
        c = build_case("hist_far", rng, 2, 3, 1, 8, 12, 5, "F32", n_hist=7, first_agent=False,
                       prompt_pos0=2 ** 31 - 1 - 17)
        errs += self.run_case(c, ["full", "gen", "h2o-head:k=3", "h2o-layer:k=3+obf+int8"])
        c = build_case("hist_default_pos0", rng, 1, 2, 1, 8, 9, 2, "BF16", n_hist=6)
        errs += self.run_case(c, ["full", "gen:sinks=2", "h2o-head:k=2,sinks=1+obf"])
        c = build_case("hist_empty", rng, 1, 2, 1, 8, 9, 2, "F32", n_hist=0)
        errs += self.run_case(c, ["full", "h2o-head:k=2+obf"])
        self.assert_no_errors(errs)

    def test_quantizers(self):
        rng = np.random.default_rng(21)
        errs = []
        for dt in ("F32", "BF16", "F16"):
            c = build_case("quant_" + dt, rng, 2, 2, 2, 32, 45, 6, dt, n_hist=3)
            specs = []
            for bits in (8, 4, 2):
                for grp in (1, 7, 32, 1000):
                    specs.append("h2o-head:k=9+int%d:group=%d" % (bits, grp))
                if bits != 8:
                    specs.append("h2o-layer:k=9+obf+int%d:rotate=hadamard" % bits)
                    specs.append("full+int%d:group=5,rotate=hadamard" % bits)
            specs.append("gen+int8")
            errs += self.run_case(c, specs)
        self.assert_no_errors(errs)

    def test_gqa_reduction(self):
        rng = np.random.default_rng(22)
        errs = []
        for g in (1, 2, 3, 4):
            c = build_case("gqa%d" % g, rng, 1, 2, g, 8, 30, 1, "F32")
            errs += self.run_case(c, ["h2o-head:k=4", "h2o-layer:k=4", "h2o-head:k=4+obf:inject=attn"])
        self.assert_no_errors(errs)


def either_tensor():
    return ("prompt.score", "gen.q")


class QueryScoreCases(CliTestCase):
    """Turns with gen.q (FORMAT.md step 0): kvrelayctl's float32 scores vs the
    float64 reference, with the selection rule and OBF slack of the module
    docstring."""

    def test_dtypes_scales_windows(self):
        rng = np.random.default_rng(40)
        errs = []
        for dt, qd, scale in (("F32", "F32", None), ("BF16", "F32", "0.0883883476"), ("BF16", "BF16", None),
                              ("F16", "F16", "0.125"), ("F16", "F32", "0.3"), ("F32", "F32", "1")):
            c = build_case("q_%s_%s_%s" % (dt, qd, scale), rng, 2, 2, 2, 32, 45, 8, dt, n_hist=4,
                           first_agent=False, prompt_pos0=50, query=(qd, 1.5), softmax_scale=scale)
            specs = ["full", "gen", "h2o-head:k=8", "h2o-layer:k=8,recent=3", "h2o-head:k=8,window=1",
                     "h2o-head:k=8,window=3+obf", "h2o-layer:k=8,window=8+obf:inject=attn",
                     "h2o-head:k=6,pool=3,window=20+obf:inject=attn,scale=ad_frac",
                     "h2o-layer:window=16777216,k=8+int4:group=8"]
            if dt == "F32":
                specs.append("h2o-head:k=8,window=2+obf:mode=fast")
            errs += self.run_case(c, specs)
        self.assert_no_errors(errs)

    def test_window_at_least_n_gen_is_all_steps(self):
        """window >= n_gen scores with every step: the same tensors as no window."""
        rng = np.random.default_rng(41)
        c = build_case("q_window_all", rng, 2, 3, 2, 16, 40, 5, "BF16", n_hist=2, query=("F32", 1.0))
        c.write(self.tmp)
        errs = []
        for base in ("h2o-head:k=7", "h2o-layer:k=7,pool=3"):
            outs = []
            for w in ("", ",window=5", ",window=6", ",window=16777216"):
                spec = base + w + "+obf:inject=attn"
                errs += check_policy(c, spec, self.tmp)
                got = ref.read_safetensors(os.path.join(self.tmp, "msg.safetensors"))[0] if not errs else {}
                outs.append({k: v[1].tobytes() for k, v in got.items()})
            if not errs and any(o != outs[0] for o in outs[1:]):
                errs.append("[q_window_all] %s: window >= n_gen = 5 gives other tensors than no window" % base)
        self.assert_no_errors(errs)

    def test_no_generated_tokens(self):
        """n_gen = 0: gen.q is [S, 0, d] and every score is 0 (ties: lowest positions)."""
        rng = np.random.default_rng(42)
        errs = []
        for dt in ("F32", "BF16"):
            c = build_case("q_no_gen_" + dt, rng, 2, 2, 3, 16, 20, 0, dt, n_hist=3, query=(dt, 1.0))
            errs += self.run_case(c, ["h2o-head:k=5", "h2o-layer:k=5,window=3+obf",
                                      "h2o-head:k=5,recent=2,pool=3+obf:inject=attn", "gen", "full"])
        self.assert_no_errors(errs)

    def test_gqa_groups(self):
        rng = np.random.default_rng(43)
        errs = []
        for g in (1, 2, 3, 4, 5):
            c = build_case("q_gqa%d" % g, rng, 1, 2, g, 16, 30, 6, "F32", query=("F32", 1.0))
            errs += self.run_case(c, ["h2o-head:k=4", "h2o-layer:k=4,window=2",
                                      "h2o-head:k=4,window=4+obf:inject=attn"])
        self.assert_no_errors(errs)

    def test_peaky_attention(self):
        """Large logits (queries x4): heavy hitters, weights down to ~1e-30."""
        rng = np.random.default_rng(44)
        errs = []
        for dt in ("F32", "BF16"):
            c = build_case("q_peaky_" + dt, rng, 2, 2, 2, 64, 60, 6, dt, query=("F32", 4.0))
            errs += self.run_case(c, ["h2o-head:k=10", "h2o-layer:k=10,window=2+obf",
                                      "h2o-head:k=10,recent=4+obf:inject=attn,scale=ad"])
        self.assert_no_errors(errs)

    def test_duplicate_keys_tie(self):
        """Equal prompt keys get exactly equal scores (the only exact ties)."""
        rng = np.random.default_rng(45)
        H, d, n = 2, 16, 24
        keys = []
        for _ in range(2):
            pk = rng.standard_normal((H, n, d))
            pk[:, 12:] = pk[:, :12]   # token j + 12 repeats token j
            keys.append(pk)
        c = build_case("q_dup_keys", rng, 2, H, 2, d, n, 4, "F32", query=("F32", 1.0), keys=keys)
        self.assert_no_errors(self.run_case(c, ["h2o-head:k=5", "h2o-layer:k=7,sinks=0",
                                                "h2o-head:k=9,window=1+obf"]))

    def test_softmax_scale_ignored_with_prompt_score(self):
        rng = np.random.default_rng(46)
        c = build_case("score_with_scale", rng, 2, 2, 2, 16, 30, 3, "F32", softmax_scale="0.5")
        self.assert_no_errors(self.run_case(c, ["h2o-head:k=5+obf", "h2o-layer:k=5,pool=3"]))


# ---------------------------------------------------------------------------
# accumulated importance, hist=K, h2o-auto, fidelity (FORMAT.md steps 3a, 5,
# 5a, 6 and "Fidelity")
# ---------------------------------------------------------------------------

N_HIST_SEEDS = int(_pop_arg("--hist-seeds", "0")) or max(4, N_SEEDS // 3)


def layer_entropies(case, spec):
    """The reference's mean entropy of every layer (step 3a) under `spec`."""
    return [lay.mean_entropy for lay in ref.compress(case.turn, spec, with_error=False).layers]


def pick_tau(rng, ents):
    """A tau that splits the layers' mean entropies where it can (a short
    decimal between two of them), else one near them; now and then 0 or 1."""
    r = rng.random()
    if r < 0.1:
        return "0"
    if r < 0.2:
        return "1"
    srt = sorted(ents)
    if len(srt) >= 2 and srt[-1] - srt[0] > 2e-3 and rng.random() < 0.7:
        i = int(rng.integers(0, len(srt) - 1))
        lo, hi = srt[i], srt[i + 1]
        if hi - lo > 2e-3:
            return ref.shortest_decimal(round(float(rng.uniform(lo + 5e-4, hi - 5e-4)), 3))
    x = float(np.clip(srt[int(rng.integers(0, len(srt)))] + rng.uniform(-0.05, 0.05), 0.0, 1.0))
    return ref.shortest_decimal(round(x, 3))


def random_hist_case(seed):
    """A random turn with history: chain anchors in it (history_anchors, low
    ids like a first agent's sinks or random ones), history.acc (random
    masses with some zeros, or small integers full of ties, or none),
    history.score on prompt.score turns, gen.q on 4 seeds in 10; GQA groups
    1 / 4 / 5; F32 / BF16 / F16."""
    rng = np.random.default_rng(90000 + seed)
    L = int(rng.integers(1, 4))
    H = int(rng.integers(1, 5))
    g = int(rng.choice([1, 4, 5]))
    d = int(rng.choice([8, 16, 32]))
    n_prompt = int(rng.integers(8, 61)) if rng.random() > 0.1 else int(rng.integers(0, 6))
    n_gen = int(rng.integers(1, 9)) if rng.random() > 0.1 else 0
    nh = int(rng.integers(3, 25)) if rng.random() > 0.1 else int(rng.integers(0, 3))
    first_agent = bool(rng.random() < 0.4)
    pos0 = nh + int(rng.integers(0, 300))
    dtype = str(rng.choice(["F32", "F32", "BF16", "F16"]))
    na = int(rng.integers(0, min(nh, 4) + 1))
    if rng.random() < 0.5:
        anchors = list(range(na))
    else:
        anchors = sorted(int(x) for x in rng.choice(max(pos0, nh), na, replace=False))
    query = None
    scale = None
    if rng.random() < 0.4:
        query = (str(rng.choice(["F32", dtype])), float(rng.uniform(0.5, 2.0)))
        scale = None if rng.random() < 0.6 else "0.125"
    acc = [None, "random", "random", "ties"][int(rng.integers(0, 4))]
    hscore = True if (query is None and rng.random() < 0.6) else None
    c = build_case("hist_seed%d" % seed, rng, L, H, g, d, n_prompt, n_gen, dtype, nh, first_agent, pos0,
                   query=query, softmax_scale=scale, hist_anchors=anchors, hist_acc=acc, hist_score=hscore)
    c.desc = ("L=%d H=%d S=%d d=%d n_prompt=%d n_gen=%d n_hist=%d anchors=%s first_agent=%s prompt_pos0=%d "
              "dtype=%s history.acc=%s history.score=%s scores=%s"
              % (L, H, H * g, d, n_prompt, n_gen, nh, anchors, first_agent, pos0, dtype, acc, bool(hscore),
                 "gen.q(%s, x%.3g) softmax_scale=%s" % (query[0], query[1], scale) if query else "prompt.score"))
    return c, rng, nh - na


def hist_policies(rng, case, n_cand_hist):
    """full, gen, and h2o-head / h2o-layer / h2o-auto with hist=K (K from 0
    to a little past the history candidates), k, sinks, recent, pool, window
    (gen.q), tau (from the layers' entropies), OBF, a quantizer."""
    turn = case.turn
    pols = ["full", "gen" if rng.random() < 0.5 else "gen:sinks=%d" % rng.integers(0, 6)]
    for sel in ("h2o-head", "h2o-layer", "h2o-auto"):
        params = ["k=%d" % rng.integers(1, 30)]
        if rng.random() < 0.5:
            params.append("sinks=%d" % rng.integers(0, 6))
        if rng.random() < 0.3:
            params.append("recent=%d" % rng.integers(0, 6))
        if rng.random() < 0.2:
            params.append("pool=%d" % rng.choice([3, 5]))
        if turn.has_query and rng.random() < 0.4:
            params.append("window=%d" % rng.integers(1, max(2, turn.n_gen + 2)))
        if rng.random() < 0.85:
            params.append("hist=%d" % rng.integers(0, max(1, n_cand_hist + 3)))
        if sel == "h2o-auto":
            params.append("tau=%s" % pick_tau(rng, layer_entropies(case, sel + ":" + ",".join(params))))
        rng.shuffle(params)
        spec = sel + ":" + ",".join(params)
        pols.append(spec)
        if rng.random() < 0.6:
            pols.append(spec + "+" + random_obf(rng))
        if rng.random() < 0.2:
            pols.append(spec + "+" + random_quant(rng))
    return pols


class HistorySeeds(CliTestCase):
    """Random turns with history (FORMAT.md steps 5, 5a, 6): layer.{l}.acc,
    the kept history under hist=K, anchor_pos, granularity and (gen.q turns)
    attention_error, with the tolerances of check_acc(), the ambiguity rules
    of follow_ambiguous_selection() and check_attention_error()."""

    def test_random_hist_seeds(self):
        errs = []
        for seed in range(N_HIST_SEEDS):
            case, rng, ncand = random_hist_case(seed)
            errs += self.run_case(case, hist_policies(rng, case, ncand))
        self.assert_no_errors(errs)


class HistoryBudget(CliTestCase):
    """hist=K (step 5a) edge cases."""

    def test_ties_and_zero_acc(self):
        """acc full of exact ties (small integers, or no history.acc at all:
        every acc 0 on a prompt.score turn without history.score): ties go to
        the earlier token."""
        rng = np.random.default_rng(60)
        errs = []
        for acc in ("ties", None):
            for g in (1, 4):
                c = build_case("hist_ties_%s_g%d" % (acc, g), rng, 2, 3, g, 8, 20, 3, "F32", n_hist=14,
                               first_agent=False, prompt_pos0=40, hist_anchors=[0, 1], hist_acc=acc)
                errs += self.run_case(c, ["h2o-head:k=4,hist=3", "h2o-layer:k=4,hist=5+obf", "h2o-head:hist=0,k=2",
                                          "h2o-auto:k=4,tau=0.5,hist=7"])
        self.assert_no_errors(errs)

    def test_anchor_positions_differ_per_head(self):
        """Random anchor ids: each head holds them at other indices, so
        h2o-layer's r-th candidates are other tokens in each head."""
        rng = np.random.default_rng(61)
        errs = []
        for dt in ("F32", "BF16", "F16"):
            c = build_case("hist_anchor_idx_" + dt, rng, 2, 4, 4, 16, 30, 4, dt, n_hist=18, first_agent=False,
                           prompt_pos0=200, hist_anchors=[17, 60, 121], hist_acc="random", hist_score=True)
            errs += self.run_case(c, ["h2o-layer:k=6,hist=4", "h2o-head:k=6,hist=4+obf:inject=attn",
                                      "h2o-layer:k=6,hist=0+int4:group=8", "h2o-layer:k=6,hist=15", "gen"])
        self.assert_no_errors(errs)

    def test_history_whole_or_only_anchors(self):
        """hist at or above the candidates keeps the history whole; every
        history token an anchor (no candidates); no history at all; a turn
        that is also the first agent (its own anchors join anchor_pos)."""
        rng = np.random.default_rng(62)
        errs = []
        c = build_case("hist_all_anchors", rng, 2, 2, 1, 8, 16, 2, "F32", n_hist=4, first_agent=True,
                       prompt_pos0=30, hist_anchors=[3, 9, 11, 20], hist_acc="random", hist_score=True)
        errs += self.run_case(c, ["h2o-head:k=3,hist=0", "h2o-layer:k=3,hist=2+obf", "full"])
        c = build_case("hist_whole", rng, 2, 2, 5, 8, 16, 2, "BF16", n_hist=9, first_agent=False,
                       prompt_pos0=30, hist_anchors=[0], hist_acc="random")
        errs += self.run_case(c, ["h2o-head:k=3,hist=8", "h2o-layer:k=3,hist=9", "h2o-head:k=3,hist=16777216",
                                  "h2o-head:k=3,hist=7"])
        c = build_case("hist_none", rng, 2, 2, 1, 8, 16, 2, "F32", first_agent=True)
        errs += self.run_case(c, ["h2o-head:k=3,hist=0", "h2o-auto:k=3,hist=2,tau=0.7+obf"])
        c = build_case("hist_no_anchors", rng, 1, 3, 4, 8, 16, 3, "F16", n_hist=10, first_agent=True,
                       prompt_pos0=12, hist_acc="random", hist_score=True)
        errs += self.run_case(c, ["h2o-head:k=3,hist=2,sinks=2", "h2o-layer:k=3,hist=2+int8"])
        self.assert_no_errors(errs)

    def test_history_not_ascending(self):
        """History ids need not ascend along a head (FORMAT.md only asks them
        to precede the prompt): candidates are taken "in their order along
        the head", kept ones keep it, ties go to the earlier token there."""
        rng = np.random.default_rng(64)
        errs = []
        for query in (None, ("F32", 1.0)):
            c = build_case("hist_shuffled_%s" % ("q" if query else "score"), rng, 2, 3, 4, 8, 20, 3, "F32",
                           n_hist=12, first_agent=False, prompt_pos0=50, hist_anchors=[5, 7], query=query,
                           hist_acc="ties", hist_score=None if query else True)
            for l in range(2):
                perm = [rng.permutation(12) for _ in range(3)]
                for nm in ("history.k", "history.v", "history.pos", "history.acc"):
                    dt, arr = c.tensors["layer.%d.%s" % (l, nm)]
                    c.tensors["layer.%d.%s" % (l, nm)] = (dt, np.stack([arr[h][perm[h]] for h in range(3)]))
                if not query:
                    dt, arr = c.tensors["layer.%d.history.score" % l]
                    # score rows of group h follow head h's permutation.
                    c.tensors["layer.%d.history.score" % l] = (dt, np.stack([arr[q][perm[q // 4]]
                                                                             for q in range(12)]))
            c.turn = ref.Turn(c.tensors, c.meta)
            errs += self.run_case(c, ["h2o-head:k=4,hist=3", "h2o-layer:k=4,hist=3+obf", "h2o-layer:k=4,hist=0",
                                      "h2o-auto:k=4,hist=6,tau=0.6", "full"])
        self.assert_no_errors(errs)

    def test_query_history_mass(self):
        """gen.q turns: the history's mass comes from the queries (step 5),
        also with window=; GQA groups 1 / 4 / 5."""
        rng = np.random.default_rng(63)
        errs = []
        for g, dt in ((1, "F32"), (4, "BF16"), (5, "F16")):
            c = build_case("hist_q_g%d_%s" % (g, dt), rng, 2, 2, g, 16, 30, 6, dt, n_hist=12, first_agent=False,
                           prompt_pos0=70, query=("F32", 1.5), hist_anchors=[0, 1, 2, 3],
                           hist_acc="random" if g != 4 else None)
            errs += self.run_case(c, ["full", "h2o-head:k=5,hist=3", "h2o-layer:k=5,hist=4,window=2+obf",
                                      "h2o-head:k=5,hist=2,window=1", "h2o-auto:k=5,hist=3,tau=0.8+int4"])
        self.assert_no_errors(errs)


class AutoGranularity(CliTestCase):
    """h2o-auto (step 3a): granularity metadata, and the layers selected as
    the h2o-head / h2o-layer they chose."""

    def _same_as(self, case, spec_auto, spec_other):
        """kvrelayctl's tensors for spec_auto equal its tensors for spec_other."""
        case.write(self.tmp)
        outs = []
        for spec in (spec_auto, spec_other):
            out = os.path.join(self.tmp, "same.safetensors")
            rc, text = run_cli(case, spec, out)
            STATS["cli_runs"] += 1
            if rc != 0:
                return ["[%s] policy=%r: kvrelayctl exited %d: %s" % (case.name, spec, rc, text[-1000:])]
            outs.append({k: v[1].tobytes() for k, v in ref.read_safetensors(out)[0].items()})
        if outs[0] != outs[1]:
            diff = sorted(k for k in set(outs[0]) | set(outs[1]) if outs[0].get(k) != outs[1].get(k))
            return ["[%s] %r and %r give different tensors: %s" % (case.name, spec_auto, spec_other, diff)]
        return []

    def test_tau_extremes(self):
        """tau=0: never below -> h2o-layer in every layer.  tau=1 with
        concentrated scores (entropy well below 1) -> h2o-head."""
        rng = np.random.default_rng(64)
        errs = []
        for g, dt in ((1, "F32"), (4, "BF16"), (5, "F16")):
            sc = [(np.asarray(heavy_scores(rng, 3 * g, 40), np.float64) ** 3).astype(np.float32) for _ in range(3)]
            c = build_case("auto_ext_g%d_%s" % (g, dt), rng, 3, 3, g, 16, 40, 3, dt, n_hist=8, first_agent=True,
                           prompt_pos0=20, scores=sc, hist_anchors=[1, 2], hist_acc="random", hist_score=True)
            ents = layer_entropies(c, "h2o-auto:k=6")
            assert max(ents) < 0.95, ents
            specs = ["h2o-auto:k=6,tau=0,hist=3", "h2o-auto:k=6,tau=1,hist=3+obf", "h2o-auto:k=6,tau=1,recent=2",
                     "h2o-auto:k=6,tau=0.0001,pool=3"]
            errs += self.run_case(c, specs)
            errs += self._same_as(c, "h2o-auto:k=6,tau=0,hist=3", "h2o-layer:k=6,hist=3")
            errs += self._same_as(c, "h2o-auto:k=6,tau=1,hist=3+obf", "h2o-head:k=6,hist=3+obf")
        self.assert_no_errors(errs)

    def test_tau_between_layers(self):
        """Layers of different concentration and a tau between them: some
        layers head, some layer, in one message."""
        rng = np.random.default_rng(65)
        errs = []
        for dt, q in (("F32", None), ("BF16", None), ("F32", ("F32", 1.0))):
            L, H, g, n = 4, 2, 4, 36
            sc = [(np.asarray(heavy_scores(rng, H * g, n), np.float64) ** (0.3 + l)).astype(np.float32)
                  for l in range(L)]
            qs = None
            if q is not None:
                qs = [rng.standard_normal((H * g, 5, 16)) * (0.3 + 1.2 * l) for l in range(L)]
            c = build_case("auto_mix_%s_%s" % (dt, "q" if q else "score"), rng, L, H, g, 16, n, 5, dt, n_hist=6,
                           first_agent=True, scores=None if q else sc, query=q, queries=qs,
                           hist_anchors=[0], hist_acc="random", hist_score=None if q else True,
                           prompt_pos0=10)
            ents = sorted(layer_entropies(c, "h2o-auto:k=5"))
            specs = []
            for i in range(L - 1):
                if ents[i + 1] - ents[i] > 1e-3:
                    tau = ref.shortest_decimal(round((ents[i] + ents[i + 1]) / 2, 4))
                    specs.append("h2o-auto:k=5,tau=%s,hist=2" % tau)
            specs.append("h2o-auto:k=5,sinks=2,tau=%s+obf:inject=attn" % ref.shortest_decimal(round(ents[1], 3)))
            specs.append("h2o-auto:k=5" + ("+int4:rotate=hadamard" if dt == "F32" else ""))
            errs += self.run_case(c, specs)
        self.assert_no_errors(errs)

    def test_flat_scores(self):
        """e_h = 1 by definition where T = 0 (all-zero scores) or c < 2
        (at most one candidate): never below tau=1 -> layer."""
        rng = np.random.default_rng(66)
        errs = []
        zeros = [np.zeros((4, 20), np.float32)] * 2
        c = build_case("auto_zero", rng, 2, 2, 2, 8, 20, 2, "F32", scores=zeros)
        errs += self.run_case(c, ["h2o-auto:k=3,tau=1", "h2o-auto:k=3,tau=1+obf"])
        c = build_case("auto_one_cand", rng, 2, 2, 2, 8, 5, 2, "F32", first_agent=True)
        errs += self.run_case(c, ["h2o-auto:k=3,sinks=4,tau=1", "h2o-auto:k=1,sinks=5,tau=1"])
        c = build_case("auto_q_no_gen", rng, 2, 2, 2, 8, 12, 0, "F32", query=("F32", 1.0))
        errs += self.run_case(c, ["h2o-auto:k=3,tau=1", "h2o-auto:k=3,tau=0.5,recent=2"])
        self.assert_no_errors(errs)


class Fidelity(CliTestCase):
    """attention_error (FORMAT.md "Fidelity") on gen.q turns, within the
    tolerance of check_attention_error()."""

    def test_policies_dtypes_groups(self):
        rng = np.random.default_rng(67)
        errs = []
        for g, dt, qd in ((1, "F32", "F32"), (4, "BF16", "BF16"), (5, "F16", "F32"), (4, "F32", "F32")):
            c = build_case("fid_g%d_%s" % (g, dt), rng, 2, 2, g, 32, 40, 6, dt, n_hist=8, first_agent=True,
                           prompt_pos0=20, query=(qd, 1.5), hist_anchors=[0, 1, 2, 3])
            specs = ["full", "gen", "h2o-head:k=8", "h2o-layer:k=8,hist=1+obf", "h2o-auto:k=4,window=2,hist=0",
                     "h2o-head:k=30+int8", "full+int2:group=8"]
            if dt == "F32":
                specs += ["h2o-head:k=8+obf:mode=fast+int4:rotate=hadamard"]
            errs += self.run_case(c, specs)
        self.assert_no_errors(errs)

    def test_peaky_and_no_gen(self):
        """Large logits (near one-hot weights: o_full ~ one value row) and a
        turn without generated steps (figure 0)."""
        rng = np.random.default_rng(68)
        errs = []
        c = build_case("fid_peaky", rng, 2, 2, 2, 64, 50, 5, "F32", query=("F32", 4.0))
        errs += self.run_case(c, ["h2o-head:k=4", "h2o-layer:k=10+obf", "gen:sinks=0"])
        c = build_case("fid_no_gen", rng, 1, 2, 2, 16, 20, 0, "BF16", n_hist=3, query=("BF16", 1.0))
        errs += self.run_case(c, ["h2o-head:k=4", "full"])
        self.assert_no_errors(errs)


class Determinism(CliTestCase):
    """FORMAT.md fixes how every number of a message is computed (step 0:
    float32 dot products and exponentials, float64 sums in ascending t;
    step 5: float64 sums in fixed orders, one rounding; OBF: sums in
    ascending row order "whatever the CPU's vector width"), and nothing in it
    depends on the number of threads or on where the data lies in memory.
    So the same turn and policy must give the same bytes for --threads 1, 2,
    4, 8 and for turn files under paths of other lengths (which move the
    process's memory layout)."""

    def test_same_message_for_any_threads(self):
        rng = np.random.default_rng(71)
        c = build_case("determinism", rng, 4, 4, 4, 32, 120, 12, "F32", n_hist=40, first_agent=False,
                       prompt_pos0=300, query=("F32", 1.0), hist_anchors=[0, 1, 2, 3], hist_acc="random")
        errs = []
        for spec in ("full", "h2o-auto:k=20,hist=10,tau=0.8+obf"):
            seen = {}
            for threads, name in (("1", "d"), ("2", "d"), ("4", "d"), ("8", "d"), ("1", "determinism_long_name"),
                                  ("2", "determinism_long_name"), ("2", "x" * 40), ("4", "x" * 40)):
                c.name = name
                c.write(self.tmp)
                out = os.path.join(self.tmp, "det.safetensors")
                rc, text = run_cli(c, spec, out, extra=("--threads", threads))
                STATS["cli_runs"] += 1
                if rc != 0:
                    errs.append("[determinism] policy=%r --threads %s: exit %d: %s" % (spec, threads, rc, text[-500:]))
                    break
                t, meta = ref.read_safetensors(out)
                key = (tuple((k, t[k][0], t[k][1].tobytes()) for k in sorted(t)), tuple(sorted(meta.items())))
                seen.setdefault(key, []).append("threads=%s path=%s" % (threads, len(c.path)))
            if len(seen) > 1:
                keys = list(seen)
                base_t, base_m = dict((x[0], x[2]) for x in keys[0][0]), dict(keys[0][1])
                diffs = []
                for other in keys[1:]:
                    ot, om = dict((x[0], x[2]) for x in other[0]), dict(other[1])
                    diffs.append(sorted(k for k in set(base_t) | set(ot) if base_t.get(k) != ot.get(k))
                                 + sorted("meta " + k for k in set(base_m) | set(om) if base_m.get(k) != om.get(k)))
                errs.append("[determinism] policy=%r: %d different messages from the same turn (runs: %s); "
                            "differing entries against the first: %s" % (spec, len(seen), list(seen.values()), diffs))
        self.assert_no_errors(errs)


class Chains(CliTestCase):
    """kvrelayctl's message becomes the next turn's history (history.k/v/pos
    from layer.{l}.k/v/pos, history.acc from layer.{l}.acc, history_anchors
    from anchor_pos, prompt_pos0 from next_pos): acc accumulates over the
    chain and the anchors travel (FORMAT.md steps 5, 5a, 6)."""

    def _next_turn(self, rng, name, msg_path, n_prompt, n_gen, query, g, hscore=False, pos_gap=0):
        tensors, meta = ref.read_safetensors(msg_path)
        L = 0
        while ("layer.%d.k" % L) in tensors:
            L += 1
        dt, k0 = tensors["layer.0.k"]
        H, nh, d = k0.shape
        layers = []
        for l in range(L):
            ch = np.exp(0.5 * rng.standard_normal(d))
            lay = {"pk": rng.standard_normal((H, n_prompt, d)) * ch, "pv": rng.standard_normal((H, n_prompt, d)),
                   "gk": rng.standard_normal((H, n_gen, d)) * ch, "gv": rng.standard_normal((H, n_gen, d))}
            if query:
                lay["q"] = rng.standard_normal((H * g, n_gen, d)) * ch
            else:
                lay["score"] = heavy_scores(rng, H * g, n_prompt)
            layers.append(lay)
        t = ref.make_turn_tensors(layers, dt, q_dtype="F32" if query else None)
        for l in range(L):
            t["layer.%d.history.k" % l] = tensors["layer.%d.k" % l]
            t["layer.%d.history.v" % l] = tensors["layer.%d.v" % l]
            t["layer.%d.history.pos" % l] = tensors["layer.%d.pos" % l]
            t["layer.%d.history.acc" % l] = tensors["layer.%d.acc" % l]
            if hscore:
                t["layer.%d.history.score" % l] = ("F32", heavy_scores(rng, H * g, nh))
        m = {"first_agent": "false", "prompt_pos0": str(int(meta["next_pos"]) + pos_gap)}
        if meta.get("anchor_pos", "") != "":
            m["history_anchors"] = meta["anchor_pos"]
        return Case(name, t, m)

    def test_chain(self):
        for query in (False, True):
            rng = np.random.default_rng(69 + query)
            g = 4 if query else 1
            errs = []
            c1 = build_case("chain%d_1" % query, rng, 2, 2, g, 16, 30, 4, "BF16", first_agent=True,
                            query=("F32", 1.0) if query else None)
            errs += self.run_case(c1, ["h2o-head:k=6"])
            if errs:
                self.assert_no_errors(errs)
            keep = os.path.join(self.tmp, "chain_msg1.safetensors")
            os.replace(os.path.join(self.tmp, "msg.safetensors"), keep)
            c2 = self._next_turn(rng, "chain%d_2" % query, keep, 25, 3, query, g, hscore=not query)
            errs += self.run_case(c2, ["full", "h2o-layer:k=5,hist=3+obf", "h2o-auto:k=5,hist=0,tau=0.9"])
            if not errs:
                # The anchors of turn 1 travel; turn 2's history acc = turn 1's + its mass.
                errs += self.run_case(c2, ["h2o-head:k=5,hist=4"])
                keep2 = os.path.join(self.tmp, "chain_msg2.safetensors")
                os.replace(os.path.join(self.tmp, "msg.safetensors"), keep2)
                c3 = self._next_turn(rng, "chain%d_3" % query, keep2, 20, 2, query, g, hscore=not query,
                                     pos_gap=7)
                errs += self.run_case(c3, ["h2o-head:k=4,hist=2", "h2o-layer:k=4,hist=6+int4", "gen"])
            self.assert_no_errors(errs)


# ---------------------------------------------------------------------------
# lloyd (step 7b) and demote (step 6a)
# ---------------------------------------------------------------------------

LLOYD_POLICIES = ["full+lloyd:bits=3", "h2o-head:k=8+lloyd:bits=2,seed=7", "full+lloyd:bits=4,keys=channel,group=8",
                  "h2o-head:k=8+demote:bits=2+int4", "h2o-layer:k=4+demote:bits=1",
                  "h2o-head:k=8,recent=2+demote:bits=3+lloyd:bits=4"]


def random_lloyd_stage(rng):
    params = []
    if rng.random() < 0.85:
        params.append("bits=%d" % rng.integers(1, 5))
    if rng.random() < 0.5:
        params.append("seed=%d" % [0, 7, int(rng.integers(0, 2 ** 63)), ref.U64_MAX][int(rng.integers(0, 4))])
    if rng.random() < 0.4:
        params.append("keys=channel")
        if rng.random() < 0.7:
            params.append("group=%d" % rng.choice([1, 3, 8, 32, 1000]))
    elif rng.random() < 0.2:
        params.append("keys=row")
    rng.shuffle(params)
    return "lloyd" + (":" + ",".join(params) if params else "")


def random_layer_bits(rng, L):
    """A random lloyd layers= value for L layers: mostly bits differing
    between layers and between keys and values; sometimes one KV pair for
    every layer (KV differing, e.g. 43.43, or not, e.g. 22.22)."""
    r = rng.random()
    if r < 0.1:
        b = int(rng.integers(1, 5))
        return ref.format_layer_bits([(b, b)] * L)
    if r < 0.2:
        bk, bv = (int(x) for x in rng.choice(np.arange(1, 5), 2, replace=False))
        return ref.format_layer_bits([(bk, bv)] * L)
    return ref.format_layer_bits([(int(rng.integers(1, 5)), int(rng.integers(1, 5))) for _ in range(L)])


def random_lloyd_layers_stage(rng, L):
    """lloyd:layers=... (instead of bits) with random keys, group, seed, in
    a random parameter order."""
    params = ["layers=" + random_layer_bits(rng, L)]
    if rng.random() < 0.5:
        params.append("seed=%d" % [0, 7, int(rng.integers(0, 2 ** 63)), ref.U64_MAX][int(rng.integers(0, 4))])
    if rng.random() < 0.4:
        params.append("keys=channel")
        if rng.random() < 0.7:
            params.append("group=%d" % rng.choice([1, 3, 8, 32, 1000]))
    elif rng.random() < 0.2:
        params.append("keys=row")
    rng.shuffle(params)
    return "lloyd:" + ",".join(params)


def random_lloyd_layers_policies(rng, L, wrng=None, n_gen=0):
    """lloyd:layers= after full, gen or h2o-* (sometimes with obf), and after
    h2o-* with demote."""
    sel = random_selector(rng, str(rng.choice(["full", "gen", "h2o-layer", "h2o-head"])), wrng, n_gen)
    if sel.startswith("full"):
        sel = "full"
    elif sel.startswith("h2o") and rng.random() < 0.3:
        sel += "+" + random_obf(rng)
    dm = "demote" + (":bits=%d" % rng.integers(1, 5) if rng.random() < 0.8 else "")
    sel2 = random_selector(rng, str(rng.choice(["h2o-layer", "h2o-head", "h2o-auto"])), wrng, n_gen)
    return [sel + "+" + random_lloyd_layers_stage(rng, L), sel2 + "+" + dm + "+" + random_lloyd_layers_stage(rng, L)]


def random_lloyd_policies(rng, wrng=None, n_gen=0):
    """lloyd after full, gen and h2o-* (also after obf); demote after h2o-*
    (auto included) alone, with lloyd and with intB."""
    gen = random_selector(rng, "gen")
    pols = [str(rng.choice(["full", gen])) + "+" + random_lloyd_stage(rng)]
    sel = random_selector(rng, str(rng.choice(["h2o-layer", "h2o-head"])), wrng, n_gen)
    pols.append(sel + "+" + random_lloyd_stage(rng))
    if rng.random() < 0.5:
        pols.append(sel + "+" + random_obf(rng) + "+" + random_lloyd_stage(rng))
    dm = "demote" + (":bits=%d" % rng.integers(1, 5) if rng.random() < 0.8 else "")
    sel2 = random_selector(rng, str(rng.choice(["h2o-layer", "h2o-head", "h2o-auto"])), wrng, n_gen)
    pols += [sel2 + "+" + dm, sel2 + "+" + dm + "+" + random_lloyd_stage(rng)]
    if rng.random() < 0.5:
        pols.append(sel2 + "+" + dm + "+" + random_quant(rng))
    return pols


class LloydDemote(CliTestCase):
    """lloyd and demote against the reference (module docstring, "lloyd and
    demote"); every case skips while kvrelayctl reports the stage unknown."""

    def test_policies_dtypes(self):
        rng = np.random.default_rng(90)
        errs = []
        for dt in ref.FLOAT_DTYPES:
            c = build_case("lloyd_" + dt, rng, 2, 2, 2, 32, 40, 4, dt, n_hist=3, first_agent=True)
            errs += self.run_case(c, LLOYD_POLICIES + ["h2o-layer:k=6,pool=3+demote+lloyd:bits=1,keys=channel,group=3",
                                                       "h2o-auto:k=5,tau=0.9+demote:bits=4+int8",
                                                       "h2o-head:k=6+obf:p=4+lloyd:bits=2,keys=channel"])
        self.assert_no_errors(errs)

    def test_bits_seeds_dims(self):
        rng = np.random.default_rng(91)
        errs = []
        for d in (8, 16, 64):
            c = build_case("lloyd_d%d" % d, rng, 1, 2, 1, d, 30, 3, "F32")
            specs = ["full+lloyd", "h2o-layer:k=3+demote"]   # defaults: bits=4, keys=row, seed=1; bits=2
            for bits, seed, group in ((1, 0, 1), (2, 1, 3), (3, 12345678901234567890, 8), (4, ref.U64_MAX, 1000)):
                specs.append("full+lloyd:bits=%d,seed=%d" % (bits, seed))
                specs.append("h2o-head:k=5+demote:bits=%d+lloyd:bits=%d,keys=channel,group=%d,seed=%d"
                             % (bits, 5 - bits, group, seed))
            errs += self.run_case(c, specs)
        self.assert_no_errors(errs)

    def test_query_turns(self):
        rng = np.random.default_rng(92)
        errs = []
        for dt, qd in (("F32", "F32"), ("BF16", "F32"), ("F16", "F16")):
            c = build_case("lloyd_q_" + dt, rng, 2, 2, 2, 32, 40, 6, dt, n_hist=4, first_agent=False,
                           prompt_pos0=60, query=(qd, 1.2))
            errs += self.run_case(c, ["full+lloyd:bits=3", "h2o-head:k=8+demote:bits=2",
                                      "h2o-auto:k=6,window=3+demote:bits=3+lloyd:bits=2,seed=9",
                                      "h2o-layer:k=6,recent=3+demote:bits=1+int4:rotate=hadamard"])
        self.assert_no_errors(errs)

    def test_demote_edges(self):
        rng = np.random.default_rng(93)
        errs = []
        c = build_case("demote_edges", rng, 2, 3, 1, 16, 20, 2, "F32", n_hist=5, first_agent=True)
        errs += self.run_case(c, [
            "h2o-head:k=16+demote",                          # k = the range: nothing demoted
            "h2o-head:k=100+demote:bits=3+lloyd:bits=2",
            "h2o-head:k=2,recent=30+demote",                 # the recent window takes every candidate
            "h2o-layer:k=1,sinks=0,recent=4+demote:bits=4",
            "h2o-head:k=3,pool=5+demote:bits=1+int2:group=3",
            "h2o-head:k=3,hist=2+demote:bits=2+lloyd:bits=3"])
        for n in (0, 1, 5):
            c = build_case("demote_short%d" % n, rng, 1, 2, 1, 8, n, 2, "F32", first_agent=bool(n % 2))
            errs += self.run_case(c, ["h2o-head:k=1+demote", "h2o-layer:k=2+demote:bits=3+lloyd:bits=1"])
        self.assert_no_errors(errs)

    def test_layer_bits(self):
        """lloyd:layers=KV.KV...: every layer's keys and values with their own
        bits (codes d*B/8 bytes per row, quant_bits = layer 0's keys' bits,
        quant_layer_bits unless every layer has one B for both, the canonical
        lloyd:keys=...,seed=S,layers=...), with keys=channel and demote; one
        KV pair for every layer (43.43.43 keeps quant_layer_bits, 22.22.22
        does not)."""
        rng = np.random.default_rng(97)
        errs = []
        for dt, d in (("F32", 32), ("BF16", 16), ("F16", 8)):
            c = build_case("lloyd_layers_" + dt, rng, 3, 2, 2, d, 36, 4, dt, n_hist=3, first_agent=True)
            errs += self.run_case(c, ["full+lloyd:layers=43.12.24", "full+lloyd:layers=43.43.43",
                                      "h2o-head:k=6+lloyd:seed=%d,layers=22.22.22" % ref.U64_MAX,
                                      "h2o-layer:k=5,recent=2+demote:bits=3+lloyd:layers=14.41.33,keys=channel,group=4",
                                      "h2o-head:k=6+obf:p=3+lloyd:keys=channel,layers=31.44.12,seed=0"])
        c = build_case("lloyd_layers_q", rng, 2, 2, 2, 32, 40, 6, "BF16", n_hist=4, first_agent=False,
                       prompt_pos0=60, query=("F32", 1.2))
        errs += self.run_case(c, ["gen+lloyd:layers=41.23", "h2o-auto:k=6+demote:bits=2+lloyd:layers=12.34,seed=9"])
        self.assert_no_errors(errs)

    def test_zero_and_large_rows(self):
        """Zero rows (nu = 0, u = 0), constant key channels (sigma at the
        smallest fp16 subnormal) and rows with norms near fp16's top."""
        rng = np.random.default_rng(94)
        H, n, d = 2, 24, 16
        keys, values = [], []
        for _ in range(2):
            k = rng.standard_normal((H, n, d))
            k[:, :, 5] = 0.75
            v = rng.standard_normal((H, n, d))
            v[:, [3, 9, 17], :] = 0.0
            v[:, 11, :] *= 9000.0     # norm about 3.6e4
            k[:, [4, 10], :] = 0.0
            keys.append(k)
            values.append(v)
        errs = []
        for dt in ("F32", "F16"):
            c = build_case("lloyd_rows_" + dt, rng, 2, H, 1, d, n, 2, dt, keys=keys, values=values)
            errs += self.run_case(c, ["full+lloyd:bits=2", "full+lloyd:bits=3,keys=channel,group=4",
                                      "h2o-head:k=4+demote:bits=2", "h2o-layer:k=4,sinks=0+demote:bits=4+lloyd:bits=1"])
        self.assert_no_errors(errs)

    def test_threads(self):
        """The same message for --threads 1 and 4 (nothing in steps 6a and
        7b depends on threads)."""
        rng = np.random.default_rng(95)
        c = build_case("lloyd_threads", rng, 3, 4, 2, 32, 80, 6, "BF16", n_hist=10, query=("F32", 1.0))
        c.write(self.tmp)
        errs = []
        for spec in ("h2o-head:k=8+demote:bits=3+lloyd:bits=2,keys=channel,group=4", "full+lloyd:bits=3,seed=5"):
            seen = []
            for threads in ("1", "4"):
                out = os.path.join(self.tmp, "thr%s.safetensors" % threads)
                rc, text = run_cli(c, spec, out, extra=("--threads", threads))
                STATS["cli_runs"] += 1
                if rc != 0:
                    if unknown_stage(text):
                        self.skipped.append("%s %s (%s)" % (c.name, spec, text.strip().splitlines()[-1]))
                        break
                    errs.append("[lloyd_threads] policy=%r --threads %s: exit %d: %s" % (spec, threads, rc, text[-500:]))
                    break
                with open(out, "rb") as f:
                    seen.append(f.read())
            if len(seen) == 2:
                self.ran += 1
                if seen[0] != seen[1]:
                    errs.append("[lloyd_threads] policy=%r: --threads 1 and 4 give different files" % spec)
        self.assert_no_errors(errs)


class LloydRandomSeeds(CliTestCase):
    def test_random_seeds(self):
        errs = []
        for seed in range(max(3, N_SEEDS // 6)):
            case, _ = random_case(9000 + seed)
            case.name = "lloyd_seed%d" % seed
            lrng = np.random.default_rng(19000 + seed)
            wrng = window_rng_for(case, 9000 + seed)
            specs = random_lloyd_policies(lrng, wrng, case.turn.n_gen)
            # lloyd:layers= from a generator of its own (the policies above
            # stay those of earlier versions of this test).
            specs += random_lloyd_layers_policies(np.random.default_rng(29000 + seed), case.turn.L, wrng,
                                                  case.turn.n_gen)
            errs += self.run_case(case, specs)
        self.assert_no_errors(errs)


class LloydRejections(CliTestCase):
    """Specs and turns FORMAT.md rules out for lloyd and demote fail with a
    nonzero exit status (skipped while kvrelayctl does not know the stages)."""

    def test_bad_specs_and_turns(self):
        rng = np.random.default_rng(96)
        c = build_case("lloyd_reject", rng, 1, 2, 1, 16, 12, 2, "F32")
        c.write(self.tmp)
        out = os.path.join(self.tmp, "bad.safetensors")
        rc, text = run_cli(c, "h2o-head:k=4+demote+lloyd", out)
        if rc != 0 and unknown_stage(text):
            self.skipped.append("lloyd_reject (%s)" % text.strip().splitlines()[-1])
            self.assert_no_errors([])
        errs = [] if rc == 0 else ["[lloyd_reject] valid spec 'h2o-head:k=4+demote+lloyd' refused: %s" % text[-500:]]
        self.ran += 1

        def expect_fail(case, spec, why, naming=None):
            case.write(self.tmp)
            rc, text = run_cli(case, spec, out)
            STATS["cli_runs"] += 1
            if rc == 0:
                errs.append("[%s] policy=%r: expected failure (%s) but exit 0" % (case.name, spec, why))
            elif naming is not None and naming not in text:
                errs.append("[%s] policy=%r: failed (%s) without naming %r: %s" % (case.name, spec, why, naming,
                                                                                 text[-500:]))
        for spec, why in (("full+demote", "demote after full"), ("gen+demote", "demote after gen"),
                          ("h2o-head+obf+demote", "obf with demote"), ("h2o-head+demote+obf", "demote with obf"),
                          ("h2o-head+int4+demote", "demote after the quantizer"),
                          ("h2o-head+lloyd+demote", "demote after the quantizer"),
                          ("h2o-head+demote+demote", "two demotes"), ("h2o-head+demote:bits=0", "demote bits 0"),
                          ("h2o-head+demote:bits=5", "demote bits 5"), ("h2o-head+demote:p=1", "unknown key"),
                          ("demote", "no selector"), ("full+lloyd:bits=0", "lloyd bits 0"),
                          ("full+lloyd:bits=5", "lloyd bits 5"), ("full+lloyd:bits=8", "lloyd bits 8"),
                          ("full+lloyd:keys=col", "bad keys"), ("full+lloyd+int4", "two quantizers"),
                          ("full+int4+lloyd", "two quantizers"), ("full+lloyd+lloyd", "two quantizers"),
                          ("full+lloyd:seed=-1", "negative seed"),
                          ("full+lloyd:seed=18446744073709551616", "seed past uint64"),
                          ("full+lloyd:keys=channel,group=0", "group 0"), ("full+lloyd:bogus=1", "unknown key"),
                          ("lloyd", "no selector")):
            expect_fail(c, spec, why)
        # lloyd:layers=: instead of bits, two digits 1..4 per layer joined by
        # '.', one entry per layer of the turn (refusals naming layers).
        c2 = build_case("lloyd_layers_reject", rng, 2, 2, 1, 16, 12, 2, "F32")
        for spec, why in (("full+lloyd:bits=4,layers=44.44", "bits with layers"),
                          ("full+lloyd:layers=44.44,bits=2", "layers with bits"),
                          ("full+lloyd:layers=", "empty layers"), ("full+lloyd:layers=4.4", "one digit per layer"),
                          ("full+lloyd:layers=443.44", "three digits"), ("full+lloyd:layers=44.05", "bits 0"),
                          ("full+lloyd:layers=45.44", "bits 5"), ("full+lloyd:layers=48.44", "bits 8"),
                          ("full+lloyd:layers=44.44.", "trailing dot"), ("full+lloyd:layers=.44.44", "leading dot"),
                          ("full+lloyd:layers=44..44", "empty entry"), ("full+lloyd:layers=4a.44", "not a digit"),
                          ("full+lloyd:layers=44_44", "other separator"),
                          ("full+lloyd:layers=44", "1 entry for 2 layers"),
                          ("h2o-head:k=4+demote+lloyd:layers=44.44.44", "3 entries for 2 layers"),
                          ("full+lloyd:layers=44.44,group=4", "group with keys=row")):
            expect_fail(c2, spec, why, naming="layers" if "group" not in spec else None)
        c4l = build_case("lloyd_layers_d4", rng, 2, 2, 1, 4, 12, 2, "F32")
        expect_fail(c4l, "full+lloyd:layers=24.23", "head_dim 4 with layer 1's values at 3 bits")
        expect_fail(c4l, "full+lloyd:layers=24.14,keys=channel", "head_dim 4 with layer 1's keys at 1 bit")
        # Rows of d channels, d a power of two, d * bits a multiple of 8.
        c24 = build_case("lloyd_d24", rng, 1, 2, 1, 24, 12, 2, "F32")
        for spec in ("full+lloyd:bits=2", "h2o-head:k=2+demote:bits=2"):
            expect_fail(c24, spec, "head_dim 24")
        c4 = build_case("lloyd_d4", rng, 1, 2, 1, 4, 12, 2, "F32")
        for spec in ("full+lloyd:bits=1", "h2o-head:k=2+demote:bits=3"):
            expect_fail(c4, spec, "head_dim * bits not a multiple of 8")
        # A row norm past fp16's 65504 fails, naming the tensor (the main
        # part's values; the demoted tokens' values).
        big = [rng.standard_normal((2, 12, 16)) * 3.0e4]
        cb = build_case("lloyd_big", rng, 1, 2, 1, 16, 12, 2, "F32", values=big)
        expect_fail(cb, "full+lloyd", "row norm past 65504", naming="layer.0")
        expect_fail(cb, "h2o-head:k=2+demote", "demoted row norm past 65504", naming="layer.0")
        self.assert_no_errors(errs)


class Rejections(CliTestCase):
    """Invalid specs and turns must fail with a nonzero exit status."""

    def _expect_fail(self, case, spec, why):
        out = os.path.join(self.tmp, "bad.safetensors")
        rc, text = run_cli(case, spec, out)
        return [] if rc != 0 else ["[%s] policy=%r: expected failure (%s) but exit 0" % (case.name, spec, why)]

    def _expect_fail_naming(self, case, spec, why, names, all_of=()):
        """Nonzero exit and a message naming one of `names` (and every one of
        `all_of`): FORMAT.md's refusals name the tensor or the parameter."""
        case.write(self.tmp)
        out = os.path.join(self.tmp, "bad.safetensors")
        rc, text = run_cli(case, spec, out)
        if rc == 0:
            return ["[%s] policy=%r: expected failure (%s) but exit 0" % (case.name, spec, why)]
        if not any(nm in text for nm in names) or not all(nm in text for nm in all_of):
            return ["[%s] policy=%r: failed (%s, exit %d) but the message does not name %s: %r"
                    % (case.name, spec, why, rc, " and ".join(
                        ([" or ".join(repr(x) for x in names)] if names else []) + [repr(x) for x in all_of]),
                       text[-1000:])]
        return []

    def test_query_turns(self):
        """gen.q turns FORMAT.md refuses: both/neither/mixed score tensors,
        wrong gen.q shape or dtype, non-finite queries, bad softmax_scale."""
        rng = np.random.default_rng(32)

        def base(name):
            # L=2, H=2, S=4, d=8, n_prompt=12, n_gen=3, BF16 K/V and gen.q.
            c = build_case(name, rng, 2, 2, 2, 8, 12, 3, "BF16", query=("BF16", 1.0))
            c.meta["softmax_scale"] = "0.25"
            return c

        either = ("gen.q", "prompt.score")
        bad = []
        c = base("q_and_score")
        for l in range(2):
            c.tensors["layer.%d.prompt.score" % l] = ("F32", np.ones((4, 12), np.float32))
        bad.append((c, "both prompt.score and gen.q", either))
        c = base("q_mixed")
        del c.tensors["layer.1.gen.q"]
        c.tensors["layer.1.prompt.score"] = ("F32", np.ones((4, 12), np.float32))
        bad.append((c, "gen.q in layer 0, prompt.score in layer 1", either))
        c = base("q_neither")
        for l in range(2):
            del c.tensors["layer.%d.gen.q" % l]
        bad.append((c, "neither prompt.score nor gen.q", either))
        for shape, why in (((4, 4, 8), "gen.q [S, n_gen + 1, d]"), ((4, 3, 7), "gen.q [S, n_gen, d - 1]"),
                           ((4, 12, 8), "gen.q [S, n_prompt, d]"), ((3, 3, 8), "gen.q S not a multiple of H"),
                           ((4, 24), "gen.q 2-D"), ((0, 3, 8), "gen.q S = 0")):
            c = base("q_shape")
            for l in range(2):  # every layer, so that no layer is consistent with another
                c.tensors["layer.%d.gen.q" % l] = ("BF16", ref.from_f64(rng.standard_normal(shape), "BF16"))
            bad.append((c, why, ("gen.q",)))
        c = base("q_S_differs")
        c.tensors["layer.1.gen.q"] = ("BF16", ref.from_f64(rng.standard_normal((6, 3, 8)), "BF16"))
        bad.append((c, "gen.q S differs between layers", ("gen.q",)))
        c = base("q_f16")
        for l in range(2):
            c.tensors["layer.%d.gen.q" % l] = ("F16", rng.standard_normal((4, 3, 8)).astype(np.float16))
        bad.append((c, "gen.q F16 with BF16 K/V", ("gen.q",)))
        c = base("q_dtype_mix")
        c.tensors["layer.1.gen.q"] = ("F32", rng.standard_normal((4, 3, 8)).astype(np.float32))
        bad.append((c, "gen.q BF16 in layer 0, F32 in layer 1", ("gen.q",)))
        c = base("q_i32")
        c.tensors["layer.0.gen.q"] = ("I32", np.ones((4, 3, 8), np.int32))
        bad.append((c, "gen.q I32", ("gen.q",)))
        for val, why in ((np.nan, "NaN"), (np.inf, "Inf"), (-np.inf, "-Inf")):
            c = base("q_nonfinite")
            c.tensors["layer.1.gen.q"][1][2, 1, 5] = ref.f32_to_bf16_bits(np.array([val], np.float32))[0]
            bad.append((c, "gen.q with " + why, ("layer.1.gen.q",)))
        for val in ("0", "-0.5", "nan", "inf", "-inf", "abc", "", "0.5x"):
            c = base("q_scale")
            c.meta["softmax_scale"] = val
            bad.append((c, "softmax_scale=%r" % val, ("softmax_scale",)))
        errs = []
        for c, why, names in bad:
            for spec in ("full", "h2o-head:k=4"):
                errs += self._expect_fail_naming(c, spec, why, names)
        self.assert_no_errors(errs)

    def test_history_acc_score_anchors(self):
        """Turns FORMAT.md refuses for history.acc, history.score and
        history_anchors: the message must name the tensor or the key."""
        rng = np.random.default_rng(34)

        def base(name, query=False):
            # L=2, H=2, S=4, d=8, n_prompt=12, n_gen=3, n_history=6 holding anchors 0, 1.
            return build_case(name, rng, 2, 2, 2, 8, 12, 3, "F32", n_hist=6, first_agent=False, prompt_pos0=30,
                              query=("F32", 1.0) if query else None, hist_anchors=[0, 1], hist_acc="random",
                              hist_score=None if query else True)

        bad = []
        c = base("hscore_with_q", query=True)
        for l in range(2):
            c.tensors["layer.%d.history.score" % l] = ("F32", np.ones((4, 6), np.float32))
        bad.append((c, "history.score on a gen.q turn", ("history.score",)))
        for shape, why in (((2, 7), "history.acc [H, n_history + 1]"), ((3, 6), "history.acc [H + 1, n_history]"),
                           ((12,), "history.acc 1-D"), ((2, 6, 1), "history.acc 3-D")):
            c = base("hacc_shape")
            for l in range(2):
                c.tensors["layer.%d.history.acc" % l] = ("F32", np.ones(shape, np.float32))
            bad.append((c, why, ("history.acc",)))
        c = base("hacc_f16")
        for l in range(2):
            c.tensors["layer.%d.history.acc" % l] = ("F16", np.ones((2, 6), np.float16))
        bad.append((c, "history.acc F16", ("history.acc",)))
        c = base("hacc_one_layer")
        del c.tensors["layer.1.history.acc"]
        bad.append((c, "history.acc in layer 0 only", ("layer.1.history.acc", "layer.0.history.acc")))
        for val, why in ((-1.0, "negative"), (np.nan, "NaN"), (np.inf, "Inf")):
            c = base("hacc_value")
            c.tensors["layer.1.history.acc"][1][1, 4] = val
            bad.append((c, "history.acc " + why, ("layer.1.history.acc",)))
            c = base("hscore_value")
            c.tensors["layer.0.history.score"][1][3, 2] = val
            bad.append((c, "history.score " + why, ("layer.0.history.score",)))
        c = base("hscore_shape")
        for l in range(2):
            c.tensors["layer.%d.history.score" % l] = ("F32", np.ones((4, 7), np.float32))
        bad.append((c, "history.score [S, n_history + 1]", ("history.score",)))
        c = base("hscore_one_layer")
        del c.tensors["layer.0.history.score"]
        bad.append((c, "history.score in layer 1 only", ("layer.1.history.score", "layer.0.history.score")))
        c = build_case("hacc_no_history", rng, 2, 2, 2, 8, 12, 3, "F32")
        for l in range(2):
            c.tensors["layer.%d.history.acc" % l] = ("F32", np.ones((2, 0), np.float32))
        bad.append((c, "history.acc without history", ("history.acc", "history.k", "history.pos")))
        # history_anchors: an id one head lacks, one a head holds twice, not
        # ascending, without history.
        c = base("hanch_missing")
        hp = c.tensors["layer.1.history.pos"][1]
        free = [x for x in range(30) if x not in set(hp[1].tolist())]
        c.meta["history_anchors"] = ref.format_id_list(sorted(set([0, 1, free[-1]])))
        if all(free[-1] in set(c.tensors["layer.%d.history.pos" % l][1][h].tolist()) for l in range(2)
               for h in range(2)):
            raise AssertionError("test setup: the id is held everywhere")
        bad.append((c, "history_anchors with an id some head lacks", ("history_anchors",)))
        c = base("hanch_twice")
        hp = c.tensors["layer.0.history.pos"][1]
        hp[0, 5] = hp[0, 0]          # head 0 of layer 0 holds anchor 0 twice
        hp[0] = np.sort(hp[0])
        bad.append((c, "history_anchors id held twice by a head", ("history_anchors",)))
        c = base("hanch_order")
        c.meta["history_anchors"] = "1,0"
        bad.append((c, "history_anchors not ascending", ("history_anchors",)))
        c = build_case("hanch_no_history", rng, 2, 2, 2, 8, 12, 3, "F32")
        c.meta["history_anchors"] = "0,1"
        bad.append((c, "history_anchors without history", ("history_anchors",)))
        errs = []
        for c, why, names in bad:
            for spec in ("full", "h2o-head:k=4,hist=2"):
                errs += self._expect_fail_naming(c, spec, why, names)
        self.assert_no_errors(errs)

    def test_hist_tau_specs(self):
        """hist= outside [0, 2^24] or not an integer, tau= outside [0, 1] or
        not a number, hist on gen/full, tau on other selectors: refused,
        naming the parameter."""
        rng = np.random.default_rng(35)
        c = build_case("hist_tau_specs", rng, 1, 2, 2, 8, 12, 3, "F32", n_hist=4, prompt_pos0=10)
        errs = []
        for spec, why in (("h2o-head:k=4,hist=-1", "hist=-1"), ("h2o-layer:hist=16777217", "hist above 2^24"),
                          ("h2o-auto:hist=abc", "hist not a number"), ("h2o-head:hist=1.5", "hist not an integer"),
                          ("h2o-head:hist=", "empty hist")):
            errs += self._expect_fail_naming(c, spec, why, ("hist=",))
        for spec, why in (("gen:hist=2", "hist on gen"), ("full:hist=2", "hist on full")):
            errs += self._expect_fail_naming(c, spec, why, ("hist",))
        for spec, why in (("h2o-auto:tau=1.5", "tau=1.5"), ("h2o-auto:k=4,tau=1.0000001", "tau just above 1"),
                          ("h2o-auto:tau=-0.1", "negative tau"), ("h2o-auto:tau=abc", "tau not a number"),
                          ("h2o-auto:tau=nan", "tau NaN"), ("h2o-auto:tau=inf", "tau Inf"),
                          ("h2o-auto:tau=", "empty tau")):
            errs += self._expect_fail_naming(c, spec, why, ("tau=",))
        for spec, why in (("h2o-head:tau=0.5", "tau on h2o-head"), ("h2o-layer:k=3,tau=0.5", "tau on h2o-layer"),
                          ("gen:tau=0.5", "tau on gen")):
            errs += self._expect_fail_naming(c, spec, why, ("tau",))
        self.assert_no_errors(errs)

    def test_window_specs(self):
        """window= outside [1, 2^24], not an integer, on gen/full, or with a
        prompt.score turn (FORMAT.md: InvalidArgument naming window= and the
        tensor)."""
        rng = np.random.default_rng(33)
        q = build_case("window_q", rng, 1, 2, 2, 8, 12, 3, "F32", query=("F32", 1.0))
        sc = build_case("window_score", rng, 1, 2, 2, 8, 12, 3, "F32")
        errs = []
        for spec, why in (("h2o-head:k=4,window=0", "window=0"), ("h2o-layer:k=4,window=0+obf", "window=0"),
                          ("h2o-head:window=16777217", "window above 2^24"),
                          ("h2o-head:window=-1", "negative window"), ("h2o-head:window=abc", "window not a number"),
                          ("h2o-layer:window=1.5", "window not an integer"), ("h2o-head:window=", "empty window")):
            errs += self._expect_fail_naming(q, spec, why, ("window=",))
        for spec in ("gen:window=3", "full:window=3"):
            errs += self._expect_fail_naming(q, spec, "window on " + spec.split(":")[0], ("window",))
        for spec in ("h2o-head:k=4,window=2", "h2o-layer:k=4,window=16777216+obf", "h2o-head:window=1+int8"):
            errs += self._expect_fail_naming(sc, spec, "window with prompt.score", either_tensor(),
                                             all_of=("window=",))
        self.assert_no_errors(errs)

    def test_bad_specs(self):
        rng = np.random.default_rng(30)
        c = build_case("reject", rng, 1, 2, 1, 8, 12, 2, "F32")
        c.write(self.tmp)
        errs = []
        for spec, why in (("obf", "obf without selector"), ("full+obf", "obf after full"),
                          ("gen+obf", "obf after gen"), ("h2o-head+int4+obf", "obf after quantizer"),
                          ("h2o-head+int8:rotate=hadamard", "rotate with int8"),
                          ("h2o-head+int4+int8", "two quantizers"), ("h2o-head:bogus=1", "unknown key"),
                          ("nope", "unknown stage"), ("h2o-head:k=4+obf:mode=slow", "bad mode"),
                          ("h2o-head:pool=0", "pool below 1"), ("h2o-layer:pool=2", "even pool"),
                          ("h2o-head:pool=-1", "negative pool"), ("h2o-head:pool=abc", "pool not a number"),
                          ("gen:pool=3", "pool on gen")):
            errs += self._expect_fail(c, spec, why)
        self.assert_no_errors(errs)

    def test_bad_turns(self):
        rng = np.random.default_rng(31)
        errs = []
        c = build_case("neg_score", rng, 1, 2, 1, 8, 6, 1, "F32")
        c.tensors["layer.0.prompt.score"][1][0, 2] = -1.0
        c.write(self.tmp)
        errs += self._expect_fail(c, "full", "negative score")
        c = build_case("nan_v", rng, 1, 2, 1, 8, 6, 1, "F32")
        c.tensors["layer.0.prompt.v"][1][1, 2, 3] = np.nan
        c.write(self.tmp)
        errs += self._expect_fail(c, "full", "NaN value")
        c = build_case("bad_S", rng, 1, 2, 1, 8, 6, 1, "F32")
        c.tensors["layer.0.prompt.score"] = ("F32", np.ones((3, 6), np.float32))
        c.write(self.tmp)
        errs += self._expect_fail(c, "full", "S not a multiple of H")
        self.assert_no_errors(errs)


if __name__ == "__main__":
    prog = unittest.main(exit=False, verbosity=2 if "-v" in sys.argv else 1)
    print("reference test: %d policies checked (%d on gen.q turns, %d ambiguous top-k sets followed), "
          "%d kvrelayctl runs" % (STATS["policies"], STATS["query_policies"], STATS["ambiguous_followed"],
                                  STATS["cli_runs"]))
    if STATS["hist_policies"] or STATS["auto_policies"] or STATS["fidelity_checked"]:
        print("history/auto/fidelity: %d policies with hist=, %d h2o-auto, %d attention_error figures "
              "checked (worst |diff| / tolerance %.3g), h2o-auto layers checked: %d head, %d layer; followed %d "
              "ambiguous history rankings and %d granularities at tau"
              % (STATS["hist_policies"], STATS["auto_policies"], STATS["fidelity_checked"], STATS["fidelity_worst"],
                 STATS["gran_head"], STATS["gran_layer"], STATS["hist_ambiguous_followed"],
                 STATS["gran_ambiguous_followed"]))
    if STATS["acc_score_values"] or STATS["acc_query_values"]:
        print("acc: %d values on prompt.score turns (%d one float32 ulp off, the rest exact), %d on gen.q turns "
              "(worst |diff| / tolerance %.3g)" % (STATS["acc_score_values"], STATS["acc_score_ulp"],
                                                   STATS["acc_query_values"], STATS["acc_query_worst"]))
    if STATS["lloyd_policies"] or STATS["demote_policies"] or STATS["skipped_unknown_stage"]:
        print("lloyd/demote: %d lloyd and %d demote policies checked (%d demoted tokens), %d codes (%d within "
              "float32 rounding of a threshold took the neighbouring code), %d norms (%d one fp16 ulp off at a "
              "rounding midpoint), %d keys=channel stats (%d not equal to the float64 reference's); %d policies "
              "SKIPPED (kvrelayctl: unknown stage)"
              % (STATS["lloyd_policies"], STATS["demote_policies"], STATS["demoted_tokens"], STATS["lloyd_codes"],
                 STATS["lloyd_codes_near"], STATS["lloyd_norms"], STATS["lloyd_norm_mid"], STATS["chan_stats"],
                 STATS["chan_stats_inexact"], STATS["skipped_unknown_stage"]))
    for n in NOTES:
        print("note:", n)
    sys.exit(0 if prog.result.wasSuccessful() else 1)
