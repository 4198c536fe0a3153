#!/usr/bin/python3
"""End-to-end tests of the kvrelayctl CLI (docs/FORMAT.md).

Usage: test_kvrelayctl.py --kvrelayctl PATH [--server PATH] [unittest args]

Stdlib only: safetensors files are read and written here with struct/json.
Offline: make-turn, compress, inspect, and `token new`. With --server
(kvrelay-server): the relay verbs against a relay serving TLS with client
certificate verification and a tokens file made by `token new` (--tls-ca,
--tls-cert/--tls-key, --token-file, KVRELAY_TOKEN; the code names printed
for UNAUTHENTICATED, UNAVAILABLE and PERMISSION_DENIED; the flags' errors).
"""
import base64
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testlib"))
import kvrelay_testlib as tl  # noqa: E402
from certs import TestPki  # noqa: E402

KVRELAYCTL = None
SERVER = None  # kvrelay-server, for the relay verbs over TLS (optional)


def _take_arg(argv, name):
    """(argv without --NAME VALUE / --NAME=VALUE, VALUE or None)."""
    out, path = [], None
    i = 0
    while i < len(argv):
        if argv[i] == name and i + 1 < len(argv):
            path = argv[i + 1]
            i += 2
            continue
        if argv[i].startswith(name + "="):
            path = argv[i].split("=", 1)[1]
            i += 1
            continue
        out.append(argv[i])
        i += 1
    return out, path


# ---- safetensors, by hand ----

DTYPE_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "U8": 1, "F64": 8, "I64": 8}


def read_st(path):
    """Returns (metadata, {name: (dtype, shape, bytes)}, header_len)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        tensors[name] = (e["dtype"], e["shape"], body[b:end])
    return meta, tensors, n


def write_st(path, tensors, metadata=None, order=None):
    """tensors: {name: (dtype, shape, bytes)}; written in `order` (or dict order)."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    off = 0
    blobs = []
    for name in (order or list(tensors)):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    write_raw(path, json.dumps(header).encode(), b"".join(blobs))


def write_raw(path, header_bytes, body=b"", length=None):
    pad = (8 - len(header_bytes) % 8) % 8
    header_bytes += b" " * pad
    n = len(header_bytes) if length is None else length
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + header_bytes + body)


def bf16_to_floats(raw):
    vals = struct.unpack("<%dH" % (len(raw) // 2), raw)
    return [struct.unpack("<f", struct.pack("<I", v << 16))[0] for v in vals]


def i32s(raw):
    return list(struct.unpack("<%di" % (len(raw) // 4), raw))


def split_heads(raw, heads):
    step = len(raw) // heads
    return [raw[h * step:(h + 1) * step] for h in range(heads)]


class CliTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="kvrelayctl_test_")
        cls.turn = cls.path("turn.safetensors")
        cls.run_ok(["make-turn", "--out", cls.turn, "--layers", "3", "--kv-heads", "2",
                    "--score-heads", "4", "--head-dim", "32", "--prompt", "48", "--gen", "6",
                    "--seed", "5"])
        cls.hturn = cls.path("hturn.safetensors")
        cls.run_ok(["make-turn", "--out", cls.hturn, "--layers", "2", "--kv-heads", "2",
                    "--head-dim", "16", "--prompt", "40", "--gen", "4", "--history", "10",
                    "--dtype", "F16", "--seed", "9"])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    @classmethod
    def path(cls, name):
        return os.path.join(cls.dir, name)

    @staticmethod
    def run_cli(args):
        return subprocess.run([KVRELAYCTL] + args, capture_output=True, text=True, timeout=120)

    @classmethod
    def run_ok(cls, args):
        p = cls.run_cli(args)
        if p.returncode != 0:
            raise AssertionError("kvrelayctl %s failed (%d): %s" % (args, p.returncode, p.stderr))
        return p

    def expect_fail(self, args, code, substr):
        p = self.run_cli(args)
        self.assertEqual(p.returncode, code, "args=%s stdout=%s stderr=%s" % (args, p.stdout, p.stderr))
        self.assertTrue(p.stderr.startswith("kvrelayctl: ") or "\nkvrelayctl: " in p.stderr, p.stderr)
        self.assertIn(substr, p.stderr)
        return p

    @staticmethod
    def parse_inspect(text):
        out, parts = {}, {}
        for line in text.splitlines():
            m = re.match(r"part (\w+): tokens=(\d+) bytes=(\d+)$", line)
            if m:
                parts[m.group(1)] = (int(m.group(2)), int(m.group(3)))
                continue
            if ": " in line:
                k, v = line.split(": ", 1)
                out[k] = v
        out["parts"] = parts
        return out

    # ---- help and usage errors ----

    def test_help(self):
        for verb in ["help", "--help", "-h"]:
            p = self.run_cli([verb])
            self.assertEqual(p.returncode, 0)
            self.assertIn("usage: kvrelayctl", p.stdout)
            for v in ["compress", "inspect", "make-turn"]:
                self.assertIn(v, p.stdout)

    def test_usage_errors_exit_2(self):
        out = self.path("usage.safetensors")
        self.expect_fail([], 2, "missing verb")
        self.expect_fail(["frobnicate"], 2, 'unknown verb "frobnicate"')
        self.expect_fail(["compress", "--in", self.turn, "--out", out], 2,
                         "missing required flag --policy")
        self.expect_fail(["compress", "--policy", "full", "--out", out], 2,
                         "missing required flag --in")
        self.expect_fail(["compress", "--policy", "full", "--in", self.turn], 2,
                         "missing required flag --out")
        self.expect_fail(["compress", "--policy", "full", "--in", self.turn, "--out", out,
                          "--bogus", "1"], 2, "unknown flag --bogus")
        self.expect_fail(["compress", "--policy", "full", "--in", self.turn, "--out"], 2,
                         "flag --out needs a value")
        self.expect_fail(["compress", "--policy", "full", "--in", self.turn, "--out", out,
                          "--threads", "zero"], 2, "flag --threads")
        self.expect_fail(["compress", "--policy", "full", "--in", self.turn, "--out", out,
                          "--threads", "0"], 2, "flag --threads")
        self.expect_fail(["inspect"], 2, "inspect: expected one FILE argument")
        self.expect_fail(["inspect", self.turn, self.turn], 2, "expected one FILE argument")
        self.expect_fail(["make-turn"], 2, "missing required flag --out")
        self.expect_fail(["make-turn", "--out", out, "--dtype", "F8"], 2, "flag --dtype")
        self.expect_fail(["make-turn", "--out", out, "--first-agent", "maybe"], 2,
                         "flag --first-agent")
        self.expect_fail(["make-turn", "--out", out, "--kv-heads", "3", "--score-heads", "4"], 2,
                         "flag --score-heads: 4, expected a multiple of --kv-heads (3)")
        self.expect_fail(["make-turn", "--out", out, "--layers", "1024", "--kv-heads", "1024", "--head-dim",
                          "1024", "--prompt", "16777216"], 2, "expected at most 16 GiB")
        self.assertFalse(os.path.exists(out))

    def test_runtime_errors_exit_1(self):
        out = self.path("rt.safetensors")
        self.expect_fail(["compress", "--policy", "h2o-head:k=-1", "--in", self.turn, "--out", out],
                         1, "kvrelayctl: ")
        self.expect_fail(["compress", "--policy", "nonsense", "--in", self.turn, "--out", out], 1,
                         "nonsense")
        self.expect_fail(["compress", "--policy", "full", "--in", self.path("missing"), "--out",
                          out], 1, "missing: cannot open")
        self.expect_fail(["inspect", self.path("missing")], 1, "cannot open")
        self.expect_fail(["compress", "--policy", "full", "--in", self.turn, "--out",
                          self.path("no/such/dir/out.safetensors")], 1, "cannot open for writing")
        # A message is not a turn.
        msg = self.path("rt_msg.safetensors")
        self.run_ok(["compress", "--policy", "full", "--in", self.turn, "--out", msg])
        self.expect_fail(["compress", "--policy", "full", "--in", msg, "--out", out], 1,
                         "file is a kvrelay message")

    # ---- make-turn and inspect ----

    def test_make_turn_is_deterministic(self):
        a, b, c = self.path("d1"), self.path("d2"), self.path("d3")
        args = ["--layers", "2", "--prompt", "20", "--gen", "3", "--seed", "42"]
        self.run_ok(["make-turn", "--out", a] + args)
        self.run_ok(["make-turn", "--out", b] + args)
        self.run_ok(["make-turn", "--out", c] + args[:-1] + ["43"])
        with open(a, "rb") as fa, open(b, "rb") as fb, open(c, "rb") as fc:
            da, db, dc = fa.read(), fb.read(), fc.read()
        self.assertEqual(da, db)
        self.assertNotEqual(da, dc)

    def test_make_turn_layout(self):
        meta, t, n = read_st(self.turn)
        self.assertEqual(n % 8, 0)
        self.assertEqual(meta, {"first_agent": "true"})
        self.assertEqual(len(t), 3 * 5)
        self.assertEqual(t["layer.2.prompt.k"][:2], ("BF16", [2, 48, 32]))
        self.assertEqual(t["layer.0.gen.v"][:2], ("BF16", [2, 6, 32]))
        self.assertEqual(t["layer.1.prompt.score"][:2], ("F32", [4, 48]))
        scores = struct.unpack("<%df" % (4 * 48), t["layer.1.prompt.score"][2])
        self.assertTrue(all(s >= 0 for s in scores))
        # Heavy-tailed: the largest score dominates the median.
        srt = sorted(scores)
        self.assertGreater(srt[-1], 10 * srt[len(srt) // 2])
        hmeta, ht, _ = read_st(self.hturn)
        self.assertEqual(hmeta, {"first_agent": "false", "prompt_pos0": "20"})
        self.assertEqual(ht["layer.1.history.pos"][:2], ("I32", [2, 10]))
        self.assertEqual(ht["layer.1.history.k"][:2], ("F16", [2, 10, 16]))

    def test_inspect_turn(self):
        p = self.run_ok(["inspect", self.turn])
        info = self.parse_inspect(p.stdout)
        self.assertEqual(info["kind"], "turn")
        self.assertEqual(info["layers"], "3")
        self.assertEqual(info["dtype"], "BF16")
        self.assertEqual(info["kv_heads"], "2")
        self.assertEqual(info["head_dim"], "32")
        self.assertEqual(info["score_heads"], "4")
        self.assertEqual(info["first_agent"], "true")
        self.assertEqual(info["prompt_pos0"], "0")
        per_token = 3 * 2 * 2 * 32 * 2
        self.assertEqual(info["parts"]["prompt"], (48, 48 * per_token))
        self.assertEqual(info["parts"]["gen"], (6, 6 * per_token))
        self.assertEqual(info["parts"]["history"], (0, 0))
        self.assertEqual(int(info["full_bytes"]), (48 + 6) * (per_token + 3 * 2 * 4))

    # ---- compress ----

    def check_full_message(self, turn_path, msg_path, first_agent):
        tmeta, t, _ = read_st(turn_path)
        mmeta, m, _ = read_st(msg_path)
        layers = len([k for k in t if k.endswith(".prompt.k")])
        dtype, (H, P, D), _ = t["layer.0.prompt.k"]
        G = t["layer.0.gen.k"][1][1]
        M = t["layer.0.history.k"][1][1] if "layer.0.history.k" in t else 0
        pos0 = int(tmeta.get("prompt_pos0", M))
        anchors = min(4, P) if first_agent else 0
        self.assertEqual(mmeta["format"], "kvrelay.message.v2")
        self.assertEqual(mmeta["policy"], "full")
        self.assertEqual(mmeta["dtype"], dtype)
        self.assertEqual(int(mmeta["n_history"]), M)
        self.assertEqual(int(mmeta["n_anchor"]), anchors)
        self.assertEqual(int(mmeta["n_kept"]), P - anchors)
        self.assertEqual(int(mmeta["n_gen"]), G)
        self.assertEqual(mmeta["full_bytes"], mmeta["sent_bytes"])
        n = M + P + G
        expected_bytes = layers * (2 * H * n * D * DTYPE_SIZE[dtype] + 4 * H * n)
        self.assertEqual(int(mmeta["sent_bytes"]), expected_bytes)
        self.assertEqual(len(m), 4 * layers)  # k, v, pos, acc
        for layer in range(layers):
            for kv in ["k", "v"]:
                mdtype, mshape, mraw = m["layer.%d.%s" % (layer, kv)]
                self.assertEqual((mdtype, mshape), (dtype, [H, n, D]))
                parts = []
                for part in ["history", "prompt", "gen"]:
                    name = "layer.%d.%s.%s" % (layer, part, kv)
                    parts.append(split_heads(t[name][2], H) if name in t else [b""] * H)
                want = b"".join(parts[0][h] + parts[1][h] + parts[2][h] for h in range(H))
                self.assertEqual(mraw, want, "layer.%d.%s is not the turn concatenated" % (layer, kv))
            pdtype, pshape, praw = m["layer.%d.pos" % layer]
            self.assertEqual((pdtype, pshape), ("I32", [H, n]))
            pos = i32s(praw)
            hist = i32s(t["layer.%d.history.pos" % layer][2]) if M else []
            for h in range(H):
                want = hist[h * M:(h + 1) * M] + list(range(pos0, pos0 + P + G))
                self.assertEqual(pos[h * n:(h + 1) * n], want)

    def test_full_round_trip(self):
        out = self.path("full.safetensors")
        p = self.run_ok(["compress", "--policy", "full", "--in", self.turn, "--out", out])
        self.check_full_message(self.turn, out, first_agent=True)
        line = p.stdout.strip()
        self.assertEqual(len(line.splitlines()), 1)
        for field in ["policy=full", "history=0", "anchor=4", "kept=44", "gen=6", "ratio=1.000",
                      "compress_ms="]:
            self.assertIn(field, line)
        self.assertRegex(line, r"full_bytes=(\d+) sent_bytes=\1 ")

    def test_full_round_trip_with_history(self):
        out = self.path("hfull.safetensors")
        self.run_ok(["compress", "--policy", "full", "--in", self.hturn, "--out", out,
                     "--threads", "1"])
        self.check_full_message(self.hturn, out, first_agent=False)

    def test_threads_do_not_change_output(self):
        outs = []
        for threads in ["1", "3"]:
            out = self.path("thr%s.safetensors" % threads)
            self.run_ok(["compress", "--policy", "h2o-head:k=8+obf:p=4+int4:group=8", "--in",
                         self.turn, "--out", out, "--threads", threads])
            with open(out, "rb") as f:
                outs.append(f.read())
        self.assertEqual(outs[0], outs[1])

    def test_avx512_and_avx2_paths_give_identical_messages(self):
        # The OBF kernels use AVX-512 where the CPU has it; the AVX2 path must
        # give the same bytes (only discriminating on an AVX-512 machine).
        with open("/proc/cpuinfo") as f:
            has_avx512 = " avx512f" in f.read()
        if not has_avx512:
            print("note: no AVX-512 on this CPU; both runs take the AVX2 path", file=sys.stderr)
        # BF16 turns take the fast path's bfloat16 Gram (VDPBF16PS where the
        # CPU has AVX512_BF16), F32 turns the float one. 151 prompt tokens:
        # an odd number of deleted rows for h2o-head.
        for dtype in ["F32", "BF16"]:
            turn = self.path("isa_turn_%s.safetensors" % dtype)
            self.run_ok(["make-turn", "--out", turn, "--layers", "2", "--kv-heads", "2", "--head-dim", "72",
                         "--prompt", "151", "--gen", "5", "--seed", "21", "--dtype", dtype])
            self.check_isa_paths_agree(turn)

    def check_isa_paths_agree(self, turn):
        for policy in ["h2o-head:k=16+obf:p=4", "h2o-head:k=16+obf:p=4,mode=fast",
                       "h2o-layer:k=40+obf:p=6,mode=fast,iters=3"]:
            outs = []
            for disable in [None, "1"]:
                out = self.path("isa_%s.safetensors" % ("avx2" if disable else "best"))
                env = dict(os.environ)
                env.pop("KVRELAY_DISABLE_AVX512", None)
                if disable:
                    env["KVRELAY_DISABLE_AVX512"] = disable
                p = subprocess.run([KVRELAYCTL, "compress", "--policy", policy, "--in", turn, "--out", out,
                                    "--threads", "1"], capture_output=True, text=True, timeout=120, env=env)
                self.assertEqual(p.returncode, 0, p.stderr)
                with open(out, "rb") as f:
                    outs.append(hashlib.sha256(f.read()).hexdigest())
            self.assertEqual(outs[0], outs[1], "%s, %s: AVX-512 and AVX2 messages differ" % (turn, policy))

    def test_compressed_message_and_inspect(self):
        out = self.path("h2o.safetensors")
        p = self.run_ok(["compress", "--policy", "h2o-layer:k=8", "--in", self.turn, "--out", out])
        meta, m, _ = read_st(out)
        self.assertEqual(meta["n_kept"], "8")
        self.assertEqual(meta["n_anchor"], "4")
        self.assertEqual(m["layer.0.k"][1], [2, 4 + 8 + 6, 32])
        full, sent = int(meta["full_bytes"]), int(meta["sent_bytes"])
        self.assertLess(sent, full)
        self.assertIn("ratio=%.3f" % (full / sent), p.stdout)

        info = self.parse_inspect(self.run_ok(["inspect", out]).stdout)
        self.assertEqual(info["kind"], "message")
        self.assertEqual(info["policy"], meta["policy"])
        self.assertEqual(info["quant"], "none")
        self.assertEqual(int(info["full_bytes"]), full)
        self.assertEqual(int(info["sent_bytes"]), sent)
        self.assertEqual(info["ratio"], "%.3f" % (full / sent))
        parts = info["parts"]
        self.assertEqual([parts[k][0] for k in ["history", "anchor", "kept", "gen"]], [0, 4, 8, 6])
        self.assertEqual(sum(b for _, b in parts.values()), sent)

    def test_quantized_message_and_inspect(self):
        out = self.path("q.safetensors")
        self.run_ok(["compress", "--policy", "h2o-head:k=8+int4:group=8", "--in", self.turn,
                     "--out", out])
        meta, m, _ = read_st(out)
        self.assertEqual((meta["quant_bits"], meta["quant_group"], meta["quant_rotate"]),
                         ("4", "8", "false"))
        n = 4 + 8 + 6
        self.assertEqual(m["layer.1.k.codes"][:2], ("U8", [2, n, 16]))
        self.assertEqual(m["layer.1.k.scale"][:2], ("F16", [2, 3, 32]))
        self.assertEqual(m["layer.1.v.zero"][:2], ("F16", [2, n]))
        self.assertNotIn("layer.1.k", m)
        sent = int(meta["sent_bytes"])
        # Every tensor but acc (relay-side state, not sent to agents).
        self.assertEqual(sent, sum(len(raw) for name, (_, _, raw) in m.items() if not name.endswith(".acc")))
        info = self.parse_inspect(self.run_ok(["inspect", out]).stdout)
        self.assertEqual(info["quant"], "int4 group=8 rotate=false")
        self.assertEqual(sum(b for _, b in info["parts"].values()) + int(info["key_stats_bytes"]),
                         sent)

    def test_decode(self):
        ref = self.path("dec_ref.safetensors")
        q = self.path("dec_q.safetensors")
        dec = self.path("dec.safetensors")
        self.run_ok(["compress", "--policy", "h2o-head:k=8", "--in", self.turn, "--out", ref])
        self.run_ok(["compress", "--policy", "h2o-head:k=8+int8:group=8", "--in", self.turn,
                     "--out", q])
        p = self.run_ok(["compress", "--policy", "h2o-head:k=8+int8:group=8", "--in", self.turn,
                         "--out", dec, "--decode"])
        self.assertIn("decoded=true", p.stdout)
        rmeta, r, _ = read_st(ref)
        qmeta, _, _ = read_st(q)
        dmeta, d, _ = read_st(dec)
        for key in ["quant_bits", "quant_group", "quant_rotate"]:
            self.assertNotIn(key, dmeta)
        self.assertEqual(dmeta["dtype"], "BF16")
        self.assertEqual(sorted(d), sorted(r))
        # Decoded bytes are dense bytes; the packed message is smaller.
        self.assertEqual(dmeta["sent_bytes"], rmeta["sent_bytes"])
        self.assertLess(int(qmeta["sent_bytes"]), int(dmeta["sent_bytes"]))
        # The summary line still reports what the relay sends: the packed bytes.
        self.assertIn(" sent_bytes=%s " % qmeta["sent_bytes"], p.stdout)
        for name in r:
            self.assertEqual(d[name][:2], r[name][:2], name)
            if name.endswith(".pos") or name.endswith(".acc"):
                self.assertEqual(d[name][2], r[name][2])
                continue
            want = bf16_to_floats(r[name][2])
            got = bf16_to_floats(d[name][2])
            span = max(want) - min(want)
            err = max(abs(a - b) for a, b in zip(want, got))
            # 8-bit min-max: at most half a step of the (local) range, plus bf16 rounding.
            self.assertLess(err, span / 255 + 0.01 * max(abs(x) for x in want), name)
            self.assertNotEqual(d[name][2], r[name][2])  # really went through quantization
        # Inspect sees a dense message.
        info = self.parse_inspect(self.run_ok(["inspect", dec]).stdout)
        self.assertEqual(info["quant"], "none")
        # --decode of a dense policy changes nothing.
        plain = self.path("dec_plain.safetensors")
        self.run_ok(["compress", "--policy", "h2o-head:k=8", "--in", self.turn, "--out", plain,
                     "--decode"])
        with open(plain, "rb") as f1, open(ref, "rb") as f2:
            self.assertEqual(f1.read(), f2.read())

    # ---- malformed files: exit 1 and the reader's message ----

    def expect_bad_file(self, path, substr):
        out = self.path("never.safetensors")
        self.expect_fail(["inspect", path], 1, substr)
        self.expect_fail(["compress", "--policy", "full", "--in", path, "--out", out], 1, substr)
        self.assertFalse(os.path.exists(out))

    def raw_case(self, name, header, body=b"", length=None):
        path = self.path(name)
        write_raw(path, header if isinstance(header, bytes) else header.encode(), body, length)
        return path

    ONE = '{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}'

    def test_bad_short_file(self):
        path = self.path("short")
        with open(path, "wb") as f:
            f.write(b"abc")
        self.expect_bad_file(path, "file is 3 bytes, expected at least 8")

    def test_bad_header_length_beyond_file(self):
        self.expect_bad_file(self.raw_case("hl", "{}", b"", 1000),
                             "header length 1000 bytes exceeds the 8 bytes after the length field")

    def test_bad_header_length_absurd(self):
        self.expect_bad_file(self.raw_case("habs", "{}", b"", 1 << 40), "expected at most 16777216")

    def test_not_a_regular_file(self):
        # /dev/zero would otherwise be read until memory runs out.
        self.expect_fail(["inspect", "/dev/zero"], 1, "not a regular file")

    def test_bad_json(self):
        self.expect_bad_file(self.raw_case("json", "{not json"), "header is not valid JSON")

    def test_bad_header_not_object(self):
        self.expect_bad_file(self.raw_case("arr", "[1,2]"), "header is a JSON array, expected an object")

    def test_bad_missing_dtype(self):
        self.expect_bad_file(self.raw_case("nodt", '{"a":{"shape":[2,2],"data_offsets":[0,16]}}',
                                           b"\0" * 16), "tensor 'a': missing field 'dtype'")

    def test_bad_wrong_field_type(self):
        self.expect_bad_file(self.raw_case("shstr", '{"a":{"dtype":"F32","shape":"2x2","data_offsets":[0,16]}}',
                                           b"\0" * 16),
                             "tensor 'a': shape is \"2x2\" (a string), expected an array of integers")

    def test_bad_unknown_dtype(self):
        self.expect_bad_file(self.raw_case("udt", self.ONE.replace("F32", "Q4"), b"\0" * 16),
                             "tensor 'a': unknown dtype 'Q4'")

    def test_bad_negative_shape(self):
        self.expect_bad_file(self.raw_case("neg", self.ONE.replace("[2,2]", "[-2,2]"), b"\0" * 16),
                             "tensor 'a': shape[0] is -2, expected a non-negative integer")

    def test_bad_offsets_out_of_range(self):
        self.expect_bad_file(self.raw_case("oor", self.ONE, b"\0" * 8),
                             "tensor 'a': data_offsets [0,16] exceed the 8 bytes of data after the header")

    def test_bad_end_before_begin(self):
        self.expect_bad_file(self.raw_case("ebb", self.ONE.replace("[0,16]", "[16,0]"), b"\0" * 16),
                             "tensor 'a': data_offsets [16,0]: end before begin")

    def test_bad_size_mismatch(self):
        self.expect_bad_file(self.raw_case("size", self.ONE.replace("[0,16]", "[0,12]"), b"\0" * 16),
                             "tensor 'a': data_offsets [0,12] hold 12 bytes, expected 16")

    def test_bad_overlap(self):
        header = ('{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
                  '"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}')
        self.expect_bad_file(self.raw_case("ovl", header, b"\0" * 24),
                             "tensor 'b': data_offsets [8,24] overlap tensor 'a'")

    def test_bad_metadata_value(self):
        self.expect_bad_file(self.raw_case("meta", '{"__metadata__":{"first_agent":true}}'),
                             "__metadata__.first_agent is true (a boolean), expected a string")

    # Turn-level errors, made by editing a valid turn.

    def edited_turn(self, name, edit):
        meta, t, _ = read_st(self.hturn)
        order = list(t)
        edit(meta, t)
        path = self.path(name)
        write_st(path, t, meta, [k for k in order if k in t] + [k for k in t if k not in order])
        return path

    def test_bad_unknown_tensor_name(self):
        def edit(meta, t):
            t["layer.0.prompt.q"] = t.pop("layer.0.prompt.k")
        self.expect_bad_file(self.edited_turn("uname", edit),
                             "layer.0.prompt.q: unknown tensor name")

    def test_bad_layer_gap(self):
        def edit(meta, t):
            for k in [k for k in t if k.startswith("layer.1.")]:
                t[k.replace("layer.1.", "layer.2.")] = t.pop(k)
        self.expect_bad_file(self.edited_turn("gap", edit),
                             "layer.1: no tensors, but layer.2 exists")

    def test_bad_missing_tensor(self):
        self.expect_bad_file(self.edited_turn("miss", lambda m, t: t.pop("layer.1.gen.k")),
                             "layer.1.gen.k: missing, required in every layer")

    def test_bad_partial_history(self):
        def edit(meta, t):
            for k in ["layer.1.history.k", "layer.1.history.v", "layer.1.history.pos"]:
                del t[k]
        self.expect_bad_file(self.edited_turn("phist", edit),
                             "layer.1.history.k: missing, but layer.0 has history")

    def test_bad_history_without_pos(self):
        self.expect_bad_file(self.edited_turn("nopos", lambda m, t: t.pop("layer.0.history.pos")),
                             "layer.0.history.pos: missing, required with history")

    def test_bad_score_dtype(self):
        def edit(meta, t):
            _, shape, raw = t["layer.1.prompt.score"]
            t["layer.1.prompt.score"] = ("BF16", shape, raw[:len(raw) // 2])
        self.expect_bad_file(self.edited_turn("sdt", edit),
                             "layer.1.prompt.score: dtype BF16, expected F32")

    def test_bad_kv_dtype(self):
        def edit(meta, t):
            _, shape, raw = t["layer.0.gen.v"]
            t["layer.0.gen.v"] = ("BF16", shape, raw)
        self.expect_bad_file(self.edited_turn("kvdt", edit),
                             "layer.0.gen.v: dtype BF16, expected F16 (dtype of layer.0.prompt.k)")

    def test_bad_kv_f64(self):
        def edit(meta, t):
            for k in [k for k in t if k.endswith((".k", ".v"))]:
                _, shape, raw = t[k]
                t[k] = ("F64", shape, raw * 4)
        self.expect_bad_file(self.edited_turn("f64", edit),
                             "layer.0.prompt.k: dtype F64, expected F32, F16 or BF16")

    def test_bad_shape(self):
        def edit(meta, t):
            _, shape, raw = t["layer.1.prompt.v"]
            t["layer.1.prompt.v"] = ("F16", [shape[0], shape[1] * 2, shape[2] // 2], raw)
        self.expect_bad_file(self.edited_turn("shape", edit),
                             "layer.1.prompt.v: shape [2,80,8], expected [2,40,16]")

    def test_bad_nan(self):
        def edit(meta, t):
            dt, shape, raw = t["layer.0.prompt.k"]
            t["layer.0.prompt.k"] = (dt, shape, b"\x00\x7e" + raw[2:])  # f16 NaN
        self.expect_bad_file(self.edited_turn("nan", edit), "layer.0.prompt.k: non-finite value nan")

    def test_bad_first_agent(self):
        def edit(meta, t):
            meta["first_agent"] = "1"
        self.expect_bad_file(self.edited_turn("fa", edit),
                             'metadata first_agent: "1", expected "true" or "false"')

    def test_bad_prompt_pos0(self):
        def edit(meta, t):
            meta["prompt_pos0"] = "-5"
        self.expect_bad_file(self.edited_turn("pp0", edit),
                             'metadata prompt_pos0: "-5", expected a decimal integer >= 0')

    def test_bad_message_inspect(self):
        msg = self.path("bm.safetensors")
        self.run_ok(["compress", "--policy", "h2o-head:k=8", "--in", self.turn, "--out", msg])
        meta, t, _ = read_st(msg)
        meta["sent_bytes"] = "1"
        bad = self.path("bm_bad.safetensors")
        write_st(bad, t, meta)
        self.expect_fail(["inspect", bad], 1, 'metadata sent_bytes: "1", expected')


class TokenTest(unittest.TestCase):
    """kvrelayctl token new AGENT (offline)."""

    def token_new(self, agent):
        p = subprocess.run([KVRELAYCTL, "token", "new", agent], capture_output=True, text=True,
                           timeout=30)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stderr, "")
        lines = p.stdout.split("\n")
        self.assertEqual(len(lines), 3, p.stdout)  # token, tokens-file line, ""
        self.assertEqual(lines[2], "")
        return lines[0], lines[1]

    def test_prints_a_fresh_token_and_its_tokens_file_line(self):
        seen = set()
        for agent in ("planner", "a", "A-z.0_9:x", "x" * 128):
            token, line = self.token_new(agent)
            self.assertRegex(token, r"^[A-Za-z0-9_-]{43}$")
            self.assertEqual(len(base64.urlsafe_b64decode(token + "=")), 32)
            self.assertEqual(line, f"{agent} sha256:{hashlib.sha256(token.encode()).hexdigest()}")
            self.assertRegex(line, r" sha256:[0-9a-f]{64}$")
            seen.add(token)
        self.assertEqual(len(seen), 4)

    def test_bad_usage_exits_2(self):
        for args, msg in ((["token"], 'token: missing verb, expected "token new AGENT"'),
                          (["token", "old", "a"], 'token: unknown verb "old", expected "token new AGENT"'),
                          (["token", "new"], "token new: expected one AGENT argument, got 0"),
                          (["token", "new", "a", "b"], "token new: expected one AGENT argument, got 2"),
                          (["token", "new", "a b"], "token new: agent: 'a b', expected [A-Za-z0-9._:-]{1,128}"),
                          (["token", "new", "a/b"], "agent: 'a/b'"),
                          (["token", "new", "x" * 129], "expected [A-Za-z0-9._:-]{1,128}"),
                          (["token", "new", "--bogus", "a"], "unknown flag --bogus")):
            p = subprocess.run([KVRELAYCTL] + args, capture_output=True, text=True, timeout=30)
            self.assertEqual(p.returncode, 2, (args, p.stderr))
            self.assertEqual(p.stdout, "", args)  # no token printed
            self.assertIn(msg, p.stderr)

    def test_help_describes_token_and_tls_flags(self):
        p = subprocess.run([KVRELAYCTL, "help"], capture_output=True, text=True, timeout=30)
        for text in ("token new AGENT", "AGENT sha256:HEX", "--tls-ca FILE", "[--tls-cert FILE] [--tls-key FILE]",
                     "--tls-cert/--tls-key: a client certificate",
                     "--token-file FILE", "KVRELAY_TOKEN", "UNAUTHENTICATED"):
            self.assertIn(text, p.stdout)


class TlsRelayVerbsTest(unittest.TestCase):
    """The relay verbs against a TLS relay with --tls-client-ca and a tokens
    file (needs --server)."""

    @classmethod
    def setUpClass(cls):
        if not SERVER:
            raise unittest.SkipTest("no --server given")
        cls.dir = tempfile.mkdtemp(prefix="kvrelayctl_tls_")
        pki = TestPki(os.path.join(cls.dir, "pki"))
        cls.ca = pki.ca("ctl-ca")
        server = pki.issue(cls.ca, "relay", dns=["localhost"], ips=["127.0.0.1"])
        cls.cert = pki.issue(cls.ca, "ctl-client", dns=["ctl-client.test"])
        cls.other_ca = pki.ca("ctl-other-ca")
        # The relay's tokens file holds the lines `token new` printed.
        cls.tokens, lines = {}, ["# made by kvrelayctl token new"]
        for agent in ("planner", "critic"):
            p = subprocess.run([KVRELAYCTL, "token", "new", agent], capture_output=True, text=True,
                               timeout=30, check=True)
            token, line = p.stdout.splitlines()
            cls.tokens[agent] = token
            lines.append(line)
        with open(cls.path("tokens"), "w") as f:
            f.write("\n".join(lines) + "\n")
        # planner's file is all of `token new`'s output (its first line is
        # read); critic's has the token alone with whitespace around it.
        with open(cls.path("planner.token"), "w") as f:
            f.write(cls.tokens["planner"] + "\n" + lines[1] + "\n")
        with open(cls.path("critic.token"), "w") as f:
            f.write("  " + cls.tokens["critic"] + " \t\n")
        with open(cls.path("wrong.token"), "w") as f:
            f.write("wrong-" + cls.tokens["planner"][6:] + "\n")
        cls.local = f"unix:{cls.dir}/local.sock"
        cls.server = tl.Server(SERVER, workdir=cls.dir, name="tls-relay", timeout=20, args=[
            "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
            "--tls-cert", server.cert, "--tls-key", server.key, "--tls-client-ca", cls.ca.cert,
            "--tokens-file", cls.path("tokens"), "--local-listen", cls.local, "--local-auth", "token"])
        cls.addr = cls.server.addr
        cls.turn = cls.path("turn.safetensors")
        p = subprocess.run([KVRELAYCTL, "make-turn", "--out", cls.turn, "--layers", "2", "--kv-heads", "2",
                            "--head-dim", "16", "--prompt", "24", "--gen", "3"], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, p.stderr

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        shutil.rmtree(cls.dir, ignore_errors=True)

    @classmethod
    def path(cls, name):
        return os.path.join(cls.dir, name)

    def ctl(self, verb, *args, agent=None, tls=True, addr=None, env=None):
        """kvrelayctl VERB --addr A [--tls-ca CA] [--token-file AGENT's] ARGS."""
        cmd = [KVRELAYCTL, verb, "--addr", addr or self.addr]
        if tls:
            cmd += ["--tls-ca", self.ca.cert]
        if agent:
            cmd += ["--token-file", self.path(f"{agent}.token")]
        rc, out, err = tl.run(cmd + list(args), timeout=60, env=env)
        return rc, out, err

    def ok(self, verb, *args, **kw):
        rc, out, err = self.ctl(verb, *args, **kw)
        self.assertEqual(rc, 0, f"{verb} {args}: {err}")
        return dict(re.findall(r"(\w+)=(\S+)", out)) | {"_out": out}

    def error_line(self, err):
        """kvrelayctl's one error line (gRPC may log handshake failures too)."""
        lines = [line for line in err.splitlines() if line.startswith("kvrelayctl: ")]
        self.assertEqual(len(lines), 1, err)
        return lines[0]

    def fails(self, verb, *args, code=None, rc=1, text=None, **kw):
        got_rc, out, err = self.ctl(verb, *args, **kw)
        self.assertEqual(got_rc, rc, f"{verb} {args}: stdout={out} stderr={err}")
        line = self.error_line(err)
        if code:
            self.assertTrue(line.startswith(f"kvrelayctl: {verb}: {code}: "), line)
        if text:
            self.assertIn(text, line)
        for token in self.tokens.values():
            self.assertNotIn(token, err + out)
        return line

    def test_verbs_over_tls_with_a_token(self):
        for i, cert in enumerate((None, self.cert)):
            with self.subTest(client_cert=cert is not None):
                extra = ["--tls-cert", cert.cert, "--tls-key", cert.key] if cert else []
                sess = f"ctl-tls-{i}"
                self.assertEqual(self.ok("health", *extra, agent="planner")["_out"], "SERVING\n")
                pub = self.ok("publish", "--session", sess, "--from", "planner", "--to", "critic",
                              "--policy", "full", "--in", self.turn, *extra, agent="planner")
                st = self.ok("status", "--session", sess, "--id", pub["message_id"], *extra, agent="planner")
                self.assertIn("sender=planner\nagent=critic state=committed", st["_out"])
                out = self.path(f"fetched-{i}.safetensors")
                got = self.ok("fetch", "--session", sess, "--agent", "critic", "--out", out, "--no-ack",
                              *extra, agent="critic")
                self.assertEqual((got["message_id"], got["from"]), (pub["message_id"], "planner"))
                meta, _, _ = read_st(out)
                self.assertEqual(meta["message_id"], pub["message_id"])
                self.ok("ack", "--session", sess, "--agent", "critic", "--id", pub["message_id"], *extra,
                        agent="critic")
                self.assertIn("messages_acked: ", self.ok("stats", *extra, agent="critic")["_out"])
                self.assertEqual(self.ok("close", "--session", sess, *extra, agent="planner")["messages_freed"],
                                 "1")

    def test_token_from_the_environment(self):
        env = tl.clean_env(KVRELAY_TOKEN=self.tokens["planner"])
        self.ok("stats", env=env)
        # --token-file wins over the environment.
        self.fails("stats", code="UNAUTHENTICATED", agent="wrong", env=env)
        self.fails("stats", code="UNAUTHENTICATED", env=tl.clean_env(KVRELAY_TOKEN="no-such-token"))

    def test_the_token_goes_over_plaintext_too(self):
        self.fails("stats", code="UNAUTHENTICATED", tls=False, addr=self.local)
        self.ok("stats", tls=False, addr=self.local, agent="planner")

    def test_failures_print_the_code_and_exit_1(self):
        self.fails("stats", code="UNAUTHENTICATED")  # no token
        self.fails("fetch", "--session", "ctl-x", "--agent", "critic", "--out", self.path("x.safetensors"),
                   code="UNAUTHENTICATED", agent="wrong")
        self.fails("publish", "--session", "ctl-x", "--from", "planner", "--to", "critic", "--in", self.turn,
                   "--retries", "0", code="UNAUTHENTICATED", agent="wrong")
        self.fails("stats", code="UNAVAILABLE", agent="planner", tls=False)  # plaintext to the TLS port
        rc, out, err = tl.run([KVRELAYCTL, "stats", "--addr", self.addr, "--tls-ca", self.other_ca.cert,
                               "--token-file", self.path("planner.token")], timeout=60)
        self.assertEqual(rc, 1, err)
        self.assertTrue(self.error_line(err).startswith("kvrelayctl: stats: UNAVAILABLE: "), err)
        # planner acting for critic.
        self.fails("publish", "--session", "ctl-perm", "--from", "critic", "--to", "planner", "--in", self.turn,
                   "--retries", "0", code="PERMISSION_DENIED", text='caller is agent "planner", not "critic"',
                   agent="planner")
        self.fails("fetch", "--session", "ctl-perm", "--agent", "critic", "--out", self.path("y.safetensors"),
                   "--wait", "5", code="PERMISSION_DENIED", text='"planner"', agent="planner")
        self.assertFalse(os.path.exists(self.path("y.safetensors")))
        self.fails("ack", "--session", "ctl-perm", "--agent", "critic", "--id", "m-1", code="PERMISSION_DENIED",
                   agent="planner")

    def test_flag_errors(self):
        cert, key = self.cert.cert, self.cert.key
        with open(self.path("empty.token"), "w") as f:
            f.write("\n")
        with open(self.path("spaced.token"), "w") as f:
            f.write("two words-secret\n")
        cases = [
            (["--tls-cert", cert], 2, "flag --tls-cert: given without --tls-key, expected both or neither"),
            (["--tls-key", key], 2, "flag --tls-key: given without --tls-cert, expected both or neither"),
            (["--tls-ca", ""], 2, "flag --tls-ca: empty value"),
            (["--tls-ca", self.path("missing.pem")], 1,
             f'flag --tls-ca: cannot read "{self.path("missing.pem")}": No such file or directory'),
            (["--tls-ca", key], 1, f'flag --tls-ca: "{key}" holds no PEM CERTIFICATE block'),
            (["--tls-ca", self.ca.cert, "--tls-cert", cert, "--tls-key", cert], 1,
             f'flag --tls-key: "{cert}" holds no PEM PRIVATE KEY block'),
            (["--token-file", self.path("missing.token")], 1, "flag --token-file: cannot read"),
            (["--token-file", self.path("empty.token")], 1, "first line is empty, expected the token"),
            (["--token-file", self.path("spaced.token")], 1, "flag --token-file: 16 characters (not shown)"),
        ]
        for args, rc, msg in cases:
            with self.subTest(args=args):
                err = self.fails("stats", *args, rc=rc, text=msg, tls=False)
                self.assertNotIn("secret", err)
        self.fails("stats", "--tls-cert", cert, "--tls-key", key, rc=2, tls=False,
                   text="flag --tls-cert: given without --tls-ca")
        rc, _, err = tl.run([KVRELAYCTL, "compress", "--policy", "full", "--in", self.turn, "--out",
                             self.path("c.safetensors"), "--token-file", self.path("planner.token")])
        self.assertEqual(rc, 2, err)
        self.assertIn("compress: --token-file is for the relay; it needs --addr", err)
        # Compress at the relay takes them.
        rc, out, err = tl.run([KVRELAYCTL, "compress", "--policy", "h2o-head:k=8", "--in", self.turn, "--out",
                               self.path("c.safetensors"), "--addr", self.addr, "--tls-ca", self.ca.cert,
                               "--token-file", self.path("planner.token")])
        self.assertEqual(rc, 0, err)
        self.assertIn("relay=true", out)


if __name__ == "__main__":
    argv, KVRELAYCTL = _take_arg(sys.argv, "--kvrelayctl")
    argv, SERVER = _take_arg(argv, "--server")
    if not KVRELAYCTL:
        sys.stderr.write("usage: test_kvrelayctl.py --kvrelayctl PATH [--server PATH] [unittest args]\n")
        sys.exit(2)
    KVRELAYCTL = os.path.abspath(KVRELAYCTL)
    if SERVER:
        SERVER = os.path.abspath(SERVER)
    try:
        unittest.main(argv=argv)
    finally:
        tl.stop_started()
