#!/usr/bin/python3
"""Independent float64 numpy reference of kvrelay's compression (docs/FORMAT.md).

Written from docs/FORMAT.md and the comment block of core/quant.h only; it
shares no code with the C++ implementation. Pure Python 3 + numpy.

Contents
  * a minimal safetensors reader/writer (F32, F16, BF16, I32, U8),
  * dtype helpers (bf16 <-> f32 by bit manipulation, round to nearest even;
    directed fp16 rounding used by the quantizer),
  * policy spec parsing,
  * query_scores(): scores from gen.q (FORMAT.md step 0), float64 softmax of
    eager attention over history + prompt + gen 0..t, summed over the steps
    of the window,
  * compress(): scores (prompt.score, or query_scores in float64) -> anchors/
    candidates -> selection -> OBF (exact, float64 SVD) -> composition with
    positions -> byte accounting,
  * quantize_layer()/dequantize_layer()/pack_codes()/unpack_codes(),
  * selftest(): internal invariants, run with
        /usr/bin/python3 tests/reference/kvrelay_ref.py --selftest

Choices where FORMAT.md leaves room (see also the report in the test file):
  * `full` has no parameters; its anchor/candidate split uses the default
    sinks=4 (s = min(4, n) if first_agent else 0).  The composed tensors are
    identical either way (anchors + all candidates = the whole prompt); only
    the n_anchor/n_kept metadata split depends on it.
  * Numerical rank of V_keep: singular values sigma_i > 1e-9 * sigma_max
    (singular values, not eigenvalues of V_keep^T V_keep).
  * Numerical rank of R (how many of the top-p right singular vectors exist):
    FORMAT.md does not give a tolerance; we use sigma_i > 1e-9 * sigma_max(R).
    Directions with tiny sigma_i contribute at most ~sigma_i to rbar, so the
    choice only matters at that level.
  * Quantizer code rounding: round half to even (np.rint); ties are measure
    zero for random data and the tests never depend on them.
  * Scores from queries: the float64 definition of FORMAT.md step 0, with the
    row's softmax denominator summed by numpy (pairwise) and the steps summed
    one at a time in ascending t.  `softmax_scale` is parsed as a float64
    (Python float()); the default is 1/math.sqrt(d) in float64.
"""

import json
import math
import struct
import sys

import numpy as np

# ---------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------

FLOAT_DTYPES = ("F32", "F16", "BF16")
_STORAGE = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # raw bf16 bit patterns
    "I32": np.dtype("<i4"),
    "U8": np.dtype("u1"),
}
DTYPE_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "U8": 1}


def f32_to_bf16_bits(x):
    """float32 array -> uint16 bf16 bit patterns, round to nearest even."""
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = x.view(np.uint32).astype(np.uint64)
    bias = np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))
    r = ((u + bias) >> np.uint64(16)).astype(np.uint16)
    # NaN stays NaN (quiet); not expected in kvrelay data.
    nan = np.isnan(x)
    if nan.any():
        r = r.copy()
        r[nan] = ((u[nan] >> np.uint64(16)) | np.uint64(0x40)).astype(np.uint16)
    return r


def bf16_bits_to_f32(b):
    b = np.ascontiguousarray(np.asarray(b, dtype=np.uint16))
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_f64(arr, dtype):
    """Storage array of a float dtype -> float64 values."""
    if dtype == "BF16":
        return bf16_bits_to_f32(arr).astype(np.float64)
    return np.asarray(arr).astype(np.float64)


def from_f64(x, dtype):
    """float64 values -> storage array of `dtype`, round to nearest even.

    F32 and F16 are rounded directly from float64 (numpy's conversions are
    correctly rounded).  BF16 goes float64 -> float32 -> bf16, which can
    double-round in rare cases; callers compare BF16 with a 1-ulp tolerance.
    """
    x = np.asarray(x, dtype=np.float64)
    if dtype == "F32":
        return x.astype(np.float32)
    if dtype == "F16":
        return x.astype(np.float16)
    if dtype == "BF16":
        return f32_to_bf16_bits(x.astype(np.float32))
    raise ValueError("not a float dtype: %s" % dtype)


def ulp(x, dtype):
    """Spacing of `dtype` at |x| (elementwise, float64)."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    if dtype == "F32":
        return np.spacing(a.astype(np.float32)).astype(np.float64)
    if dtype == "F16":
        return np.spacing(np.minimum(a, 65504.0).astype(np.float16)).astype(np.float64)
    if dtype == "BF16":
        # bf16 has 8 significant bits: spacing = 2^(e-7); min normal 2^-126.
        with np.errstate(divide="ignore"):
            e = np.floor(np.log2(np.maximum(a, 2.0 ** -126)))
        return np.exp2(e - 7)
    raise ValueError(dtype)


F16_MIN_SUBNORMAL = 2.0 ** -24


def f16_round_down(x):
    """float64 -> float16, rounded toward -inf.  Raises if not representable."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        y = x.astype(np.float16)
    too_big = y.astype(np.float64) > x
    y = np.where(too_big, np.nextafter(y, np.float16(-np.inf)), y)
    if not np.all(np.isfinite(y)):
        raise OverflowError("fp16 zero out of range")
    return y


def f16_round_up(x):
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        y = x.astype(np.float16)
    too_small = y.astype(np.float64) < x
    y = np.where(too_small, np.nextafter(y, np.float16(np.inf)), y)
    if not np.all(np.isfinite(y)):
        raise OverflowError("fp16 scale out of range")
    return y


# ---------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------

def read_safetensors(path):
    """Returns (tensors, metadata); tensors: name -> (dtype, ndarray storage)."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError("%s: too short" % path)
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, info in header.items():
        dt = info["dtype"]
        shape = tuple(int(s) for s in info["shape"])
        b, e = info["data_offsets"]
        st = _STORAGE[dt]
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if e - b != count * st.itemsize:
            raise ValueError("%s: tensor %s: %d bytes for shape %s %s"
                             % (path, name, e - b, shape, dt))
        arr = np.frombuffer(data[b:e], dtype=st).reshape(shape).copy()
        tensors[name] = (dt, arr)
    return tensors, meta


def write_safetensors(path, tensors, metadata=None):
    """tensors: name -> (dtype, ndarray).  Arrays are cast to the storage type."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    chunks = []
    off = 0
    for name in sorted(tensors):
        dt, arr = tensors[name]
        a = np.ascontiguousarray(np.asarray(arr).astype(_STORAGE[dt]))
        raw = a.tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape),
                        "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((8 - len(hjson) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for c in chunks:
            f.write(c)


# ---------------------------------------------------------------------------
# policy specs
# ---------------------------------------------------------------------------

_SELECTORS = {
    "full": {},
    "gen": {"sinks": 4},
    "h2o-layer": {"k": 32, "sinks": 4, "recent": 0, "pool": 1, "window": None},
    "h2o-head": {"k": 32, "sinks": 4, "recent": 0, "pool": 1, "window": None},
}
WINDOW_MAX = 1 << 24
_OBF = {"p": 8, "mode": "exact", "inject": "uniform", "scale": "ad_over_as",
        "iters": 12, "oversample": 10}
_QUANT = {"group": 32, "rotate": "none"}


def parse_policy(spec):
    """Returns dict(selector=dict(name,...), obf=dict|None, quant=dict|None)."""
    for i, ch in enumerate(spec):
        if not "!" <= ch <= "~":
            raise ValueError("byte %d of %r: expected printable ASCII without spaces" % (i, spec))
    stages = spec.split("+")
    out = {"selector": None, "obf": None, "quant": None}
    for i, st in enumerate(stages):
        name, _, params = st.partition(":")
        kv = {}
        if params:
            for item in params.split(","):
                key, eq, val = item.partition("=")
                if not eq:
                    raise ValueError("bad parameter %r in %r" % (item, spec))
                kv[key] = val
        if i == 0:
            if name not in _SELECTORS:
                raise ValueError("first stage must be a selector: %r" % spec)
            sel = dict(_SELECTORS[name])
            for key, val in kv.items():
                if key not in sel:
                    raise ValueError("unknown key %s for %s" % (key, name))
                sel[key] = int(val)
            if sel.get("pool", 1) < 1 or sel.get("pool", 1) % 2 == 0:
                raise ValueError("pool must be odd and >= 1: %r" % spec)
            if sel.get("window") is not None and not 1 <= sel["window"] <= WINDOW_MAX:
                raise ValueError("window=%d: expected an integer in [1, %d]" % (sel["window"], WINDOW_MAX))
            sel["name"] = name
            out["selector"] = sel
        elif name == "obf":
            if out["obf"] is not None or out["quant"] is not None:
                raise ValueError("obf misplaced in %r" % spec)
            if not out["selector"]["name"].startswith("h2o-"):
                raise ValueError("obf only after h2o-*")
            o = dict(_OBF)
            for key, val in kv.items():
                if key not in o:
                    raise ValueError("unknown obf key %s" % key)
                o[key] = int(val) if key in ("p", "iters", "oversample") else val
            out["obf"] = o
        elif name in ("int8", "int4", "int2"):
            if out["quant"] is not None:
                raise ValueError("two quantizers")
            q = dict(_QUANT)
            for key, val in kv.items():
                if key not in q:
                    raise ValueError("unknown quant key %s" % key)
                q[key] = int(val) if key == "group" else val
            q["bits"] = int(name[3:])
            q["rotate"] = (q["rotate"] == "hadamard")
            out["quant"] = q
        else:
            raise ValueError("unknown stage %r" % name)
    return out


def canonical_selector(sel):
    """The canonical form of a parsed selector stage (FORMAT.md "Policy specs"):
    every parameter except pool, which is listed only when it is not 1, and
    window, listed only when given (after pool)."""
    name = sel["name"]
    if name == "full":
        return "full"
    if name == "gen":
        return "gen:sinks=%d" % sel["sinks"]
    out = "%s:k=%d,sinks=%d,recent=%d" % (name, sel["k"], sel["sinks"], sel["recent"])
    if sel["pool"] != 1:
        out += ",pool=%d" % sel["pool"]
    if sel.get("window") is not None:
        out += ",window=%d" % sel["window"]
    return out


# ---------------------------------------------------------------------------
# turns
# ---------------------------------------------------------------------------

class Turn(object):
    """A turn file's content; arrays are kept in their storage form."""

    def __init__(self, tensors, meta):
        self.tensors = tensors
        self.meta = dict(meta)
        L = 0
        while ("layer.%d.prompt.k" % L) in tensors:
            L += 1
        self.L = L
        dt, k0 = tensors["layer.0.prompt.k"]
        self.dtype = dt
        self.H, self.n_prompt, self.d = k0.shape
        self.n_gen = tensors["layer.0.gen.k"][1].shape[1]
        # Scores from queries (FORMAT.md step 0) when the turn has gen.q.
        self.has_query = "layer.0.gen.q" in tensors
        if self.has_query:
            self.q_dtype = tensors["layer.0.gen.q"][0]
            self.S = tensors["layer.0.gen.q"][1].shape[0]
        else:
            self.q_dtype = None
            self.S = tensors["layer.0.prompt.score"][1].shape[0]
        # softmax_scale is ignored on a turn with prompt.score.
        self.softmax_scale = None
        if self.has_query:
            self.softmax_scale = (float(self.meta["softmax_scale"]) if "softmax_scale" in self.meta
                                  else 1.0 / math.sqrt(self.d))
        self.has_history = "layer.0.history.k" in tensors
        self.n_history = tensors["layer.0.history.k"][1].shape[1] if self.has_history else 0
        self.first_agent = self.meta.get("first_agent", "true") == "true"
        self.prompt_pos0 = int(self.meta.get("prompt_pos0", self.n_history))

    def arr(self, name):
        return self.tensors[name][1]

    @staticmethod
    def load(path):
        t, m = read_safetensors(path)
        return Turn(t, m)


# ---------------------------------------------------------------------------
# compression semantics
# ---------------------------------------------------------------------------

def query_weights(q, hk, pk, gk, scale=None):
    """Eager-attention softmax weights of the generated steps (FORMAT.md step 0).

    q: [S, n_gen, d]; hk: [H, n_history, d]; pk: [H, n_prompt, d];
    gk: [H, n_gen, d] -- float64 arrays holding the exact values of the stored
    dtype (see to_f64).  scale: the logit scale (None: 1/sqrt(d)).

    Returns W [S, n_gen, M] float64, M = n_history + n_prompt + n_gen, over
    the keys [history; prompt; gen] of KV head h = q // (S/H): row (q, t) is
    softmax((k_i . q_t) * scale) over the m_t = n_history + n_prompt + t + 1
    keys that step t sees (max subtracted first), and 0 past them.
    """
    q = np.asarray(q, dtype=np.float64)
    hk = np.asarray(hk, dtype=np.float64)
    pk = np.asarray(pk, dtype=np.float64)
    gk = np.asarray(gk, dtype=np.float64)
    S, ng, d = q.shape
    H, nh = hk.shape[0], hk.shape[1]
    n = pk.shape[1]
    assert H >= 1 and S >= H and S % H == 0, (S, H)
    assert hk.shape == (H, nh, d) and pk.shape == (H, n, d) and gk.shape == (H, ng, d), \
        (q.shape, hk.shape, pk.shape, gk.shape)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    g = S // H
    M = nh + n + ng
    W = np.zeros((S, ng, M), dtype=np.float64)
    for h in range(H):
        keys = np.concatenate([hk[h], pk[h], gk[h]], axis=0)  # [M, d]
        for qi in range(h * g, (h + 1) * g):
            for t in range(ng):
                m = nh + n + t + 1
                z = (keys[:m] @ q[qi, t]) * scale
                e = np.exp(z - np.max(z))
                W[qi, t, :m] = e / np.sum(e)
    return W


def query_scores(q, hk, pk, gk, scale=None, window=None):
    """FORMAT.md step 0: prompt scores from the generated steps' queries.

    Arguments as query_weights(); window: None (every step) or an integer
    >= 1 (the last `window` steps; more than n_gen means all of them).

    Returns score [S, n_prompt] float64: score[q][j] = sum over the steps t in
    the window (t >= n_gen - window) of the weight step t of score head q puts
    on prompt token j, accumulated in float64 in ascending t.
    """
    W = query_weights(q, hk, pk, gk, scale)
    S, ng, _ = W.shape
    nh, n = np.shape(hk)[1], np.shape(pk)[1]
    t0 = 0 if window is None else max(0, ng - int(window))
    out = np.zeros((S, n), dtype=np.float64)
    for t in range(t0, ng):  # ascending t, one add at a time
        out = out + W[:, t, nh:nh + n]
    return out


def turn_scores(turn, l, window=None):
    """The [S, n_prompt] scores of layer l: prompt.score as float64 (exact
    F32 values), or query_scores() of gen.q kept in float64 (not rounded to
    F32).  `window` needs gen.q, as in kvrelay (InvalidArgument there)."""
    if not turn.has_query:
        if window is not None:
            raise ValueError("window=%d needs layer.%d.gen.q; the turn has layer.%d.prompt.score"
                             % (window, l, l))
        return np.asarray(turn.arr("layer.%d.prompt.score" % l), dtype=np.float64)
    dt = turn.dtype
    q = to_f64(turn.arr("layer.%d.gen.q" % l), turn.q_dtype)
    if turn.has_history:
        hk = to_f64(turn.arr("layer.%d.history.k" % l), dt)
    else:
        hk = np.zeros((turn.H, 0, turn.d), dtype=np.float64)
    pk = to_f64(turn.arr("layer.%d.prompt.k" % l), dt)
    gk = to_f64(turn.arr("layer.%d.gen.k" % l), dt)
    return query_scores(q, hk, pk, gk, turn.softmax_scale, window)


def reduce_scores(score_f32, H):
    """[S, n] F32 -> (A [H, n] float64, A_layer [n] float64), sequential sums."""
    sc = np.asarray(score_f32, dtype=np.float64)
    S, n = sc.shape
    g = S // H
    A = np.zeros((H, n), dtype=np.float64)
    for h in range(H):
        acc = np.zeros(n, dtype=np.float64)
        for q in range(h * g, (h + 1) * g):  # ascending q, one add at a time
            acc = acc + sc[q]
        A[h] = acc
    A_layer = np.zeros(n, dtype=np.float64)
    for h in range(H):  # ascending h
        A_layer = A_layer + A[h]
    return A, A_layer


def pool_scores(score, s, e, pool):
    """FORMAT.md step 3: P[j] = max a[i] over max(s, j-r) <= i <= min(e-1, j+r),
    r = (pool-1)//2, for j in the top-k range s..e-1 (other entries unchanged)."""
    a = np.asarray(score, dtype=np.float64)
    P = a.copy()
    r = (pool - 1) // 2
    for j in range(s, e):
        lo, hi = max(s, j - r), min(e - 1, j + r)
        P[j] = np.max(a[lo:hi + 1])
    return P


def select(score, s, n, k, recent, pool=1):
    """Kept prompt indices (ascending) among candidates s..n-1."""
    n_cand = n - s
    rw = min(recent, n_cand)
    others = list(range(s, n - rw))
    recent_idx = list(range(n - rw, n))
    if k >= len(others):
        chosen = others
    else:
        P = pool_scores(score, s, n - rw, pool)
        # Highest score first, ties to the lower position (exact float keys).
        order = sorted(others, key=lambda j: (-float(P[j]), j))
        chosen = order[:k]
    return sorted(chosen + recent_idx)


def _numerical_rank(sv, rel):
    if sv.size == 0 or not sv[0] > 0:
        return 0
    return int(np.count_nonzero(sv > rel * sv[0]))


def obf_head(V, keep, dele, A_h, opts):
    """Exact float64 OBF for one head.

    V: [n_prompt, d] float64 prompt values; keep/dele: prompt indices of kept
    and deleted candidates; A_h: [n_prompt] float64 scores of this head.
    Returns None (head skipped) or a dict with 'add' ([len(keep), d], the
    float64 increment of each kept row), 'delta', 'Q', 'C', 'R'.
    """
    if len(keep) == 0 or len(dele) == 0:
        return None
    Vk = V[keep]
    Vd = V[dele]
    _, sk, vtk = np.linalg.svd(Vk, full_matrices=False)
    r = _numerical_rank(sk, 1e-9)
    Q = vtk[:r].T  # d x r
    R = Vd - (Vd @ Q) @ Q.T
    if np.linalg.norm(R) <= 1e-10:
        return None
    _, sr, vtr = np.linalg.svd(R, full_matrices=False)
    rr = _numerical_rank(sr, 1e-9)
    C = vtr[:min(opts["p"], rr)]  # p' x d
    w = np.array([A_h[j] for j in dele], dtype=np.float64)
    wsum = 0.0
    for x in w:
        wsum += x
    if wsum <= 1e-12:
        w = np.ones_like(w)
        wsum = float(len(w))
    rbar = (w @ R) / wsum
    A_del = 0.0
    for j in dele:
        A_del += A_h[j]
    A_keep = 0.0
    for j in keep:
        A_keep += A_h[j]
    mode = opts["scale"]
    if mode == "ad_over_as":
        factor = A_del / (A_keep + 1e-12)
    elif mode == "ad_frac":
        factor = A_del / (A_del + A_keep + 1e-12)
    elif mode == "ad":
        factor = A_del
    elif mode == "none":
        factor = 1.0
    else:
        raise ValueError("scale mode %r" % mode)
    delta = factor * ((rbar @ C.T) @ C)
    n_keep = len(keep)
    if opts["inject"] == "uniform":
        coef = np.ones(n_keep)
    elif opts["inject"] == "attn":
        a = np.array([A_h[t] for t in keep], dtype=np.float64)
        asum = 0.0
        for x in a:
            asum += x
        coef = np.ones(n_keep) if asum <= 1e-12 else n_keep * a / asum
    else:
        raise ValueError("inject mode %r" % opts["inject"])
    add = coef[:, None] * delta[None, :]
    return {"add": add, "delta": delta, "Q": Q, "C": C, "R": R, "factor": factor,
            "rbar": rbar, "coef": coef, "sigma_R": sr}


class RefLayer(object):
    pass


class RefMessage(object):
    pass


def dense_layer_bytes(H, n, d, dtype):
    return 2 * H * n * d * DTYPE_SIZE[dtype] + 4 * H * n


def quant_layer_bytes(H, n, d, bits, group):
    codes = 2 * H * n * (d * bits // 8)
    kstat = 2 * H * (-(-n // group) if n else 0) * d * 2
    vstat = 2 * H * n * 2
    return codes + kstat + vstat + 4 * H * n


def compress(turn, policy, kept_override=None):
    """Reference compression. `policy` is a spec string or parse_policy() dict.

    kept_override: optional {layer: [kept prompt indices per head]} replacing
    the selection of those layers (the tests use it to follow kvrelay's choice
    where float32 query scores make the reference's top-k ambiguous); the
    rest (composition, OBF with this layer's A[h]) is computed as usual."""
    pol = parse_policy(policy) if isinstance(policy, str) else policy
    sel = pol["selector"]
    obf = pol["obf"]
    quant = pol["quant"]
    H, d, n, dt = turn.H, turn.d, turn.n_prompt, turn.dtype
    sinks = sel.get("sinks", 4)
    s = min(sinks, n) if turn.first_agent else 0
    p0 = turn.prompt_pos0
    nh, ng = turn.n_history, turn.n_gen
    msg = RefMessage()
    msg.policy = pol
    msg.dtype = dt
    msg.layers = []
    n_kept = None
    for l in range(turn.L):
        pk = turn.arr("layer.%d.prompt.k" % l)
        pv = turn.arr("layer.%d.prompt.v" % l)
        gk = turn.arr("layer.%d.gen.k" % l)
        gv = turn.arr("layer.%d.gen.v" % l)
        score = turn_scores(turn, l, sel.get("window"))
        A, A_layer = reduce_scores(score, H)
        if turn.has_history:
            hk = turn.arr("layer.%d.history.k" % l)
            hv = turn.arr("layer.%d.history.v" % l)
            hpos = turn.arr("layer.%d.history.pos" % l).astype(np.int64)
        else:
            hk = np.zeros((H, 0, d), dtype=pk.dtype)
            hv = np.zeros((H, 0, d), dtype=pk.dtype)
            hpos = np.zeros((H, 0), dtype=np.int64)
        cands = list(range(s, n))
        kept = []  # per head
        for h in range(H):
            if sel["name"] == "full":
                kept.append(cands)
            elif sel["name"] == "gen":
                kept.append([])
            elif sel["name"] == "h2o-layer":
                kept.append(select(A_layer, s, n, sel["k"], sel["recent"], sel["pool"]))
            elif sel["name"] == "h2o-head":
                kept.append(select(A[h], s, n, sel["k"], sel["recent"], sel["pool"]))
            else:
                raise ValueError(sel["name"])
        if kept_override is not None and l in kept_override:
            kept = [list(x) for x in kept_override[l]]
            assert len(kept) == H
        nk = len(kept[0])
        assert all(len(x) == nk for x in kept)
        if n_kept is None:
            n_kept = nk
        assert n_kept == nk
        ntot = nh + s + nk + ng
        K = np.zeros((H, ntot, d), dtype=pk.dtype)
        V = np.zeros((H, ntot, d), dtype=pk.dtype)
        V64 = np.zeros((H, ntot, d), dtype=np.float64)   # exact (pre-rounding)
        Vorig64 = np.zeros((H, ntot, d), dtype=np.float64)
        D64 = np.zeros((H, ntot, d), dtype=np.float64)   # increments
        part = np.zeros(ntot, dtype="<U7")
        pos = np.zeros((H, ntot), dtype=np.int64)
        modified = np.zeros((H, ntot), dtype=bool)
        obf_info = [None] * H
        part[:nh] = "history"
        part[nh:nh + s] = "anchor"
        part[nh + s:nh + s + nk] = "kept"
        part[nh + s + nk:] = "gen"
        for h in range(H):
            rows_k = [hk[h], pk[h, :s], pk[h, kept[h]], gk[h]]
            rows_v = [hv[h], pv[h, :s], pv[h, kept[h]], gv[h]]
            K[h] = np.concatenate(rows_k, axis=0)
            V[h] = np.concatenate(rows_v, axis=0)
            pos[h] = np.concatenate([
                hpos[h],
                p0 + np.arange(s, dtype=np.int64),
                p0 + np.asarray(kept[h], dtype=np.int64),
                p0 + n + np.arange(ng, dtype=np.int64)])
            Vorig64[h] = to_f64(V[h], dt)
            V64[h] = Vorig64[h]
            if obf is not None:
                vals = to_f64(pv[h], dt)
                keep_set = set(kept[h])
                dele = [j for j in cands if j not in keep_set]
                res = obf_head(vals, kept[h], dele, A[h], obf)
                obf_info[h] = res
                if res is not None:
                    sl = slice(nh + s, nh + s + nk)
                    D64[h, sl] = res["add"]
                    V64[h, sl] = Vorig64[h, sl] + res["add"]
                    V[h, sl] = from_f64(V64[h, sl], dt)
                    modified[h, sl] = True
        lay = RefLayer()
        lay.k, lay.v, lay.pos = K, V, pos
        lay.v64, lay.vorig64, lay.add64 = V64, Vorig64, D64
        lay.modified, lay.part, lay.kept, lay.obf = modified, part, kept, obf_info
        lay.score, lay.A, lay.A_layer = score, A, A_layer
        msg.layers.append(lay)
    msg.n_history, msg.n_anchor, msg.n_kept, msg.n_gen = nh, s, n_kept, ng
    msg.n = nh + s + n_kept + ng
    msg.full_bytes = turn.L * dense_layer_bytes(H, nh + n + ng, d, dt)
    if quant is None:
        msg.sent_bytes = turn.L * dense_layer_bytes(H, msg.n, d, dt)
    else:
        msg.sent_bytes = turn.L * quant_layer_bytes(H, msg.n, d, quant["bits"], quant["group"])
    return msg


# ---------------------------------------------------------------------------
# quantization (core/quant.h comment block + FORMAT.md packed layout)
# ---------------------------------------------------------------------------

def hadamard(d):
    """Orthonormal Walsh-Hadamard matrix (Sylvester order) H_d / sqrt(d)."""
    assert d >= 1 and d & (d - 1) == 0
    Hm = np.array([[1.0]])
    while Hm.shape[0] < d:
        Hm = np.block([[Hm, Hm], [Hm, -Hm]])
    return Hm / math.sqrt(d)


def _stats(lo, hi, bits):
    levels = (1 << bits) - 1
    z = f16_round_down(lo)
    s = f16_round_up((hi - z.astype(np.float64)) / levels)
    s = np.maximum(s, np.float16(F16_MIN_SUBNORMAL))
    return z, s


def _codes(x, z, s, bits):
    levels = (1 << bits) - 1
    c = np.rint((x - z.astype(np.float64)) / s.astype(np.float64))
    return np.clip(c, 0, levels).astype(np.int64)


def quantize_layer(k64, v64, bits, group, rotate):
    """k64, v64: [H, n, d] float64 (values of the message in its dtype).

    Returns dict with codes_k, codes_v ([H, n, d] int), k_scale, k_zero
    ([H, ceil(n/group), d] fp16), v_scale, v_zero ([H, n] fp16), and the
    (rotated) float64 inputs xk, xv that were quantized.
    """
    H, n, d = k64.shape
    if rotate:
        Hd = hadamard(d)
        xk = k64 @ Hd
        xv = v64 @ Hd
    else:
        xk, xv = k64, v64
    ng = -(-n // group) if n else 0
    kz = np.zeros((H, ng, d), dtype=np.float16)
    ks = np.zeros((H, ng, d), dtype=np.float16)
    ck = np.zeros((H, n, d), dtype=np.int64)
    for gi in range(ng):
        a, b = gi * group, min(n, (gi + 1) * group)
        blk = xk[:, a:b, :]
        z, s = _stats(blk.min(axis=1), blk.max(axis=1), bits)
        kz[:, gi], ks[:, gi] = z, s
        ck[:, a:b] = _codes(blk, z[:, None, :], s[:, None, :], bits)
    if n:
        vz, vs = _stats(xv.min(axis=2), xv.max(axis=2), bits)
    else:
        vz = np.zeros((H, 0), dtype=np.float16)
        vs = np.zeros((H, 0), dtype=np.float16)
    cv = _codes(xv, vz[:, :, None], vs[:, :, None], bits) if n else np.zeros((H, 0, d), np.int64)
    return {"codes_k": ck, "codes_v": cv, "k_scale": ks, "k_zero": kz,
            "v_scale": vs, "v_zero": vz, "xk": xk, "xv": xv}


def expand_k_stat(stat, n, group):
    """[H, ceil(n/group), d] -> [H, n, d] float64."""
    st = stat.astype(np.float64)
    if n == 0:
        return np.zeros((st.shape[0], 0, st.shape[2]))
    return np.repeat(st, group, axis=1)[:, :n, :]


def dequantize_layer(ck, cv, ks, kz, vs, vz, group, rotate):
    """Codes + fp16 stats -> float64 K, V (rotated back when `rotate`).

    Also returns the per-element scale arrays [H, n, d] (rotated domain)."""
    H, n, d = ck.shape
    sk = expand_k_stat(ks, n, group)
    zk = expand_k_stat(kz, n, group)
    sv = np.broadcast_to(vs.astype(np.float64)[:, :, None], (H, n, d))
    zv = np.broadcast_to(vz.astype(np.float64)[:, :, None], (H, n, d))
    yk = ck * sk + zk
    yv = cv * sv + zv
    if rotate:
        Hd = hadamard(d)
        yk, yv = yk @ Hd, yv @ Hd
    return yk, yv, sk, sv


def pack_codes(c, bits):
    """[..., d] ints < 2^bits -> [..., d*bits/8] uint8, LSB-first."""
    c = np.asarray(c, dtype=np.uint64)
    sh = c.shape
    bitsarr = ((c[..., None] >> np.arange(bits, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)
    flat = bitsarr.reshape(sh[:-1] + (sh[-1] * bits,))
    return np.packbits(flat, axis=-1, bitorder="little")


def unpack_codes(u8, bits, d):
    u8 = np.asarray(u8, dtype=np.uint8)
    bitsarr = np.unpackbits(u8, axis=-1, bitorder="little")
    bitsarr = bitsarr.reshape(u8.shape[:-1] + (d, bits)).astype(np.int64)
    return (bitsarr << np.arange(bits, dtype=np.int64)).sum(axis=-1)


# ---------------------------------------------------------------------------
# helpers for building turns (used by the tests and the self-test)
# ---------------------------------------------------------------------------

def make_turn_tensors(layers, dtype, history=None, history_pos=None, q_dtype=None):
    """layers: list of dicts with float64 'pk','pv','gk','gv' and either F32
    'score' ([S, n_prompt], written as prompt.score) or float64 'q'
    ([S, n_gen, d], written as gen.q in q_dtype: F32 or the K/V dtype, default
    the K/V dtype).  history / history_pos: optional list (per layer) of
    (hk, hv) and pos arrays.  The softmax_scale metadata goes in the turn's
    metadata, see softmax_scale_str()."""
    t = {}
    for l, lay in enumerate(layers):
        t["layer.%d.prompt.k" % l] = (dtype, from_f64(lay["pk"], dtype))
        t["layer.%d.prompt.v" % l] = (dtype, from_f64(lay["pv"], dtype))
        t["layer.%d.gen.k" % l] = (dtype, from_f64(lay["gk"], dtype))
        t["layer.%d.gen.v" % l] = (dtype, from_f64(lay["gv"], dtype))
        if lay.get("q") is not None:
            qd = q_dtype or dtype
            t["layer.%d.gen.q" % l] = (qd, from_f64(lay["q"], qd))
        else:
            t["layer.%d.prompt.score" % l] = ("F32", np.asarray(lay["score"], np.float32))
        if history is not None:
            hk, hv = history[l]
            t["layer.%d.history.k" % l] = (dtype, from_f64(hk, dtype))
            t["layer.%d.history.v" % l] = (dtype, from_f64(hv, dtype))
            t["layer.%d.history.pos" % l] = ("I32", np.asarray(history_pos[l], np.int32))
    return t


def softmax_scale_str(x):
    """float -> the `softmax_scale` metadata string: a plain decimal (no
    exponent), the shortest one that reads back as the same float64."""
    x = float(x)
    if not (math.isfinite(x) and x > 0):
        raise ValueError("softmax_scale must be finite and > 0: %r" % x)
    out = np.format_float_positional(x, unique=True, trim="-")
    assert float(out) == x, (out, x)
    return out


# ---------------------------------------------------------------------------
# self-test
# ---------------------------------------------------------------------------

def _check(cond, what):
    if not cond:
        raise AssertionError("selftest: " + what)


def selftest(verbose=True):
    import os
    import tempfile
    rng = np.random.default_rng(1234)
    n_checks = 0

    # bf16 round trip over every non-NaN bit pattern.
    allb = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = bf16_bits_to_f32(allb)
    ok = ~np.isnan(f)
    _check(np.array_equal(f32_to_bf16_bits(f[ok]), allb[ok]), "bf16 bits->f32->bits")
    # RNE ties: 1 + 2^-8 is halfway between 1 and 1+2^-7 -> even (1.0);
    # 1 + 3*2^-8 is halfway between 1+2^-7 and 1+2^-6 -> even (1+2^-6).
    ties = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -20, -(1 + 2.0 ** -8)],
                    dtype=np.float32)
    want = np.array([1.0, 1 + 2.0 ** -6, 1 + 2.0 ** -7, -1.0], dtype=np.float32)
    _check(np.array_equal(bf16_bits_to_f32(f32_to_bf16_bits(ties)), want), "bf16 RNE ties")
    x = rng.standard_normal(10000).astype(np.float32)
    xb = bf16_bits_to_f32(f32_to_bf16_bits(x)).astype(np.float64)
    _check(np.all(np.abs(xb - x) <= 0.5 * ulp(x, "BF16") * (1 + 1e-12)), "bf16 half-ulp rounding")
    n_checks += 4

    # Directed fp16 rounding.
    v = rng.standard_normal(5000) * 10.0 ** rng.integers(-7, 4, 5000)
    dn, up = f16_round_down(v).astype(np.float64), f16_round_up(v).astype(np.float64)
    _check(np.all(dn <= v) and np.all(up >= v), "fp16 directed rounding direction")
    _check(np.all(np.nextafter(dn.astype(np.float16), np.float16(np.inf)).astype(np.float64) > v),
           "fp16 round-down is tight")
    _check(np.all(np.nextafter(up.astype(np.float16), np.float16(-np.inf)).astype(np.float64) < v),
           "fp16 round-up is tight")
    n_checks += 3

    # safetensors round trip, all dtypes, including empty tensors.
    with tempfile.TemporaryDirectory() as td:
        p = os.path.join(td, "x.safetensors")
        tens = {
            "a": ("F32", rng.standard_normal((2, 3, 4)).astype(np.float32)),
            "b": ("F16", rng.standard_normal((3, 5)).astype(np.float16)),
            "c": ("BF16", f32_to_bf16_bits(rng.standard_normal((1, 7)))),
            "d": ("I32", rng.integers(-2 ** 31, 2 ** 31 - 1, (4, 2)).astype(np.int32)),
            "e": ("U8", rng.integers(0, 256, (3,)).astype(np.uint8)),
            "f": ("F32", np.zeros((2, 0, 8), np.float32)),
        }
        write_safetensors(p, tens, {"k": "v"})
        back, meta = read_safetensors(p)
        _check(meta == {"k": "v"}, "safetensors metadata")
        for kname, (dt, arr) in tens.items():
            _check(back[kname][0] == dt and back[kname][1].shape == arr.shape
                   and back[kname][1].tobytes() == arr.tobytes(), "safetensors tensor " + kname)
        with open(p, "rb") as fh:
            (hn,) = struct.unpack("<Q", fh.read(8))
        _check(hn % 8 == 0, "safetensors header padded to 8")
    n_checks += 8

    # Code packing.
    for bits in (2, 4, 8):
        c = rng.integers(0, 1 << bits, (2, 3, 16))
        pk = pack_codes(c, bits)
        _check(pk.shape == (2, 3, 16 * bits // 8), "pack shape")
        _check(np.array_equal(unpack_codes(pk, bits, 16), c), "pack round trip %d" % bits)
    _check(pack_codes(np.array([[1, 2, 3, 0]]), 2)[0, 0] == 0b00111001, "pack LSB-first")
    n_checks += 7

    # Hadamard: orthonormal and its own inverse.
    for dd in (1, 2, 8, 64):
        Hd = hadamard(dd)
        _check(np.allclose(Hd @ Hd, np.eye(dd), atol=1e-12), "hadamard involution")
    n_checks += 4

    # Selection: ties to the lower position, recent window, k >= candidates.
    sc = np.array([5, 1, 3, 3, 3, 0, 3, 9], dtype=np.float64)
    _check(select(sc, 1, 8, 2, 0) == [2, 7], "select ties")
    _check(select(sc, 1, 8, 3, 0) == [2, 3, 7], "select ties 3")
    _check(select(sc, 0, 8, 2, 2) == [0, 2, 6, 7], "select recent")
    _check(select(sc, 0, 8, 100, 3) == list(range(8)), "select k>=cand")
    _check(select(sc, 8, 8, 3, 3) == [], "select no candidates")
    _check(select(np.zeros(6), 1, 6, 2, 0) == [1, 2], "select all-zero")
    n_checks += 6

    # Max-pooled selection: a heavy hitter lifts its neighbours; windows are
    # clipped to the top-k range (no anchors, no recent window).
    sc = np.array([100, 0, 1, 0, 0, 9, 0, 0, 2, 50], dtype=np.float64)
    _check(list(pool_scores(sc, 1, 9, 3)) == [100, 1, 1, 1, 9, 9, 9, 2, 2, 50], "pool 3 clipped")
    _check(select(sc, 1, 10, 3, 1, 3) == [4, 5, 6, 9], "select pool 3 recent 1")
    _check(select(sc, 1, 10, 3, 1, 1) == [2, 5, 8, 9], "select pool 1 recent 1")
    _check(select(sc, 1, 10, 2, 0, 101) == [1, 2], "select pool > range")
    _check(select(sc, 1, 10, 4, 0, 5) == [3, 7, 8, 9], "select pool 5 (9 reaches 50)")
    n_checks += 5

    # Score reduction: groups of consecutive rows.
    scr = np.arange(12, dtype=np.float32).reshape(6, 2)
    A, Al = reduce_scores(scr, 2)
    _check(np.array_equal(A, [[6, 9], [24, 27]]) and np.array_equal(Al, [30, 36]), "reduce")
    n_checks += 1

    # Scores from queries (FORMAT.md step 0), a hand-computed case: d = 1,
    # scale 1, so each logit is q * k; keys ln 3 (history), 0, ln 2 (prompt),
    # 0, ln 4 (gen).  Step 0 sees exp-weights 3,1,2,1 (sum 7), step 1 sees
    # 3,1,2,1,4 (sum 11); score head 1 (q = 2) squares them.
    ln2, ln3, ln4 = math.log(2.0), math.log(3.0), math.log(4.0)
    hk1 = np.array([[[ln3]]])
    pk1 = np.array([[[0.0], [ln2]]])
    gk1 = np.array([[[0.0], [ln4]]])
    q1 = np.array([[[1.0], [1.0]], [[2.0], [2.0]]])  # S = 2 score heads, H = 1
    sc = query_scores(q1, hk1, pk1, gk1, scale=1.0)
    want = np.array([[1 / 7 + 1 / 11, 2 / 7 + 2 / 11],
                     [1 / 15 + 1 / 31, 4 / 15 + 4 / 31]])  # 9,1,4,1 (15); 9,1,4,1,16 (31)
    _check(np.allclose(sc, want, rtol=1e-14, atol=0), "query_scores hand case %r" % sc)
    scw = query_scores(q1, hk1, pk1, gk1, scale=1.0, window=1)
    _check(np.allclose(scw, [[1 / 11, 2 / 11], [1 / 31, 4 / 31]], rtol=1e-14, atol=0),
           "query_scores hand case window=1")
    # scale 0.5 on q = 2 gives q = 1's weights.
    _check(np.array_equal(query_scores(q1[1:], hk1, pk1, gk1, scale=0.5),
                          query_scores(q1[:1], hk1, pk1, gk1, scale=1.0)), "query_scores scale")
    n_checks += 3

    # Zero queries: uniform weights 1/m_t over the m_t = nh + n + t + 1 keys.
    H, g, d, nh, n, ng = 2, 3, 8, 4, 7, 5
    hk1, pk1, gk1 = (rng.standard_normal((H, x, d)) for x in (nh, n, ng))
    sc = query_scores(np.zeros((H * g, ng, d)), hk1, pk1, gk1)
    want = sum(1.0 / (nh + n + t + 1) for t in range(ng))
    _check(np.allclose(sc, want, rtol=1e-14, atol=0), "query_scores zero q -> uniform 1/m_t")
    n_checks += 1

    # Random cases: rows of W sum to 1 and are 0 past m_t (causal); scores =
    # sums of W over the steps; window = n_gen (or more) equals no window;
    # score head q reads KV head q // (S/H); n_gen = 0 gives zeros.
    for trial in range(30):
        H = int(rng.integers(1, 4))
        g = int(rng.integers(1, 6))
        d = int(rng.choice([1, 4, 8, 16, 64]))
        nh, n, ng = int(rng.integers(0, 6)), int(rng.integers(0, 12)), int(rng.integers(0, 7))
        ch = np.exp(rng.standard_normal(d))
        hk1, pk1, gk1 = (rng.standard_normal((H, x, d)) * ch for x in (nh, n, ng))
        q1 = rng.standard_normal((H * g, ng, d)) * 2.0
        scale = None if trial % 2 else float(rng.uniform(0.05, 2.0))
        W = query_weights(q1, hk1, pk1, gk1, scale)
        for t in range(ng):
            m = nh + n + t + 1
            _check(np.allclose(W[:, t].sum(axis=1), 1.0, rtol=0, atol=1e-14), "W rows sum to 1")
            _check(np.all(W[:, t, m:] == 0) and np.all(W[:, t, :m] > 0), "W causal")
        sc = query_scores(q1, hk1, pk1, gk1, scale)
        _check(np.allclose(sc, W[:, :, nh:nh + n].sum(axis=1), rtol=1e-14, atol=1e-300), "scores = sum W")
        _check(np.all(sc.sum(axis=1) <= ng * (1 + 1e-14)), "scores sum to at most n_gen")
        for w in (ng, ng + 1, WINDOW_MAX):
            if w >= 1:
                _check(np.array_equal(query_scores(q1, hk1, pk1, gk1, scale, w), sc), "window >= n_gen")
        if ng >= 2:
            w = int(rng.integers(1, ng))
            sw = query_scores(q1, hk1, pk1, gk1, scale, w)
            _check(np.allclose(sw, W[:, ng - w:, nh:nh + n].sum(axis=1), rtol=1e-14, atol=1e-300),
                   "window = last steps")
            _check(np.all(sw <= sc * (1 + 1e-14)), "window scores <= all-step scores")
        for qi in range(H * g):
            h = qi // g
            one = query_scores(q1[qi:qi + 1], hk1[h:h + 1], pk1[h:h + 1], gk1[h:h + 1], scale)
            _check(np.array_equal(one[0], sc[qi]), "score head q reads KV head q // (S/H)")
        if ng == 0:
            _check(sc.shape == (H * g, n) and np.all(sc == 0), "n_gen = 0 gives zeros")
        n_checks += 6

    # Policy specs: window on h2o-*, canonical form, refusals.
    pw = parse_policy("h2o-head:window=8,k=3")
    _check(pw["selector"]["window"] == 8 and parse_policy("h2o-layer")["selector"]["window"] is None,
           "parse window")
    _check(canonical_selector(pw["selector"]) == "h2o-head:k=3,sinks=4,recent=0,window=8",
           "canonical window")
    _check(canonical_selector(parse_policy("h2o-layer:pool=5,window=%d" % WINDOW_MAX)["selector"])
           == "h2o-layer:k=32,sinks=4,recent=0,pool=5,window=16777216", "canonical pool + window")
    _check(canonical_selector(parse_policy("h2o-head")["selector"]) == "h2o-head:k=32,sinks=4,recent=0",
           "canonical without window")
    for bad in ("h2o-head:window=0", "h2o-layer:window=16777217", "h2o-head:window=-1",
                "h2o-head:window=x", "gen:window=4", "full:window=4"):
        try:
            parse_policy(bad)
            _check(False, "parse_policy accepted %r" % bad)
        except ValueError:
            pass
    n_checks += 10

    # softmax_scale metadata: plain decimals that read back exactly.
    for x in (0.125, 1.0 / math.sqrt(128), 1e-5, 3.0, 0.1):
        st = softmax_scale_str(x)
        _check(float(st) == x and "e" not in st.lower(), "softmax_scale_str %r -> %r" % (x, st))
    n_checks += 5

    def rand_turn(H, d, n, ng, dtype, nh=0, first=True, pos0=None, g=1):
        layers, hist, hpos = [], [], []
        for _ in range(2):
            layers.append({"pk": rng.standard_normal((H, n, d)), "pv": rng.standard_normal((H, n, d)),
                           "gk": rng.standard_normal((H, ng, d)), "gv": rng.standard_normal((H, ng, d)),
                           "score": rng.exponential(size=(H * g, n))})
            hist.append((rng.standard_normal((H, nh, d)), rng.standard_normal((H, nh, d))))
            hpos.append(rng.integers(0, 1000, (H, nh)))
        t = make_turn_tensors(layers, dtype, hist if nh else None, hpos if nh else None)
        meta = {"first_agent": "true" if first else "false"}
        if pos0 is not None:
            meta["prompt_pos0"] = str(pos0)
        return Turn(t, meta)

    # full is the identity (concatenation) with the right positions.
    for dtype in FLOAT_DTYPES:
        t = rand_turn(3, 8, 11, 2, dtype, nh=3, first=False, pos0=50, g=2)
        m = compress(t, "full")
        for l in range(2):
            for h in range(3):
                want_k = np.concatenate([t.arr("layer.%d.history.k" % l)[h], t.arr("layer.%d.prompt.k" % l)[h],
                                         t.arr("layer.%d.gen.k" % l)[h]])
                want_v = np.concatenate([t.arr("layer.%d.history.v" % l)[h], t.arr("layer.%d.prompt.v" % l)[h],
                                         t.arr("layer.%d.gen.v" % l)[h]])
                _check(m.layers[l].k[h].tobytes() == want_k.tobytes(), "full identity k")
                _check(m.layers[l].v[h].tobytes() == want_v.tobytes(), "full identity v")
                wp = np.concatenate([t.arr("layer.%d.history.pos" % l)[h], 50 + np.arange(13)])
                _check(np.array_equal(m.layers[l].pos[h], wp), "full positions")
        _check(m.full_bytes == m.sent_bytes == 2 * (2 * 3 * 16 * 8 * DTYPE_SIZE[dtype] + 4 * 3 * 16),
               "full bytes")
        n_checks += 13

    # OBF invariants: delta orthogonal to span(V_keep), in span(C), and
    # (p >= rank R, uniform weights, scale none) delta == mean residual.
    for trial in range(40):
        d = int(rng.choice([8, 16, 32]))
        n = int(rng.integers(6, 50))
        k = int(rng.integers(1, n))
        p = int(rng.integers(1, 10))
        t = rand_turn(int(rng.integers(1, 4)), d, n, 2, "F32")
        opts = {"p": p, "inject": str(rng.choice(["uniform", "attn"])),
                "scale": str(rng.choice(["ad_over_as", "ad_frac", "ad", "none"]))}
        for l in range(2):
            vals = to_f64(t.arr("layer.%d.prompt.v" % l)[0], "F32")
            A, _ = reduce_scores(t.arr("layer.%d.prompt.score" % l), t.H)
            s = min(4, n)
            kept = select(A[0], s, n, k, 0)
            dele = [j for j in range(s, n) if j not in kept]
            res = obf_head(vals, kept, dele, A[0], opts)
            if res is None:
                _check(not kept or not dele or np.linalg.matrix_rank(vals[kept]) == d, "skip reason")
                continue
            delta, Q, C = res["delta"], res["Q"], res["C"]
            scale = max(1.0, np.linalg.norm(delta))
            _check(np.linalg.norm(vals[kept] @ delta) <= 1e-9 * scale * np.linalg.norm(vals[kept]),
                   "delta orthogonal to V_keep rows")
            _check(np.linalg.norm(delta @ Q) <= 1e-10 * scale, "delta orthogonal to Q")
            _check(np.linalg.norm(delta - (delta @ C.T) @ C) <= 1e-10 * scale, "delta in span(C)")
            _check(np.allclose(C @ C.T, np.eye(C.shape[0]), atol=1e-10), "C orthonormal")
            _check(C.shape[0] <= p, "C has at most p rows")
            if opts["inject"] == "uniform":
                _check(np.allclose(res["add"], delta[None, :]), "uniform inject")
            else:
                _check(np.allclose(res["add"].mean(axis=0), delta), "attn inject averages to delta")
            n_checks += 7
    # p >= rank(R), scale none, uniform weights: delta == mean of residual rows.
    V = rng.standard_normal((12, 8))
    A0 = np.zeros(12)
    res = obf_head(V, [0, 1, 2], list(range(3, 12)), A0, {"p": 8, "inject": "uniform", "scale": "none"})
    Q, _ = np.linalg.qr(V[:3].T)
    Rm = V[3:] - V[3:] @ Q @ Q.T
    _check(np.allclose(res["delta"], Rm.mean(axis=0), atol=1e-12), "delta = mean residual")
    # ad_over_as with all-zero scores: factor 0.
    res = obf_head(V, [0, 1, 2], list(range(3, 12)), A0, {"p": 2, "inject": "attn", "scale": "ad_over_as"})
    _check(np.all(res["add"] == 0), "zero scores -> zero delta")
    # Rank-deficient V_keep: duplicated + combination rows give rank 2.
    Vr = rng.integers(-4, 5, (10, 8)).astype(np.float64)
    Vr[2] = Vr[0]
    Vr[3] = Vr[0] + 2 * Vr[1]
    res = obf_head(Vr, [0, 1, 2, 3], list(range(4, 10)), np.ones(10), {"p": 3, "inject": "uniform",
                                                                        "scale": "ad_over_as"})
    _check(res["Q"].shape[1] == 2, "rank-deficient V_keep -> r=2")
    _check(np.linalg.norm(Vr[:4] @ res["delta"]) <= 1e-10 * np.linalg.norm(res["delta"]) * 10,
           "rank-deficient orthogonality")
    # k >= d: V_keep spans everything -> skipped.
    res = obf_head(V, list(range(8)), list(range(8, 12)), np.ones(12), {"p": 8, "inject": "uniform",
                                                                        "scale": "none"})
    _check(res is None, "V_keep full rank -> skip")
    n_checks += 5

    # Turns with gen.q: written and read back (q in F32 or the K/V dtype,
    # softmax_scale metadata), compress() uses query scores in float64 (not
    # rounded to F32); window is refused on a prompt.score turn.
    for dtype, qd, scale in (("BF16", "F32", None), ("F16", "F16", 0.3), ("F32", "F32", 0.0625),
                             ("BF16", "BF16", 0.7)):
        H, g, d, nh, n, ng = 2, 2, 16, 3, 20, 4
        layers, hist, hpos = [], [], []
        for _ in range(2):
            layers.append({"pk": rng.standard_normal((H, n, d)), "pv": rng.standard_normal((H, n, d)),
                           "gk": rng.standard_normal((H, ng, d)), "gv": rng.standard_normal((H, ng, d)),
                           "q": rng.standard_normal((H * g, ng, d)) * 2})
            hist.append((rng.standard_normal((H, nh, d)), rng.standard_normal((H, nh, d))))
            hpos.append(np.tile(np.arange(nh), (H, 1)))
        tens = make_turn_tensors(layers, dtype, hist, hpos, q_dtype=qd)
        meta = {} if scale is None else {"softmax_scale": softmax_scale_str(scale)}
        with tempfile.TemporaryDirectory() as td:
            pth = os.path.join(td, "q.safetensors")
            write_safetensors(pth, tens, meta)
            t = Turn.load(pth)
        _check(t.has_query and t.q_dtype == qd and t.S == H * g and "layer.0.prompt.score" not in t.tensors,
               "gen.q turn")
        _check(t.softmax_scale == (1 / math.sqrt(d) if scale is None else scale), "softmax_scale read")
        for w in (None, 1, 3):
            spec = "h2o-head:k=5" + ("" if w is None else ",window=%d" % w)
            m = compress(t, spec)
            for l in range(2):
                qv = to_f64(t.arr("layer.%d.gen.q" % l), qd)
                want = query_scores(qv, to_f64(t.arr("layer.%d.history.k" % l), dtype),
                                    to_f64(t.arr("layer.%d.prompt.k" % l), dtype),
                                    to_f64(t.arr("layer.%d.gen.k" % l), dtype), t.softmax_scale, w)
                _check(np.array_equal(m.layers[l].score, want), "compress uses query scores (float64)")
                A, _ = reduce_scores(want, H)
                _check(np.array_equal(m.layers[l].A, A), "query scores reduced")
        n_checks += 8
    # The F32 rounding is not applied: some score differs from its F32 rounding.
    _check(np.any(m.layers[0].score != m.layers[0].score.astype(np.float32)), "scores stay float64")
    tp = rand_turn(2, 8, 10, 2, "F32")
    try:
        compress(tp, "h2o-head:k=3,window=2")
        _check(False, "window accepted on a prompt.score turn")
    except ValueError as e:
        _check("window=" in str(e) and "prompt.score" in str(e), "window refusal names window= and tensor")
    n_checks += 2

    # Quantization error bound (in the rotated domain) and accounting.
    for bits in (2, 4, 8):
        for rot in ((False, True) if bits < 8 else (False,)):
            for grp in (1, 5, 32):
                H, n, d = 2, 37, 16
                k64 = rng.standard_normal((H, n, d)) * np.exp(rng.standard_normal(d))
                v64 = rng.standard_normal((H, n, d))
                q = quantize_layer(k64, v64, bits, grp, rot)
                yk, yv, sk, sv = dequantize_layer(q["codes_k"], q["codes_v"], q["k_scale"], q["k_zero"],
                                                  q["v_scale"], q["v_zero"], grp, rot)
                Hd = hadamard(d) if rot else np.eye(d)
                ek = (yk - k64) @ Hd
                ev = (yv - v64) @ Hd
                _check(np.all(np.abs(ek) <= sk / 2 * (1 + 1e-9) + 1e-12), "quant K bound")
                _check(np.all(np.abs(ev) <= sv / 2 * (1 + 1e-9) + 1e-12), "quant V bound")
                _check(q["k_scale"].shape == (H, -(-n // grp), d) and q["v_scale"].shape == (H, n),
                       "quant stat shapes")
                _check(np.all(q["codes_k"] <= (1 << bits) - 1) and np.all(q["codes_k"] >= 0), "code range")
                n_checks += 4
    if verbose:
        print("kvrelay_ref selftest: %d checks passed" % n_checks)
    return n_checks


if __name__ == "__main__":
    if "--selftest" in sys.argv[1:]:
        selftest()
    else:
        print(__doc__)
