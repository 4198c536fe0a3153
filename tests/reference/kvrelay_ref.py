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
  * query_masses(): the same steps' mass on every key (history, prompt,
    generated), for the accumulated importance,
  * compress(): scores (prompt.score, or query_scores in float64) -> anchors/
    candidates -> granularity (h2o-auto, layer_entropy(), step 3a) ->
    selection -> OBF (exact, float64 SVD) -> accumulated importance `acc`
    (step 5) -> history budget hist=K (history_budget(), step 5a) ->
    composition with positions, acc and anchor_pos (step 6) -> byte
    accounting -> attention_error (gen.q turns, "Fidelity"),
  * attention_error(): FORMAT.md "Fidelity" in float64 for any message's
    keys and values (the tests pass kvrelayctl's own),
  * quantize_layer()/dequantize_layer()/pack_codes()/unpack_codes() (any
    1..8 bits, element i at bits [i*B, (i+1)*B) of the row, LSB first),
  * the rotated Lloyd-Max quantizer (step 7b): splitmix64(), lloyd_signs(),
    lloyd_rotation(), lloyd_codebook()/lloyd_thresholds()/lloyd_code(),
    lloyd_quantize_rows()/lloyd_dequantize_rows() (row form),
    lloyd_quantize_keys_channel()/lloyd_dequantize_keys_channel(),
    lloyd_quantize_layer()/lloyd_dequantize_layer() (per layer the keys'
    and values' bits of lloyd:layers=, lloyd_bits()); codes are decided on
    float64 u against float64 thresholds (exact comparisons), the rotation
    by float64 butterflies (fwht(), exact for F16/BF16 rows) and one scaling,
  * demotion (step 6a) in compress(): each layer's demoted tokens (lay.dem_*),
    their positions and acc after the main part's, byte accounting;
    message_tensors() (the file's tensors, packed or decoded to dense) and
    message_as_held() merge them into the kept tokens by ascending position
    (merge_order()),
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
  * History budget (step 5a) ranks by "their acc after step 5"; step 5 makes
    every acc a float32, so compress() ranks by the float32 acc (h2o-layer:
    the float64 sum over heads of the float32 values).  Ranking by the
    float64 value before rounding differs only where two float32 keys tie
    or (h2o-layer sums) lie within ~2^-23 relative; the tests accept either
    reading there (lay.hist_keys64).
  * `tau` in the canonical spec, "the shortest decimal form that reads back
    as the same float64": numpy's shortest positional form, no exponent and
    no trailing ".0" (0.9 -> "0.9", 1.0 -> "1", 0.0 -> "0").  Whether a form
    with an exponent counts ("1e-04" is shorter than "0.0001") is not
    decided by FORMAT.md; the tests accept one that is no longer and reads
    back as the same float64.
  * `granularity` ("h2o-auto only") is expected absent on other policies, and
    `attention_error` ("present for a turn with gen.q") absent on
    prompt.score turns.
  * Fidelity: o_full sees the turn's whole history (before hist=K), o_msg the
    message's (after it); the figure ignores `window` ("every step").  When
    only o_full is 0 a step's error is 1, when both are 0 it is 0.
  * `full` takes no parameters, so hist= (like every h2o-only key) is refused
    on `full` and `gen`; their messages carry the history whole, with acc.
  * lloyd: `group` is refused with keys=row ("group (32; with keys=channel
    only)"); `seed` is a decimal uint64 (ASCII digits, 0 .. 2^64 - 1); bits
    and group are decimal integers.  The canonical stage forms (FORMAT.md
    spells out the selector's only) are `lloyd:bits=B,keys=row,seed=S`,
    `lloyd:bits=B,keys=channel,group=G,seed=S` and `demote:bits=B`.
  * lloyd row form: nu = fp16(||x||_2) from the float64 sum of squares,
    round to nearest even; the compression fails when that rounds past
    65504 (||x|| >= 65520).  u = y sqrt(d) / nu, as the unnormalized
    transform of sigma * x (float64 butterflies) divided by nu.
  * lloyd keys=channel: mu and sigma are means over the tokens of the group
    (the last group may be shorter), in float64, rounded to nearest even;
    sigma is taken about the fp16 mu ("sigma = fp16(sqrt(mean (x - mu)^2))"
    with mu the fp16 value), then raised to 2^-24 if below.  A mean or rms
    past fp16's range fails the compression.
  * lloyd:layers=KV.KV... (per layer the keys' and values' bits): FORMAT.md
    gives it "instead of bits", read as: bits and layers together are
    refused; an entry is exactly two ASCII digits 1..4, entries joined by
    single dots (an empty value or entry is refused); the count must equal
    the turn's layers, checked when compressing.  FORMAT.md does not spell
    out the canonical form; the reference writes
    `lloyd:keys=row,seed=S,layers=...` / `lloyd:keys=channel,group=G,seed=S,
    layers=...` (no bits=, layers= last, as given even when every entry is
    the same).  quant_layer_bits is "present when the layers' bits differ";
    the reference reads that as "unless every layer has the same bits for
    keys and values", since quant_bits (layer 0's keys' bits) cannot carry a
    values' B that differs (layers=43.43 has it, layers=33.33 does not).
    Layer l's keys are quantized with Bk bits, its values with Bv, both with
    the stage's seed (keys=channel: the keys' codes with Bk); the demoted
    part keeps demote's bits.
  * Demotion with a top-k range of at most k candidates demotes nothing
    (n_demoted = 0).  Decoding to dense orders the merged kept tokens by
    position; the demoted tokens keep their position and acc (after the main
    part's in layer.{l}.pos and layer.{l}.acc, merged when decoded).
  * Fidelity with demoted tokens: o_msg uses the message decoded to dense
    ("the message's keys and values as the recipient holds them"), i.e. the
    demoted tokens decoded and merged into the kept ones.
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
    "h2o-layer": {"k": 32, "sinks": 4, "recent": 0, "pool": 1, "window": None, "hist": None},
    "h2o-head": {"k": 32, "sinks": 4, "recent": 0, "pool": 1, "window": None, "hist": None},
    "h2o-auto": {"k": 32, "sinks": 4, "recent": 0, "pool": 1, "window": None, "hist": None,
                 "tau": 0.9},
}
WINDOW_MAX = 1 << 24
HIST_MAX = 1 << 24
_OBF = {"p": 8, "mode": "exact", "inject": "uniform", "scale": "ad_over_as",
        "iters": 12, "oversample": 10}
_QUANT = {"group": 32, "rotate": "none"}


def _parse_tau(val):
    """`tau` (h2o-auto): a decimal number in [0, 1], read as float64."""
    try:
        x = float(val)
    except ValueError:
        raise ValueError("tau=%s: expected a decimal number in [0, 1]" % val)
    if "_" in val or not math.isfinite(x) or not 0.0 <= x <= 1.0:
        raise ValueError("tau=%s: expected a decimal number in [0, 1]" % val)
    return x


_LLOYD = {"bits": 4, "keys": "row", "group": 32, "seed": 1, "layers": None}
_DEMOTE = {"bits": 2}
U64_MAX = (1 << 64) - 1


def _parse_uint(key, val, lo, hi):
    """A decimal integer in [lo, hi], ASCII digits only (no sign, no spaces)."""
    if not val or not all("0" <= ch <= "9" for ch in val) or not lo <= int(val) <= hi:
        raise ValueError("%s=%s: expected an integer in [%d, %d]" % (key, val, lo, hi))
    return int(val)


def parse_layer_bits(val):
    """`layers=KV.KV...` (FORMAT.md "Policy specs"): one entry per layer of
    two digits 1..4, the keys' then the values' bits, joined by '.'.
    '43.32.44' -> ((4, 3), (3, 2), (4, 4)).  Anything else (empty, an empty
    entry, one or three digits, 0 or 5..9, another character) is refused."""
    if not val:
        raise ValueError("layers=: expected KV.KV... (two digits 1..4 per layer)")
    out = []
    for i, ent in enumerate(val.split(".")):
        if len(ent) != 2 or not all("1" <= ch <= "4" for ch in ent):
            raise ValueError("layers=%s: entry %d %r: expected two digits 1..4 (keys' and values' bits)"
                             % (val, i, ent))
        out.append((int(ent[0]), int(ent[1])))
    return tuple(out)


def format_layer_bits(layers):
    """((4, 3), (3, 2)) -> '43.32' (layers= and quant_layer_bits)."""
    return ".".join("%d%d" % (bk, bv) for bk, bv in layers)


def _parse_lloyd(kv):
    """`lloyd` (FORMAT.md "Policy specs"): bits 1..4 (4), keys row|channel
    (row), group >= 1 (32; keys=channel only), seed a uint64 (1), layers
    (instead of bits: per layer the keys' and values' bits; q["bits"] is
    then None and q["layers"] a tuple of (Bk, Bv), see lloyd_bits())."""
    q = dict(_LLOYD)
    for key, val in kv.items():
        if key not in q:
            raise ValueError("unknown lloyd key %s" % key)
        if key == "keys":
            if val not in ("row", "channel"):
                raise ValueError("keys=%s: expected row or channel" % val)
            q[key] = val
        elif key == "bits":
            q[key] = _parse_uint(key, val, 1, 4)
        elif key == "group":
            q[key] = _parse_uint(key, val, 1, 1 << 24)
        elif key == "layers":
            q[key] = parse_layer_bits(val)
        else:
            q[key] = _parse_uint(key, val, 0, U64_MAX)
    if "group" in kv and q["keys"] != "channel":
        raise ValueError("group=%s: only with keys=channel" % kv["group"])
    if "layers" in kv:
        # "layers (none; instead of bits)": the two together are refused.
        if "bits" in kv:
            raise ValueError("bits=%s with layers=%s: expected one of them" % (kv["bits"], kv["layers"]))
        q["bits"] = None
    q["scheme"] = "lloyd"
    return q


def lloyd_bits(q, l):
    """(Bk, Bv) of layer l under a parsed lloyd stage: its layers= entry,
    else (bits, bits)."""
    if q.get("layers") is not None:
        return q["layers"][l]
    return q["bits"], q["bits"]


def check_lloyd_layers(q, L):
    """lloyd:layers= needs one entry per layer of the turn (FORMAT.md)."""
    if q.get("layers") is not None and len(q["layers"]) != L:
        raise ValueError("lloyd:layers=%s gives %d layers, expected one per layer of the turn (%d)"
                         % (format_layer_bits(q["layers"]), len(q["layers"]), L))


def lloyd_layer_bits_meta(q, L):
    """The message's quant_layer_bits: None when every layer has the same
    bits for keys and values (quant_bits says it all), else per layer
    'KV' joined by '.' (see the module docstring on FORMAT.md's wording)."""
    bits = [lloyd_bits(q, l) for l in range(L)]
    if all(b == (bits[0][0], bits[0][0]) for b in bits):
        return None
    return format_layer_bits(bits)


def parse_policy(spec):
    """Returns dict(selector=dict(name,...), obf=dict|None, demote=dict|None,
    quant=dict|None); quant["scheme"] is "int" (int8/int4/int2) or "lloyd"."""
    for i, ch in enumerate(spec):
        if not "!" <= ch <= "~":
            raise ValueError("byte %d of %r: expected printable ASCII without spaces" % (i, spec))
    stages = spec.split("+")
    out = {"selector": None, "obf": None, "demote": None, "quant": None}
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
                sel[key] = _parse_tau(val) if key == "tau" else int(val)
            if sel.get("pool", 1) < 1 or sel.get("pool", 1) % 2 == 0:
                raise ValueError("pool must be odd and >= 1: %r" % spec)
            if sel.get("window") is not None and not 1 <= sel["window"] <= WINDOW_MAX:
                raise ValueError("window=%d: expected an integer in [1, %d]" % (sel["window"], WINDOW_MAX))
            if sel.get("hist") is not None and not 0 <= sel["hist"] <= HIST_MAX:
                raise ValueError("hist=%d: expected an integer in [0, %d]" % (sel["hist"], HIST_MAX))
            sel["name"] = name
            out["selector"] = sel
        elif name == "obf":
            if out["obf"] is not None or out["quant"] is not None or out["demote"] is not None:
                raise ValueError("obf misplaced in %r (obf and demote exclude each other)" % spec)
            if not out["selector"]["name"].startswith("h2o-"):
                raise ValueError("obf only after h2o-*")
            o = dict(_OBF)
            for key, val in kv.items():
                if key not in o:
                    raise ValueError("unknown obf key %s" % key)
                o[key] = int(val) if key in ("p", "iters", "oversample") else val
            out["obf"] = o
        elif name == "demote":
            # Step 6a: after h2o-*, before the quantizer, not with obf.
            if out["obf"] is not None or out["quant"] is not None or out["demote"] is not None:
                raise ValueError("demote misplaced in %r (after the selector, before the quantizer, "
                                 "not with obf)" % spec)
            if not out["selector"]["name"].startswith("h2o-"):
                raise ValueError("demote only after h2o-*")
            dm = dict(_DEMOTE)
            for key, val in kv.items():
                if key not in dm:
                    raise ValueError("unknown demote key %s" % key)
                dm[key] = _parse_uint(key, val, 1, 4)
            out["demote"] = dm
        elif name == "lloyd":
            if out["quant"] is not None:
                raise ValueError("two quantizers")
            out["quant"] = _parse_lloyd(kv)
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
            q["scheme"] = "int"
            out["quant"] = q
        else:
            raise ValueError("unknown stage %r" % name)
    return out


def canonical_lloyd(q):
    """The canonical form of a parsed lloyd stage: bits, keys, group (with
    keys=channel only), seed, every one listed; with layers= no bits and
    layers= last (lloyd:keys=row,seed=S,layers=43.32)."""
    out = "lloyd:" if q.get("layers") is not None else "lloyd:bits=%d," % q["bits"]
    if q["keys"] == "channel":
        out += "keys=channel,group=%d,seed=%d" % (q["group"], q["seed"])
    else:
        out += "keys=row,seed=%d" % q["seed"]
    if q.get("layers") is not None:
        out += ",layers=" + format_layer_bits(q["layers"])
    return out


def canonical_demote(dm):
    return "demote:bits=%d" % dm["bits"]


def message_seed(pol):
    """The message's rotation seed (FORMAT.md step 6a): the lloyd stage's,
    else 1."""
    q = pol["quant"]
    return q["seed"] if q is not None and q["scheme"] == "lloyd" else 1


def shortest_decimal(x):
    """The shortest plain decimal (no exponent, no trailing '.0') that reads
    back as the same float64: 0.9 -> '0.9', 1.0 -> '1', 0.0 -> '0'."""
    out = np.format_float_positional(float(x), unique=True, trim="-")
    assert float(out) == float(x), (out, x)
    return out


def canonical_selector(sel):
    """The canonical form of a parsed selector stage (FORMAT.md "Policy specs"):
    k, sinks, recent, then tau (h2o-auto only, always, in the shortest decimal
    form), pool (only when it is not 1), window (only when given), hist (only
    when given)."""
    name = sel["name"]
    if name == "full":
        return "full"
    if name == "gen":
        return "gen:sinks=%d" % sel["sinks"]
    out = "%s:k=%d,sinks=%d,recent=%d" % (name, sel["k"], sel["sinks"], sel["recent"])
    if name == "h2o-auto":
        out += ",tau=%s" % shortest_decimal(sel["tau"])
    if sel["pool"] != 1:
        out += ",pool=%d" % sel["pool"]
    if sel.get("window") is not None:
        out += ",window=%d" % sel["window"]
    if sel.get("hist") is not None:
        out += ",hist=%d" % sel["hist"]
    return out


# ---------------------------------------------------------------------------
# turns
# ---------------------------------------------------------------------------

def parse_id_list(text):
    """'3,5,9' -> [3, 5, 9]; '' -> [] (history_anchors / anchor_pos)."""
    text = str(text)
    if text == "":
        return []
    return [int(x) for x in text.split(",")]


def format_id_list(ids):
    return ",".join(str(int(x)) for x in ids)


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
        # Accumulated importance of the history (FORMAT.md step 5): history.acc
        # (else 0) and, on prompt.score turns, history.score (else no mass).
        self.has_history_acc = "layer.0.history.acc" in tensors
        self.has_history_score = "layer.0.history.score" in tensors
        # The chain's anchors the history holds (history_anchors metadata).
        ha = self.meta.get("history_anchors")
        self.history_anchors = parse_id_list(ha) if ha is not None else []

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


def window_steps(n_gen, window):
    """The steps t of the window: t >= n_gen - window (every step without)."""
    t0 = 0 if window is None else max(0, n_gen - int(window))
    return range(t0, n_gen)


def sum_steps(W, lo, hi, steps):
    """sum over the steps t (ascending, one add at a time) of W[:, t, lo:hi]."""
    out = np.zeros((W.shape[0], hi - lo), dtype=np.float64)
    for t in steps:
        out = out + W[:, t, lo:hi]
    return out


def query_masses(q, hk, pk, gk, scale=None, window=None):
    """The attention mass the generated steps of the window put on every key,
    per score head (FORMAT.md steps 0 and 5).  Arguments as query_weights().

    Returns (hist [S, n_history], prompt [S, n_prompt], gen [S, n_gen]),
    float64, each sum_t W[q, t, i] over the steps t of the window in ascending
    t (a generated token j only gets mass from steps t >= j: W is 0 before).
    """
    W = query_weights(q, hk, pk, gk, scale)
    ng = W.shape[1]
    nh, n = np.shape(hk)[1], np.shape(pk)[1]
    steps = window_steps(ng, window)
    return (sum_steps(W, 0, nh, steps), sum_steps(W, nh, nh + n, steps),
            sum_steps(W, nh + n, nh + n + ng, steps))


def query_scores(q, hk, pk, gk, scale=None, window=None):
    """FORMAT.md step 0: prompt scores from the generated steps' queries.

    Arguments as query_weights(); window: None (every step) or an integer
    >= 1 (the last `window` steps; more than n_gen means all of them).

    Returns score [S, n_prompt] float64: score[q][j] = sum over the steps t in
    the window (t >= n_gen - window) of the weight step t of score head q puts
    on prompt token j, accumulated in float64 in ascending t.
    """
    W = query_weights(q, hk, pk, gk, scale)
    nh, n = np.shape(hk)[1], np.shape(pk)[1]
    return sum_steps(W, nh, nh + n, window_steps(W.shape[1], window))


def turn_keys_f64(turn, l):
    """(gen.q, history.k, prompt.k, gen.k) of layer l as float64 arrays of
    their exact stored values (gen.q only on a gen.q turn, else None)."""
    dt = turn.dtype
    if turn.has_history:
        hk = to_f64(turn.arr("layer.%d.history.k" % l), dt)
    else:
        hk = np.zeros((turn.H, 0, turn.d), dtype=np.float64)
    pk = to_f64(turn.arr("layer.%d.prompt.k" % l), dt)
    gk = to_f64(turn.arr("layer.%d.gen.k" % l), dt)
    q = to_f64(turn.arr("layer.%d.gen.q" % l), turn.q_dtype) if turn.has_query else None
    return q, hk, pk, gk


def turn_scores(turn, l, window=None):
    """The [S, n_prompt] scores of layer l: prompt.score as float64 (exact
    F32 values), or query_scores() of gen.q kept in float64 (not rounded to
    F32).  `window` needs gen.q, as in kvrelay (InvalidArgument there)."""
    return turn_masses(turn, l, window)[1]


def turn_masses(turn, l, window=None):
    """(hist [S, n_history], prompt [S, n_prompt], gen [S, n_gen]) float64
    masses of layer l, per score head.  gen.q turns: query_masses().
    prompt.score turns: history.score (zeros without it), prompt.score, and
    zeros for the generated tokens (FORMAT.md step 5)."""
    if not turn.has_query:
        if window is not None:
            raise ValueError("window=%d needs layer.%d.gen.q; the turn has layer.%d.prompt.score"
                             % (window, l, l))
        sc = np.asarray(turn.arr("layer.%d.prompt.score" % l), dtype=np.float64)
        if turn.has_history_score:
            hs = np.asarray(turn.arr("layer.%d.history.score" % l), dtype=np.float64)
        else:
            hs = np.zeros((turn.S, turn.n_history), dtype=np.float64)
        return hs, sc, np.zeros((turn.S, turn.n_gen), dtype=np.float64)
    if turn.has_history_score:
        raise ValueError("layer.%d.history.score: only with prompt.score (the turn has layer.%d.gen.q)"
                         % (l, l))
    q, hk, pk, gk = turn_keys_f64(turn, l)
    return query_masses(q, hk, pk, gk, turn.softmax_scale, window)


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


def layer_entropy(A, s, n):
    """FORMAT.md step 3a: the normalized attention entropy of one layer.

    A: [H, n_prompt] float64 reduced scores.  For each KV head h, over the
    c = n - s candidates (recent window included): T = sum_j A[h][j] and,
    when c >= 2 and T > 0, e_h = -(sum_j p_j ln p_j) / ln c with p_j =
    A[h][j] / T (terms with p_j = 0 add 0), else e_h = 1; float64, sums in
    ascending j.  Returns (mean over h of e_h (summed in ascending h, divided
    by H), [e_h])."""
    H = A.shape[0]
    c = n - s
    es = []
    for h in range(H):
        T = 0.0
        for j in range(s, n):
            T += float(A[h, j])
        if c >= 2 and T > 0:
            acc = 0.0
            for j in range(s, n):
                p = float(A[h, j]) / T
                if p > 0:
                    acc += p * math.log(p)
            es.append(-acc / math.log(c))
        else:
            es.append(1.0)
    tot = 0.0
    for e in es:
        tot += e
    return tot / H, es


def auto_granularity(mean_entropy, tau):
    """h2o-auto: 'head' when the mean entropy is below tau, else 'layer'."""
    return "head" if mean_entropy < tau else "layer"


def history_split(hpos, anchors):
    """Per head: (anchor indices, candidate indices) along the head's history.
    hpos: [H, n_history] position ids; anchors: the chain's anchor ids."""
    aset = set(int(x) for x in anchors)
    out = []
    for h in range(hpos.shape[0]):
        anc = [i for i in range(hpos.shape[1]) if int(hpos[h, i]) in aset]
        cand = [i for i in range(hpos.shape[1]) if int(hpos[h, i]) not in aset]
        out.append((anc, cand))
    return out


def history_rank_keys(acc32, split, gran):
    """FORMAT.md step 5a ranking keys of the history candidates, float64
    [H, c]: 'head': acc[h][cand_h(r)]; 'layer': sum_h acc[h][cand_h(r)] (in
    ascending h), the same row for every head.  acc32: [H, n_history] acc
    after step 5: the float32 acc (what compress() ranks by), or the float64
    value before rounding (the tests accept either reading, see
    lay.hist_keys64)."""
    H = acc32.shape[0]
    c = len(split[0][1])
    keys = np.zeros((H, c), dtype=np.float64)
    for h in range(H):
        keys[h] = acc32[h, split[h][1]].astype(np.float64)
    if gran == "layer":
        tot = np.zeros(c, dtype=np.float64)
        for h in range(H):
            tot = tot + keys[h]
        keys = np.tile(tot, (H, 1))
    return keys


def history_budget(keys, split, K):
    """Kept history indices per head (ascending along the head): the anchors
    and the K candidates with the largest keys (ties to the earlier token),
    or the whole history when c <= K or K is None."""
    out = []
    for h, (anc, cand) in enumerate(split):
        c = len(cand)
        if K is None or c <= K:
            out.append(sorted(anc + cand))
            continue
        order = sorted(range(c), key=lambda r: (-float(keys[h, r]), r))
        ranks = sorted(order[:K])
        out.append(sorted(anc + [cand[r] for r in ranks]))
    return out


def check_history_anchors(turn):
    """FORMAT.md reader rules for history_anchors (ValueError naming the key)."""
    ha = turn.history_anchors
    if not ha:
        if "history_anchors" in turn.meta and turn.meta["history_anchors"] != "" and not turn.has_history:
            raise ValueError("history_anchors without history")
        return
    if not turn.has_history:
        raise ValueError("history_anchors without history")
    if any(b <= a for a, b in zip(ha, ha[1:])):
        raise ValueError("history_anchors: ids not ascending")
    for l in range(turn.L):
        hpos = turn.arr("layer.%d.history.pos" % l)
        for h in range(turn.H):
            for x in ha:
                cnt = int(np.count_nonzero(hpos[h] == x))
                if cnt != 1:
                    raise ValueError("history_anchors: id %d held %d times by layer %d head %d"
                                     % (x, cnt, l, h))


def compress(turn, policy, kept_override=None, hist_override=None, gran_override=None,
             with_error=True):
    """Reference compression. `policy` is a spec string or parse_policy() dict.

    kept_override: optional {layer: [kept prompt indices per head]} replacing
    the selection of those layers (the tests use it to follow kvrelay's choice
    where float32 query scores make the reference's top-k ambiguous); the
    rest (composition, OBF with this layer's A[h]) is computed as usual.
    hist_override: the same for the history budget, {layer: [kept history
    indices per head]}.  gran_override: {layer: 'head' | 'layer'} replacing
    h2o-auto's choice (step 3a) of those layers.
    with_error: on a gen.q turn, also compute msg.attention_error (FORMAT.md
    "Fidelity") from the reference's own message (quantized: its own codes
    decoded into the turn's dtype)."""
    pol = parse_policy(policy) if isinstance(policy, str) else policy
    sel = pol["selector"]
    obf = pol["obf"]
    quant = pol["quant"]
    H, d, n, dt = turn.H, turn.d, turn.n_prompt, turn.dtype
    sinks = sel.get("sinks", 4)
    s = min(sinks, n) if turn.first_agent else 0
    p0 = turn.prompt_pos0
    nh, ng = turn.n_history, turn.n_gen
    check_history_anchors(turn)
    if quant is not None and quant["scheme"] == "lloyd":
        check_lloyd_layers(quant, turn.L)
    window = sel.get("window")
    msg = RefMessage()
    msg.policy = pol
    msg.dtype = dt
    msg.layers = []
    msg.granularity = [] if sel["name"] == "h2o-auto" else None
    n_kept = None
    n_hist_kept = None
    n_dem = None
    for l in range(turn.L):
        pk = turn.arr("layer.%d.prompt.k" % l)
        pv = turn.arr("layer.%d.prompt.v" % l)
        gk = turn.arr("layer.%d.gen.k" % l)
        gv = turn.arr("layer.%d.gen.v" % l)
        hmass, score, gmass = turn_masses(turn, l, window)
        A, A_layer = reduce_scores(score, H)
        Ahist, _ = reduce_scores(hmass, H)
        Agen, _ = reduce_scores(gmass, H)
        if turn.has_history:
            hk = turn.arr("layer.%d.history.k" % l)
            hv = turn.arr("layer.%d.history.v" % l)
            hpos = turn.arr("layer.%d.history.pos" % l).astype(np.int64)
        else:
            hk = np.zeros((H, 0, d), dtype=pk.dtype)
            hv = np.zeros((H, 0, d), dtype=pk.dtype)
            hpos = np.zeros((H, 0), dtype=np.int64)
        if turn.has_history_acc:
            acc_in = np.asarray(turn.arr("layer.%d.history.acc" % l), dtype=np.float64)
        else:
            acc_in = np.zeros((H, nh), dtype=np.float64)
        # Step 3a (h2o-auto): the layer's granularity.
        name = sel["name"]
        gran = None
        mean_e = None
        if name == "h2o-auto":
            mean_e, _ = layer_entropy(A, s, n)
            gran = auto_granularity(mean_e, sel["tau"])
            if gran_override is not None and l in gran_override:
                gran = gran_override[l]
            msg.granularity.append(gran)
            name = "h2o-head" if gran == "head" else "h2o-layer"
        elif name in ("h2o-head", "h2o-layer"):
            gran = "head" if name == "h2o-head" else "layer"
        cands = list(range(s, n))
        kept = []  # per head
        for h in range(H):
            if name == "full":
                kept.append(cands)
            elif name == "gen":
                kept.append([])
            elif name == "h2o-layer":
                kept.append(select(A_layer, s, n, sel["k"], sel["recent"], sel["pool"]))
            elif name == "h2o-head":
                kept.append(select(A[h], s, n, sel["k"], sel["recent"], sel["pool"]))
            else:
                raise ValueError(name)
        if kept_override is not None and l in kept_override:
            kept = [list(x) for x in kept_override[l]]
            assert len(kept) == H
        nk = len(kept[0])
        assert all(len(x) == nk for x in kept)
        if n_kept is None:
            n_kept = nk
        assert n_kept == nk
        # Step 5: accumulated importance, float64, rounded to float32 once.
        # acc_q: the part that comes from this agent's masses (for the tests'
        # tolerance on gen.q turns); acc_in is exact.
        hacc64 = acc_in + Ahist
        hacc32 = hacc64.astype(np.float32)
        # Step 5a: the history budget (h2o-* with hist=K).
        split = history_split(hpos, turn.history_anchors)
        hist_keys = hist_keys64 = None
        if sel["name"].startswith("h2o-") and sel.get("hist") is not None and nh:
            hist_keys = history_rank_keys(hacc32, split, gran)
            hist_keys64 = history_rank_keys(hacc64, split, gran)
            hkept = history_budget(hist_keys, split, sel["hist"])
        else:
            hkept = [list(range(nh)) for _ in range(H)]
        if hist_override is not None and l in hist_override:
            hkept = [list(x) for x in hist_override[l]]
            assert len(hkept) == H
        nhk = len(hkept[0])
        assert all(len(x) == nhk for x in hkept)
        if n_hist_kept is None:
            n_hist_kept = nhk
        assert n_hist_kept == nhk
        # Step 6: compose.
        ntot = nhk + s + nk + ng
        K = np.zeros((H, ntot, d), dtype=pk.dtype)
        V = np.zeros((H, ntot, d), dtype=pk.dtype)
        V64 = np.zeros((H, ntot, d), dtype=np.float64)   # exact (pre-rounding)
        Vorig64 = np.zeros((H, ntot, d), dtype=np.float64)
        D64 = np.zeros((H, ntot, d), dtype=np.float64)   # increments
        part = np.zeros(ntot, dtype="<U7")
        pos = np.zeros((H, ntot), dtype=np.int64)
        acc64 = np.zeros((H, ntot), dtype=np.float64)
        accq = np.zeros((H, ntot), dtype=np.float64)   # mass part of acc64
        modified = np.zeros((H, ntot), dtype=bool)
        obf_info = [None] * H
        part[:nhk] = "history"
        part[nhk:nhk + s] = "anchor"
        part[nhk + s:nhk + s + nk] = "kept"
        part[nhk + s + nk:] = "gen"
        for h in range(H):
            hi = hkept[h]
            rows_k = [hk[h, hi], pk[h, :s], pk[h, kept[h]], gk[h]]
            rows_v = [hv[h, hi], pv[h, :s], pv[h, kept[h]], gv[h]]
            K[h] = np.concatenate(rows_k, axis=0)
            V[h] = np.concatenate(rows_v, axis=0)
            pos[h] = np.concatenate([
                hpos[h, hi],
                p0 + np.arange(s, dtype=np.int64),
                p0 + np.asarray(kept[h], dtype=np.int64),
                p0 + n + np.arange(ng, dtype=np.int64)])
            acc64[h] = np.concatenate([hacc64[h, hi], A[h, :s], A[h, kept[h]], Agen[h]])
            accq[h] = np.concatenate([Ahist[h, hi], A[h, :s], A[h, kept[h]], Agen[h]])
            Vorig64[h] = to_f64(V[h], dt)
            V64[h] = Vorig64[h]
            if obf is not None:
                vals = to_f64(pv[h], dt)
                keep_set = set(kept[h])
                dele = [j for j in cands if j not in keep_set]
                res = obf_head(vals, kept[h], dele, A[h], obf)
                obf_info[h] = res
                if res is not None:
                    sl = slice(nhk + s, nhk + s + nk)
                    D64[h, sl] = res["add"]
                    V64[h, sl] = Vorig64[h, sl] + res["add"]
                    V[h, sl] = from_f64(V64[h, sl], dt)
                    modified[h, sl] = True
        # Step 6a: the top-k range's candidates that step 3 does not keep.
        dem = [[] for _ in range(H)]
        if pol.get("demote") is not None:
            e = n - min(sel["recent"], n - s)
            dem = [[j for j in range(s, e) if j not in set(kept[h])] for h in range(H)]
        nd = len(dem[0])
        assert all(len(x) == nd for x in dem)
        if n_dem is None:
            n_dem = nd
        assert n_dem == nd
        dem_k = np.stack([pk[h, dem[h]] for h in range(H)]) if nd else np.zeros((H, 0, d), pk.dtype)
        dem_v = np.stack([pv[h, dem[h]] for h in range(H)]) if nd else np.zeros((H, 0, d), pk.dtype)
        dem_pos = p0 + np.asarray(dem, dtype=np.int64).reshape(H, nd)
        dem_acc64 = np.stack([A[h, dem[h]] for h in range(H)]).reshape(H, nd)
        lay = RefLayer()
        lay.k, lay.v, lay.pos = K, V, pos
        lay.n_main = ntot
        lay.dem_idx, lay.dem_k, lay.dem_v, lay.dem_pos = dem, dem_k, dem_v, dem_pos
        # Steps 6a and 7b fail the compression on a norm past fp16's range.
        lay.lloyd = lay.dem_q = None
        if quant is not None and quant["scheme"] == "lloyd":
            lay.lloyd = lloyd_quantize_layer(to_f64(K, dt), to_f64(V, dt), quant, "layer.%d" % l,
                                             lloyd_bits(quant, l))
        if pol.get("demote") is not None:
            lay.dem_q = {x: lloyd_quantize_rows(to_f64(arr, dt), pol["demote"]["bits"], message_seed(pol),
                                                "layer.%d.demoted.%s" % (l, x))
                         for x, arr in (("k", dem_k), ("v", dem_v))}
        # layer.{l}.acc covers the main part, then the demoted tokens.
        acc64 = np.concatenate([acc64, dem_acc64], axis=1)
        accq = np.concatenate([accq, dem_acc64], axis=1)
        lay.v64, lay.vorig64, lay.add64 = V64, Vorig64, D64
        lay.modified, lay.part, lay.kept, lay.obf = modified, part, kept, obf_info
        lay.score, lay.A, lay.A_layer = score, A, A_layer
        lay.acc64, lay.acc_mass64 = acc64, accq
        lay.acc = acc64.astype(np.float32)
        lay.gran, lay.mean_entropy = gran, mean_e
        lay.hist_split, lay.hist_keys, lay.hist_kept = split, hist_keys, hkept
        lay.hist_acc64, lay.hist_mass64, lay.hist_keys64 = hacc64, Ahist, hist_keys64
        msg.layers.append(lay)
    msg.n_history, msg.n_anchor, msg.n_kept, msg.n_gen = n_hist_kept, s, n_kept, ng
    msg.n = n_hist_kept + s + n_kept + ng
    msg.n_demoted = n_dem
    msg.seed = message_seed(pol)
    msg.anchor_pos = sorted(turn.history_anchors) + [p0 + j for j in range(s)]
    msg.next_pos = p0 + n + ng
    msg.full_bytes = turn.L * dense_layer_bytes(H, nh + n + ng, d, dt)
    msg.quant_layer_bits = None
    if quant is None:
        msg.sent_bytes = turn.L * dense_layer_bytes(H, msg.n, d, dt)
    elif quant["scheme"] == "lloyd":
        msg.quant_layer_bits = lloyd_layer_bits_meta(quant, turn.L)
        msg.sent_bytes = 0
        for l in range(turn.L):
            bk, bv = lloyd_bits(quant, l)
            check_lloyd_geometry(d, bk, "layer.%d.k" % l)
            check_lloyd_geometry(d, bv, "layer.%d.v" % l)
            msg.sent_bytes += lloyd_layer_bytes(H, msg.n, d, quant, (bk, bv))
    else:
        msg.sent_bytes = turn.L * quant_layer_bytes(H, msg.n, d, quant["bits"], quant["group"])
    if pol.get("demote") is not None:
        check_lloyd_geometry(d, pol["demote"]["bits"], "layer.0.prompt.k")
        msg.sent_bytes += turn.L * demoted_layer_bytes(H, n_dem, d, pol["demote"]["bits"])
    msg.attention_error = None
    if with_error and turn.has_query:
        msg.attention_error = attention_error(turn, message_as_held(msg), window)["figure"]
    return msg


def decode_into(x64, dtype):
    """float64 decoded values -> the turn's dtype (float64 of the stored
    values); F16 / BF16 saturate at their largest finite value."""
    x = np.asarray(x64, dtype=np.float64)
    if dtype == "F16":
        x = np.clip(x, -65504.0, 65504.0)
    elif dtype == "BF16":
        big = float(bf16_bits_to_f32(np.array([0x7F7F], np.uint16))[0])
        x = np.clip(x, -big, big)
    return to_f64(from_f64(x, dtype), dtype)


def decode_layer(msg, lay):
    """(K, V) float64 [H, n, d] of one layer's main part as the recipient
    holds it: the dense tensors, or the reference's own codes decoded into
    the turn's dtype."""
    q = msg.policy["quant"]
    k64, v64 = to_f64(lay.k, msg.dtype), to_f64(lay.v, msg.dtype)
    if q is None:
        return k64, v64
    if q["scheme"] == "lloyd":
        r = lay.lloyd
        yk, yv = lloyd_dequantize_layer(r["codes_k"], r["codes_v"], r["k_scale"], r["k_zero"],
                                        r["v_scale"], q, r["bits"])
    else:
        r = quantize_layer(k64, v64, q["bits"], q["group"], q["rotate"])
        yk, yv, _, _ = dequantize_layer(r["codes_k"], r["codes_v"], r["k_scale"], r["k_zero"],
                                        r["v_scale"], r["v_zero"], q["group"], q["rotate"])
    return decode_into(yk, msg.dtype), decode_into(yv, msg.dtype)


def decode_demoted(msg, lay):
    """(K, V) float64 [H, n_demoted, d] of one layer's demoted tokens decoded
    into the turn's dtype (row form, the demotion's bits, the message's seed)."""
    bits = msg.policy["demote"]["bits"]
    out = []
    for x in ("k", "v"):
        r = lay.dem_q[x]
        out.append(decode_into(lloyd_dequantize_rows(r["codes"], r["norm"], bits, msg.seed), msg.dtype))
    return tuple(out)


def message_as_held(msg):
    """Per layer (K, V) float64 of the message decoded to dense, as the
    recipient holds it: the main part (dense, or the reference's own codes
    decoded into the turn's dtype) with the demoted tokens, decoded, merged
    into the kept ones by ascending position ([H, n + n_demoted, d])."""
    out = []
    for lay in msg.layers:
        k64, v64 = decode_layer(msg, lay)
        if msg.policy.get("demote") is not None and msg.n_demoted:
            dk, dv = decode_demoted(msg, lay)
            order = merge_order(lay.pos, lay.dem_pos, msg.n_history + msg.n_anchor, msg.n_kept)
            k64, v64 = merge_demoted(k64, dk, order), merge_demoted(v64, dv, order)
        out.append((k64, v64))
    return out


def message_tensors(msg, decode=False):
    """The tensors of the message file (FORMAT.md "Message (output)") the
    reference produces: name -> (dtype, array); packed with a quantizer, the
    demoted part after the main one; decode=True: dense, merged."""
    out = {}
    q = msg.policy["quant"]
    dm = msg.policy.get("demote")
    for l, lay in enumerate(msg.layers):
        acc, pos = lay.acc, lay.pos
        if decode:
            k64, v64 = decode_layer(msg, lay)
            if dm is not None:
                dk, dv = decode_demoted(msg, lay)
                order = merge_order(lay.pos, lay.dem_pos, msg.n_history + msg.n_anchor, msg.n_kept)
                k64, v64 = merge_demoted(k64, dk, order), merge_demoted(v64, dv, order)
                pos = merge_demoted(lay.pos, lay.dem_pos, order)
                acc = np.stack([acc[h][order[h]] for h in range(acc.shape[0])])
            out["layer.%d.k" % l] = (msg.dtype, from_f64(k64, msg.dtype))
            out["layer.%d.v" % l] = (msg.dtype, from_f64(v64, msg.dtype))
        elif q is None:
            out["layer.%d.k" % l] = (msg.dtype, lay.k)
            out["layer.%d.v" % l] = (msg.dtype, lay.v)
        else:
            k64, v64 = to_f64(lay.k, msg.dtype), to_f64(lay.v, msg.dtype)
            bk = bv = q["bits"]
            if q["scheme"] == "lloyd":
                r = lay.lloyd
                bk, bv = r["bits"]
            else:
                r = quantize_layer(k64, v64, bk, q["group"], q["rotate"])
                out["layer.%d.v.zero" % l] = ("F16", r["v_zero"])
            out["layer.%d.k.codes" % l] = ("U8", pack_codes(r["codes_k"], bk))
            out["layer.%d.v.codes" % l] = ("U8", pack_codes(r["codes_v"], bv))
            out["layer.%d.k.scale" % l] = ("F16", r["k_scale"])
            out["layer.%d.v.scale" % l] = ("F16", r["v_scale"])
            if r["k_zero"] is not None:
                out["layer.%d.k.zero" % l] = ("F16", r["k_zero"])
        if dm is not None and not decode:
            for x in ("k", "v"):
                r = lay.dem_q[x]
                out["layer.%d.demoted.%s.codes" % (l, x)] = ("U8", pack_codes(r["codes"], dm["bits"]))
                out["layer.%d.demoted.%s.norm" % (l, x)] = ("F16", r["norm"])
            # layer.{l}.pos covers the main part, then the demoted tokens.
            pos = np.concatenate([lay.pos, lay.dem_pos], axis=1)
        out["layer.%d.pos" % l] = ("I32", pos.astype(np.int32))
        out["layer.%d.acc" % l] = ("F32", acc)
    return out


def _softmax_rows(Z, mask):
    """Row-wise softmax of Z over the entries where mask is True (0 elsewhere)."""
    Zm = np.where(mask, Z, -np.inf)
    mx = np.max(Zm, axis=1, keepdims=True)
    E = np.where(mask, np.exp(Zm - mx), 0.0)
    return E / np.sum(E, axis=1, keepdims=True)


def attention_error(turn, msg_kv, window=None):
    """FORMAT.md "Fidelity": the attention_error of a message, float64.

    msg_kv: per layer (K, V) float64 [H, n_msg, d] as the recipient holds
    them, the last n_gen rows being the generated tokens.  For each layer,
    score head q (KV head q // (S/H)) and step t (every step; `window` does
    not apply): o_full = softmax((q_t . k_i) * scale) @ v over the turn's
    history, prompt and gen 0..t; o_msg the same over the message's tokens
    other than the generated ones plus gen 0..t.  The step's error is
    ||o_msg - o_full|| / ||o_full|| (0 when both are 0, 1 when only o_full
    is).  Layer figure: the mean over heads and steps; figure: the mean over
    layers; 0 when n_gen = 0.

    Returns {'figure', 'layers': [layer figures], 'steps': per layer
    [S, n_gen] errors, 'nfull': per layer [S, n_gen] ||o_full||, 'sfull' /
    'smsg': per layer [S, n_gen] sum_i w_i ||v_i||_2 (for the tests'
    tolerance)}."""
    S, H, ng, d = turn.S, turn.H, turn.n_gen, turn.d
    g = S // H
    scale = turn.softmax_scale
    out = {"figure": 0.0, "layers": [], "steps": [], "nfull": [], "sfull": [], "smsg": []}
    if ng == 0:
        out["layers"] = [0.0] * turn.L
        return out
    tot = 0.0
    for l in range(turn.L):
        q, hk, pk, gk = turn_keys_f64(turn, l)
        dt = turn.dtype
        if turn.has_history:
            hv = to_f64(turn.arr("layer.%d.history.v" % l), dt)
        else:
            hv = np.zeros((H, 0, d))
        pv = to_f64(turn.arr("layer.%d.prompt.v" % l), dt)
        gv = to_f64(turn.arr("layer.%d.gen.v" % l), dt)
        Km, Vm = msg_kv[l]
        nm = Km.shape[1]
        base_m = nm - ng
        errs = np.zeros((S, ng))
        nfull = np.zeros((S, ng))
        sfull = np.zeros((S, ng))
        smsg = np.zeros((S, ng))
        tsteps = np.arange(ng)
        for h in range(H):
            kf = np.concatenate([hk[h], pk[h], gk[h]], axis=0)
            vf = np.concatenate([hv[h], pv[h], gv[h]], axis=0)
            base_f = kf.shape[0] - ng
            mask_f = np.arange(kf.shape[0])[None, :] < (base_f + tsteps + 1)[:, None]
            mask_m = np.arange(nm)[None, :] < (base_m + tsteps + 1)[:, None]
            nvf = np.linalg.norm(vf, axis=1)
            nvm = np.linalg.norm(Vm[h], axis=1)
            for qi in range(h * g, (h + 1) * g):
                Wf = _softmax_rows((q[qi] @ kf.T) * scale, mask_f)
                Wm = _softmax_rows((q[qi] @ Km[h].T) * scale, mask_m)
                of = Wf @ vf
                om = Wm @ Vm[h]
                nf = np.linalg.norm(of, axis=1)
                nd = np.linalg.norm(om - of, axis=1)
                nmm = np.linalg.norm(om, axis=1)
                e = np.where(nf > 0, nd / np.where(nf > 0, nf, 1.0), np.where(nmm > 0, 1.0, 0.0))
                errs[qi], nfull[qi] = e, nf
                sfull[qi], smsg[qi] = Wf @ nvf, Wm @ nvm
        lf = float(np.mean(errs))
        out["layers"].append(lf)
        out["steps"].append(errs)
        out["nfull"].append(nfull)
        out["sfull"].append(sfull)
        out["smsg"].append(smsg)
        tot += lf
    out["figure"] = tot / turn.L
    return out


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
# the rotated Lloyd-Max quantizer (FORMAT.md step 7b) and demotion (step 6a)
# ---------------------------------------------------------------------------

# The non-negative levels of FORMAT.md's table, as float32; the others are
# their negatives.
LLOYD_LEVELS = {
    1: (0.7978846,),
    2: (0.4527800, 1.5104176),
    3: (0.2450942, 0.7560053, 1.3439093, 2.1519456),
    4: (0.1283950, 0.3880483, 0.6567591, 0.9423404, 1.2562312, 1.6180464, 2.0690172, 2.7325895),
}
_M64 = (1 << 64) - 1


def lloyd_codebook(bits):
    """c_0 < ... < c_{2^bits - 1}, float64 holding the float32 levels."""
    pos = np.asarray(LLOYD_LEVELS[bits], dtype=np.float32).astype(np.float64)
    return np.concatenate([-pos[::-1], pos])


def lloyd_thresholds(bits):
    """t_j = (c_j + c_{j+1}) / 2, exact in float64 (the levels are float32)."""
    c = lloyd_codebook(bits)
    return (c[:-1] + c[1:]) / 2.0


def lloyd_code(u, bits):
    """The code of u: the number of thresholds t_j <= u (exact comparisons)."""
    return np.searchsorted(lloyd_thresholds(bits), np.asarray(u, dtype=np.float64), side="right")


def splitmix64(seed, count):
    """`count` successive outputs of SplitMix64 seeded with `seed` (uint64)."""
    state = int(seed) & _M64
    out = []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        out.append(z ^ (z >> 31))
    return out


def lloyd_signs(seed, d):
    """sigma [d] of +-1: channel i takes bit i % 64 of call i / 64 + 1; a set
    bit means -1."""
    words = splitmix64(seed, (d + 63) // 64)
    return np.array([-1.0 if (words[i // 64] >> (i % 64)) & 1 else 1.0 for i in range(d)])


def fwht(x):
    """Unnormalized Walsh-Hadamard transform (Sylvester order, = x @ H_d *
    sqrt(d)) along the last axis, by float64 butterflies: exact whenever the
    sums fit in 53 bits (always for F16 / BF16 values and rows of moderate
    exponent range), so a coordinate that is 0 comes out exactly 0."""
    x = np.array(x, dtype=np.float64)
    d = x.shape[-1]
    h = 1
    while h < d:
        y = x.reshape(x.shape[:-1] + (d // (2 * h), 2, h))
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        x = y.reshape(x.shape)
        h *= 2
    return x


def lloyd_rotation(d, seed):
    """The matrix of R x = (H_d / sqrt(d)) (sigma * x), i.e. hadamard(d) diag(sigma)."""
    return hadamard(d) * lloyd_signs(seed, d)[None, :]


def check_lloyd_geometry(d, bits, what):
    """Rows of d channels, d a power of two, d * bits / 8 bytes of codes."""
    if d < 1 or d & (d - 1) or (d * bits) % 8:
        raise ValueError("%s: head_dim %d with %d bits: expected a power of two with head_dim * bits "
                         "a multiple of 8" % (what, d, bits))


def _f16_rne(x, what):
    """float64 -> float16, round to nearest even; non-finite is an error."""
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.asarray(x, dtype=np.float64).astype(np.float16)
    if not np.all(np.isfinite(y)):
        raise ValueError("%s: %r past fp16's largest finite value 65504"
                         % (what, float(np.max(np.abs(np.asarray(x, dtype=np.float64))))))
    return y


def lloyd_row_u(x64, nu, seed):
    """u = (R x) sqrt(d) / nu (u = 0 where nu = 0), computed as the
    unnormalized transform of sigma * x (exact, fwht()) divided by nu: one
    float64 rounding.  Returns (u, y = R x)."""
    x = np.asarray(x64, dtype=np.float64)
    d = x.shape[-1]
    z = fwht(x * lloyd_signs(seed, d))
    nu64 = np.asarray(nu, dtype=np.float64)[..., None]
    u = np.where(nu64 > 0, z / np.where(nu64 > 0, nu64, 1.0), 0.0)
    return u, z / math.sqrt(d)


def lloyd_quantize_rows(x64, bits, seed, what="rows"):
    """Step 7b, row form.  x64 [..., d] float64 (the stored values).

    Returns {'codes' [..., d] int, 'norm' [...] fp16 (nu = fp16(||x||_2),
    computed in float64, round to nearest even), 'u' [..., d] float64 (the
    values the codes decide on, u = y sqrt(d) / nu), 'y' = R x, 'norm64'}."""
    x = np.asarray(x64, dtype=np.float64)
    d = x.shape[-1]
    check_lloyd_geometry(d, bits, what)
    with np.errstate(over="ignore"):
        norm64 = np.sqrt(np.sum(x * x, axis=-1))
    nu = _f16_rne(norm64, what + ": row norm")
    u, y = lloyd_row_u(x, nu, seed)
    return {"codes": lloyd_code(u, bits), "norm": nu, "u": u, "y": y, "norm64": norm64}


def lloyd_dequantize_rows(codes, nu, bits, seed):
    """x = sigma * (H_d / sqrt(d)) (c[code] * nu / sqrt(d)), float64."""
    codes = np.asarray(codes)
    d = codes.shape[-1]
    z = lloyd_codebook(bits)[codes] * (np.asarray(nu, dtype=np.float64) / math.sqrt(d))[..., None]
    return (fwht(z) / math.sqrt(d)) * lloyd_signs(seed, d)


def lloyd_channel_u(k64, mean, rms, group):
    """u = (x - mu) / sigma with the fp16 stats expanded over their groups."""
    n = np.asarray(k64).shape[1]
    mu = expand_k_stat(np.asarray(mean), n, group)
    sg = expand_k_stat(np.asarray(rms), n, group)
    return (np.asarray(k64, dtype=np.float64) - mu) / sg


def lloyd_quantize_keys_channel(k64, bits, group, what="keys"):
    """Step 7b, keys=channel: k64 [H, n, d] float64.  Per head, channel and
    group of `group` consecutive tokens (the last one shorter): mu =
    fp16(mean x), sigma = fp16(sqrt(mean (x - mu)^2)) about that fp16 mu, at
    least the smallest fp16 subnormal; means in float64, round to nearest
    even.  Returns {'codes', 'mean', 'rms' ([H, ceil(n/group), d] fp16), 'u'}."""
    k = np.asarray(k64, dtype=np.float64)
    H, n, d = k.shape
    ng = -(-n // group) if n else 0
    mean = np.zeros((H, ng, d), dtype=np.float16)
    rms = np.zeros((H, ng, d), dtype=np.float16)
    for gi in range(ng):
        blk = k[:, gi * group:min(n, (gi + 1) * group), :]
        mu = _f16_rne(blk.mean(axis=1), what + ": channel mean")
        with np.errstate(over="ignore"):
            r = np.sqrt(np.mean((blk - mu.astype(np.float64)[:, None, :]) ** 2, axis=1))
        sg = _f16_rne(r, what + ": channel rms")
        mean[:, gi], rms[:, gi] = mu, np.maximum(sg, np.float16(F16_MIN_SUBNORMAL))
    u = lloyd_channel_u(k, mean, rms, group)
    return {"codes": lloyd_code(u, bits), "mean": mean, "rms": rms, "u": u}


def lloyd_dequantize_keys_channel(codes, mean, rms, bits, group):
    """x = mu + sigma * c[code], float64."""
    n = np.asarray(codes).shape[1]
    return (expand_k_stat(np.asarray(mean), n, group)
            + expand_k_stat(np.asarray(rms), n, group) * lloyd_codebook(bits)[np.asarray(codes)])


def lloyd_quantize_layer(k64, v64, q, what="layer", bits=None):
    """Step 7b on a message's K and V ([H, n, d] float64); bits = (Bk, Bv),
    the layer's keys' and values' bits (default: lloyd_bits(q, 0), i.e. the
    stage's bits).  Returns codes_k, codes_v, k_scale (row norms [H, n], or
    keys=channel rms [H, ng, d]), k_zero (None, or keys=channel means),
    v_scale (row norms [H, n]), u_k, u_v, bits."""
    bk, bv = lloyd_bits(q, 0) if bits is None else bits
    seed = q["seed"]
    check_lloyd_geometry(np.shape(v64)[-1], bv, what + ".v")
    check_lloyd_geometry(np.shape(k64)[-1], bk, what + ".k")
    rv = lloyd_quantize_rows(v64, bv, seed, what + ".v")
    if q["keys"] == "channel":
        rk = lloyd_quantize_keys_channel(k64, bk, q["group"], what + ".k")
        ks, kz = rk["rms"], rk["mean"]
    else:
        rk = lloyd_quantize_rows(k64, bk, seed, what + ".k")
        ks, kz = rk["norm"], None
    return {"codes_k": rk["codes"], "codes_v": rv["codes"], "k_scale": ks, "k_zero": kz,
            "v_scale": rv["norm"], "u_k": rk["u"], "u_v": rv["u"], "bits": (bk, bv)}


def lloyd_dequantize_layer(ck, cv, ks, kz, vs, q, bits=None):
    """Codes + fp16 stats of lloyd_quantize_layer() -> float64 K, V;
    bits = (Bk, Bv) as there."""
    bk, bv = lloyd_bits(q, 0) if bits is None else bits
    if q["keys"] == "channel":
        yk = lloyd_dequantize_keys_channel(ck, kz, ks, bk, q["group"])
    else:
        yk = lloyd_dequantize_rows(ck, ks, bk, q["seed"])
    return yk, lloyd_dequantize_rows(cv, vs, bv, q["seed"])


def lloyd_layer_bytes(H, n, d, q, bits=None):
    """Codes (d*Bk/8 bytes per key row, d*Bv/8 per value row), row norms
    (or keys=channel rms and mean) and positions."""
    bk, bv = lloyd_bits(q, 0) if bits is None else bits
    codes = H * n * (d * bk // 8) + H * n * (d * bv // 8)
    if q["keys"] == "channel":
        kstat = 2 * H * (-(-n // q["group"]) if n else 0) * d * 2
    else:
        kstat = H * n * 2
    return codes + kstat + H * n * 2 + 4 * H * n


def demoted_layer_bytes(H, nd, d, bits):
    """Demoted tokens: K and V codes, their 2-byte norms, 4-byte positions."""
    return 2 * H * nd * (d * bits // 8) + 2 * H * nd * 2 + 4 * H * nd


def merge_order(main_pos, dem_pos, n_before, n_kept):
    """Per head, the order of concat([main, demoted]) along the token axis
    that decodes a message to dense (FORMAT.md "Message (output)"): the main
    part's first n_before tokens (history, anchors), then its n_kept kept
    prompt tokens and the demoted ones merged by ascending position, then
    the rest (generated).  main_pos [H, n], dem_pos [H, nd] -> [H, n + nd]."""
    main_pos = np.asarray(main_pos, dtype=np.int64)
    dem_pos = np.asarray(dem_pos, dtype=np.int64)
    H, n = main_pos.shape
    nd = dem_pos.shape[1]
    out = np.zeros((H, n + nd), dtype=np.int64)
    for h in range(H):
        mid = list(range(n_before, n_before + n_kept)) + list(range(n, n + nd))
        allpos = np.concatenate([main_pos[h], dem_pos[h]])
        mid.sort(key=lambda i: (int(allpos[i]), i))
        out[h] = list(range(n_before)) + mid + list(range(n_before + n_kept, n))
    return out


def merge_demoted(main, dem, order):
    """concat([main, dem], axis=1) taken per head in `order` (merge_order())."""
    cat = np.concatenate([np.asarray(main), np.asarray(dem)], axis=1)
    return np.stack([cat[h][order[h]] for h in range(cat.shape[0])]) if cat.shape[0] else cat


# ---------------------------------------------------------------------------
# helpers for building turns (used by the tests and the self-test)
# ---------------------------------------------------------------------------

def make_turn_tensors(layers, dtype, history=None, history_pos=None, q_dtype=None,
                      history_acc=None, history_score=None):
    """layers: list of dicts with float64 'pk','pv','gk','gv' and either F32
    'score' ([S, n_prompt], written as prompt.score) or float64 'q'
    ([S, n_gen, d], written as gen.q in q_dtype: F32 or the K/V dtype, default
    the K/V dtype).  history / history_pos: optional list (per layer) of
    (hk, hv) and pos arrays; history_acc ([H, n_history]) / history_score
    ([S, n_history]): optional lists (per layer), written as F32.  The
    softmax_scale and history_anchors metadata go in the turn's metadata, see
    softmax_scale_str() and format_id_list()."""
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
        if history_acc is not None:
            t["layer.%d.history.acc" % l] = ("F32", np.asarray(history_acc[l], np.float32))
        if history_score is not None:
            t["layer.%d.history.score" % l] = ("F32", np.asarray(history_score[l], np.float32))
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
    n_checks += _selftest_history_auto_fidelity(rng)
    n_checks += _selftest_lloyd_demote(rng)
    if verbose:
        print("kvrelay_ref selftest: %d checks passed" % n_checks)
    return n_checks


def _hist_turn(rng, H, g, d, n, ng, dtype="F32", nh=0, n_anchor=0, query=False, acc=False,
               hscore=False, first=False, L=2, anchors_low=True, qmul=1.0, scores=None):
    """A random turn for the self-test: history of nh tokens per head (unique
    ascending positions below prompt_pos0 = nh + 50) holding n_anchor chain
    anchors, optional history.acc / history.score, prompt.score or gen.q."""
    p0 = nh + 50
    anchors = []
    if nh and n_anchor:
        anchors = (list(range(n_anchor)) if anchors_low
                   else sorted(int(x) for x in rng.choice(p0, n_anchor, replace=False)))
    layers, hist, hpos, hacc, hsc = [], [], [], [], []
    for l in range(L):
        lay = {"pk": rng.standard_normal((H, n, d)), "pv": rng.standard_normal((H, n, d)),
               "gk": rng.standard_normal((H, ng, d)), "gv": rng.standard_normal((H, ng, d))}
        if query:
            lay["q"] = rng.standard_normal((H * g, ng, d)) * qmul
        else:
            lay["score"] = (rng.exponential(size=(H * g, n)) if scores is None else scores[l]).astype(np.float32)
        layers.append(lay)
        hist.append((rng.standard_normal((H, nh, d)), rng.standard_normal((H, nh, d))))
        others = np.array([x for x in range(p0) if x not in set(anchors)])
        ph = np.zeros((H, nh), dtype=np.int64)
        for h in range(H):
            ph[h] = np.sort(np.concatenate([anchors, rng.choice(others, nh - len(anchors), replace=False)]))
        hpos.append(ph)
        hacc.append(rng.exponential(size=(H, nh)) * 3)
        hsc.append(rng.exponential(size=(H * g, nh)))
    t = make_turn_tensors(layers, dtype, hist if nh else None, hpos if nh else None,
                          history_acc=hacc if (acc and nh) else None,
                          history_score=hsc if (hscore and nh) else None)
    meta = {"first_agent": "true" if first else "false", "prompt_pos0": str(p0)}
    if anchors:
        meta["history_anchors"] = format_id_list(anchors)
    return Turn(t, meta)


def _same_message(a, b):
    if a.n != b.n or len(a.layers) != len(b.layers):
        return False
    for la, lb in zip(a.layers, b.layers):
        if (la.k.tobytes() != lb.k.tobytes() or la.v.tobytes() != lb.v.tobytes()
                or not np.array_equal(la.pos, lb.pos) or la.acc.tobytes() != lb.acc.tobytes()):
            return False
    return True


def _selftest_history_auto_fidelity(rng):
    """Self-test of accumulated importance, hist=K, h2o-auto and the fidelity
    figure (FORMAT.md steps 3a, 5, 5a, 6 and "Fidelity")."""
    n_checks = 0

    # Policy specs: hist on h2o-*, tau on h2o-auto, canonical order
    # k, sinks, recent, tau, pool, window, hist.
    pa = parse_policy("h2o-auto:hist=7,k=3,window=2,pool=3,tau=0.25")
    _check(pa["selector"]["tau"] == 0.25 and pa["selector"]["hist"] == 7, "parse auto")
    _check(canonical_selector(pa["selector"]) == "h2o-auto:k=3,sinks=4,recent=0,tau=0.25,pool=3,window=2,hist=7",
           "canonical auto")
    _check(canonical_selector(parse_policy("h2o-auto")["selector"]) == "h2o-auto:k=32,sinks=4,recent=0,tau=0.9",
           "canonical auto default")
    _check(canonical_selector(parse_policy("h2o-auto:tau=1")["selector"]).endswith("tau=1")
           and canonical_selector(parse_policy("h2o-auto:tau=0.0")["selector"]).endswith("tau=0")
           and canonical_selector(parse_policy("h2o-auto:tau=0.10")["selector"]).endswith("tau=0.1"),
           "canonical tau shortest")
    _check(canonical_selector(parse_policy("h2o-head:hist=0")["selector"]) == "h2o-head:k=32,sinks=4,recent=0,hist=0",
           "canonical hist")
    _check(canonical_selector(parse_policy("h2o-layer:hist=16777216,window=4")["selector"])
           == "h2o-layer:k=32,sinks=4,recent=0,window=4,hist=16777216", "canonical window + hist")
    n_checks += 6
    for bad in ("h2o-head:hist=-1", "h2o-layer:hist=16777217", "h2o-auto:hist=1.5", "gen:hist=2",
                "full:hist=2", "h2o-auto:tau=1.5", "h2o-auto:tau=1.0000001", "h2o-auto:tau=-0.1",
                "h2o-auto:tau=nan", "h2o-auto:tau=inf", "h2o-auto:tau=", "h2o-head:tau=0.5",
                "h2o-layer:tau=0.5"):
        try:
            parse_policy(bad)
            _check(False, "parse_policy accepted %r" % bad)
        except ValueError:
            pass
        n_checks += 1

    # Entropy (step 3a), hand cases.
    A = np.array([[9.0, 1, 1, 1, 1], [9.0, 0, 0, 5, 0], [0.0, 0, 0, 0, 0]])
    m, es = layer_entropy(A, 1, 5)
    _check(abs(es[0] - 1.0) < 1e-15 and es[1] == 0.0 and es[2] == 1.0, "entropy uniform/one-hot/T=0 %r" % es)
    _check(abs(m - 2.0 / 3.0) < 1e-15, "entropy mean")
    m, es = layer_entropy(np.array([[1.0, 3.0, 1.0, 3.0]]), 0, 4)
    want = -(2 * 0.125 * math.log(0.125) + 2 * 0.375 * math.log(0.375)) / math.log(4)
    _check(abs(es[0] - want) < 1e-15, "entropy hand")
    _check(layer_entropy(np.array([[5.0, 7.0]]), 1, 2)[1] == [1.0], "entropy c = 1")
    n_checks += 4

    for trial in range(12):
        query = trial % 2 == 1
        H = int(rng.integers(1, 4))
        g = int(rng.choice([1, 4, 5]))
        nh = int(rng.integers(0, 14))
        n_anchor = int(rng.integers(0, min(nh, 4) + 1))
        t = _hist_turn(rng, H, g, 8, int(rng.integers(6, 30)), int(rng.integers(1, 6)),
                       dtype=str(rng.choice(FLOAT_DTYPES)), nh=nh, n_anchor=n_anchor, query=query,
                       acc=rng.random() < 0.7, hscore=(not query) and rng.random() < 0.7,
                       first=rng.random() < 0.5, anchors_low=rng.random() < 0.5)
        k = int(rng.integers(1, 8))
        # tau = 0: mean entropy is never below 0 -> h2o-layer, every layer.
        ma = compress(t, "h2o-auto:k=%d,tau=0+obf" % k)
        ml = compress(t, "h2o-layer:k=%d+obf" % k)
        _check(_same_message(ma, ml) and ma.granularity == ["layer"] * t.L, "auto tau=0 == h2o-layer")
        # hist at least the history candidates: the history passes whole.
        for sel in ("h2o-head", "h2o-layer", "h2o-auto"):
            big = compress(t, "%s:k=%d,hist=%d" % (sel, k, nh - n_anchor + int(rng.integers(0, 3))))
            _check(_same_message(big, compress(t, "%s:k=%d" % (sel, k))), "hist >= candidates keeps all")
        # acc (step 5): history = acc in + mass, anchors/kept = A[h], gen = mass.
        m = compress(t, "full")
        for l, lay in enumerate(m.layers):
            hm, sc, gm = turn_masses(t, l)
            Ah, _ = reduce_scores(hm, H)
            A, _ = reduce_scores(sc, H)
            Ag, _ = reduce_scores(gm, H)
            ain = (t.arr("layer.%d.history.acc" % l).astype(np.float64) if t.has_history_acc
                   else np.zeros((H, nh)))
            want = np.concatenate([ain + Ah, A, Ag], axis=1)
            _check(np.array_equal(lay.acc64, want) and lay.acc.dtype == np.float32
                   and np.array_equal(lay.acc, want.astype(np.float32)), "acc of full")
            if not query:
                _check(np.all(lay.acc64[:, nh + t.n_prompt:] == 0), "acc of gen = 0 with prompt.score")
                if not t.has_history_score:
                    _check(np.array_equal(lay.acc64[:, :nh], ain), "acc of history = history.acc")
            else:
                # Every step's weights sum to 1 over the keys it sees, all kept by full.
                tot = lay.acc64.sum(axis=1) - ain.sum(axis=1)
                _check(np.allclose(tot, g * t.n_gen, rtol=1e-12), "acc of full sums to g * n_gen")
            n_checks += 2
        # anchor_pos: the history's chain anchors plus the first agent's own.
        mg = compress(t, "gen:sinks=3")
        s = min(3, t.n_prompt) if t.first_agent else 0
        _check(mg.anchor_pos == t.history_anchors + [t.prompt_pos0 + j for j in range(s)], "anchor_pos")
        n_checks += 5
        # hist=K: anchors kept, K candidates by acc; h2o-head per head, h2o-layer the same ranks.
        if nh - n_anchor >= 2:
            K = int(rng.integers(0, nh - n_anchor))
            for sel in ("h2o-head", "h2o-layer"):
                mh = compress(t, "%s:k=%d,hist=%d" % (sel, k, K))
                _check(mh.n_history == n_anchor + K, "hist=K keeps anchors + K")
                for l, lay in enumerate(mh.layers):
                    hp = t.arr("layer.%d.history.pos" % l)
                    acc32 = lay.hist_acc64.astype(np.float32).astype(np.float64)
                    ranks = []
                    for h in range(H):
                        anc, cand = lay.hist_split[h]
                        kept = lay.hist_kept[h]
                        _check(set(anc) <= set(kept) and kept == sorted(kept), "anchors kept, order kept")
                        kc = [i for i in kept if i not in set(anc)]
                        ranks.append([cand.index(i) for i in kc])
                        if sel == "h2o-head":
                            drop = [i for i in cand if i not in set(kc)]
                            if kc and drop:
                                _check(min(acc32[h, kc]) >= max(acc32[h, drop]), "head keeps the K largest acc")
                        _check(np.array_equal(lay.pos[h, :mh.n_history], hp[h, kept]), "history positions")
                        _check(np.array_equal(lay.acc64[h, :mh.n_history], lay.hist_acc64[h, kept]),
                               "history acc travels")
                    if sel == "h2o-layer":
                        _check(all(r == ranks[0] for r in ranks), "h2o-layer keeps the same ranks")
                    n_checks += 3
        if t.n_gen and query:
            _check(m.attention_error == 0.0, "full has attention_error 0")
            n_checks += 1

    # tau = 1 with concentrated scores (entropy well below 1): h2o-head.
    for dt in FLOAT_DTYPES:
        H, g, n = 3, 2, 30
        sc = []
        for _ in range(2):
            x = rng.exponential(size=(H * g, n)) ** 4   # heavy-tailed, entropy ~ 0.5
            sc.append(x)
        t = _hist_turn(rng, H, g, 8, n, 3, dtype=dt, nh=6, n_anchor=2, acc=True, hscore=True,
                       scores=sc, first=True)
        ma = compress(t, "h2o-auto:k=5,tau=1,hist=2+obf:inject=attn")
        mh = compress(t, "h2o-head:k=5,hist=2+obf:inject=attn")
        _check(all(lay.mean_entropy < 0.9 for lay in ma.layers), "concentrated")
        _check(_same_message(ma, mh) and ma.granularity == ["head"] * t.L, "auto tau=1 == h2o-head")
        # A tau between two layers' entropies chooses per layer.
        e0, e1 = ma.layers[0].mean_entropy, ma.layers[1].mean_entropy
        if e0 != e1:
            tau = (e0 + e1) / 2
            mm = compress(t, "h2o-auto:k=5,tau=%r,hist=2" % tau)
            want = ["head" if e < tau else "layer" for e in (e0, e1)]
            _check(mm.granularity == want, "auto per layer")
            for l in range(2):
                other = compress(t, "h2o-%s:k=5,hist=2" % want[l])
                _check(np.array_equal(mm.layers[l].pos, other.layers[l].pos)
                       and mm.layers[l].acc.tobytes() == other.layers[l].acc.tobytes(), "auto layer = chosen")
            n_checks += 3
        n_checks += 2

    # A chain: message 1 (gen.q) becomes turn 2's history (acc, anchor_pos);
    # under full everywhere each head's total acc grows by g * n_gen each turn.
    H, g, d = 2, 4, 8
    t1 = _hist_turn(rng, H, g, d, 12, 3, query=True, first=True, nh=0)
    m1 = compress(t1, "h2o-head:k=4")
    layers, hist, hpos, hacc = [], [], [], []
    for lay in m1.layers:
        layers.append({"pk": rng.standard_normal((H, 9, d)), "pv": rng.standard_normal((H, 9, d)),
                       "gk": rng.standard_normal((H, 4, d)), "gv": rng.standard_normal((H, 4, d)),
                       "q": rng.standard_normal((H * g, 4, d))})
        hist.append((to_f64(lay.k, "F32"), to_f64(lay.v, "F32")))
        hpos.append(lay.pos)
        hacc.append(lay.acc)
    t2 = Turn(make_turn_tensors(layers, "F32", hist, hpos, history_acc=hacc),
              {"first_agent": "false", "prompt_pos0": str(m1.next_pos + 5),
               "history_anchors": format_id_list(m1.anchor_pos)})
    m2 = compress(t2, "full")
    _check(m1.anchor_pos == [t1.prompt_pos0 + j for j in range(4)] and m2.anchor_pos == m1.anchor_pos,
           "anchor_pos travels")
    for l in range(2):
        hm, _, _ = turn_masses(t2, l)
        Ah, _ = reduce_scores(hm, H)
        _check(np.array_equal(m2.layers[l].acc64[:, :m1.n], m1.layers[l].acc.astype(np.float64) + Ah),
               "chain: acc = acc of message 1 + mass of turn 2")
        tot1 = m1.layers[l].acc.astype(np.float64).sum(axis=1)
        tot2 = m2.layers[l].acc64.sum(axis=1)
        _check(np.allclose(tot2 - tot1, g * 4, rtol=1e-12), "chain: total acc grows by g * n_gen")
        n_checks += 2
    # Budget on the chain: hist=1 keeps the 4 anchors and 1 more per head.
    m3 = compress(t2, "h2o-head:k=2,hist=1")
    _check(m3.n_history == 5 and all(set(m1.anchor_pos) <= set(m3.layers[l].pos[h, :5].tolist())
                                     for l in range(2) for h in range(H)), "chain budget keeps anchors")
    n_checks += 2

    # Fidelity, a hand case: d = 1, one prompt key (dropped by gen:sinks=0)
    # and one generated key; scale 1.  Step 0 sees prompt (z = 0, v = 3) and
    # gen (z = ln 2, v = -1): o_full = (3 - 2) / 3 = 1/3, o_msg = -1 -> 4.
    tens = make_turn_tensors([{"pk": np.zeros((1, 1, 1)), "pv": np.full((1, 1, 1), 3.0),
                               "gk": np.full((1, 1, 1), math.log(2.0)), "gv": np.full((1, 1, 1), -1.0),
                               "q": np.ones((1, 1, 1))}], "F32")
    t = Turn(tens, {"softmax_scale": "1"})
    mf = compress(t, "gen:sinks=0")
    want_err = abs(-1.0 - 1.0 / 3.0) / (1.0 / 3.0)
    _check(abs(mf.attention_error - want_err) < 1e-6 * 4, "fidelity hand case %r" % mf.attention_error)
    _check(compress(t, "full").attention_error == 0.0, "fidelity full = 0")
    # Two steps, mean over steps: step 1 sees prompt, gen 0 and gen 1.
    tens = make_turn_tensors([{"pk": np.zeros((1, 1, 1)), "pv": np.full((1, 1, 1), 2.0),
                               "gk": np.zeros((1, 2, 1)), "gv": np.array([[[0.0], [0.0]]]),
                               "q": np.ones((1, 2, 1))}], "F32")
    t = Turn(tens, {})
    # step 0: full = (2 + 0) / 2 = 1, msg = 0 -> 1; step 1: full = 2/3, msg = 0 -> 1.
    _check(abs(compress(t, "gen:sinks=0").attention_error - 1.0) < 1e-12, "fidelity mean of steps")
    # Zero values everywhere: o_full = o_msg = 0 -> 0.
    tens["layer.0.prompt.v"] = ("F32", np.zeros((1, 1, 1), np.float32))
    t = Turn(tens, {})
    _check(compress(t, "gen:sinks=0").attention_error == 0.0, "fidelity both zero")
    n_checks += 4
    # Random: attention_error >= 0, invariant to scaling the values by 2,
    # and with window the same figure as without (every step counts).
    for trial in range(6):
        H, g = int(rng.integers(1, 3)), int(rng.choice([1, 4, 5]))
        t = _hist_turn(rng, H, g, 8, 20, 4, query=True, nh=5, n_anchor=1, first=True)
        e1 = compress(t, "h2o-head:k=3,hist=1").attention_error
        e2 = compress(t, "h2o-head:k=3,hist=1,window=1").attention_error
        _check(e1 > 0 and e2 > 0, "fidelity > 0 when tokens are dropped")
        tens2 = dict(t.tensors)
        for l in range(t.L):
            for nm in ("history.v", "prompt.v", "gen.v"):
                dtn, arr = tens2["layer.%d.%s" % (l, nm)]
                tens2["layer.%d.%s" % (l, nm)] = (dtn, (arr.astype(np.float64) * 2).astype(np.float32))
        e3 = compress(Turn(tens2, t.meta), "h2o-head:k=3,hist=1").attention_error
        _check(abs(e3 - e1) <= 1e-12 * max(1.0, e1), "fidelity scale invariant")
        mq = compress(t, "h2o-head:k=3,hist=1+int8")
        _check(mq.attention_error != e1 and abs(mq.attention_error - e1) < 0.05, "fidelity with int8")
        n_checks += 3

    # Reader rules (reference side): history.score with gen.q, history_anchors.
    t = _hist_turn(rng, 2, 1, 8, 10, 2, query=True, nh=4, n_anchor=1)
    t.tensors["layer.0.history.score"] = ("F32", np.ones((2, 4), np.float32))
    t.tensors["layer.1.history.score"] = ("F32", np.ones((2, 4), np.float32))
    t = Turn(t.tensors, t.meta)
    try:
        compress(t, "full")
        _check(False, "history.score with gen.q accepted")
    except ValueError as e:
        _check("history.score" in str(e), "history.score refusal names it")
    t = _hist_turn(rng, 2, 1, 8, 10, 2, nh=4, n_anchor=2)
    for bad in ("%d" % (t.prompt_pos0 - 1), "1,0", "0,0"):
        meta = dict(t.meta)
        meta["history_anchors"] = bad
        try:
            compress(Turn(t.tensors, meta), "full")
            _check(False, "history_anchors=%r accepted" % bad)
        except ValueError as e:
            _check("history_anchors" in str(e), "history_anchors refusal names the key")
    n_checks += 4
    return n_checks


def _gauss_cells(bits):
    """Per Lloyd-Max cell [t_{j-1}, t_j) of N(0, 1), float64: (mass,
    first moment, second moment) from closed forms with erf and exp."""
    t = np.concatenate([[-np.inf], lloyd_thresholds(bits), [np.inf]])
    phi = lambda x: 0.0 if math.isinf(x) else math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    xphi = lambda x: 0.0 if math.isinf(x) else x * phi(x)  # noqa: E731
    upper = lambda x: 0.5 * math.erfc(x / math.sqrt(2))  # P(X > x)  # noqa: E731
    out = []
    for a, b in zip(t[:-1], t[1:]):
        mass = upper(a) - upper(b) if a >= 0 else (1 - upper(b)) - (1 - upper(a))
        m1 = phi(a) - phi(b)
        m2 = mass - (xphi(b) - xphi(a))
        out.append((mass, m1, m2))
    return out


# Lloyd-Max distortions of N(0, 1), 1 to 4 bits, as tabulated (Max, 1960),
# rounded to 4 digits: the integral of the table's levels gives 0.36338,
# 0.11748, 0.034548, 0.0095010.
LLOYD_MAX_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def _selftest_lloyd_demote(rng):
    """Self-test of the lloyd quantizer (step 7b) and demotion (step 6a)."""
    n_checks = 0

    # SplitMix64: published outputs (seed 1234567), and the sign rule.
    _check(splitmix64(1234567, 5) == [6457827717110365317, 3203168211198807973, 9817491932198370423,
                                      4593380528125082431, 16408922859458223821], "splitmix64 outputs")
    _check(splitmix64(0, 1) == [0xE220A8397B1DCDAF], "splitmix64 seed 0")
    for seed in (0, 1, 7, U64_MAX):
        w = splitmix64(seed, 3)
        sg = lloyd_signs(seed, 130)
        want = [-1.0 if (w[i // 64] >> (i % 64)) & 1 else 1.0 for i in range(130)]
        _check(list(sg) == want and np.array_equal(lloyd_signs(seed, 8), sg[:8]), "signs bit i%64 of call i/64+1")
    _check(not np.array_equal(lloyd_signs(1, 64), lloyd_signs(2, 64)), "seeds differ")
    n_checks += 7

    # Codebook: 2^B sorted symmetric levels; the Lloyd-Max fixed point (each
    # level the centroid of its cell under N(0, 1), each threshold the
    # midpoint), to the float32 rounding of the table; distortions as known.
    for bits in (1, 2, 3, 4):
        c = lloyd_codebook(bits)
        _check(c.size == 1 << bits and np.all(np.diff(c) > 0) and np.array_equal(c, -c[::-1]), "codebook shape")
        cells = _gauss_cells(bits)
        cent = np.array([m1 / mass for mass, m1, _ in cells])
        _check(np.max(np.abs(cent - c)) < 1e-6, "centroid condition %d bits: %r" % (bits, cent - c))
        _check(abs(sum(x[0] for x in cells) - 1.0) < 1e-14, "cells cover N(0,1)")
        mse = sum(m2 - 2 * cj * m1 + cj * cj * mass for (mass, m1, m2), cj in zip(cells, c))
        _check(abs(mse - LLOYD_MAX_MSE[bits]) <= 5e-4 * LLOYD_MAX_MSE[bits], "distortion %d bits %r" % (bits, mse))
        _check(lloyd_thresholds(bits)[(1 << (bits - 1)) - 1] == 0.0, "middle threshold 0")
        n_checks += 5

    # fwht: the Hadamard matrix times sqrt(d); a zero coordinate stays exactly 0.
    for d in (1, 2, 8, 64):
        x = rng.standard_normal((4, d))
        _check(np.allclose(fwht(x), x @ hadamard(d) * math.sqrt(d), atol=1e-12), "fwht = hadamard")
    xz = np.array([[1.0, 1.0, 1.0, 1.0, 0.5, -0.5, 0.5, -0.5]], dtype=np.float64)
    _check(fwht(xz).tolist() == [[4.0, 2.0, 0.0, 0.0, 4.0, -2.0, 0.0, 0.0]], "fwht exact zeros")
    n_checks += 5
    # Rotation: orthonormal, and sigma * H(H(sigma * x)) = x.
    for d in (1, 2, 8, 64, 128, 256):
        for seed in (1, 99, U64_MAX):
            R = lloyd_rotation(d, seed)
            _check(np.allclose(R @ R.T, np.eye(d), atol=1e-12), "rotation orthonormal")
            x = rng.standard_normal((3, d))
            y = x @ R.T
            _check(np.allclose((y @ hadamard(d)) * lloyd_signs(seed, d), x, atol=1e-12), "rotation inverse")
            n_checks += 2

    # Packing 1..4 bits: element i at bits [i*B, (i+1)*B) of the row, LSB
    # first (3 bits straddle bytes), checked against integer arithmetic.
    for bits in (1, 2, 3, 4):
        for d in (8, 16, 64):
            c = rng.integers(0, 1 << bits, (2, 5, d))
            pk = pack_codes(c, bits)
            _check(pk.shape == (2, 5, d * bits // 8) and np.array_equal(unpack_codes(pk, bits, d), c),
                   "pack round trip %d bits" % bits)
            row = c[1, 2]
            _check(int.from_bytes(pk[1, 2].tobytes(), "little") == sum(int(x) << (bits * i) for i, x in enumerate(row)),
                   "pack layout %d bits" % bits)
            n_checks += 2
    # 3 bits, by hand: codes 1..7, 0 -> 0b000_111_110_101_100_011_010_001.
    _check(pack_codes(np.array([[1, 2, 3, 4, 5, 6, 7, 0]]), 3).tolist() == [[0xD1, 0x58, 0x1F]], "pack 3 bits by hand")
    n_checks += 1

    # Row form: u decides the code by the thresholds; decoding gives R x_hat
    # = c[code] nu / sqrt(d); the MSE on Gaussian rows is Lloyd-Max's.
    for bits in (1, 2, 3, 4):
        d = 256
        x = rng.standard_normal((600, d)) * 3.0
        r = lloyd_quantize_rows(x, bits, 12345)
        t = np.concatenate([[-np.inf], lloyd_thresholds(bits), [np.inf]])
        _check(np.all(t[r["codes"]] <= r["u"]) and np.all(r["u"] < t[r["codes"] + 1]), "codes decided by u")
        _check(np.array_equal(r["norm"], np.sqrt((x * x).sum(axis=1)).astype(np.float16)), "norm fp16 RNE")
        xh = lloyd_dequantize_rows(r["codes"], r["norm"], bits, 12345)
        rot = xh @ lloyd_rotation(d, 12345).T
        want = lloyd_codebook(bits)[r["codes"]] * r["norm"].astype(np.float64)[:, None] / math.sqrt(d)
        _check(np.allclose(rot, want, rtol=0, atol=1e-12), "decode = R^T c nu / sqrt(d)")
        mse = float(np.sum((xh - x) ** 2) / np.sum(x * x))
        _check(abs(mse - LLOYD_MAX_MSE[bits]) <= 0.03 * LLOYD_MAX_MSE[bits],
               "lloyd MSE %d bits: %.5g vs %.5g" % (bits, mse, LLOYD_MAX_MSE[bits]))
        n_checks += 4
    # Zero rows: nu = 0, u = 0 (code 2^(B-1)), decoded as 0.
    z = lloyd_quantize_rows(np.zeros((2, 16)), 3, 1)
    _check(np.all(z["norm"] == 0) and np.all(z["codes"] == 4)
           and np.all(lloyd_dequantize_rows(z["codes"], z["norm"], 3, 1) == 0), "zero rows")
    # Norm past fp16: refused, naming the tensor; d not a power of two refused.
    for bad, why in ((np.full((1, 16), 2.0e4), "norm"), (np.ones((1, 24)), "d=24"), (np.ones((1, 4)), "d*bits")):
        try:
            lloyd_quantize_rows(bad, 1 if why == "d*bits" else 3, 1, what="layer.0.v")
            _check(False, "lloyd accepted %s" % why)
        except ValueError as e:
            _check("layer.0.v" in str(e), "refusal names the tensor")
    n_checks += 4

    # keys=channel: stats per head, channel and token group; u decides the
    # code; decoding mu + sigma c; constant channels get the smallest scale.
    for group in (1, 3, 8, 100):
        H, n, d = 2, 21, 16
        k = rng.standard_normal((H, n, d)) * np.exp(rng.standard_normal(d)) + rng.standard_normal(d)
        k[:, :, 3] = 0.5
        r = lloyd_quantize_keys_channel(k, 2, group)
        ng = -(-n // group)
        _check(r["mean"].shape == (H, ng, d) and r["rms"].shape == (H, ng, d), "channel stat shapes")
        _check(np.all(r["rms"][:, :, 3] == np.float16(F16_MIN_SUBNORMAL)) and np.all(r["mean"][:, :, 3] == 0.5),
               "constant channel")
        last = k[:, (ng - 1) * group:, :]
        _check(np.array_equal(r["mean"][:, -1], last.mean(axis=1).astype(np.float16)), "last group mean")
        t = np.concatenate([[-np.inf], lloyd_thresholds(2), [np.inf]])
        _check(np.all(t[r["codes"]] <= r["u"]) and np.all(r["u"] < t[r["codes"] + 1]), "channel codes")
        y = lloyd_dequantize_keys_channel(r["codes"], r["mean"], r["rms"], 2, group)
        _check(np.allclose(y, expand_k_stat(r["mean"], n, group) + expand_k_stat(r["rms"], n, group)
                           * lloyd_codebook(2)[r["codes"]], atol=0), "channel decode")
        n_checks += 5

    # Policy specs.
    pl = parse_policy("h2o-head:k=8,recent=2+demote:bits=3+lloyd:bits=4")
    _check(pl["demote"] == {"bits": 3} and pl["quant"]["scheme"] == "lloyd" and pl["quant"]["seed"] == 1
           and message_seed(pl) == 1, "parse demote + lloyd")
    _check(canonical_lloyd(parse_policy("full+lloyd:seed=7,bits=2")["quant"]) == "lloyd:bits=2,keys=row,seed=7",
           "canonical lloyd row")
    _check(canonical_lloyd(parse_policy("full+lloyd:keys=channel,group=8")["quant"])
           == "lloyd:bits=4,keys=channel,group=8,seed=1", "canonical lloyd channel")
    _check(canonical_demote(parse_policy("h2o-layer+demote")["demote"]) == "demote:bits=2", "canonical demote")
    _check(message_seed(parse_policy("h2o-head+demote+lloyd:seed=%d" % U64_MAX)) == U64_MAX
           and message_seed(parse_policy("h2o-head+demote+int4")) == 1, "message seed")
    n_checks += 5
    for bad in ("full+demote", "gen+demote", "h2o-head+obf+demote", "h2o-head+demote+obf", "h2o-head+int4+demote",
                "h2o-head+lloyd+demote", "h2o-head+demote+demote", "h2o-head+demote:bits=0",
                "h2o-head+demote:bits=5", "h2o-head+demote:p=2", "full+lloyd:bits=0", "full+lloyd:bits=5",
                "full+lloyd:bits=8", "full+lloyd:keys=col", "full+lloyd+int4", "full+int4+lloyd",
                "full+lloyd:seed=-1", "full+lloyd:seed=18446744073709551616", "full+lloyd:group=0,keys=channel",
                "full+lloyd:group=8", "full+lloyd:bogus=1", "lloyd"):
        try:
            parse_policy(bad)
            _check(False, "parse_policy accepted %r" % bad)
        except ValueError:
            pass
        n_checks += 1

    # Demotion: demoted, kept and anchors partition the prompt (the recent
    # window kept); demoted ascending with acc A[h][j]; the main part is the
    # message without demote; bytes are the packed tensors' bytes; decoding to
    # dense merges n_kept + n_demoted kept tokens by position.
    for trial in range(10):
        query = trial % 3 == 2
        H = int(rng.integers(1, 4))
        d = int(rng.choice([8, 16, 32]))
        n = int(rng.integers(0, 40))
        t = _hist_turn(rng, H, int(rng.choice([1, 2])), d, n, int(rng.integers(1, 4)),
                       dtype=str(rng.choice(FLOAT_DTYPES)), nh=int(rng.integers(0, 6)), query=query,
                       first=rng.random() < 0.6)
        sel = "%s:k=%d,recent=%d,pool=%d" % (str(rng.choice(["h2o-head", "h2o-layer", "h2o-auto"])),
                                            int(rng.integers(1, 12)), int(rng.integers(0, 4)),
                                            int(rng.choice([1, 3])))
        B = int(rng.integers(1, 5))
        quant = str(rng.choice(["", "+int4", "+lloyd:bits=3,seed=5", "+lloyd:bits=2,keys=channel,group=4"]))
        m = compress(t, sel + "+demote:bits=%d" % B + quant)
        m0 = compress(t, sel + quant)
        s = m.n_anchor
        pp = parse_policy(sel)["selector"]
        e = n - min(pp["recent"], n - s)
        _check(m.n_demoted == max(0, (e - s) - pp["k"]), "n_demoted = range - k")
        for l, lay in enumerate(m.layers):
            lay0 = m0.layers[l]
            for h in range(H):
                kp = set(lay.kept[h])
                dp = lay.dem_idx[h]
                _check(dp == sorted(dp) and not kp & set(dp) and kp | set(dp) | set(range(s)) == set(range(n))
                       and set(range(e, n)) <= kp, "demoted + kept + anchors = prompt")
                _check(np.array_equal(lay.dem_pos[h], t.prompt_pos0 + np.array(dp, dtype=np.int64)), "demoted pos")
            _check(lay.k.tobytes() == lay0.k.tobytes() and lay.v.tobytes() == lay0.v.tobytes()
                   and np.array_equal(lay.pos, lay0.pos)
                   and lay.acc[:, :m.n].tobytes() == lay0.acc.tobytes(), "main part unchanged by demote")
            want = np.stack([lay.A[h, lay.dem_idx[h]] for h in range(H)]).reshape(H, m.n_demoted)
            _check(np.array_equal(lay.acc64[:, m.n:], want), "demoted acc = A[h][j]")
            n_checks += 3 + H
        tens = message_tensors(m)
        for l, lay in enumerate(m.layers):
            _check(np.array_equal(tens["layer.%d.pos" % l][1], np.concatenate([lay.pos, lay.dem_pos], axis=1))
                   and tens["layer.%d.acc" % l][1].shape == (H, m.n + m.n_demoted), "pos, acc: main then demoted")
            n_checks += 1
        nbytes = sum(a.nbytes for nm, (_, a) in tens.items() if not nm.endswith(".acc"))
        _check(nbytes == m.sent_bytes, "sent_bytes = bytes of the packed tensors (%d vs %d)" % (nbytes, m.sent_bytes))
        _check(m.sent_bytes - m0.sent_bytes == t.L * demoted_layer_bytes(H, m.n_demoted, d, B), "demoted bytes")
        dense = message_tensors(m, decode=True)
        held = message_as_held(m)
        for l, lay in enumerate(m.layers):
            pos = dense["layer.%d.pos" % l][1]
            nb, nk = m.n_history + m.n_anchor, m.n_kept + m.n_demoted
            _check(pos.shape == (H, m.n + m.n_demoted) and np.all(np.diff(pos[:, nb:nb + nk], axis=1) > 0),
                   "decoded: n_kept + n_demoted kept tokens, ascending")
            _check(np.array_equal(to_f64(dense["layer.%d.v" % l][1], t.dtype), held[l][1]), "decoded = as held")
            for h in range(H):
                _check(sorted(pos[h, nb:nb + nk].tolist()) == sorted(
                    [t.prompt_pos0 + j for j in lay.kept[h] + lay.dem_idx[h]]), "decoded kept = kept + demoted")
                for i in range(nb, nb + nk):
                    j = int(pos[h, i]) - t.prompt_pos0
                    if j in set(lay.kept[h]) and parse_policy(sel + quant)["quant"] is None:
                        _check(dense["layer.%d.v" % l][1][h, i].tobytes() == t.arr("layer.%d.prompt.v" % l)[h, j].tobytes(),
                               "decoded kept rows exact without a quantizer")
                n_checks += 1
            n_checks += 2
        n_checks += 3
    # compress() refuses a norm past fp16's range, naming the tensor.
    tb = _hist_turn(rng, 2, 1, 16, 12, 2, first=True)
    for l in range(tb.L):
        tb.tensors["layer.%d.prompt.v" % l] = ("F32", np.full((2, 12, 16), 3.0e4, np.float32))
    for spec, name in (("full+lloyd", "layer.0.v"), ("h2o-head:k=2+demote", "layer.0.demoted.v")):
        try:
            compress(tb, spec)
            _check(False, "norm past fp16 accepted by %s" % spec)
        except ValueError as e:
            _check(name in str(e), "refusal names %s: %s" % (name, e))
        n_checks += 1
    # A main lloyd stage and the demoted part share the message's seed.
    t = _hist_turn(rng, 2, 1, 16, 30, 2, first=True)
    m = compress(t, "h2o-head:k=5+demote:bits=4+lloyd:bits=4,seed=77")
    tens = message_tensors(m)
    lay = m.layers[0]
    r = lloyd_quantize_rows(to_f64(lay.dem_v, "F32"), 4, 77)
    _check(np.array_equal(unpack_codes(tens["layer.0.demoted.v.codes"][1], 4, 16), r["codes"]), "demoted seed")
    n_checks += 1
    n_checks += _selftest_lloyd_layers(rng)
    return n_checks


def _selftest_lloyd_layers(rng):
    """lloyd:layers=KV.KV...: parsing, refusals, canonical form, per-layer
    per-tensor bits, quant_layer_bits and bytes."""
    n_checks = 0
    q = parse_policy("full+lloyd:layers=43.12.44,seed=9")["quant"]
    _check(q["layers"] == ((4, 3), (1, 2), (4, 4)) and q["bits"] is None and q["seed"] == 9
           and lloyd_bits(q, 1) == (1, 2), "parse layers")
    _check(canonical_lloyd(q) == "lloyd:keys=row,seed=9,layers=43.12.44", "canonical layers row")
    qc = parse_policy("h2o-head+demote+lloyd:layers=21,keys=channel,group=4")["quant"]
    _check(canonical_lloyd(qc) == "lloyd:keys=channel,group=4,seed=1,layers=21", "canonical layers channel")
    _check(parse_policy("full+" + canonical_lloyd(q))["quant"] == q, "canonical layers reads back")
    _check(lloyd_bits(parse_policy("full+lloyd:bits=2")["quant"], 5) == (2, 2), "bits= gives every layer")
    n_checks += 5
    for bad in ("full+lloyd:bits=4,layers=44", "full+lloyd:layers=44,bits=4", "full+lloyd:layers=",
                "full+lloyd:layers=4", "full+lloyd:layers=443", "full+lloyd:layers=05", "full+lloyd:layers=45",
                "full+lloyd:layers=44.", "full+lloyd:layers=.44", "full+lloyd:layers=44..44",
                "full+lloyd:layers=4a", "full+lloyd:layers=44-44", "full+lloyd:layers=44,44",
                "full+lloyd:layers=44.3", "full+lloyd:layers=+4", "full+lloyd:layers=44,group=4"):
        try:
            parse_policy(bad)
            _check(False, "parse_policy accepted %r" % bad)
        except ValueError:
            pass
        n_checks += 1
    _check(lloyd_layer_bits_meta(parse_policy("full+lloyd:layers=33.33")["quant"], 2) is None
           and lloyd_layer_bits_meta(parse_policy("full+lloyd:layers=43.43")["quant"], 2) == "43.43"
           and lloyd_layer_bits_meta(parse_policy("full+lloyd:layers=33.32")["quant"], 2) == "33.32"
           and lloyd_layer_bits_meta(parse_policy("full+lloyd:bits=2")["quant"], 3) is None, "quant_layer_bits")
    n_checks += 1
    # Per layer and tensor: the codes of bits=B on that tensor alone.
    H, d, n, ng = 2, 16, 20, 3
    for keys in ("row", "channel"):
        t = _hist_turn(rng, H, 1, d, n, ng, first=True, L=3)
        spec = "h2o-head:k=6+demote:bits=3+lloyd:layers=41.23.44,seed=5,keys=%s" % keys
        m = compress(t, spec)
        tens = message_tensors(m)
        want_bytes = 0
        for l, (bk, bv) in enumerate(((4, 1), (2, 3), (4, 4))):
            lay = m.layers[l]
            kb = compress(t, spec.replace("layers=41.23.44", "bits=%d" % bk))
            vb = compress(t, spec.replace("layers=41.23.44", "bits=%d" % bv))
            tk, tv = message_tensors(kb), message_tensors(vb)
            for nm, other in (("k.codes", tk), ("k.scale", tk), ("v.codes", tv), ("v.scale", tv),
                              ("demoted.k.codes", tk), ("demoted.v.norm", tv)):
                a, b = tens["layer.%d.%s" % (l, nm)], other["layer.%d.%s" % (l, nm)]
                _check(a[0] == b[0] and np.array_equal(a[1], b[1]), "layers= %s layer %d %s" % (keys, l, nm))
            _check(tens["layer.%d.k.codes" % l][1].shape == (H, m.n, d * bk // 8)
                   and tens["layer.%d.v.codes" % l][1].shape == (H, m.n, d * bv // 8), "codes shapes")
            want_bytes += sum(a[1].nbytes for nm, a in tens.items()
                              if nm.startswith("layer.%d." % l) and not nm.endswith(".acc"))
            n_checks += 7
        _check(m.sent_bytes == want_bytes, "sent_bytes %d = packed tensors %d" % (m.sent_bytes, want_bytes))
        _check(m.quant_layer_bits == "41.23.44", "message quant_layer_bits")
        n_checks += 2
    # Uniform layers= is the message of bits=B; the layer count must match.
    t = _hist_turn(rng, H, 1, d, n, ng, L=2)
    a, b = compress(t, "full+lloyd:layers=22.22"), compress(t, "full+lloyd:bits=2")
    ta, tb = message_tensors(a), message_tensors(b)
    _check(a.sent_bytes == b.sent_bytes and a.quant_layer_bits is None
           and all(x[0] == y[0] and x[1].tobytes() == y[1].tobytes()
                   for x, y in zip(ta.values(), tb.values())) and list(ta) == list(tb), "layers=22.22 is bits=2")
    n_checks += 1
    for spec in ("full+lloyd:layers=22", "full+lloyd:layers=22.22.22"):
        try:
            compress(t, spec)
            _check(False, "layer count accepted: %s" % spec)
        except ValueError as e:
            _check("layers" in str(e), "count refusal names layers: %s" % e)
        n_checks += 1
    # d * B / 8 bytes per row for every layer's keys and values.
    t4 = _hist_turn(rng, H, 1, 4, n, ng, L=2)
    compress(t4, "full+lloyd:layers=24.42")
    try:
        compress(t4, "full+lloyd:layers=24.43")
        _check(False, "head_dim 4 with 3 bits accepted")
    except ValueError as e:
        _check("layer.1.v" in str(e), "geometry refusal names layer.1.v: %s" % e)
    n_checks += 1
    return n_checks


if __name__ == "__main__":
    if "--selftest" in sys.argv[1:]:
        selftest()
    else:
        print(__doc__)
