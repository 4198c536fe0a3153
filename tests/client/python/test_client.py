#!/usr/bin/python3
"""The Python client (client/python/kvrelay) against a real kvrelay-server.

    /usr/bin/python3 test_client.py --server BIN --kvrelayctl BIN

PYTHONPATH must hold client/python and the generated stubs dir (the ctest
registration sets both). Checks: CRC32C (known vector, lengths, speed);
every malformed delivery stream DATA_LOSS (offline); publish/fetch with
`full` bit-exact for F32 (multi-chunk tensors), F16 and BF16; compressed
deliveries against `kvrelayctl compress` offline on the same turn written
as safetensors (dense: bit-exact; int4/int2: packed bits
exact, and the Python decode equal to `--decode` in the turn's dtype);
Compress equal to the delivery; ack and redelivery, auto_ack, duplicate
re-publish; a parent chain; history_anchors and history_score (offline:
upload order, geometry, turn files, every refusal; live: anchors kept by a
history budget, an anchor the history lacks refused, a history_score over
an uploaded history and over a parent choosing the tokens hist=2 keeps,
columns that do not fit the parent refused); deadline on an empty mailbox; bad policy;
stats, health, close; a publish and a fetch over the relay's Unix socket
(unix:PATH), also published over TCP and fetched over the socket. Against a
second relay serving TLS with client-certificate verification and a tokens
file: publish/fetch/ack with a token (with and without a client
certificate, and from KVRELAY_TOKEN; over TLS and over its plaintext
--local-listen socket with --local-auth token), no or a wrong token
UNAUTHENTICATED, an untrusted CA or a plaintext client UNAVAILABLE, acting
for another agent PERMISSION_DENIED; and the arguments Client refuses. The whole run is
bounded (watchdog) and the servers are always stopped.
"""
import argparse
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import grpc
import numpy as np

import kvrelay
from kvrelay import Turn, TurnLayer
from kvrelay import safetensors as st
from kvrelay.types import from_f32, to_f32

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "testlib"))
from kvrelay_testlib import Server, unittest_main  # noqa: E402
from certs import TestPki  # noqa: E402

ARGS = None
SERVER = None
ADDR = None
UNIX_ADDR = None  # the same relay on a Unix socket
TMP = None
WATCHDOG_S = 90


def setUpModule():
    global SERVER, ADDR, UNIX_ADDR, TMP
    TMP = tempfile.mkdtemp(prefix="kvrelay-py-")
    SERVER = Server(ARGS.server, args=["--listen", "127.0.0.1:0", "--listen", f"unix:{TMP}/relay.sock",
                                       "--metrics-listen", "127.0.0.1:0"], timeout=20)
    ADDR, UNIX_ADDR = SERVER.addrs


def tearDownModule():
    if SERVER:
        SERVER.stop()
    if TMP:
        shutil.rmtree(TMP, ignore_errors=True)


# ---- turns -------------------------------------------------------------------

def make_turn(seed, dtype="F32", layers=2, H=2, S=4, d=64, n_prompt=40, n_gen=6,
              first_agent=True, prompt_pos0=None):
    rng = np.random.default_rng(seed)

    def kv(n):
        return from_f32(rng.standard_normal((H, n, d)).astype(np.float32), dtype)

    ls = [TurnLayer(prompt_k=kv(n_prompt), prompt_v=kv(n_prompt), gen_k=kv(n_gen),
                    gen_v=kv(n_gen), score=rng.random((S, n_prompt)).astype(np.float32))
          for _ in range(layers)]
    return Turn(ls, dtype=dtype, first_agent=first_agent, prompt_pos0=prompt_pos0)


def add_history(turn, n_hist, seed, anchors=None):
    """Gives every layer of `turn` an uploaded history of n_hist tokens at
    positions 0..n_hist-1 (every head), with the chain's anchors `anchors`."""
    rng = np.random.default_rng(seed)
    for layer in turn.layers:
        H, _, d = layer.prompt_k.shape
        kv = lambda: from_f32(rng.standard_normal((H, n_hist, d)).astype(np.float32), turn.kv_dtype())  # noqa: E731
        layer.history_k, layer.history_v = kv(), kv()
        layer.history_pos = np.broadcast_to(np.arange(n_hist, dtype=np.int32), (H, n_hist)).copy()
    turn.first_agent = False
    turn.history_anchors = anchors
    return turn


def mass_on(score_heads, n, columns):
    """A history_score [score_heads, n]: 100 on `columns` (the same for every
    head), 0 elsewhere: those tokens outweigh any prompt token's score."""
    hs = np.zeros((score_heads, n), np.float32)
    hs[:, columns] = 100.0
    return hs


def history_sets(m):
    """Per layer and head, the set of position ids of the message's history part."""
    return [[set(row[:m.n_history].tolist()) for row in layer.pos] for layer in m.layers]


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def kvrelayctl_compress(turn, policy, decode):
    tag = f"{abs(hash((policy, decode, id(turn))))}"
    tin = os.path.join(TMP, f"turn-{tag}.safetensors")
    out = os.path.join(TMP, f"msg-{tag}.safetensors")
    st.write_turn(tin, turn)
    cmd = [ARGS.kvrelayctl, "compress", "--policy", policy, "--in", tin, "--out", out,
           "--threads", "2"] + (["--decode"] if decode else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}: rc={p.returncode} {p.stderr}")
    return st.read(out)


class Crc32cTest(unittest.TestCase):
    def test_known_and_lengths(self):
        self.assertEqual(kvrelay.crc32c(b"123456789"), 0xE3069283)
        self.assertEqual(kvrelay.crc32c(b""), 0)
        rng = np.random.default_rng(7)
        for n in [1, 7, 2047, 2048, 4099, 65536, 65537 + 3, (1 << 20) + 5]:
            d = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            full = kvrelay.crc32c(d)
            k = n // 3
            self.assertEqual(kvrelay.crc32c(d[k:], kvrelay.crc32c(d[:k])), full, n)
            self.assertEqual(kvrelay.crc32c_combine(kvrelay.crc32c(d[:k]),
                                                    kvrelay.crc32c(d[k:]), n - k), full, n)
            if n < 70000:  # against the plain byte loop
                from kvrelay._crc32c import _reg_bytes
                self.assertEqual(full, (~_reg_bytes(0xFFFFFFFF, d)) & 0xFFFFFFFF, n)

    def test_concurrent_first_use(self):
        # The numpy backend builds its shift operators on first use; threads
        # racing to build them once stored them at the wrong places.
        from kvrelay import _crc32c as c
        if c.BACKEND != "numpy":
            self.skipTest(f"backend {c.BACKEND}")
        import threading
        d = bytes(range(256)) * 64
        want = (~c._reg_bytes(0xFFFFFFFF, d)) & 0xFFFFFFFF
        for _ in range(5):
            c._POW2_OPS.clear()
            c._WORD_TABLES = None
            barrier = threading.Barrier(8)
            got = []

            def run():
                barrier.wait()
                for _ in range(3):
                    got.append(c.crc32c(d))
                    c.crc32c_combine(1, 2, 1 << 20)

            threads = [threading.Thread(target=run) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self.assertEqual(set(got), {want})
            self.assertEqual(c.crc32c(d), want)

    def test_speed(self):
        d = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
        kvrelay.crc32c(d)
        t = time.perf_counter()
        for _ in range(5):
            kvrelay.crc32c(d)
        ms = (time.perf_counter() - t) / 5 * 1e3
        self.assertLess(ms, 50, f"CRC32C of 1 MiB took {ms:.1f} ms")


class OfflineTest(unittest.TestCase):
    def test_bf16_round_trip(self):
        x = np.array([1.0, -2.5, 3.14159, 65504.0, 1e-30], dtype=np.float32)
        b = kvrelay.f32_to_bf16(x)
        self.assertEqual(b.dtype, np.uint16)
        self.assertTrue(np.array_equal(kvrelay.bf16_to_f32(b)[:2], x[:2]))
        self.assertEqual(int(kvrelay.f32_to_bf16(np.float32(1.00390625))), 0x3F80)  # tie to even

    def test_bf16_from_float64_rounds_once(self):
        # Just above the tie between 1.0 and 1.0078125: float32 would round it
        # to the tie, which then goes to even (1.0).
        self.assertEqual(int(kvrelay.f32_to_bf16(np.float64(1.0039062500000002))), 0x3F81)
        self.assertEqual(int(kvrelay.f32_to_bf16(np.float64(1.00390625))), 0x3F80)  # an exact tie
        # Against an independent reference: the nearest bfloat16 by distance
        # (ties to the even pattern), over random float64 values of every scale.
        rng = np.random.default_rng(7)
        x = rng.standard_normal(20000) * np.exp2(rng.integers(-140, 128, 20000))
        x = np.concatenate([x, [0.0, -0.0, 3.4e38, -3.4e38, 1e-45, 2.0 ** -134, 2.0 ** -133 * 1.5,
                                np.inf, -np.inf]])
        got = kvrelay.f32_to_bf16(x)
        for v, g in zip(x, got):
            lo = kvrelay.bf16_to_f32(np.uint16(g)).astype(np.float64)
            # neighbours of the chosen pattern, toward and away from zero
            for n in (int(g) - 1, int(g) + 1):
                if (n & 0x7FFF) >= 0x7F80 or n < 0 or n > 0xFFFF or (n ^ int(g)) & 0x8000:
                    continue
                other = float(kvrelay.bf16_to_f32(np.uint16(n)))
                if not np.isfinite(v) or not np.isfinite(lo):
                    continue
                d_got, d_other = abs(float(lo) - v), abs(other - v)
                self.assertTrue(d_got < d_other or (d_got == d_other and int(g) % 2 == 0),
                                f"{v!r}: got {int(g):#06x} ({float(lo)!r}), {n:#06x} ({other!r}) is nearer")
        self.assertEqual(int(kvrelay.f32_to_bf16(np.float64(np.nan))) & 0x7FC0, 0x7FC0)
        self.assertEqual(int(kvrelay.f32_to_bf16(np.float64(3.5e38))), 0x7F80)  # past bfloat16's largest

    def test_safetensors_read_refuses_duplicate_keys(self):
        import struct
        import tempfile
        for header in (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"dtype":"F32"}}',
                       b'{"__metadata__":{"k":"1","k":"2"}}'):
            with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
                f.write(struct.pack("<Q", len(header)) + header + b"x")
                f.flush()
                with self.assertRaisesRegex(ValueError, "appears more than once"):
                    st.read(f.name)

    def test_safetensors_write_refuses_what_it_would_change(self):
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "x.safetensors")
            for tensors, dtypes, msg in (
                    ({"x": np.array([1.5, -2.0], np.float32)}, {"x": "BF16"}, "dtype float32 for BF16"),
                    ({"x": np.array([1.5], np.float64)}, None, "dtype float64, expected float32"),
                    ({"x": np.array([1], np.int64)}, None, "dtype int64"),
                    ({"x": np.array([1], np.float32)}, {"x": "F8"}, "expected one of")):
                with self.assertRaisesRegex(ValueError, msg):
                    st.write(out, tensors, None, dtypes)
            bits = kvrelay.f32_to_bf16(np.array([1.5, -2.0], np.float32))
            st.write(out, {"x": bits}, None, {"x": "BF16"})
            self.assertEqual(kvrelay.bf16_to_f32(st.read(out)[1]["x"]).tolist(), [1.5, -2.0])

    def test_hadamard_orthonormal(self):
        x = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
        y = kvrelay.hadamard_f32(kvrelay.hadamard_f32(x))
        self.assertLess(np.abs(y - x).max(), 1e-5)

    def test_history_score_and_anchors_in_the_upload(self):
        # HISTORY_SCORE right after PROMPT_SCORE, before the HISTORY_K/V/POS
        # parts; geometry.history_anchors and history_score_tokens.
        from kvrelay.client import _geometry, _upload_tensors
        from kvrelay.v1 import relay_pb2 as pb
        turn = add_history(make_turn(40, layers=2, n_prompt=5, n_gen=2, d=8), 6, 41, anchors=[0, 3])
        for i, layer in enumerate(turn.layers):
            layer.history_score = np.arange(4 * 6, dtype=np.float32).reshape(4, 6) + i
        g = _geometry(turn)
        self.assertEqual((list(g.history_anchors), g.history_score_tokens, g.n_history), ([0, 3], 6, 6))
        parts = [(l, p) for l, p, _ in _upload_tensors(turn)]
        per_layer = [pb.PART_PROMPT_K, pb.PART_PROMPT_V, pb.PART_GEN_K, pb.PART_GEN_V, pb.PART_PROMPT_SCORE,
                     pb.PART_HISTORY_SCORE, pb.PART_HISTORY_K, pb.PART_HISTORY_V, pb.PART_HISTORY_POS]
        self.assertEqual(parts, [(l, p) for l in range(2) for p in per_layer])
        data = {(l, p): d for l, p, d in _upload_tensors(turn)}
        self.assertEqual(data[(1, pb.PART_HISTORY_SCORE)], turn.layers[1].history_score.astype("<f4").tobytes())
        # Without history (a publish with parent_id): any width, the parent's tokens per head.
        child = make_turn(42, layers=2, n_prompt=5, n_gen=2, d=8)
        for layer in child.layers:
            layer.history_score = np.ones((4, 11), np.float32)
        g = _geometry(child)
        self.assertEqual((list(g.history_anchors), g.history_score_tokens, g.n_history), ([], 11, 0))
        self.assertEqual([p for l, p, _ in _upload_tensors(child) if l == 0], per_layer[:6])
        # None: neither field nor part.
        g = _geometry(make_turn(43))
        self.assertEqual((list(g.history_anchors), g.history_score_tokens), ([], 0))
        self.assertNotIn(pb.PART_HISTORY_SCORE, [p for _, p, _ in _upload_tensors(make_turn(43))])

    def test_history_score_and_anchors_refused_before_any_call(self):
        c = kvrelay.Client("127.0.0.1:1")

        def turn(n_hist=6, anchors=None, hs=(4, 6), layers_with=(0, 1)):
            t = make_turn(50, n_prompt=5, n_gen=2, d=8)
            if n_hist:
                add_history(t, n_hist, 51, anchors)
            else:
                t.history_anchors = anchors
            for i in layers_with:
                if hs is not None:
                    t.layers[i].history_score = np.ones(hs, np.float32)
            return t

        cases = [
            (turn(anchors=[2, 1]), r"turn\.history_anchors\[1\]: 1 after 2, expected ascending distinct"),
            (turn(anchors=[0, 0]), r"turn\.history_anchors\[1\]: 0 after 0"),
            (turn(anchors=[-1]), r"turn\.history_anchors\[0\]: -1, expected an integer position id in \[0, 2\^31\)"),
            (turn(anchors=[True]), r"turn\.history_anchors\[0\]: True"),
            (turn(anchors=[1.0]), r"turn\.history_anchors\[0\]: 1\.0"),
            (turn(anchors="0,1"), r"turn\.history_anchors: '0,1', expected a sequence"),
            (turn(anchors=list(range(7))), r"turn\.history_anchors: 7 position ids, expected at most n_history = 6"),
            (turn(n_hist=0, anchors=[0], hs=None),
             r"turn\.history_anchors: 1 position ids, expected none for a turn without history"),
            (turn(layers_with=(1,)), r"layer\.0\.history\.score: missing, expected it in every layer or in none"),
            (turn(hs=(4, 7)), r"layer\.0\.history\.score: shape \[4, 7\], expected \[4, 6\] \(\[score_heads, n_history\]\)"),
            (turn(hs=(2, 6)), r"layer\.0\.history\.score: shape \[2, 6\], expected \[4, 6\]"),
            (turn(hs=(4, 6, 1)), r"layer\.0\.history\.score: shape \[4, 6, 1\], expected \[4, 6\]"),
            (turn(n_hist=0, hs=(4, 0)), r"layer\.0\.history\.score: shape \[4, 0\], expected at least one column"),
        ]
        t = turn(n_hist=0, hs=(4, 5))
        t.layers[1].history_score = np.ones((4, 6), np.float32)
        cases.append((t, r"layer\.1\.history\.score: shape \[4, 6\], expected \[4, 5\] .*like layer\.0"))
        t = turn()
        t.layers[1].history_score = np.ones((4, 6), np.float64)
        cases.append((t, r"layer\.1\.history\.score: dtype float64, expected float32"))
        t = turn()
        for layer in t.layers:
            layer.score, layer.gen_q = None, np.zeros((4, 2, 8), np.float32)
        cases.append((t, r"layer\.0\.history\.score: given with layer\.0\.gen\.q, expected none"))
        for t, msg in cases:
            with self.subTest(msg=msg):
                with self.assertRaisesRegex(ValueError, msg):
                    c.publish(t, "s", "a", ["b"], parent_id="p" if t.geometry()[6] == 0 else "")
                with self.assertRaisesRegex(ValueError, msg):
                    c.compress(t, "full")
        # No history at all: neither uploaded nor a parent's.
        orphan = turn(n_hist=0, hs=(4, 9))
        for call in (lambda: c.publish(orphan, "s", "a", ["b"]), lambda: c.compress(orphan, "full")):
            with self.assertRaisesRegex(ValueError, r"layer\.0\.history\.score: \[4, 9\] given without history, "
                                                    r"expected none \(upload the history, or publish with parent_id"):
                call()
        # With a parent the relay supplies history and anchors: no anchors of the turn's own.
        with self.assertRaisesRegex(ValueError, r"turn\.history_anchors: .*expected none for a turn without history"):
            c.publish(turn(n_hist=0, anchors=[0], hs=None), "s", "a", ["b"], parent_id="p")
        # A turn file takes it (for a parent: kvrelayctl --parent reads it), checked like an upload.
        path = os.path.join(TMP, "for-a-parent.safetensors")
        st.write_turn(path, orphan)
        _, tensors = st.read(path)
        self.assertEqual(tensors["layer.1.history.score"].shape, (4, 9))
        self.assertNotIn("layer.1.history.k", tensors)
        with self.assertRaisesRegex(ValueError, r"layer\.1\.history\.score: shape \[4, 6\], expected \[4, 5\]"):
            t = turn(n_hist=0, hs=(4, 5))
            t.layers[1].history_score = np.ones((4, 6), np.float32)
            st.write_turn(path, t)
        c.close()

    def test_turn_file_with_history_score_and_anchors(self):
        # write_turn writes history.score and the history_anchors metadata;
        # kvrelayctl reads them: under a history budget it keeps the anchors
        # and the tokens the history_score weighs.
        turn = add_history(make_turn(60, n_prompt=10, n_gen=3, d=16), 12, 61, anchors=[0, 2])
        for layer in turn.layers:
            layer.history_score = mass_on(4, 12, [9, 11])
        path = os.path.join(TMP, "hist-turn.safetensors")
        st.write_turn(path, turn)
        meta, tensors = st.read(path)
        self.assertEqual(meta["history_anchors"], "0,2")
        self.assertEqual(tensors["layer.1.history.score"].dtype, np.dtype("<f4"))
        self.assertTrue(np.array_equal(tensors["layer.1.history.score"], turn.layers[1].history_score))
        meta, ref = kvrelayctl_compress(turn, "h2o-head:k=4,hist=2", decode=False)
        self.assertEqual((meta["n_history"], meta["anchor_pos"]), ("4", "0,2"))
        for li in range(2):
            for row in ref[f"layer.{li}.pos"]:
                self.assertEqual(set(row[:4].tolist()), {0, 2, 9, 11}, f"layer.{li}")

    def test_every_malformed_delivery_is_data_loss(self):
        # The relay sent damaged data, the caller did nothing wrong: every
        # delivery that does not assemble is DATA_LOSS; one found before the
        # stream ended cancels the call.
        from kvrelay.client import _read_delivery
        from kvrelay.v1 import relay_pb2 as pb

        k = np.arange(4, dtype=np.float32).tobytes()
        v = k[::-1]
        pos = np.array([7], dtype=np.int32).tobytes()

        def header(**kw):
            h = dict(layers=1, kv_heads=1, head_dim=4, dtype=pb.DTYPE_F32, n_gen=1,
                     accounting=pb.Accounting(sent_bytes=36))
            h.update(kw)
            return pb.FetchResponse(header=pb.MessageHeader(**h))

        def chunk(part, data, crc=None, offset=0):
            return pb.FetchResponse(chunk=pb.Chunk(
                layer=0, part=part, offset=offset, data=data,
                crc32c=kvrelay.crc32c(data) if crc is None else crc))

        def trailer(crc=None):
            if crc is None:
                crc = kvrelay.crc32c_combine(kvrelay.crc32c_combine(
                    kvrelay.crc32c(k), kvrelay.crc32c(v), 16), kvrelay.crc32c(pos), 4)
            return pb.FetchResponse(trailer=pb.Trailer(chunks=3, bytes=36, crc32c=crc))

        def delivery():
            return [header(), chunk(pb.PART_K, k), chunk(pb.PART_V, v), chunk(pb.PART_POS, pos),
                    trailer()]

        class Call(list):
            cancelled = False

            def cancel(self):
                self.cancelled = True

        m = _read_delivery(Call(delivery()))
        self.assertEqual(m.layers[0].v.tobytes(), v)
        d = delivery()
        cases = [
            ("chunk crc", d[:2] + [chunk(pb.PART_V, v, crc=kvrelay.crc32c(v) ^ 1)] + d[3:],
             "chunk layer 0 part v offset 0: crc32c "),
            ("trailer crc", d[:4] + [trailer(crc=1)], "trailer.crc32c: 1, expected "),
            ("out of order", [d[0], d[2], d[1]] + d[3:],
             "chunk layer 0 part v (offset 0): out of order, expected chunk layer 0 part k offset 0"),
            ("bad offset", [d[0], chunk(pb.PART_K, k, offset=4)] + d[2:],
             "chunk layer 0 part k: offset 4, expected 0"),
            ("missing chunk", d[:3] + d[4:],
             "trailer: stream ended with chunk layer 0 part pos at 0 of 4 bytes"),
            ("chunk past its tensor", [d[0], chunk(pb.PART_K, k + k)] + d[2:],
             "chunk layer 0 part k: 32 bytes at offset 0, expected at most 16 (tensor of 16 bytes)"),
            ("sent_bytes", [header(accounting=pb.Accounting(sent_bytes=37))] + d[1:],
             "header.accounting.sent_bytes: 37, expected 36"),
            ("no layers", [header(layers=0)] + d[1:], "header.layers: 0, expected 1..1024"),
            ("quant_bits", [header(quant_bits=3)] + d[1:],
             "header.quant_bits: 3, expected 0, 2, 4 or 8"),
            ("dtype", [header(dtype=pb.DTYPE_UNSPECIFIED)] + d[1:], "header.dtype: 0, expected"),
            ("next_pos", [header(next_pos=-1)] + d[1:], "header.next_pos: -1, expected 0..2^31"),
            ("chunk before the header", d[1:], "chunk: before the header"),
            ("second header", d[:1] + d, "header: given twice, expected one"),
            ("extra chunk", d[:4] + d[3:], "after every tensor of the message is complete"),
            ("after the trailer", d + d[3:4], "response after the trailer"),
            ("empty response", d[:1] + [pb.FetchResponse()], "empty response"),
            ("no trailer", d[:4], "ended without a trailer"),
            ("empty stream", [], "ended without a trailer"),
        ]
        for name, responses, want in cases:
            with self.subTest(name):
                call = Call(responses)
                with self.assertRaises(kvrelay.RelayError) as cm:
                    _read_delivery(call)
                self.assertEqual(cm.exception.code(), grpc.StatusCode.DATA_LOSS, str(cm.exception))
                self.assertIn(want, cm.exception.details())
                self.assertEqual(call.cancelled, name not in ("no trailer", "empty stream"))

    def test_memory_follows_the_data_not_the_header(self):
        # A header announcing 32 GiB of tensors, then one chunk: the client
        # holds what arrived, not what was announced (it used to allocate
        # and zero every tensor up front, and copy each again at the end).
        import tracemalloc
        from kvrelay.client import _Assembler
        from kvrelay.v1 import relay_pb2 as pb
        a = _Assembler()
        tracemalloc.start()
        try:
            a.start(pb.MessageHeader(layers=64, kv_heads=64, head_dim=1024, dtype=pb.DTYPE_F32,
                                     n_gen=1024, accounting=pb.Accounting(sent_bytes=1)))
            data = np.zeros(1 << 18, dtype=np.float32).tobytes()  # 1 MiB
            a.add(pb.Chunk(layer=0, part=pb.PART_K, offset=0, data=data,
                           crc32c=kvrelay.crc32c(data)))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        self.assertLess(peak, 16 << 20)
        # Geometry past the relay's bounds: refused before any bookkeeping
        # (200000 empty layers took 148 MiB and 11 s).
        for field, value in (("layers", 200000), ("kv_heads", 1025), ("head_dim", 4096)):
            geo = dict(layers=1, kv_heads=1, head_dim=4)
            geo[field] = value
            with self.assertRaises(kvrelay.RelayError) as cm:
                _Assembler().start(pb.MessageHeader(dtype=pb.DTYPE_F32, **geo))
            self.assertEqual(cm.exception.code(), grpc.StatusCode.DATA_LOSS)
            self.assertIn(f"header.{field}: {value}, expected 1..1024", str(cm.exception))
        # A complete message comes back as arrays over the received bytes.
        b = _Assembler()
        b.start(pb.MessageHeader(layers=1, kv_heads=1, head_dim=4, dtype=pb.DTYPE_F32, n_gen=1,
                                 accounting=pb.Accounting(sent_bytes=36)))
        k = np.arange(4, dtype=np.float32).tobytes()
        pos = np.array([7], dtype=np.int32).tobytes()
        for part, d in ((pb.PART_K, k), (pb.PART_V, k[::-1]), (pb.PART_POS, pos)):
            b.add(pb.Chunk(layer=0, part=part, offset=0, data=d, crc32c=kvrelay.crc32c(d)))
        m = b.finish(pb.Trailer(chunks=3, bytes=36, crc32c=kvrelay.crc32c_combine(
            kvrelay.crc32c_combine(kvrelay.crc32c(k), kvrelay.crc32c(k[::-1]), 16),
            kvrelay.crc32c(pos), 4)))
        self.assertEqual(m.layers[0].k.tolist(), [[[0.0, 1.0, 2.0, 3.0]]])
        self.assertEqual(m.layers[0].v.tobytes(), k[::-1])
        self.assertEqual(m.layers[0].pos.tolist(), [[7]])

    def test_bad_arguments(self):
        c = kvrelay.Client("127.0.0.1:1")
        t = make_turn(1)
        with self.assertRaises(ValueError):
            c.publish(t, "bad session!", "a", ["b"])
        with self.assertRaises(ValueError):
            c.publish(t, "s", "a", [])
        for kw, msg in ((dict(role=5), "role: 5, expected a string"),
                        (dict(policy=5), "policy: 5, expected a string"),
                        (dict(retries=None), "retries: None, expected an integer >= 0")):
            with self.assertRaisesRegex(ValueError, msg):
                c.publish(t, "s", "a", ["b"], **kw)
        with self.assertRaises(kvrelay.PublishError):  # numpy integers are integers: sent, UNAVAILABLE
            c.publish(t, "s", "a", ["b"], retries=np.int64(0), timeout=5)
        for policy in (5, b"full", ""):
            with self.assertRaisesRegex(ValueError, "policy: .*, expected a non-empty pipeline spec string"):
                c.compress(t, policy)
        with self.assertRaisesRegex(ValueError, "service: 5, expected a string"):
            c.health(5)
        empty = make_turn(1)
        for layer in empty.layers:
            for name in ("prompt_k", "prompt_v", "gen_k", "gen_v"):
                setattr(layer, name, getattr(layer, name)[:0])
        with self.assertRaisesRegex(ValueError, r"layer\.0\.prompt\.k: shape \[0, 40, 64\], expected \[kv_heads >= 1"):
            c.publish(empty, "s", "a", ["b"])
        for p0 in (2.7, "5", True, -1, 1 << 31):
            bad = make_turn(1, prompt_pos0=p0)
            with self.assertRaisesRegex(ValueError, r"turn\.prompt_pos0: .*, expected an integer in \[0, 2\^31\)"):
                c.publish(bad, "s", "a", ["b"])
        half = make_turn(1)
        half.layers[0].history_v = np.zeros((2, 3, 64), np.float32)
        with self.assertRaisesRegex(ValueError, r"layer\.0\.history: .*expected all three or none"):
            c.publish(half, "s", "a", ["b"])
        t.layers[1].gen_k = t.layers[1].gen_k[:, :2]
        with self.assertRaisesRegex(ValueError, r"layer\.1\.gen\.k: shape"):
            c.publish(t, "s", "a", ["b"])
        c.close()


class RelayTest(unittest.TestCase):
    def setUp(self):
        self.c = kvrelay.Client(ADDR)

    def tearDown(self):
        self.c.close()

    def assert_full(self, turn, m):
        p0 = turn.prompt_pos0 or 0
        n_prompt, n_gen = turn.layers[0].prompt_k.shape[1], turn.layers[0].gen_k.shape[1]
        self.assertEqual((m.n_history, m.n_anchor + m.n_kept, m.n_gen), (0, n_prompt, n_gen))
        self.assertEqual(m.dtype, turn.kv_dtype())
        for tl, ml in zip(turn.layers, m.layers, strict=True):
            for mine, parts in ((ml.k, (tl.prompt_k, tl.gen_k)), (ml.v, (tl.prompt_v, tl.gen_v))):
                want = np.concatenate(parts, axis=1)
                want = want.astype(want.dtype.newbyteorder("<"))  # the values, in bits() order
                self.assertEqual(mine.dtype.itemsize, want.dtype.itemsize)
                self.assertTrue(np.array_equal(bits(mine), bits(want)))
            want_pos = p0 + np.arange(n_prompt + n_gen, dtype=np.int32)
            self.assertTrue(np.array_equal(ml.pos, np.broadcast_to(want_pos, ml.pos.shape)))

    def test_full_bit_exact(self):
        cases = [("F32", dict(H=4, d=128, n_prompt=600, n_gen=20)),  # 1.2 MiB tensors: 2 chunks
                 ("F16", dict(prompt_pos0=17)), ("BF16", {}), ("F32-big-endian", {})]
        for i, (case, kw) in enumerate(cases):
            with self.subTest(case=case):
                dtype = case.split("-")[0]
                turn = make_turn(10 + i, dtype, **kw)
                if case.endswith("big-endian"):  # the dtype is still inferred, the bytes go little-endian
                    for layer in turn.layers:
                        for name in ("prompt_k", "prompt_v", "gen_k", "gen_v", "score"):
                            a = getattr(layer, name)
                            setattr(layer, name, a.astype(a.dtype.newbyteorder(">")))
                    turn.dtype = None
                sess = f"full-{case}"
                r = self.c.publish(turn, sess, "planner", ["critic"], policy="full", role="planner")
                self.assertFalse(r.duplicate)
                self.assertEqual(r.accounting.policy, "full")
                self.assertEqual(r.accounting.full_bytes, r.accounting.sent_bytes)
                m = self.c.fetch(sess, "critic", timeout=10)
                self.assertEqual((m.message_id, m.sender, m.role, m.delivery_attempt),
                                 (r.message_id, "planner", "planner", 1))
                self.assertEqual(m.accounting.sent_bytes, r.accounting.sent_bytes)
                self.assert_full(turn, m)
                self.c.ack(sess, "critic", m.message_id)
                self.assertEqual(self.c.close_session(sess), 1)

    def test_compressed_matches_kvrelayctl(self):
        cases = [("F32", "h2o-head:k=8+obf:p=4"),
                 ("BF16", "h2o-head:k=8+obf:p=4"),
                 ("F16", "h2o-layer:k=8,recent=2+obf:p=4,mode=fast"),
                 ("F32", "h2o-head:k=8+obf:p=4+int4:rotate=hadamard"),
                 ("BF16", "h2o-head:k=8+int4:group=16,rotate=hadamard"),
                 ("F16", "h2o-layer:k=8+int2:group=8"),
                 ("BF16", "gen+int8")]
        for i, (dtype, policy) in enumerate(cases):
            with self.subTest(dtype=dtype, policy=policy):
                turn = make_turn(100 + i, dtype)
                sess = f"cmp-{i}"
                r = self.c.publish(turn, sess, "planner", ["critic"], policy=policy)
                m = self.c.fetch(sess, "critic", timeout=10, auto_ack=True)
                self.assertEqual(m.accounting.sent_bytes, r.accounting.sent_bytes)
                self.assertIsNone(r.accounting.attention_error)  # scores, not queries
                meta, ref = kvrelayctl_compress(turn, policy, decode=False)
                self.assertEqual(meta["policy"], m.accounting.policy)
                self.assertEqual(int(meta["sent_bytes"]), m.accounting.sent_bytes)
                self.assertEqual(int(meta["full_bytes"]), m.accounting.full_bytes)
                for key in ("n_history", "n_anchor", "n_kept", "n_gen", "next_pos"):
                    self.assertEqual(int(meta[key]), getattr(m, key), key)
                quant = "+int" in policy
                self.assertEqual(m.quant_bits, int(meta.get("quant_bits", 0)))
                for li, ml in enumerate(m.layers):
                    p = f"layer.{li}."
                    self.assertTrue(np.array_equal(ml.pos, ref[p + "pos"]))
                    if not quant:
                        self.assertIsNone(ml.quant)
                        self.assertTrue(np.array_equal(bits(ml.k), bits(ref[p + "k"])))
                        self.assertTrue(np.array_equal(bits(ml.v), bits(ref[p + "v"])))
                        continue
                    for name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"):
                        self.assertTrue(np.array_equal(bits(getattr(ml.quant, name)),
                                                       bits(ref[p + name.replace("_", ".")])), name)
                if quant:
                    _, dec = kvrelayctl_compress(turn, policy, decode=True)
                    for li, ml in enumerate(m.layers):
                        p = f"layer.{li}."
                        self.assertEqual(ml.k.dtype, np.float32)
                        for mine, name in ((ml.k, "k"), (ml.v, "v")):
                            got = from_f32(mine, dtype)
                            want = dec[p + name]
                            diff = np.abs(bits(got).astype(np.int64) - bits(want).astype(np.int64))
                            self.assertEqual(int(diff.max()), 0, f"{p}{name}")
                            if dtype == "F32":
                                self.assertTrue(np.array_equal(bits(mine), bits(want)))
                # Compress (stateless) gives the same message.
                c = self.c.compress(turn, policy, timeout=30)
                self.assertEqual(c.accounting.sent_bytes, m.accounting.sent_bytes)
                for a, b in zip(c.layers, m.layers, strict=True):
                    self.assertTrue(np.array_equal(bits(a.k), bits(b.k)))
                    self.assertTrue(np.array_equal(bits(a.v), bits(b.v)))
                    self.assertTrue(np.array_equal(a.pos, b.pos))
                self.c.close_session(sess)

    def test_queries_instead_of_scores_match_kvrelayctl(self):
        # gen_q (float32 or the K/V dtype) travels as GEN_Q, softmax_scale in
        # the geometry; the relay's message equals kvrelayctl's for the same
        # turn file (written by kvrelay.safetensors, gen.q and all).
        cases = [("BF16", "F32", None, "h2o-head:k=8+obf:p=4"),
                 ("BF16", "BF16", 0.3, "h2o-layer:k=8,window=3"),
                 ("F16", "F16", 0.05, "h2o-head:k=6,pool=3,window=2+int4")]
        for i, (dtype, qdt, scale, policy) in enumerate(cases):
            with self.subTest(dtype=dtype, q=qdt, policy=policy):
                turn = make_turn(200 + i, dtype)
                rng = np.random.default_rng(300 + i)
                for layer in turn.layers:
                    q = rng.standard_normal((4, 6, 64)).astype(np.float32)
                    layer.gen_q = q if qdt == "F32" else from_f32(q, qdt)
                    layer.score = None
                turn.softmax_scale = scale
                sess = f"q-{i}"
                r = self.c.publish(turn, sess, "planner", ["critic"], policy=policy)
                m = self.c.fetch(sess, "critic", timeout=10, auto_ack=True)
                meta, ref = kvrelayctl_compress(turn, policy, decode=False)
                self.assertEqual(int(meta["sent_bytes"]), r.accounting.sent_bytes)
                self.assertEqual(meta["policy"], m.accounting.policy)
                # The fidelity figure: the same in the accounting and the file.
                self.assertIsNotNone(r.accounting.attention_error)
                self.assertEqual(float(meta["attention_error"]), r.accounting.attention_error)
                self.assertGreater(r.accounting.attention_error, 0.0)
                self.assertEqual(m.accounting.attention_error, r.accounting.attention_error)
                for li, ml in enumerate(m.layers):
                    p = f"layer.{li}."
                    self.assertTrue(np.array_equal(ml.pos, ref[p + "pos"]), p + "pos")
                    if ml.quant is None:
                        self.assertTrue(np.array_equal(bits(ml.k), bits(ref[p + "k"])))
                        self.assertTrue(np.array_equal(bits(ml.v), bits(ref[p + "v"])))
                    else:
                        self.assertTrue(np.array_equal(bits(ml.quant.v_codes), bits(ref[p + "v.codes"])))
                self.c.close_session(sess)
        # Both inputs, or a gen_q of a third dtype: ValueError before any RPC.
        turn = make_turn(210, "BF16")
        turn.layers[0].gen_q = np.zeros((4, 6, 64), np.float32)
        with self.assertRaisesRegex(ValueError, r"layer\.0\.gen\.q: given together with layer\.0\.prompt\.score"):
            self.c.publish(turn, "q-bad", "planner", ["critic"])
        for layer in turn.layers:
            layer.score, layer.gen_q = None, np.zeros((4, 6, 64), np.float16)
        with self.assertRaisesRegex(ValueError, r"layer\.0\.gen\.q: dtype float16, expected float32 or the K/V"):
            self.c.publish(turn, "q-bad", "planner", ["critic"])
        for layer in turn.layers:
            layer.gen_q = np.zeros((4, 6, 64), np.float32)
        turn.softmax_scale = -1.0
        with self.assertRaisesRegex(ValueError, r"turn\.softmax_scale: -1\.0, expected a finite number in \[1e-06, 1000\]"):
            self.c.publish(turn, "q-bad", "planner", ["critic"])

    def test_ack_redelivery_duplicate(self):
        sess = "ack"
        turn = make_turn(200)
        r = self.c.publish(turn, sess, "planner", ["critic", "judge"], message_id="msg-1",
                           policy="h2o-head:k=8")
        again = self.c.publish(turn, sess, "planner", ["critic", "judge"], message_id="msg-1",
                               policy="h2o-head:k=8")
        self.assertEqual((r.message_id, r.duplicate), ("msg-1", False))
        self.assertEqual((again.message_id, again.duplicate), ("msg-1", True))
        self.assertEqual(again.accounting.sent_bytes, r.accounting.sent_bytes)
        # The id reused for another publish: ALREADY_EXISTS (not retried), naming the field.
        with self.assertRaises(kvrelay.PublishError) as cm:
            self.c.publish(turn, sess, "planner", ["critic"], message_id="msg-1", policy="h2o-head:k=8")
        self.assertEqual(cm.exception.code(), grpc.StatusCode.ALREADY_EXISTS)
        self.assertEqual(cm.exception.message_id, "msg-1")
        self.assertIn("header.recipients [critic,judge], this publish has [critic]", cm.exception.details())
        # Not delivered yet: an ack cannot skip it.
        with self.assertRaises(grpc.RpcError) as cm:
            self.c.ack(sess, "critic", "msg-1")
        self.assertEqual(cm.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        m1 = self.c.fetch(sess, "critic", timeout=5)
        m2 = self.c.fetch(sess, "critic", timeout=5)
        self.assertEqual((m1.message_id, m1.delivery_attempt), ("msg-1", 1))
        self.assertEqual((m2.message_id, m2.delivery_attempt), ("msg-1", 2))
        self.c.ack(sess, "critic", "msg-1")
        with self.assertRaises(grpc.RpcError) as cm:
            self.c.fetch(sess, "critic", timeout=0.3)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        # judge has its own delivery; auto_ack acknowledges it.
        mj = self.c.fetch(sess, "judge", timeout=5, auto_ack=True)
        self.assertEqual((mj.message_id, mj.delivery_attempt), ("msg-1", 1))
        with self.assertRaises(grpc.RpcError) as cm:
            self.c.fetch(sess, "judge", timeout=0.3)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        with self.assertRaises(grpc.RpcError) as cm:
            self.c.ack(sess, "critic", "no-such-message")
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.c.close_session(sess)

    def test_parent_chain(self):
        sess = "chain"
        t1 = make_turn(300, "BF16")
        r1 = self.c.publish(t1, sess, "planner", ["critic"], policy="full")
        m1 = self.c.fetch(sess, "critic", timeout=5)
        self.c.ack(sess, "critic", m1.message_id)
        # first_agent=True (the default): with a parent the client sends
        # False, so the turn keeps no anchors of its own.
        t2 = make_turn(301, "BF16", n_prompt=30, n_gen=5)
        self.assertTrue(t2.first_agent)
        r2 = self.c.publish(t2, sess, "critic", ["refiner"], policy="h2o-head:k=8",
                            parent_id=r1.message_id)
        m2 = self.c.fetch(sess, "refiner", timeout=5)
        self.assertEqual((m2.message_id, m2.parent_id, m2.sender), (r2.message_id, r1.message_id,
                                                                    "critic"))
        nh = m1.tokens
        self.assertEqual((m2.n_history, m2.n_anchor, m2.n_kept, m2.n_gen), (nh, 0, 8, 5))
        for a, b, tl in zip(m1.layers, m2.layers, t2.layers, strict=True):
            self.assertTrue(np.array_equal(bits(b.k[:, :nh]), bits(a.k)))
            self.assertTrue(np.array_equal(bits(b.v[:, :nh]), bits(a.v)))
            self.assertTrue(np.array_equal(b.pos[:, :nh], a.pos))
            self.assertTrue(np.array_equal(bits(b.k[:, -5:]), bits(tl.gen_k)))
            gen_pos = m1.next_pos + 30 + np.arange(5)
            self.assertTrue(np.array_equal(b.pos[:, -5:], np.broadcast_to(gen_pos, (2, 5))))
            kept = b.pos[:, nh:nh + 8]
            self.assertTrue((np.diff(kept, axis=1) > 0).all())
        self.assertEqual(m2.next_pos, m1.next_pos + 35)
        # A parent the publisher is neither the sender nor a recipient of
        # reads as missing (NOT_FOUND), like an unknown id.
        with self.assertRaises(grpc.RpcError) as cm:
            self.c.publish(t2, sess, "judge", ["refiner"], policy="full", parent_id=r1.message_id)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.c.close_session(sess)

    def test_uploaded_history_keeps_its_anchors_under_a_budget(self):
        # The chain's anchors in the geometry: a history budget (hist=2)
        # keeps them in every head, as kvrelayctl does from the turn file's
        # history_anchors; an anchor the history does not hold is the relay's
        # INVALID_ARGUMENT, and nothing is committed.
        sess = "anchors"
        policy = "h2o-head:k=4,hist=2"
        turn = add_history(make_turn(70, "BF16", n_prompt=12, n_gen=3, d=16), 12, 71, anchors=[3, 7])
        turn.prompt_pos0 = 30  # history ids 0..11: 20 is one it does not hold
        r = self.c.publish(turn, sess, "planner", ["critic"], policy=policy)
        m = self.c.fetch(sess, "critic", timeout=10, auto_ack=True)
        self.assertEqual((m.message_id, m.n_history, m.anchor_pos), (r.message_id, 4, [3, 7]))
        for li, heads in enumerate(history_sets(m)):
            for h, held in enumerate(heads):
                self.assertLessEqual({3, 7}, held, f"layer.{li} head {h}")
        meta, ref = kvrelayctl_compress(turn, policy, decode=False)
        self.assertEqual(meta["anchor_pos"], "3,7")
        for li, ml in enumerate(m.layers):
            self.assertTrue(np.array_equal(ml.pos, ref[f"layer.{li}.pos"]), f"layer.{li}.pos")
            self.assertTrue(np.array_equal(bits(ml.k), bits(ref[f"layer.{li}.k"])), f"layer.{li}.k")
        before = self.c.stats()
        turn.history_anchors = [3, 20]
        with self.assertRaises(kvrelay.PublishError) as cm:
            self.c.publish(turn, sess, "planner", ["critic"], policy=policy)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertRegex(cm.exception.details(), r"history_anchors.*\b20\b")
        self.assertEqual(self.c.stats().messages_committed, before.messages_committed)
        self.c.close_session(sess)

    def test_uploaded_history_score_chooses_the_kept_history(self):
        # NEEDS the relay to accept PART_HISTORY_SCORE. The agent's mass on
        # history tokens 9 and 11 (positions 9, 11) makes them the two that
        # hist=2 keeps besides the anchors; the message equals kvrelayctl's
        # for the same turn file, and Compress gives the same.
        sess = "hist-score"
        policy = "h2o-head:k=4,hist=2"
        turn = add_history(make_turn(80, "F32", n_prompt=10, n_gen=3, d=16), 12, 81, anchors=[0, 2])
        for layer in turn.layers:
            layer.history_score = mass_on(4, 12, [9, 11])
        r = self.c.publish(turn, sess, "planner", ["critic"], policy=policy)
        m = self.c.fetch(sess, "critic", timeout=10, auto_ack=True)
        self.assertEqual((m.message_id, m.n_history, m.anchor_pos), (r.message_id, 4, [0, 2]))
        for li, heads in enumerate(history_sets(m)):
            for h, held in enumerate(heads):
                self.assertEqual(held, {0, 2, 9, 11}, f"layer.{li} head {h}")
        _, ref = kvrelayctl_compress(turn, policy, decode=False)
        cm = self.c.compress(turn, policy)
        for li, (ml, cl) in enumerate(zip(m.layers, cm.layers, strict=True)):
            self.assertTrue(np.array_equal(ml.pos, ref[f"layer.{li}.pos"]), f"layer.{li}.pos")
            self.assertTrue(np.array_equal(bits(ml.v), bits(ref[f"layer.{li}.v"])), f"layer.{li}.v")
            self.assertTrue(np.array_equal(cl.pos, ml.pos), f"compress layer.{li}.pos")
        self.c.close_session(sess)

    def test_parent_history_score_chooses_the_kept_history(self):
        # NEEDS the relay to accept PART_HISTORY_SCORE. With parent_id the
        # history is the parent message (its tokens per head are the
        # history_score's columns, in the parent's token order per KV
        # head): mass on each head's last two tokens (the parent's generated
        # ones, acc 0 otherwise) makes hist=2 keep them besides the chain's
        # anchors; without the mass it keeps others.
        sess = "parent-score"
        t1 = make_turn(90, "BF16", n_prompt=12, n_gen=3, d=16)
        self.c.publish(t1, sess, "planner", ["critic"], policy="h2o-head:k=4")
        parent = self.c.fetch(sess, "critic", timeout=10)
        self.c.ack(sess, "critic", parent.message_id)
        n = parent.tokens
        self.assertEqual(parent.anchor_pos, [0, 1, 2, 3])
        chosen = [[set(row[-2:].tolist()) for row in layer.pos] for layer in parent.layers]

        def child(with_score):
            t = make_turn(91, "BF16", n_prompt=10, n_gen=2, d=16)
            for layer in t.layers:
                layer.history_score = mass_on(4, n, [n - 2, n - 1]) if with_score else None
            self.c.publish(t, sess, "critic", ["judge"], policy="h2o-head:k=4,hist=2",
                           parent_id=parent.message_id)
            return self.c.fetch(sess, "judge", timeout=10, auto_ack=True)

        m = child(True)
        self.assertEqual((m.parent_id, m.n_history, m.anchor_pos), (parent.message_id, 6, [0, 1, 2, 3]))
        got = history_sets(m)
        for li in range(len(m.layers)):
            for h in range(m.kv_heads):
                self.assertEqual(got[li][h], {0, 1, 2, 3} | chosen[li][h], f"layer.{li} head {h}")
        plain = history_sets(child(False))
        self.assertNotEqual(plain, got, "the history_score changed nothing")
        # Columns other than the parent's tokens per head: the parent does not fit.
        t = make_turn(92, "BF16", n_prompt=10, n_gen=2, d=16)
        for layer in t.layers:
            layer.history_score = np.ones((4, n + 1), np.float32)
        with self.assertRaises(kvrelay.PublishError) as cm:
            self.c.publish(t, sess, "critic", ["judge"], policy="h2o-head:k=4,hist=2", parent_id=parent.message_id)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn(f"history_score_tokens: {n + 1}", cm.exception.details())
        self.c.close_session(sess)

    def test_read_message_of_a_fetched_file_names_it(self):
        # `kvrelayctl fetch --out` writes the delivery's ids into the file;
        # read_message hands them back, so the next publish can name it as parent.
        sess = "fetched-file"
        t1 = make_turn(320, "BF16")
        r1 = self.c.publish(t1, sess, "planner", ["critic"], policy="h2o-head:k=8", role="planner")
        out = os.path.join(TMP, "fetched.safetensors")
        subprocess.run([ARGS.kvrelayctl, "fetch", "--addr", ADDR, "--session", sess, "--agent", "critic",
                        "--out", out, "--wait", "10"], check=True, capture_output=True, timeout=60)
        m = st.read_message(out)
        self.assertEqual((m.message_id, m.session_id, m.sender, m.role, m.delivery_attempt),
                         (r1.message_id, sess, "planner", "planner", 1))
        self.assertEqual((m.accounting.received_bytes, m.accounting.full_bytes, m.accounting.sent_bytes),
                         (r1.accounting.received_bytes, r1.accounting.full_bytes, r1.accounting.sent_bytes))
        t2 = make_turn(321, "BF16", first_agent=False)
        self.c.publish(t2, sess, "critic", ["refiner"], policy="full", parent_id=m.message_id)
        m2 = self.c.fetch(sess, "refiner", timeout=10, auto_ack=True)
        self.assertEqual((m2.parent_id, m2.n_history), (r1.message_id, m.tokens))
        self.c.close_session(sess)

    def test_first_agent_defaults_to_no_uploaded_history(self):
        turn = make_turn(330, "F32", prompt_pos0=20)
        turn.first_agent = None
        self.assertTrue(turn.is_first_agent())
        self.assertGreater(self.c.compress(turn, "h2o-head:k=8").n_anchor, 0)
        for layer in turn.layers:  # 6 tokens of uploaded history: a later agent
            H, _, d = layer.prompt_k.shape
            layer.history_k = np.zeros((H, 6, d), np.float32)
            layer.history_v = np.zeros((H, 6, d), np.float32)
            layer.history_pos = np.broadcast_to(np.arange(6, dtype=np.int32), (H, 6)).copy()
        self.assertFalse(turn.is_first_agent())
        m = self.c.compress(turn, "h2o-head:k=8")
        self.assertEqual((m.n_history, m.n_anchor), (6, 0))
        turn.first_agent = True  # explicit wins
        self.assertGreater(self.c.compress(turn, "h2o-head:k=8").n_anchor, 0)
        turn.first_agent = "false"
        with self.assertRaisesRegex(ValueError, "turn.first_agent: 'false', expected True, False or None"):
            self.c.compress(turn, "h2o-head:k=8")

    def test_next_pos_is_the_turns_end(self):
        # No generated tokens and the prompt's tail evicted: the receiver
        # continues where the turn ended, not after the last id it holds.
        sess = "end"
        turn = make_turn(310, "BF16", n_prompt=40, n_gen=0, prompt_pos0=100)
        for layer in turn.layers:
            layer.score[:, 30:] = 0.0
        self.c.publish(turn, sess, "planner", ["critic"], policy="h2o-head:k=8")
        m = self.c.fetch(sess, "critic", timeout=5, auto_ack=True)
        self.assertLessEqual(m.held_end, 130)
        self.assertEqual((m.turn_end, m.next_pos), (140, 140))
        tin = os.path.join(TMP, "end-turn.safetensors")
        out = os.path.join(TMP, "end-msg.safetensors")
        st.write_turn(tin, turn)
        subprocess.run([ARGS.kvrelayctl, "compress", "--policy", "h2o-head:k=8", "--in", tin,
                        "--out", out], check=True, capture_output=True, timeout=30)
        self.assertEqual(st.read_message(out).next_pos, 140)
        # The reader checks the key as kvrelayctl does.
        meta, tensors = st.read(out)
        for bad in ("abc", "-5", "3", str(1 << 32)):
            st.write(out, {k: v for k, v in tensors.items()}, dict(meta, next_pos=bad),
                     {k: ("BF16" if k.endswith((".k", ".v")) else None) for k in tensors})
            with self.assertRaisesRegex(ValueError, r"metadata next_pos: .*expected a decimal integer"):
                st.read_message(out)
        # Without the field (an older relay or file) next_pos is 1 + the largest id held.
        m.turn_end = 0
        self.assertEqual(m.next_pos, m.held_end)
        self.c.close_session(sess)

    def test_deadline_on_empty_mailbox(self):
        t = time.monotonic()
        with self.assertRaises(grpc.RpcError) as cm:
            self.c.fetch("empty", "nobody", timeout=0.5)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertLess(time.monotonic() - t, 5)

    def test_bad_policy(self):
        turn = make_turn(400)
        with self.assertRaises(grpc.RpcError) as cm:
            self.c.publish(turn, "bad", "planner", ["critic"], policy="h2o-head:k=8+bogus")
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("bogus", cm.exception.details())
        with self.assertRaises(grpc.RpcError) as cm:
            self.c.compress(turn, "gen+obf")
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)

    def test_publish_retries_unavailable_only(self):
        real = self.c._stub.Publish
        calls, failures_left = [], [1]  # fail the first call only

        def flaky(requests, timeout=None, metadata=None):
            calls.append(1)
            if failures_left[0]:
                failures_left[0] -= 1
                raise kvrelay.RelayError(grpc.StatusCode.UNAVAILABLE, "injected")
            return real(requests, timeout=timeout, metadata=metadata)

        self.c._stub.Publish = flaky
        r = self.c.publish(make_turn(500), "retry", "planner", ["critic"], policy="full",
                           initial_backoff=0.01)
        self.assertEqual((r.attempts, len(calls), r.duplicate), (2, 2, False))
        calls.clear()
        with self.assertRaises(grpc.RpcError) as cm:  # INVALID_ARGUMENT: no retry
            self.c.publish(make_turn(501), "retry", "planner", ["critic"], policy="bogus",
                           initial_backoff=0.01)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(len(calls), 1)
        # A failed publish names the id it used (generated here), to retry with.
        self.assertIsInstance(cm.exception, kvrelay.PublishError)
        self.assertRegex(cm.exception.message_id, r"^m-[0-9a-f]{24}$")
        self.assertIn(f"(message_id {cm.exception.message_id})", str(cm.exception))
        with self.assertRaises(kvrelay.PublishError) as cm:
            self.c.publish(make_turn(501), "retry", "planner", ["critic"], policy="bogus",
                           message_id="chosen")
        self.assertEqual((cm.exception.code(), cm.exception.message_id),
                         (grpc.StatusCode.INVALID_ARGUMENT, "chosen"))
        self.c.close_session("retry")

    def test_publish_retries_reach_a_relay_that_comes_back(self):
        # The relay starts listening 0.3 s after the publish began (a
        # restart): the retries (0.1, 0.2, 0.4 s) reach it, instead of
        # failing on the channel's cached connect error until gRPC's own
        # reconnect backoff (1 s, growing) runs out.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            addr = "127.0.0.1:%d" % s.getsockname()[1]
        late = []
        starter = threading.Timer(0.3, lambda: late.append(
            Server(ARGS.server, args=["--listen", addr, "--metrics-listen", "off"])))
        c = kvrelay.Client(addr)
        try:
            starter.start()
            r = c.publish(make_turn(502), "back", "planner", ["critic"], policy="full", retries=3)
            self.assertGreaterEqual(r.attempts, 2)
        finally:
            starter.join()
            c.close()
            for srv in late:
                srv.stop()

    def test_unix_socket(self):
        self.assertTrue(UNIX_ADDR.startswith("unix:"), UNIX_ADDR)
        policy = "h2o-head:k=8+obf:p=4"
        turn = make_turn(300, "BF16")
        meta, ref = kvrelayctl_compress(turn, policy, decode=False)
        with kvrelay.Client(UNIX_ADDR) as u:
            self.assertEqual(u.health(), "SERVING")
            for i, (pub, fetch) in enumerate(((u, u), (self.c, u), (u, self.c))):
                sess = f"unix-{i}"
                before = self.c.stats().messages_acked
                r = pub.publish(turn, sess, "planner", ["critic"], policy=policy)
                m = fetch.fetch(sess, "critic", timeout=10, auto_ack=True)
                self.assertEqual((m.message_id, m.sender), (r.message_id, "planner"))
                self.assertEqual(m.accounting.policy, meta["policy"])
                self.assertEqual(m.accounting.sent_bytes, int(meta["sent_bytes"]))
                for li, ml in enumerate(m.layers):
                    p = f"layer.{li}."
                    self.assertTrue(np.array_equal(bits(ml.k), bits(ref[p + "k"])), p + "k")
                    self.assertTrue(np.array_equal(bits(ml.v), bits(ref[p + "v"])), p + "v")
                    self.assertTrue(np.array_equal(ml.pos, ref[p + "pos"]), p + "pos")
                self.assertEqual(self.c.stats().messages_acked, before + 1)  # one relay behind both
                self.assertEqual(u.close_session(sess), 1)

    def test_health_and_stats(self):
        self.assertEqual(self.c.health(), "SERVING")
        self.assertEqual(self.c.health("kvrelay.v1.Relay"), "SERVING")
        self.assertEqual(self.c.health("no.such.Service"), "SERVICE_UNKNOWN")
        s = self.c.stats()
        self.assertTrue(s.version)
        self.assertGreaterEqual(s.full_bytes, s.sent_bytes)
        self.assertLessEqual(s.mailbox_bytes, s.store_bytes)  # unacked messages are retained


def _write_tokens_file(path, tokens):
    """tokens: {agent: token}; the file holds only their SHA-256."""
    with open(path, "w") as f:
        f.write("# agent tokens (sha256 of each)\n")
        for agent, token in tokens.items():
            f.write(f"{agent} sha256:{hashlib.sha256(token.encode()).hexdigest()}\n")


class ClientArgumentsTest(unittest.TestCase):
    """What Client refuses before dialling (no relay needed)."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="kvrelay-py-args-")
        pki = TestPki(cls.dir)
        cls.ca = pki.ca("args-ca")
        cls.cert = pki.issue(cls.ca, "agent", dns=["agent.test"])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_bad_arguments(self):
        cert, key = self.cert.cert, self.cert.key
        cases = [
            (dict(tls_ca=self.ca.cert, tls_cert=cert), "tls_cert: given without tls_key"),
            (dict(tls_ca=self.ca.cert, tls_key=key), "tls_key: given without tls_cert"),
            (dict(tls_cert=cert, tls_key=key), "tls_cert: given without tls_ca"),
            (dict(tls_ca=os.path.join(self.dir, "missing.pem")), "tls_ca: cannot read"),
            (dict(tls_ca=key), "tls_ca: " + repr(key) + " holds no PEM CERTIFICATE block"),
            (dict(tls_ca=self.ca.cert, tls_cert=cert, tls_key=cert),
             "tls_key: " + repr(cert) + " holds no PEM PRIVATE KEY block"),
            (dict(channel=grpc.insecure_channel("127.0.0.1:1"), tls_ca=self.ca.cert),
             "given with channel"),
            (dict(token="two words-secret"), "token: 16 characters (not shown)"),
            (dict(token="x" * 4097), "expected 1 to 4096 visible ASCII characters"),
        ]
        for kw, msg in cases:
            with self.subTest(kw=sorted(kw)), self.assertRaises(ValueError) as cm:
                kvrelay.Client("127.0.0.1:1", **kw)
            self.assertIn(msg, str(cm.exception))
            self.assertNotIn("secret", str(cm.exception))


class TlsRelayTest(unittest.TestCase):
    """A relay with --tls-cert/--tls-key, --tls-client-ca and --tokens-file."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="kvrelay-py-tls-")
        pki = TestPki(os.path.join(cls.dir, "pki"))
        cls.ca = pki.ca("test-ca")
        server = pki.issue(cls.ca, "relay", dns=["localhost"], ips=["127.0.0.1"])
        cls.client_cert = pki.issue(cls.ca, "planner-client", dns=["planner.test"])
        cls.other_ca = pki.ca("other-ca")
        cls.tokens = {"planner": "planner-" + "p" * 40, "critic": "critic-" + "c" * 40}
        tokens_file = os.path.join(cls.dir, "tokens")
        _write_tokens_file(tokens_file, cls.tokens)
        cls.server = Server(ARGS.server, args=[
            "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
            "--tls-cert", server.cert, "--tls-key", server.key, "--tls-client-ca", cls.ca.cert,
            "--tokens-file", tokens_file,
            "--local-listen", f"unix:{cls.dir}/local.sock", "--local-auth", "token"],
            workdir=cls.dir, name="tls-relay", timeout=20)
        cls.addr = cls.server.addr
        cls.local_addr = f"unix:{cls.dir}/local.sock"  # plaintext; tokens required there too

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def client(self, agent=None, token=None, **kw):
        kw.setdefault("tls_ca", self.ca.cert)
        return kvrelay.Client(self.addr, token=self.tokens[agent] if agent else token, **kw)

    def assert_code(self, code, fn, *args, **kw):
        with self.assertRaises(grpc.RpcError) as cm:
            fn(*args, **kw)
        self.assertEqual(cm.exception.code(), code, cm.exception.details())
        return cm.exception

    def test_publish_fetch_ack_over_tls_with_a_token(self):
        turn = make_turn(500, "BF16")
        for i, cert in enumerate((None, self.client_cert)):
            with self.subTest(client_cert=cert is not None):
                tls = dict(tls_cert=cert.cert, tls_key=cert.key) if cert else {}
                sess = f"tls-{i}"
                with self.client("planner", **tls) as p, self.client("critic", **tls) as c:
                    self.assertEqual(p.health(), "SERVING")
                    r = p.publish(turn, sess, "planner", ["critic"], policy="full")
                    self.assertFalse(r.duplicate)
                    m = c.fetch(sess, "critic", timeout=10)
                    self.assertEqual((m.message_id, m.sender), (r.message_id, "planner"))
                    for tl, ml in zip(turn.layers, m.layers, strict=True):
                        want = np.concatenate((tl.prompt_k, tl.gen_k), axis=1)
                        self.assertTrue(np.array_equal(bits(ml.k), bits(want)))
                    c.ack(sess, "critic", m.message_id)
                    # Acked: nothing left for critic in this session.
                    self.assert_code(grpc.StatusCode.DEADLINE_EXCEEDED, c.fetch, sess, "critic",
                                     timeout=0.5)
                    self.assertGreaterEqual(c.stats().messages_acked, i + 1)
                    self.assertEqual(p.close_session(sess), 1)

    def test_token_from_the_environment(self):
        old = os.environ.get("KVRELAY_TOKEN")
        os.environ["KVRELAY_TOKEN"] = self.tokens["planner"] + "\n"
        try:
            with self.client() as p:  # token=None: KVRELAY_TOKEN
                r = p.publish(make_turn(501), "tls-env", "planner", ["critic"], policy="full")
            with self.client(token="") as none:  # "": no token, whatever the environment says
                self.assert_code(grpc.StatusCode.UNAUTHENTICATED, none.stats)
        finally:
            if old is None:
                del os.environ["KVRELAY_TOKEN"]
            else:
                os.environ["KVRELAY_TOKEN"] = old
        with self.client("critic") as c:
            self.assertEqual(c.fetch("tls-env", "critic", timeout=10, auto_ack=True).message_id,
                             r.message_id)

    def test_the_token_goes_over_plaintext_too(self):
        turn = make_turn(504)
        with kvrelay.Client(self.local_addr, token="") as none:
            self.assert_code(grpc.StatusCode.UNAUTHENTICATED, none.stats)
        with kvrelay.Client(self.local_addr, token=self.tokens["planner"]) as p, \
                kvrelay.Client(self.local_addr, token=self.tokens["critic"]) as c:
            r = p.publish(turn, "tls-local", "planner", ["critic"], policy="full")
            m = c.fetch("tls-local", "critic", timeout=10)
            self.assertEqual(m.message_id, r.message_id)
            c.ack("tls-local", "critic", m.message_id)
            self.assertEqual(p.close_session("tls-local"), 1)

    def test_no_token_or_a_wrong_token_is_unauthenticated(self):
        turn = make_turn(502)
        for name, token in (("none", ""), ("wrong", "not-a-token-of-anyone"),
                            ("planner's with a typo", self.tokens["planner"] + "x")):
            with self.subTest(token=name), self.client(token=token) as c:
                for fn, args in ((c.stats, ()), (c.fetch, ("tls-auth", "planner")),
                                 (c.ack, ("tls-auth", "planner", "m-1")),
                                 (c.close_session, ("tls-auth",)),
                                 (c.compress, (turn, "h2o-head:k=8"))):
                    e = self.assert_code(grpc.StatusCode.UNAUTHENTICATED, fn, *args)
                    if token:
                        self.assertNotIn(token, e.details())
                e = self.assert_code(grpc.StatusCode.UNAUTHENTICATED, c.publish, turn, "tls-auth",
                                     "planner", ["critic"], retries=0)
                self.assertIsInstance(e, kvrelay.PublishError)
        with self.client("critic") as c:  # nothing was published
            self.assert_code(grpc.StatusCode.DEADLINE_EXCEEDED, c.fetch, "tls-auth", "critic",
                             timeout=0.5)

    def test_an_untrusted_ca_or_plaintext_is_unavailable(self):
        with self.client("planner", tls_ca=self.other_ca.cert) as c:
            self.assert_code(grpc.StatusCode.UNAVAILABLE, c.stats, timeout=5)
        with kvrelay.Client(self.addr, token=self.tokens["planner"]) as plain:
            self.assert_code(grpc.StatusCode.UNAVAILABLE, plain.stats, timeout=5)

    def test_acting_for_another_agent_is_permission_denied(self):
        turn = make_turn(503)
        with self.client("planner") as p, self.client("critic") as c:
            e = self.assert_code(grpc.StatusCode.PERMISSION_DENIED, p.publish, turn, "tls-perm",
                                 "critic", ["planner"], retries=0)
            self.assertIn('caller is agent "planner", not "critic"', e.details())
            r = c.publish(turn, "tls-perm", "critic", ["critic"], policy="full")
            e = self.assert_code(grpc.StatusCode.PERMISSION_DENIED, p.fetch, "tls-perm", "critic",
                                 timeout=5)
            self.assertIn('"planner"', e.details())
            m = c.fetch("tls-perm", "critic", timeout=10)
            self.assertEqual(m.message_id, r.message_id)
            self.assert_code(grpc.StatusCode.PERMISSION_DENIED, p.ack, "tls-perm", "critic",
                             m.message_id)
            c.ack("tls-perm", "critic", m.message_id)  # still critic's to ack
            self.assertEqual(c.close_session("tls-perm"), 1)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--kvrelayctl", required=True)
    ARGS, rest = ap.parse_known_args()
    sys.exit(unittest_main(rest, WATCHDOG_S))


if __name__ == "__main__":
    main()
