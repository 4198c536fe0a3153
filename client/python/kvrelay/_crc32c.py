"""CRC32C (Castagnoli), as relay.proto uses it for chunks and trailers.

Uses the `google_crc32c` or `crc32c` extension module when one is installed;
otherwise a numpy implementation: the data is cut into equal lanes, every
lane's CRC register is advanced in parallel, a little-endian 32-bit word
at a time (two lookups in 16-bit tables), and the lanes are combined pairwise with
"append n zero bytes" operators (CRC is linear over GF(2)). A 1 MiB chunk
takes a few milliseconds.

crc32c(data, crc=0) extends `crc` (the CRC of the preceding bytes) by
`data`; crc32c_combine(a, b, len_b) is the CRC of A||B from crc(A), crc(B).
"""
import threading

import numpy as np

__all__ = ["crc32c", "crc32c_combine", "BACKEND"]

_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def _make_tables():
    t = np.zeros((4, 256), dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (_POLY if c & 1 else 0)
        t[0, i] = c
    for k in range(1, 4):
        t[k] = (t[k - 1] >> 8) ^ t[0][t[k - 1] & 0xFF]
    return t


_T = _make_tables()
_T0, _T1, _T2, _T3 = (_T[0], _T[1], _T[2], _T[3])
_T0_LIST = [int(x) for x in _T0]


def _reg_bytes(reg, data):
    """Advances the raw register `reg` over `data` (a bytes-like), in Python."""
    t = _T0_LIST
    for b in bytes(data):
        reg = t[(reg ^ b) & 0xFF] ^ (reg >> 8)
    return reg


# ---- linear "advance n zero bytes" operators, as 4 byte tables -------------

_BITS = np.arange(8, dtype=np.uint32)


def _op_from_columns(cols):
    """4x256 byte tables of the linear map whose image of bit i is cols[i]."""
    cols = np.asarray(cols, dtype=np.uint32).reshape(4, 8)
    idx = np.arange(256, dtype=np.uint32)
    sel = ((idx[:, None] >> _BITS[None, :]) & 1).astype(bool)  # [256, 8]
    tabs = np.zeros((4, 256), dtype=np.uint32)
    for byte in range(4):
        tabs[byte] = np.bitwise_xor.reduce(np.where(sel, cols[byte][None, :], 0), axis=1)
    return tabs


def _apply(tabs, x):
    x = np.asarray(x, dtype=np.uint32)
    return (tabs[0][x & 0xFF] ^ tabs[1][(x >> 8) & 0xFF] ^ tabs[2][(x >> 16) & 0xFF]
            ^ tabs[3][x >> 24])


_POW2_OPS = []  # _POW2_OPS[j]: advance 2**j zero bytes
_CACHE_LOCK = threading.Lock()  # the lazily built operators and tables


def _pow2_op(j):
    if j < len(_POW2_OPS):
        return _POW2_OPS[j]
    with _CACHE_LOCK:  # two threads extending the list would misplace entries
        while len(_POW2_OPS) <= j:
            basis = np.uint32(1) << np.arange(32, dtype=np.uint32)
            if not _POW2_OPS:
                cols = _T0[basis & 0xFF] ^ (basis >> 8)  # one zero byte
            else:
                prev = _POW2_OPS[-1]
                cols = _apply(prev, _apply(prev, basis))
            _POW2_OPS.append(_op_from_columns(cols))
    return _POW2_OPS[j]


def _shift(x, n):
    """Advances register value(s) `x` over n zero bytes."""
    j = 0
    x = np.asarray(x, dtype=np.uint32)
    while n:
        if n & 1:
            x = _apply(_pow2_op(j), x)
        n >>= 1
        j += 1
    return x


# ---- numpy lanes -------------------------------------------------------------

_WORD_TABLES = None  # (TA, TB): 16-bit tables of "advance 4 zero bytes"


def _reg0_lanes(cols):
    """Raw registers (from 0) of each lane: column of `cols` [w, lanes]."""
    global _WORD_TABLES
    tables = _WORD_TABLES
    if tables is None:
        z4 = _pow2_op(2)
        i = np.arange(65536, dtype=np.uint32)
        tables = (z4[0][i & 0xFF] ^ z4[1][i >> 8], z4[2][i & 0xFF] ^ z4[3][i >> 8])
        _WORD_TABLES = tables  # one assignment of a finished pair: safe to race
    ta, tb = tables
    r = np.zeros(cols.shape[1], dtype=np.uint32)
    x, a, b = np.empty_like(r), np.empty_like(r), np.empty_like(r)
    for j in range(cols.shape[0]):
        np.bitwise_xor(r, cols[j], out=x)
        np.bitwise_and(x, 0xFFFF, out=a)
        np.right_shift(x, 16, out=b)
        np.bitwise_xor(ta.take(a), tb.take(b), out=r)
    return r


def _reg0_bulk(buf, lane):
    """Raw register (from 0) over buf, len(buf) a multiple of `lane` bytes."""
    n_lanes = len(buf) // lane
    words = np.frombuffer(buf, dtype="<u4").reshape(n_lanes, lane // 4)
    r = _reg0_lanes(np.ascontiguousarray(words.T))
    # Leading zero lanes change nothing (a zero register over zero bytes stays
    # zero), so pad to a power of two and combine pairwise.
    size = 1
    while size < n_lanes:
        size *= 2
    if size != n_lanes:
        r = np.concatenate([np.zeros(size - n_lanes, dtype=np.uint32), r])
    length = lane
    while r.size > 1:
        r = _shift(r[0::2], length) ^ r[1::2]
        length *= 2
    return int(r[0])


def _crc32c_numpy(data, crc=0):
    buf = memoryview(data).cast("B")
    n = len(buf)
    reg = (~crc) & 0xFFFFFFFF
    if n < 2048:
        return (~_reg_bytes(reg, buf)) & 0xFFFFFFFF
    lane = 256 if n >= (1 << 16) else 64
    bulk = n - n % lane
    reg = int(_shift(reg, bulk)) ^ _reg0_bulk(buf[:bulk], lane)
    reg = _reg_bytes(reg, buf[bulk:])
    return (~reg) & 0xFFFFFFFF


def crc32c_combine(crc_a, crc_b, len_b):
    """CRC32C of A||B given crc(A), crc(B) and len(B)."""
    return (int(_shift(crc_a, len_b)) ^ crc_b) & 0xFFFFFFFF


BACKEND = "numpy"
crc32c = _crc32c_numpy
try:  # pragma: no cover - depends on what is installed
    import google_crc32c as _g

    def crc32c(data, crc=0):  # noqa: F811
        return _g.extend(crc, bytes(data))

    BACKEND = "google_crc32c"
except ImportError:
    try:  # pragma: no cover
        import crc32c as _c

        def crc32c(data, crc=0):  # noqa: F811
            return _c.crc32c(bytes(data), crc)

        BACKEND = "crc32c"
    except ImportError:
        pass
