"""Minimal safetensors I/O for kvrelay turn and message files (docs/FORMAT.md),
so turns built in Python can go through `kvrelayctl` and back. BF16 tensors
are uint16 bit patterns."""
import json
import struct

import numpy as np

from kvrelay.types import (DTYPES, Accounting, Message, MessageLayer, QuantizedLayer,
                           Turn, dequantize_layer)

__all__ = ["write", "read", "write_turn", "read_message"]

_NP = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
       "I32": np.dtype("<i4"), "U8": np.dtype("u1")}


def write(path, tensors, metadata=None, dtypes=None):
    """Writes {name: array} (dtypes: {name: "BF16"} for uint16 bf16 bits)."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    by_dtype = {v.str: k for k, v in _NP.items() if k != "BF16"}
    for name, a in tensors.items():
        a = np.asarray(a)
        st = (dtypes or {}).get(name)
        if st is None:
            st = by_dtype.get(a.dtype.newbyteorder("<").str if a.dtype.itemsize > 1 else a.dtype.str)
            if st is None:
                raise ValueError(f"{name}: dtype {a.dtype}, expected float32, float16, int32 or uint8 "
                                 "(uint16 bfloat16 bits with dtypes={name: 'BF16'})")
        elif st not in _NP:
            raise ValueError(f"{name}: dtypes[{name!r}] = {st!r}, expected one of {sorted(_NP)}")
        elif a.dtype.newbyteorder("<") != _NP[st].newbyteorder("<") and not (st == "BF16" and a.dtype == np.uint16):
            # A value cast would write other numbers (float 1.5 as bf16 bits 1).
            raise ValueError(f"{name}: dtype {a.dtype} for {st}, expected {_NP[st]}"
                             + (" (bfloat16 bit patterns: kvrelay.f32_to_bf16)" if st == "BF16" else ""))
        data = np.ascontiguousarray(a, dtype=_NP[st]).tobytes()
        header[name] = {"dtype": st, "shape": list(a.shape),
                        "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def _unique_keys(pairs):
    """json object_pairs_hook: a key twice in one object is an error (json
    would keep the last one; kvrelay's C++ reader refuses the file)."""
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise ValueError(f"safetensors: key {k!r} appears more than once in a header object")
        obj[k] = v
    return obj


def read(path):
    """(metadata, {name: array}) of a safetensors file."""
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n], object_pairs_hook=_unique_keys)
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    out = {}
    for name, t in header.items():
        b, e = t["data_offsets"]
        out[name] = np.frombuffer(buf[base + b:base + e], dtype=_NP[t["dtype"]]).reshape(t["shape"])
    return meta, out


def write_turn(path, turn):
    """Writes a kvrelay.Turn as a turn file (what `kvrelayctl compress --in`
    reads), with its history_score as layer.{l}.history.score and its
    history_anchors as metadata. A history_score without history covers a
    parent's tokens: such a file is read for a parent only (`kvrelayctl
    compress --parent`, `kvrelayctl publish --parent`)."""
    dtype = turn.geometry()[0]
    qdt = turn.query_dtype()
    anchors = turn.anchors()
    turn.history_score_tokens()  # checked like an upload
    tensors, dts = {}, {}
    for i, l in enumerate(turn.layers):
        p = f"layer.{i}."
        parts = {"prompt.k": l.prompt_k, "prompt.v": l.prompt_v, "gen.k": l.gen_k,
                 "gen.v": l.gen_v}
        if l.history_k is not None:
            parts.update({"history.k": l.history_k, "history.v": l.history_v})
        for name, a in parts.items():
            tensors[p + name] = np.asarray(a, dtype=DTYPES[dtype])
            dts[p + name] = dtype
        if qdt:
            tensors[p + "gen.q"] = np.asarray(l.gen_q, dtype=DTYPES[qdt])
            dts[p + "gen.q"] = qdt
        else:
            tensors[p + "prompt.score"] = np.asarray(l.score, dtype=np.float32)
        if l.history_k is not None:
            tensors[p + "history.pos"] = np.asarray(l.history_pos, dtype=np.int32)
        if l.history_score is not None:
            tensors[p + "history.score"] = np.asarray(l.history_score, dtype=np.float32)
    meta = {"first_agent": "true" if turn.is_first_agent() else "false"}
    if turn.prompt_pos0 is not None:
        meta["prompt_pos0"] = str(int(turn.prompt_pos0))
    if turn.softmax_scale is not None:
        meta["softmax_scale"] = repr(float(turn.softmax_scale))  # reads back exactly
    if anchors:
        meta["history_anchors"] = ",".join(str(a) for a in anchors)
    write(path, tensors, meta, dts)


def read_message(path):
    """A message file (`kvrelayctl compress/fetch --out`) as a kvrelay.Message;
    packed K/V are decoded to float32 as Client.fetch does. A fetched file's
    message_id, session, sender, role, parent_id, delivery_attempt and
    accounting are filled in (empty/0 for a compressed one)."""
    meta, t = read(path)
    layers, i = [], 0
    bits = int(meta.get("quant_bits", 0) or 0)
    group = int(meta.get("quant_group", 0) or 0)
    rotate = meta.get("quant_rotate", "false") == "true"
    while f"layer.{i}.pos" in t:
        p = f"layer.{i}."
        pos = t[p + "pos"]
        if p + "k.codes" in t:
            q = QuantizedLayer(bits=bits, group=group, rotate=rotate,
                               k_codes=t[p + "k.codes"], k_scale=t[p + "k.scale"],
                               k_zero=t[p + "k.zero"], v_codes=t[p + "v.codes"],
                               v_scale=t[p + "v.scale"], v_zero=t[p + "v.zero"])
            k, v = dequantize_layer(q, q.k_codes.shape[2] * 8 // bits)
            layers.append(MessageLayer(k=k, v=v, pos=pos, quant=q))
        else:
            layers.append(MessageLayer(k=t[p + "k"], v=t[p + "v"], pos=pos))
        i += 1
    if not layers:
        raise ValueError(f"{path}: no layer.0.pos, expected a kvrelay message file")
    l0 = layers[0]
    acc = Accounting(full_bytes=int(meta.get("full_bytes", 0)),
                     sent_bytes=int(meta.get("sent_bytes", 0)), policy=meta.get("policy", ""),
                     received_bytes=int(meta.get("received_bytes", 0)),
                     compress_seconds=float(meta.get("compress_seconds", 0)),
                     commit_seconds=float(meta.get("commit_seconds", 0)),
                     attention_error=float(meta["attention_error"]) if "attention_error" in meta else None)
    if acc.sent_bytes:
        acc.ratio = acc.full_bytes / acc.sent_bytes
    # A delivery written by `kvrelayctl fetch --out` also names itself: its id
    # is what the next publish takes as parent_id (history by reference).
    m = Message(layers=layers, dtype=meta.get("dtype", ""), kv_heads=l0.pos.shape[0],
                head_dim=l0.k.shape[2], n_history=int(meta.get("n_history", 0)),
                n_anchor=int(meta.get("n_anchor", 0)), n_kept=int(meta.get("n_kept", 0)),
                n_gen=int(meta.get("n_gen", 0)), quant_bits=bits, quant_group=group,
                quant_rotate=rotate, accounting=acc, message_id=meta.get("message_id", ""),
                session_id=meta.get("session", ""), sender=meta.get("from", ""),
                role=meta.get("role", ""), parent_id=meta.get("parent_id", ""),
                delivery_attempt=int(meta.get("delivery_attempt", 0)))
    if "next_pos" in meta:  # optional: files before the key read as 1 + the largest id held
        raw, held = meta["next_pos"], m.held_end
        if not (raw.isascii() and raw.isdigit() and held <= int(raw) <= 1 << 31):
            raise ValueError(f"{path}: metadata next_pos: {raw!r}, expected a decimal integer "
                             f"{held}..2^31 (1 + the largest position id held, or more)")
        m.turn_end = int(raw)
    return m
