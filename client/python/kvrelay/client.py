"""Client of the kvrelay.v1.Relay service (proto/kvrelay/v1/relay.proto).

Errors are grpc.RpcError: the relay's status, or a RelayError (also an
RpcError, with code() and details()) for what this client checks itself:
DATA_LOSS for every malformed delivery (out of order or missing chunks, bad
sizes, a header that describes no valid message, a sent_bytes, CRC32C or
trailer mismatch: the relay sent damaged data). Arguments that cannot be
sent raise ValueError, before any call.

Retries: only publish retries, on UNAVAILABLE or ABORTED, because every
publish carries a message id (the idempotency key; generated when none is
given): a retry of a publish the relay already committed is answered with
duplicate=True, which is a success. Nothing else retries: fetch delivers at
least once anyway, and an ack may have taken effect before its reply was lost.
A publish that fails raises PublishError (a grpc.RpcError) naming the message
id it used, so that the caller can retry with that id: after e.g.
DEADLINE_EXCEEDED the relay may have committed it.

Security: tls_ca (a PEM file of CAs) turns TLS on; tls_cert and tls_key add
a client certificate (mTLS); token (default: the environment's
KVRELAY_TOKEN) goes as "authorization: Bearer TOKEN" metadata on every call,
over TLS and plaintext alike. A relay that wants a token and gets none or a
wrong one answers UNAUTHENTICATED; acting for another agent is
PERMISSION_DENIED; a failed TLS handshake (e.g. an untrusted CA) is
UNAVAILABLE.
"""
import math
import numbers
import os
import re
import secrets
import threading
import time

import grpc
import numpy as np

from kvrelay._crc32c import crc32c, crc32c_combine
from kvrelay.types import (DTYPES, Accounting, Message, MessageLayer, PublishResult,
                           QuantizedLayer, Stats, Turn, dequantize_layer)

from kvrelay.v1 import relay_pb2 as pb
from kvrelay.v1 import relay_pb2_grpc as pb_grpc

__all__ = ["Client", "RelayError", "PublishError", "MAX_CHUNK_BYTES", "new_message_id",
           "TOKEN_ENV"]

TOKEN_ENV = "KVRELAY_TOKEN"  # where Client takes its token from when given none

MAX_CHUNK_BYTES = 1 << 20  # relay.proto: at most 1 MiB of tensor bytes per chunk
_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}\Z")
_DTYPE_TO_PB = {"F32": pb.DTYPE_F32, "F16": pb.DTYPE_F16, "BF16": pb.DTYPE_BF16}
_PB_TO_DTYPE = {v: k for k, v in _DTYPE_TO_PB.items()}
_PART_NAME = {
    pb.PART_K: "k", pb.PART_V: "v", pb.PART_POS: "pos", pb.PART_K_CODES: "k.codes",
    pb.PART_K_SCALE: "k.scale", pb.PART_K_ZERO: "k.zero", pb.PART_V_CODES: "v.codes",
    pb.PART_V_SCALE: "v.scale", pb.PART_V_ZERO: "v.zero",
}
_MAX_MESSAGE_BYTES = 1 << 36


class _StatusError(grpc.RpcError):
    """A grpc.RpcError that carries a status code and details."""

    def __init__(self, code, details, text):
        super().__init__(text)
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class RelayError(_StatusError):
    """An error this client detected itself, shaped like a gRPC status."""

    def __init__(self, code, details):
        super().__init__(code, details, f"{code.name}: {details}")


class PublishError(_StatusError):
    """A failed publish: the relay's (or this client's) status, and the
    message id the publish used (message_id), to retry with."""

    def __init__(self, cause, message_id):
        code = cause.code() if callable(getattr(cause, "code", None)) else grpc.StatusCode.UNKNOWN
        details = cause.details() if callable(getattr(cause, "details", None)) else str(cause)
        super().__init__(code, details, f"{code.name}: {details} (message_id {message_id})")
        self.message_id = message_id


# gRPC's default reconnect backoff (1 s, growing x1.6 to 120 s) outlasts the
# publish retries' own backoff: a relay back after a restart would not be
# tried again in time. Options given to Client replace these (a channel arg
# given twice keeps its first value in grpcio 1.51).
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 2000)]


def _read_pem(field, path, kind):
    """The bytes of PEM file `path` (option `field`), which must hold a block
    "-----BEGIN ...KIND-----"."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{field}: {path!r}, expected a file path")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{field}: cannot read {os.fspath(path)!r}: {e.strerror}") from None
    if not re.search(rb"-----BEGIN [A-Z0-9 ]*" + kind.encode() + rb"-----", data):
        raise ValueError(f"{field}: {os.fspath(path)!r} holds no PEM {kind} block, expected a PEM file")
    return data


def _token_of(token):
    """The token to send (None: none): `token`, or KVRELAY_TOKEN when None;
    "" means none. Never shows the token in an error."""
    field = "token"
    if token is None:
        token, field = os.environ.get(TOKEN_ENV, "").strip(), TOKEN_ENV
    if not isinstance(token, str):
        raise ValueError(f"token: a {type(token).__name__}, expected a string")
    if token == "":
        return None
    if not (len(token) <= 4096 and all("!" <= c <= "~" for c in token)):
        raise ValueError(f"{field}: {len(token)} characters (not shown), expected 1 to 4096 "
                         "visible ASCII characters")
    return token


def _credentials(tls_ca, tls_cert, tls_key):
    """grpc.ChannelCredentials for TLS, or None for plaintext."""
    if (tls_cert is None) != (tls_key is None):
        missing, given = ("tls_key", "tls_cert") if tls_key is None else ("tls_cert", "tls_key")
        raise ValueError(f"{given}: given without {missing}, expected both or neither")
    if tls_ca is None:
        if tls_cert is not None:
            raise ValueError("tls_cert: given without tls_ca, expected a CA file (it turns TLS on)")
        return None
    ca = _read_pem("tls_ca", tls_ca, "CERTIFICATE")
    cert = key = None
    if tls_cert is not None:
        cert = _read_pem("tls_cert", tls_cert, "CERTIFICATE")
        key = _read_pem("tls_key", tls_key, "PRIVATE KEY")
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)


def new_message_id():
    """A fresh message id: "m-" and 24 random hex digits."""
    return "m-" + secrets.token_hex(12)


def _check_id(field, v, required=True):
    if not v and not required:
        return
    if not isinstance(v, str) or not _ID.match(v):
        raise ValueError(f"{field}: {v!r}, expected [A-Za-z0-9._:-]{{1,128}}")


def _accounting(a):
    return Accounting(received_bytes=a.received_bytes, full_bytes=a.full_bytes,
                      sent_bytes=a.sent_bytes, ratio=a.ratio,
                      compress_seconds=a.compress_seconds, commit_seconds=a.commit_seconds,
                      policy=a.policy,
                      attention_error=a.attention_error if a.HasField("attention_error") else None)


def _is_int(v):
    """An integer (Python or numpy), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _le_bytes(a, dtype):
    """Little-endian row-major bytes of array `a` stored as numpy `dtype`."""
    return np.ascontiguousarray(a, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def _geometry(turn):
    dtype, h, s, d, n_prompt, n_gen, n_hist = turn.geometry()
    g = pb.TurnGeometry(layers=len(turn.layers), kv_heads=h, score_heads=s, head_dim=d,
                        dtype=_DTYPE_TO_PB[dtype], n_prompt=n_prompt, n_gen=n_gen,
                        n_history=n_hist, first_agent=turn.is_first_agent())
    if turn.prompt_pos0 is not None:
        p0 = turn.prompt_pos0
        if not _is_int(p0) or not 0 <= p0 < 1 << 31:
            raise ValueError(f"turn.prompt_pos0: {p0!r}, expected an integer in [0, 2^31) or None")
        g.prompt_pos0 = int(p0)
    qdt = turn.query_dtype()
    if qdt:
        g.query_dtype = _DTYPE_TO_PB[qdt]
    if turn.softmax_scale is not None:
        sc = turn.softmax_scale
        if isinstance(sc, bool) or not isinstance(sc, numbers.Real) or not 1e-6 <= sc <= 1e3:
            raise ValueError(f"turn.softmax_scale: {sc!r}, expected a finite number in [1e-06, 1000] or None")
        g.softmax_scale = float(sc)
    g.history_anchors.extend(turn.anchors())
    g.history_score_tokens = turn.history_score_tokens()
    return g


def _check_history_score(geometry, parent_id):
    """A history_score needs a history: uploaded, or the parent's."""
    if geometry.history_score_tokens and not geometry.n_history and not parent_id:
        raise ValueError(f"layer.0.history.score: [{geometry.score_heads}, {geometry.history_score_tokens}] "
                         "given without history, expected none (upload the history, or publish with "
                         "parent_id: its columns are then the parent's tokens per head)")


def _upload_tensors(turn):
    """(layer, part, bytes) of every tensor of `turn` in upload order."""
    kv = DTYPES[turn.kv_dtype()]
    qdt = turn.query_dtype()
    for i, l in enumerate(turn.layers):
        yield i, pb.PART_PROMPT_K, _le_bytes(l.prompt_k, kv)
        yield i, pb.PART_PROMPT_V, _le_bytes(l.prompt_v, kv)
        yield i, pb.PART_GEN_K, _le_bytes(l.gen_k, kv)
        yield i, pb.PART_GEN_V, _le_bytes(l.gen_v, kv)
        if qdt:
            yield i, pb.PART_GEN_Q, _le_bytes(l.gen_q, DTYPES[qdt])
        else:
            yield i, pb.PART_PROMPT_SCORE, _le_bytes(l.score, np.float32)
            if l.history_score is not None:
                yield i, pb.PART_HISTORY_SCORE, _le_bytes(l.history_score, np.float32)
        if l.history_k is not None and np.shape(l.history_k)[1] > 0:
            yield i, pb.PART_HISTORY_K, _le_bytes(l.history_k, kv)
            yield i, pb.PART_HISTORY_V, _le_bytes(l.history_v, kv)
            yield i, pb.PART_HISTORY_POS, _le_bytes(l.history_pos, np.int32)


def _upload(turn, request_cls, first):
    """Request stream: `first`, every chunk, the commit trailer."""
    yield first
    chunks = total = 0
    crc = 0
    for layer, part, data in _upload_tensors(turn):
        view = memoryview(data)
        for off in range(0, len(data), MAX_CHUNK_BYTES):
            piece = view[off:off + MAX_CHUNK_BYTES]
            c = crc32c(piece)
            crc = crc32c_combine(crc, c, len(piece))
            chunks += 1
            total += len(piece)
            yield request_cls(chunk=pb.Chunk(layer=layer, part=part, offset=off,
                                             data=piece.tobytes(), crc32c=c))
    yield request_cls(commit=pb.Trailer(chunks=chunks, bytes=total, crc32c=crc))


def _damaged(msg):
    """A delivery that does not assemble: DATA_LOSS, for the relay sent damaged
    data and the caller did nothing wrong."""
    return RelayError(grpc.StatusCode.DATA_LOSS, msg)


class _Assembler:
    """Rebuilds a Message from a delivery stream (header, chunks, trailer),
    checking order, offsets, sizes and CRC32Cs like the C++ client. Every
    failure is DATA_LOSS (_damaged)."""

    def __init__(self):
        self.header = None
        self.done = False

    def start(self, h):
        if self.header is not None:
            raise _damaged("header: given twice, expected one")
        # The relay's own bounds (a turn's): a header cannot make the client
        # allocate per-layer bookkeeping beyond what any real message has.
        for name, most in (("layers", 1024), ("kv_heads", 1024), ("head_dim", 1024)):
            if not 1 <= getattr(h, name) <= most:
                raise _damaged(f"header.{name}: {getattr(h, name)}, expected 1..{most}")
        if h.dtype not in _PB_TO_DTYPE:
            raise _damaged(f"header.dtype: {h.dtype}, expected F32, F16 or BF16")
        n = h.n_history + h.n_anchor + h.n_kept + h.n_gen
        bits, H, d, L = h.quant_bits, h.kv_heads, h.head_dim, h.layers
        if n >= 1 << 31:
            raise _damaged(f"header.n_history+n_anchor+n_kept+n_gen: {n}, expected < 2^31")
        if not 0 <= h.next_pos <= 1 << 31:
            raise _damaged(f"header.next_pos: {h.next_pos}, expected 0..2^31")
        if bits:
            if bits not in (2, 4, 8):
                raise _damaged(f"header.quant_bits: {bits}, expected 0, 2, 4 or 8")
            if h.quant_group < 1:
                raise _damaged(f"header.quant_group: {h.quant_group}, expected >= 1 when quantized")
            if d * bits % 8:
                raise _damaged(f"header.head_dim: {d}, expected head_dim*quant_bits a multiple of 8")
        self.header, self.n, self.dtype = h, n, _PB_TO_DTYPE[h.dtype]
        kvdt = DTYPES[self.dtype]
        groups = -(-n // h.quant_group) if bits else 0
        specs = []  # (part, numpy dtype, shape)
        if bits:
            specs = [(pb.PART_K_CODES, np.uint8, (H, n, d * bits // 8)),
                     (pb.PART_K_SCALE, np.float16, (H, groups, d)),
                     (pb.PART_K_ZERO, np.float16, (H, groups, d)),
                     (pb.PART_V_CODES, np.uint8, (H, n, d * bits // 8)),
                     (pb.PART_V_SCALE, np.float16, (H, n)),
                     (pb.PART_V_ZERO, np.float16, (H, n))]
        else:
            specs = [(pb.PART_K, kvdt, (H, n, d)), (pb.PART_V, kvdt, (H, n, d))]
        specs.append((pb.PART_POS, np.int32, (H, n)))
        per_layer = sum(int(np.prod(s)) * np.dtype(t).itemsize for _, t, s in specs)
        if L * per_layer > _MAX_MESSAGE_BYTES:
            raise _damaged(f"header.layers: {L}, expected a message below 2^36 bytes "
                           f"({per_layer} per layer)")
        # (layer, part, dtype, shape, size, bytearray): each tensor grows as
        # its chunks arrive, so memory follows the data received, not what a
        # header announces.
        self.slots = []
        for layer in range(L):
            for part, t, shape in specs:
                size = int(np.prod(shape)) * np.dtype(t).itemsize
                self.slots.append((layer, part, np.dtype(t).newbyteorder("<"), shape, size,
                                   bytearray()))
        self.next = self.filled = 0
        self.chunks = self.bytes = self.crc = 0
        self._skip_complete()

    def _skip_complete(self):
        while self.next < len(self.slots) and self.filled == self.slots[self.next][4]:
            self.next += 1
            self.filled = 0

    def add(self, c):
        if self.header is None:
            raise _damaged("chunk: before the header, expected a header first")
        name = f"chunk layer {c.layer} part {_PART_NAME.get(c.part, 'unknown')}"
        if self.next >= len(self.slots):
            raise _damaged(f"{name}: after every tensor of the message is complete, "
                           "expected the trailer")
        layer, part, _, _, size, buf = self.slots[self.next]
        if c.layer != layer or c.part != part:
            raise _damaged(f"{name} (offset {c.offset}): out of order, expected chunk layer "
                           f"{layer} part {_PART_NAME[part]} offset {self.filled}")
        if c.offset != self.filled:
            raise _damaged(f"{name}: offset {c.offset}, expected {self.filled}")
        n = len(c.data)
        if n < 1 or n > MAX_CHUNK_BYTES:
            raise _damaged(f"{name}: {n} data bytes, expected 1..{MAX_CHUNK_BYTES}")
        if n > size - self.filled:
            raise _damaged(f"{name}: {n} bytes at offset {self.filled}, expected at most "
                           f"{size - self.filled} (tensor of {size} bytes)")
        crc = crc32c(c.data)
        if crc != c.crc32c:
            raise _damaged(f"{name} offset {c.offset}: crc32c {c.crc32c}, expected {crc} "
                           "(computed over the data)")
        buf += c.data
        self.filled += n
        self.chunks += 1
        self.bytes += n
        self.crc = crc32c_combine(self.crc, crc, n)
        self._skip_complete()

    def finish(self, t):
        if self.header is None:
            raise _damaged("trailer: before the header, expected a header first")
        if self.next < len(self.slots):
            layer, part, _, _, size, _ = self.slots[self.next]
            raise _damaged(f"trailer: stream ended with chunk layer {layer} part "
                           f"{_PART_NAME[part]} at {self.filled} of {size} bytes")
        for field, want in (("chunks", self.chunks), ("bytes", self.bytes), ("crc32c", self.crc)):
            if getattr(t, field) != want:
                raise _damaged(f"trailer.{field}: {getattr(t, field)}, expected {want} "
                               "(computed over the chunks received)")
        h = self.header
        sent = sum(s[4] for s in self.slots)
        if sent != h.accounting.sent_bytes:
            raise _damaged(f"header.accounting.sent_bytes: {h.accounting.sent_bytes}, "
                           f"expected {sent} (bytes of the delivered tensors)")
        arrays = {}
        for layer, part, dt, shape, _, buf in self.slots:
            arrays[(layer, part)] = np.frombuffer(buf, dtype=dt).reshape(shape)  # no copy
        layers = []
        for layer in range(h.layers):
            pos = arrays[(layer, pb.PART_POS)]
            if h.quant_bits:
                q = QuantizedLayer(
                    bits=h.quant_bits, group=h.quant_group, rotate=h.quant_rotate,
                    k_codes=arrays[(layer, pb.PART_K_CODES)],
                    k_scale=arrays[(layer, pb.PART_K_SCALE)],
                    k_zero=arrays[(layer, pb.PART_K_ZERO)],
                    v_codes=arrays[(layer, pb.PART_V_CODES)],
                    v_scale=arrays[(layer, pb.PART_V_SCALE)],
                    v_zero=arrays[(layer, pb.PART_V_ZERO)])
                k, v = dequantize_layer(q, h.head_dim)
                layers.append(MessageLayer(k=k, v=v, pos=pos, quant=q))
            else:
                layers.append(MessageLayer(k=arrays[(layer, pb.PART_K)],
                                           v=arrays[(layer, pb.PART_V)], pos=pos))
        self.done = True
        return Message(
            layers=layers, dtype=self.dtype, kv_heads=h.kv_heads, head_dim=h.head_dim,
            n_history=h.n_history, n_anchor=h.n_anchor, n_kept=h.n_kept, n_gen=h.n_gen,
            quant_bits=h.quant_bits, quant_group=h.quant_group, quant_rotate=h.quant_rotate,
            accounting=_accounting(h.accounting), message_id=h.message_id,
            session_id=h.session_id, sender=h.sender, role=h.role, parent_id=h.parent_id,
            delivery_attempt=h.delivery_attempt, turn_end=h.next_pos, anchor_pos=list(h.anchor_pos))


def _read_delivery(call):
    """Consumes a Fetch/Compress response stream into a Message; cancels the
    call on a local error."""
    a = _Assembler()
    try:
        for r in call:
            if a.done:
                raise _damaged("delivery stream: response after the trailer, expected the end")
            kind = r.WhichOneof("kind")
            if kind == "header":
                a.start(r.header)
            elif kind == "chunk":
                a.add(r.chunk)
            elif kind == "trailer":
                msg = a.finish(r.trailer)
            else:
                raise _damaged(
                    "delivery stream: empty response, expected header, chunk or trailer")
    except RelayError:
        call.cancel()
        raise
    if not a.done:
        raise _damaged(
            "delivery stream: ended without a trailer, expected header, chunks, trailer")
    return msg


class Client:
    """A connection to one relay ("HOST:PORT" or "unix:PATH", or an existing
    grpc.Channel). Thread-safe; usable as a context manager.

    tls_ca: path of a PEM file of the CA(s) the relay's certificate must
    chain to; it turns TLS on, and the certificate must then also name the
    address's host (a DNS or IP SAN). None: plaintext (a relay's
    --local-listen address, a Unix socket, or a relay run with --insecure).
    tls_cert, tls_key: a client certificate chain and its private key (PEM
    paths), both or neither, and only with tls_ca. token: the agent's bearer
    token, sent with every call (also over a given channel); None: the
    environment's KVRELAY_TOKEN (whitespace trimmed) when set, "": none.
    Files are read here. ValueError (naming the argument, never showing the
    token) for a file that cannot be read or holds no PEM block of the kind
    expected, a certificate without its key or the reverse, a certificate
    without tls_ca, TLS arguments with `channel`, or a token that is not 1 to
    4096 visible ASCII characters."""

    def __init__(self, addr, channel=None, options=None, tls_ca=None, tls_cert=None,
                 tls_key=None, token=None):
        token = _token_of(token)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        if channel is not None:
            if tls_ca is not None or tls_cert is not None or tls_key is not None:
                raise ValueError("tls_ca, tls_cert, tls_key: given with channel, expected "
                                 "them only when Client makes the channel")
            self._channel = channel
        else:
            creds = _credentials(tls_ca, tls_cert, tls_key)
            options = list(options or [])
            given = {k for k, _ in options}
            options += [o for o in _CHANNEL_OPTIONS if o[0] not in given]
            self._channel = (grpc.insecure_channel(addr, options=options) if creds is None
                             else grpc.secure_channel(addr, creds, options=options))
        self._stub = pb_grpc.RelayStub(self._channel)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- Publish -------------------------------------------------------------

    def publish(self, turn, session, sender, recipients, message_id=None, policy="", role="",
                parent_id="", timeout=120.0, retries=3, initial_backoff=0.1):
        """Uploads `turn` for `recipients`; returns a PublishResult.

        policy: pipeline spec ("" = the relay's default for `role`);
        parent_id: history by reference (the turn must then carry no history
        nor history_anchors; it is sent with first_agent=False, whatever
        turn.first_agent says; a history_score then has the parent's tokens
        per head as columns);
        timeout: seconds per attempt. A re-publish of a committed message_id
        returns the original accounting with duplicate=True. Raises
        PublishError (with .message_id) when the publish fails; ValueError
        for arguments that cannot be sent."""
        if not isinstance(turn, Turn):
            raise ValueError("turn: expected a kvrelay.Turn")
        _check_id("session", session)
        _check_id("sender", sender)
        _check_id("message_id", message_id or "", required=False)
        _check_id("parent_id", parent_id or "", required=False)
        if isinstance(recipients, str):
            recipients = [recipients]
        recipients = list(recipients)
        if not recipients:
            raise ValueError("recipients: none, expected at least one agent")
        for i, r in enumerate(recipients):
            _check_id(f"recipients[{i}]", r)
        if not _is_int(retries) or retries < 0:
            raise ValueError(f"retries: {retries!r}, expected an integer >= 0")
        for name, v in (("role", role), ("policy", policy)):
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{name}: {v!r}, expected a string")
        geometry = _geometry(turn)
        if parent_id:  # continues a chain: never the first agent's turn
            geometry.first_agent = False
        if parent_id and geometry.n_history > 0:
            raise ValueError(f"geometry.n_history: {geometry.n_history}, expected 0 with a "
                             "parent (the relay supplies the history of parent_id)")
        _check_history_score(geometry, parent_id)
        header = pb.PublishHeader(
            session_id=session, message_id=message_id or new_message_id(), sender=sender,
            recipients=recipients, role=role or "", policy=policy or "",
            parent_id=parent_id or "", geometry=geometry)
        backoff = initial_backoff
        attempt = 1
        while True:
            try:
                # A relay that already committed this id answers from the
                # header (duplicate=True) without reading the rest; grpc then
                # stops pulling the request iterator: that is a success.
                resp = self._stub.Publish(
                    _upload(turn, pb.PublishRequest, pb.PublishRequest(header=header)),
                    timeout=timeout, metadata=self._metadata)
                return PublishResult(message_id=resp.message_id, duplicate=resp.duplicate,
                                     accounting=_accounting(resp.accounting), attempts=attempt)
            except grpc.RpcError as e:
                code = e.code() if callable(getattr(e, "code", None)) else None
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED) \
                        or attempt > retries:
                    raise PublishError(e, header.message_id) from e
            time.sleep(backoff)
            # Give a relay that is coming back up to another backoff to
            # accept the connection, instead of failing the retry at once.
            ready = grpc.channel_ready_future(self._channel)
            try:
                ready.result(timeout=backoff)
            except grpc.FutureTimeoutError:
                ready.cancel()
            backoff = min(backoff * 2, 2.0)
            attempt += 1

    # ---- Fetch / Ack ---------------------------------------------------------

    def fetch(self, session, agent, timeout=30.0, auto_ack=False):
        """The oldest unacknowledged message for (session, agent), waiting up
        to `timeout` seconds (the call's deadline: it bounds the transfer too;
        DEADLINE_EXCEEDED when none arrived). Quantized K/V are decoded to
        float32 (the packed tensors stay in layer.quant). auto_ack: the relay
        acknowledges once it sent the trailer, before this client checked it;
        prefer ack() once the message is safely used."""
        _check_id("session", session)
        _check_id("agent", agent)
        call = self._stub.Fetch(pb.FetchRequest(session_id=session, agent=agent,
                                                auto_ack=bool(auto_ack)),
                                 timeout=timeout, metadata=self._metadata)
        return _read_delivery(call)

    def ack(self, session, agent, message_id, timeout=10.0):
        """Acknowledges a delivered message (NOT_FOUND for an unknown one,
        FAILED_PRECONDITION for one not yet delivered to `agent`)."""
        _check_id("session", session)
        _check_id("agent", agent)
        _check_id("message_id", message_id)
        self._stub.Ack(pb.AckRequest(session_id=session, agent=agent, message_id=message_id),
                       timeout=timeout, metadata=self._metadata)

    def close_session(self, session, timeout=10.0):
        """Frees the session; returns the number of messages freed. Idempotent."""
        _check_id("session", session)
        return self._stub.CloseSession(pb.CloseSessionRequest(session_id=session),
                                       timeout=timeout, metadata=self._metadata).messages_freed

    def stats(self, timeout=10.0):
        r = self._stub.Stats(pb.StatsRequest(), timeout=timeout, metadata=self._metadata)
        return Stats(**{f: getattr(r, f) for f in Stats.__dataclass_fields__})

    # ---- Compress --------------------------------------------------------------

    def compress(self, turn, policy, timeout=120.0):
        """Stateless compression by the relay: returns the Message (nothing is
        stored; message_id and routing fields are empty)."""
        if not isinstance(policy, str) or not policy:
            raise ValueError(f"policy: {policy!r}, expected a non-empty pipeline spec string")
        if not isinstance(turn, Turn):
            raise ValueError("turn: expected a kvrelay.Turn")
        geometry = _geometry(turn)
        _check_history_score(geometry, "")
        first = pb.CompressRequest(header=pb.CompressHeader(policy=policy, geometry=geometry))
        call = self._stub.Compress(_upload(turn, pb.CompressRequest, first), timeout=timeout,
                                   metadata=self._metadata)
        return _read_delivery(call)

    # ---- Health ------------------------------------------------------------------

    def health(self, service="", timeout=5.0):
        """grpc.health.v1.Health/Check: "SERVING", "NOT_SERVING", "UNKNOWN"
        or "SERVICE_UNKNOWN" (wire format hand-rolled: Debian ships no
        grpc_health module)."""
        if not isinstance(service, str):
            raise ValueError(f"service: {service!r}, expected a string")
        data = service.encode()
        req = b"" if not data else b"\x0a" + _varint(len(data)) + data
        check = self._channel.unary_unary("/grpc.health.v1.Health/Check",
                                          request_serializer=lambda b: b,
                                          response_deserializer=lambda b: b)
        try:
            status = _health_status(check(req, timeout=timeout, metadata=self._metadata))
        except grpc.RpcError as e:
            # Check answers NOT_FOUND for a service the server does not know.
            if callable(getattr(e, "code", None)) and e.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise
        return {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}.get(
            status, "UNKNOWN")


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(s, i):
    v = shift = 0
    while i < len(s) and shift < 64:
        b = s[i]
        i += 1
        v |= (b & 0x7F) << shift
        if not b & 0x80:
            return v, i
        shift += 7
    raise RelayError(grpc.StatusCode.INVALID_ARGUMENT,
                     "grpc.health.v1.HealthCheckResponse: malformed reply")


def _health_status(s):
    status, i = 0, 0
    while i < len(s):
        key, i = _read_varint(s, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _read_varint(s, i)
            if field == 1:
                status = v
        elif wire == 2:
            n, i = _read_varint(s, i)
            i += n
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise RelayError(grpc.StatusCode.INVALID_ARGUMENT,
                             "grpc.health.v1.HealthCheckResponse: malformed reply")
    return status
