"""Turns, messages and their numpy helpers (docs/FORMAT.md).

K/V arrays are numpy arrays of shape [kv_heads, tokens, head_dim]:
float32 for F32, float16 for F16, and for BF16 uint16 arrays holding the
bfloat16 bit patterns (numpy has no bfloat16; see f32_to_bf16/bf16_to_f32).
"""
from dataclasses import dataclass, field
import numbers
from typing import List, Optional, Sequence

import numpy as np

__all__ = [
    "DTYPES", "Accounting", "PublishResult", "Stats", "TurnLayer", "Turn",
    "QuantizedLayer", "MessageLayer", "Message", "f32_to_bf16", "bf16_to_f32",
    "dequantize_layer", "hadamard_f32",
]

# Storage dtype of each K/V dtype name (BF16: raw bit patterns).
DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


def _f64_to_f32_round_to_odd(x):
    """float64 -> float32 rounded to odd: truncated toward zero, with the last
    bit set when that dropped anything. Rounding this to nearest even with at
    least two fewer bits (bfloat16) gives float64's own nearest even."""
    f = x.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        away = np.abs(f.astype(np.float64)) > np.abs(x)  # rounded away from zero
        f = np.where(away, np.nextafter(f, np.float32(0)), f)
        inexact = f.astype(np.float64) != x  # NaN too: it stays NaN
    u = f.view(np.uint32)
    return np.where(inexact, u | np.uint32(1), u)


def f32_to_bf16(x):
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even.
    float64 input is rounded once, from its own value (not via float32);
    other input is converted to float32 first."""
    a = np.asarray(x)
    if a.dtype == np.float64:
        u = np.ascontiguousarray(_f64_to_f32_round_to_odd(a), dtype=np.uint32)
    else:
        u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    # ascontiguousarray makes a 0-d input 1-d: give back the input's shape.
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded).reshape(a.shape)


def bf16_to_f32(bits):
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    # np.uint32(16): a plain 16 would make a 0-d input's shift int64.
    return np.left_shift(np.asarray(bits, dtype=np.uint16).astype(np.uint32), np.uint32(16)).view(np.float32)


def to_f32(a, dtype):
    """A K/V array stored as `dtype` ("F32", "F16", "BF16") as float32."""
    return bf16_to_f32(a) if dtype == "BF16" else np.asarray(a).astype(np.float32)


def from_f32(a, dtype):
    """float32 -> storage of `dtype`, rounding to nearest even."""
    if dtype == "BF16":
        return f32_to_bf16(a)
    return np.asarray(a, dtype=np.float32).astype(DTYPES[dtype])


@dataclass
class Accounting:
    """Byte accounting of one message (relay.proto Accounting)."""
    received_bytes: int = 0
    full_bytes: int = 0
    sent_bytes: int = 0
    ratio: float = 0.0
    compress_seconds: float = 0.0
    commit_seconds: float = 0.0
    policy: str = ""  # canonical spec that was applied
    # For a turn with queries (gen_q): mean over layers of |o_msg - o_full| /
    # |o_full| of the sender's own attention output; None otherwise.
    attention_error: Optional[float] = None


@dataclass
class PublishResult:
    message_id: str
    duplicate: bool  # the id was already committed; nothing changed
    accounting: Accounting
    attempts: int = 1


@dataclass
class Stats:
    messages_committed: int = 0
    messages_failed: int = 0
    messages_delivered: int = 0
    messages_acked: int = 0
    received_bytes: int = 0
    full_bytes: int = 0
    sent_bytes: int = 0
    sessions: int = 0
    mailbox_messages: int = 0
    mailbox_bytes: int = 0
    inflight_bytes: int = 0
    version: str = ""
    store_bytes: int = 0


@dataclass
class TurnLayer:
    """One layer of a turn. K/V: [kv_heads, n, head_dim]; history_pos: int32
    [kv_heads, n_history]. The attention input, exactly one of: score,
    float32 [score_heads, n_prompt] (attention mass on each prompt token,
    >= 0), or gen_q [score_heads, n_gen, head_dim], the generated steps'
    post-RoPE queries in float32 or the K/V dtype, from which the relay
    computes the scores (every layer the same one).

    history_score (optional, with score only; every layer or none): float32
    [score_heads, n_h], this agent's attention mass on each history token
    (finite, >= 0), added to the tokens' accumulated importance, which a
    history budget (hist=) keeps the top of. n_h is the history's tokens per
    head: n_history for an uploaded history, or with parent_id the parent
    message's (Message.tokens of the message fetched), in that message's
    token order per KV head (GQA: score head q reads KV head
    q // (score_heads // kv_heads))."""
    prompt_k: np.ndarray
    prompt_v: np.ndarray
    gen_k: np.ndarray
    gen_v: np.ndarray
    score: Optional[np.ndarray] = None
    history_k: Optional[np.ndarray] = None
    history_v: Optional[np.ndarray] = None
    history_pos: Optional[np.ndarray] = None
    gen_q: Optional[np.ndarray] = None
    history_score: Optional[np.ndarray] = None


@dataclass
class Turn:
    """One agent turn. dtype: "F32", "F16" or "BF16"; None infers it from
    layer 0's prompt_k (float32 / float16; uint16 needs dtype="BF16")."""
    layers: List[TurnLayer]
    dtype: Optional[str] = None
    # None: True when the turn uploads no history (the chain's first agent
    # keeps its attention sinks), else False. Not a bool: ValueError.
    first_agent: Optional[bool] = None
    prompt_pos0: Optional[int] = None  # None: the history length
    # The attention's logit scale for scores from gen_q; None: 1/sqrt(head_dim).
    softmax_scale: Optional[float] = None
    # Position ids of the chain's anchors that the uploaded history holds (a
    # fetched message's anchor_pos), ascending: every head of every layer's
    # history must hold each once (the relay checks), and a history budget
    # (hist=) never drops them. Only with history; None or []: none. With
    # parent_id the relay takes the parent's.
    history_anchors: Optional[Sequence[int]] = None

    def kv_dtype(self):
        if self.dtype is not None:
            if self.dtype not in DTYPES:
                raise ValueError(f"turn.dtype: {self.dtype!r}, expected F32, F16 or BF16")
            return self.dtype
        if not self.layers:
            raise ValueError("turn.layers: empty, expected at least one layer")
        dt = np.asarray(self.layers[0].prompt_k).dtype
        if dt.kind == "f":  # either byte order: the upload writes little-endian
            dt = dt.newbyteorder("<")
        if dt == np.float32:
            return "F32"
        if dt == np.float16:
            return "F16"
        raise ValueError(f"layer.0.prompt.k: dtype {dt}, expected float32 or float16 "
                         "(bfloat16: uint16 bit patterns with Turn(dtype='BF16'))")

    def is_first_agent(self):
        """first_agent as sent: the field, or whether no history is uploaded."""
        if self.first_agent is None:
            return not self.layers or self.layers[0].history_k is None or \
                np.shape(self.layers[0].history_k)[1:2] == (0,)
        if not isinstance(self.first_agent, (bool, np.bool_)):
            raise ValueError(f"turn.first_agent: {self.first_agent!r}, expected True, False or None")
        return bool(self.first_agent)

    def anchors(self):
        """history_anchors as a list of ints (ValueError naming the field for
        ids that are not ascending distinct integers in [0, 2^31), more ids
        than history tokens, or ids without an uploaded history). Whether
        every head holds each id is the relay's to check."""
        a = self.history_anchors
        if a is None:
            return []
        if isinstance(a, (str, bytes)) or not hasattr(a, "__iter__"):
            raise ValueError(f"turn.history_anchors: {a!r}, expected a sequence of position ids or None")
        ids = list(a)
        for i, v in enumerate(ids):
            if not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)) or not 0 <= v < 1 << 31:
                raise ValueError(f"turn.history_anchors[{i}]: {v!r}, expected an integer position id "
                                 "in [0, 2^31)")
            if i and v <= ids[i - 1]:
                raise ValueError(f"turn.history_anchors[{i}]: {v} after {ids[i - 1]}, expected ascending "
                                 "distinct position ids")
        if not ids:
            return []
        n_hist = self.geometry()[6]
        if n_hist == 0:
            raise ValueError(f"turn.history_anchors: {len(ids)} position ids, expected none for a turn "
                             "without history (with parent_id the relay takes the parent's anchors)")
        if len(ids) > n_hist:
            raise ValueError(f"turn.history_anchors: {len(ids)} position ids, expected at most "
                             f"n_history = {n_hist}")
        return [int(v) for v in ids]

    def history_score_tokens(self):
        """Columns of the layers' history_score, 0 when they carry none
        (ValueError naming the tensor unless every layer or none carries one,
        float32 [score_heads, n] with n >= 1 the same in every layer, never
        with gen_q, and n = n_history when the turn uploads history). Without
        uploaded history n must be the parent's tokens per head, which only
        the relay can check."""
        given = [layer.history_score is not None for layer in self.layers]
        if not any(given):
            return 0
        if not all(given):
            i = given.index(False)
            raise ValueError(f"layer.{i}.history.score: missing, expected it in every layer or in none "
                             f"(layer.{given.index(True)} has one)")
        _, _, s, _, _, _, n_hist = self.geometry()
        if self.query_dtype():
            raise ValueError("layer.0.history.score: given with layer.0.gen.q, expected none (the relay "
                             "computes the mass on the history from the queries)")
        a0 = self.layers[0].history_score
        n = n_hist if n_hist else (np.shape(a0)[1] if np.ndim(a0) == 2 else -1)
        why = "[score_heads, n_history]" if n_hist else "[score_heads, tokens per head of the parent]"
        for i, layer in enumerate(self.layers):
            a = layer.history_score
            if tuple(np.shape(a)) != (s, n):
                want = f"[{s}, {n}]" if n >= 0 else f"[{s}, n]"
                raise ValueError(f"layer.{i}.history.score: shape {list(np.shape(a))}, expected {want} "
                                 f"({why}{', like layer.0' if i and not n_hist else ''})")
            if np.asarray(a).dtype.newbyteorder("<") != np.dtype("<f4"):
                raise ValueError(f"layer.{i}.history.score: dtype {np.asarray(a).dtype}, expected float32")
        if n < 1:
            raise ValueError(f"layer.0.history.score: shape [{s}, 0], expected at least one column "
                             "(one per history token)")
        return n

    def query_dtype(self):
        """None when the layers carry scores; else gen_q's dtype, "F32" or the
        K/V dtype (ValueError naming the tensor for another, or for both or
        neither input, or a mix across layers)."""
        kv = self.kv_dtype()
        if not self.layers:
            raise ValueError("turn.layers: empty, expected at least one layer")
        queries = self.layers[0].gen_q is not None
        for i, layer in enumerate(self.layers):
            if layer.gen_q is not None and layer.score is not None:
                raise ValueError(f"layer.{i}.gen.q: given together with layer.{i}.prompt.score, "
                                 "expected exactly one of the two")
            if layer.gen_q is None and layer.score is None:
                raise ValueError(f"layer.{i}.prompt.score: missing, expected it or layer.{i}.gen.q "
                                 "(the queries)")
            if (layer.gen_q is not None) != queries:
                given, want = ("gen.q", "prompt.score") if layer.gen_q is not None else \
                    ("prompt.score", "gen.q")
                raise ValueError(f"layer.{i}.{given}: given, expected layer.{i}.{want} like layer.0 "
                                 "(every layer carries the same one)")
        if not queries:
            return None
        dt = np.asarray(self.layers[0].gen_q).dtype
        if dt.kind == "f":
            dt = dt.newbyteorder("<")
        if dt == np.float32:
            return "F32"
        if dt == np.dtype(DTYPES[kv]).newbyteorder("<"):
            return kv
        raise ValueError(f"layer.0.gen.q: dtype {dt}, expected float32 or the K/V dtype "
                         f"({np.dtype(DTYPES[kv])}, {kv} turn)")

    def geometry(self):
        """(dtype, kv_heads, score_heads, head_dim, n_prompt, n_gen, n_history),
        checked across layers (ValueError naming the tensor)."""
        dtype = self.kv_dtype()
        if not self.layers:
            raise ValueError("turn.layers: empty, expected at least one layer")
        l0 = self.layers[0]
        h, n_prompt, d = np.shape(l0.prompt_k) if np.ndim(l0.prompt_k) == 3 else (None,) * 3
        if h is None or h < 1 or d < 1:
            raise ValueError(f"layer.0.prompt.k: shape {list(np.shape(l0.prompt_k))}, "
                             "expected [kv_heads >= 1, n_prompt, head_dim >= 1]")
        n_gen = np.shape(l0.gen_k)[1] if np.ndim(l0.gen_k) == 3 else -1
        hist = l0.history_k is not None
        n_hist = np.shape(l0.history_k)[1] if hist and np.ndim(l0.history_k) == 3 else 0
        qdt = self.query_dtype()
        if qdt:
            s = np.shape(l0.gen_q)[0] if np.ndim(l0.gen_q) == 3 else -1
        else:
            s = np.shape(l0.score)[0] if np.ndim(l0.score) == 2 else -1
        want = {
            "prompt.k": (h, n_prompt, d), "prompt.v": (h, n_prompt, d),
            "gen.k": (h, n_gen, d), "gen.v": (h, n_gen, d),
        }
        if qdt:
            want["gen.q"] = (s, n_gen, d)
        else:
            want["prompt.score"] = (s, n_prompt)
        if hist:
            want.update({"history.k": (h, n_hist, d), "history.v": (h, n_hist, d),
                         "history.pos": (h, n_hist)})
        dts = {"prompt.score": np.float32, "history.pos": np.int32,
               "gen.q": DTYPES[qdt] if qdt else np.float32}
        for i, layer in enumerate(self.layers):
            parts = [getattr(layer, n) is not None for n in ("history_k", "history_v", "history_pos")]
            if any(parts) and not all(parts):
                raise ValueError(f"layer.{i}.history: history_k, history_v and history_pos "
                                 f"given {parts}, expected all three or none")
            if (layer.history_k is not None) != hist:
                raise ValueError(f"layer.{i}.history.k: history in some layers only, "
                                 "expected all layers or none")
            for name, shape in want.items():
                a = getattr(layer, name.replace("prompt.score", "score").replace(".", "_"))
                if a is None or tuple(np.shape(a)) != shape:
                    found = None if a is None else list(np.shape(a))
                    # -1: a size the first layer's tensor did not give (not 3-D / 2-D).
                    expected = ", ".join("any" if n == -1 else str(n) for n in shape)
                    raise ValueError(f"layer.{i}.{name}: shape {found}, expected [{expected}]"
                                     + (f" ({len(shape)}-D)" if -1 in shape else ""))
                want_dt = dts.get(name, DTYPES[dtype])
                if np.asarray(a).dtype.newbyteorder("<") != np.dtype(want_dt).newbyteorder("<"):
                    raise ValueError(f"layer.{i}.{name}: dtype {np.asarray(a).dtype}, "
                                     f"expected {np.dtype(want_dt)} ({dtype} turn)")
        if s < 1 or s % h:
            raise ValueError(f"layer.0.{'gen.q' if qdt else 'prompt.score'}: {s} score heads, "
                             f"expected a positive multiple of kv_heads={h}")
        return dtype, h, s, d, n_prompt, n_gen, n_hist


@dataclass
class QuantizedLayer:
    """Packed K/V of one layer as delivered (FORMAT.md): codes uint8
    [H, n, d*bits/8]; k_scale/k_zero float16 [H, ceil(n/group), d];
    v_scale/v_zero float16 [H, n]."""
    bits: int
    group: int
    rotate: bool
    k_codes: np.ndarray
    k_scale: np.ndarray
    k_zero: np.ndarray
    v_codes: np.ndarray
    v_scale: np.ndarray
    v_zero: np.ndarray


@dataclass
class MessageLayer:
    """k, v: [H, n, d], dense in the message dtype, or float32 decoded from
    `quant` when the message is quantized; pos: int32 [H, n] position ids."""
    k: np.ndarray
    v: np.ndarray
    pos: np.ndarray
    quant: Optional[QuantizedLayer] = None


@dataclass
class Message:
    """A delivered (Fetch) or compressed (Compress) message with its header."""
    layers: List[MessageLayer]
    dtype: str
    kv_heads: int
    head_dim: int
    n_history: int
    n_anchor: int
    n_kept: int
    n_gen: int
    quant_bits: int = 0
    quant_group: int = 0
    quant_rotate: bool = False
    accounting: Accounting = field(default_factory=Accounting)
    message_id: str = ""
    session_id: str = ""
    sender: str = ""
    role: str = ""
    parent_id: str = ""
    delivery_attempt: int = 0
    # Where the turn ended, as the relay (MessageHeader.next_pos) or the file
    # (metadata next_pos) says; 0: not known. Read next_pos instead.
    turn_end: int = 0
    # Position ids of the chain's anchors the message holds, ascending
    # (MessageHeader.anchor_pos): a turn that uploads this message as its
    # history passes them on, so a history budget (hist=) keeps them.
    anchor_pos: List[int] = field(default_factory=list)

    @property
    def tokens(self):
        return self.n_history + self.n_anchor + self.n_kept + self.n_gen

    @property
    def held_end(self):
        """1 + the largest position id held (0 for a message without tokens)."""
        if not self.layers or not self.tokens:
            return 0
        return max(int(layer.pos.max()) for layer in self.layers) + 1

    @property
    def next_pos(self):
        """Position id the receiver's own tokens start at: where the relayed
        turn ended (prompt_pos0 + n_prompt + n_gen), also when its last tokens
        were evicted; at least 1 + every id held."""
        return max(self.turn_end, self.held_end)


# ---- quantization decode (FORMAT.md; bit-identical to core/quant.cc) -------

def hadamard_f32(x):
    """Orthonormal Walsh-Hadamard transform of the last axis (a power of two),
    in float32 with the butterfly order and rounding of core/quant.cc."""
    x = np.array(x, dtype=np.float32)
    n = x.shape[-1] if x.ndim else 0
    if n < 1 or n & (n - 1):
        raise ValueError(f"x: last axis of length {n}, expected a power of two")
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(lead + (n // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        x = np.stack([a + b, a - b], axis=-2).reshape(lead + (n,))
        h *= 2
    return x * np.float32(1.0 / np.sqrt(np.float64(n)))


def _unpack(codes, bits, d):
    codes = np.asarray(codes, dtype=np.uint8)
    if bits == 8:
        out = codes
    else:
        shifts = np.arange(0, 8, bits, dtype=np.uint8)
        out = (codes[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return out.reshape(codes.shape[:-1] + (d,)).astype(np.float32)


def dequantize_layer(q, head_dim):
    """(k, v) float32 [H, n, d] decoded from a QuantizedLayer:
    x = code * scale + zero, then the Hadamard rotation when q.rotate."""
    kc = _unpack(q.k_codes, q.bits, head_dim)
    vc = _unpack(q.v_codes, q.bits, head_dim)
    n = kc.shape[1]
    ks = np.repeat(np.asarray(q.k_scale).astype(np.float32), q.group, axis=1)[:, :n]
    kz = np.repeat(np.asarray(q.k_zero).astype(np.float32), q.group, axis=1)[:, :n]
    # code * scale is exact in float32 (<= 8 + 11 significant bits), so
    # mul then add rounds like the fused multiply-add of the C++ decoder.
    k = kc * ks + kz
    v = vc * np.asarray(q.v_scale).astype(np.float32)[..., None] \
        + np.asarray(q.v_zero).astype(np.float32)[..., None]
    if q.rotate:
        k, v = hadamard_f32(k), hadamard_f32(v)
    return k, v
