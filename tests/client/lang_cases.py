"""The live-relay cases shared by the Go and Node.js client tests
(tests/client/go/test_go_client.py, tests/client/node/test_node_client.py).

Each language ships an example client that publishes a turn file, fetches
the message, writes it as a safetensors file and acks it. A driver starts a
Live (kvrelay-server on 127.0.0.1:0 and on a Unix socket, kvrelayctl, a
scratch folder) and defines its RelayTest as RelayCases + unittest.TestCase
with:

    LANG         prefix of the message ids it chooses ("go", "node")
    USAGE_ERROR  what the example prints for a missing --out
    live         the Live (set in setUpModule)
    example(*args, timeout=60, addr=None) -> subprocess.CompletedProcess (a
                 staticmethod) runs the example with --addr ADDR (default
                 live.addr) and args

The cases: the fetched message equals `kvrelayctl compress` of the same turn
bit for bit (every tensor's dtype, shape and bytes, and the accounting
metadata) for dense, quantized and default policies, multi-chunk F32
tensors, F16/BF16, GQA and uploaded history; with `full` it equals the input
K/V (and positions); every message was acked (the relay holds nothing, stats
count every ack); a bad policy fails with INVALID_ARGUMENT naming
header.policy and commits nothing; a malformed turn file fails before any
call, naming the tensor; a missing flag is a usage error (exit 2); a publish
and a fetch over the relay's Unix socket (--addr unix:PATH) give the same
message, counted by the same relay. Turns whose layers carry gen.q (the
generated steps' queries, F32 or the K/V dtype, with and without
softmax_scale; QUERY_CASES) published and fetched, and sent to Compress,
equal `kvrelayctl compress` of the same file bit for bit, and differ from
the turn's scores and from the default scale (so the client sent GEN_Q,
query_dtype and softmax_scale); a file with gen.q and prompt.score in one
layer, a mix across layers, gen.q in a third dtype or a softmax_scale that
is not a finite decimal > 0 fails before any call, naming it. A turn with
queries gets the fidelity figure (attention_error) in the publish output and
the message file, equal to kvrelayctl's; a turn with scores none. A turn
file's history_anchors metadata and history.score (with an uploaded
history) are sent: under a history budget (hist=2) every head keeps the
anchors and the tokens the history.score weighs, and the message equals
kvrelayctl compress of the same file; an anchor the history does not hold
is the relay's INVALID_ARGUMENT naming history_anchors.

TLS cases (TlsCases; the driver defines TlsTest as TlsCases +
unittest.TestCase with LANG, example and BINARIES = (server, kvrelayctl)):
TlsLive starts a second kvrelay-server with TLS on 127.0.0.1:0 (a test CA
from testlib/certs.py, client certificates requested and verified), a tokens
file for planner and critic, and a plaintext local listener on a Unix socket
with --local-auth token. The example there takes `env`, a dict of the
KVRELAY_* variables it runs with (every other KVRELAY_* variable removed).
Checks: publish, fetch and ack work over TLS with the agent's token (from
--token-file or KVRELAY_TOKEN), and with a client certificate too, counted
by the relay's metrics; the token also goes over the plaintext Unix socket;
no token and a wrong token fail the publish with UNAUTHENTICATED; a CA that
did not sign the relay's certificate, and a plaintext client on the TLS port,
with UNAVAILABLE; publishing as another agent with PERMISSION_DENIED naming
header.sender, fetching another agent's mailbox too; every refused call
commits nothing, exits 1 and prints the code by name; no token appears in
the example's output or the relay's log.
"""
import hashlib
import json
import os
import re
import secrets
import shutil
import struct
import sys
import tempfile
import urllib.request

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testlib"))
from certs import TestPki  # noqa: E402
from kvrelay_testlib import Server, check_run, parse_exposition, read_st  # noqa: E402

MESSAGE_KEYS = ("format", "policy", "dtype", "n_history", "n_anchor", "n_kept", "n_gen",
                "full_bytes", "sent_bytes", "next_pos", "anchor_pos", "quant_bits", "quant_group", "quant_rotate")

# (name, policy, make-turn flags); policy None: the relay's default for the role.
CASES = [
    ("full-f32-multichunk", "full", dict(dtype="F32", layers=2, kv_heads=4, head_dim=128, prompt=600,
                                          gen=20, seed=11)),  # 1.2 MiB tensors: 2 chunks each way
    ("full-bf16-history", "full", dict(dtype="BF16", history=8, seed=12)),
    ("h2o-head-obf-bf16", "h2o-head:k=8+obf:p=4", dict(dtype="BF16", seed=13)),
    ("h2o-layer-fast-f16-gqa", "h2o-layer:k=16,recent=2+obf:p=4,mode=fast",
     dict(dtype="F16", kv_heads=2, score_heads=8, seed=14)),
    ("int4-hadamard-f32-history", "h2o-head:k=8+obf:p=4+int4:group=16,rotate=hadamard",
     dict(dtype="F32", history=6, seed=15)),
    ("gen-int8-bf16", "gen+int8", dict(dtype="BF16", seed=16)),
    ("default-policy", None, dict(dtype="BF16", seed=17)),
    # Nothing generated and the prompt's tail evicted: next_pos lies past every id held.
    ("evicted-tail-no-gen", "h2o-layer:k=2", dict(dtype="BF16", gen=0, seed=18)),
]

# Turns whose layers carry gen.q (the generated steps' queries) instead of
# prompt.score: (name, policy, make-turn flags, gen.q dtype, softmax_scale
# metadata or None). window= needs the queries (the relay refuses it on a
# turn with scores); a scale that is not 1/sqrt(head_dim) changes the kept
# set, so a client that dropped it would not match kvrelayctl.
QUERY_CASES = [
    ("q-f32-bf16", "h2o-head:k=8+obf:p=4", dict(dtype="BF16", seed=51), "F32", None),
    ("q-f16-gqa-window", "h2o-layer:k=8,window=3", dict(dtype="F16", kv_heads=2, score_heads=8, seed=52),
     "F16", "0.05"),
    ("q-bf16-history-int4", "h2o-head:k=6,pool=3,window=2+int4",
     dict(dtype="BF16", history=6, seed=53), "BF16", "3e-1"),
    ("q-f32-multichunk", "h2o-layer:k=64,recent=4",
     dict(dtype="F32", layers=2, kv_heads=4, head_dim=128, prompt=600, gen=600, seed=54), "F32", "0.02"),
]


def write_st(path, meta, tensors):
    """Writes a safetensors file: tensors {name: (dtype, shape, bytes)} (as
    read_st returns them) in their order, metadata `meta`."""
    header, offset = {}, 0
    if meta:
        header["__metadata__"] = meta
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(t[2] for t in tensors.values()))


def query_bytes(q, dtype):
    """float32 array q as little-endian bytes of dtype (BF16: the top 16 bits)."""
    if dtype == "F32":
        return q.astype("<f4").tobytes()
    if dtype == "F16":
        return q.astype("<f2").tobytes()
    return (q.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()


def rows(t):
    """A [H, n, ...] tensor as uint8 [H, n, row_bytes], for concatenating along tokens."""
    dtype, shape, data = t
    return np.frombuffer(data, np.uint8).reshape(shape[0], shape[1], -1)


class Live:
    """A kvrelay-server on 127.0.0.1:0 (addr) and on unix:TMP/relay.sock
    (unix_addr), kvrelayctl and a scratch folder (tmp)."""

    def __init__(self, server, kvrelayctl, prefix):
        self.kvrelayctl = kvrelayctl
        self.tmp = tempfile.mkdtemp(prefix=prefix)
        sock = os.path.join(self.tmp, "relay.sock")
        try:
            self.server = Server(server, args=["--listen", "127.0.0.1:0", "--listen", f"unix:{sock}",
                                               "--metrics-listen", "127.0.0.1:0"], timeout=20)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.addr, self.unix_addr = self.server.addrs

    def close(self):
        self.server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.tmp, name)

    def make_turn(self, name, **flags):
        path = self.path(name + ".safetensors")
        cmd = [self.kvrelayctl, "make-turn", "--out", path]
        for k, v in flags.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        check_run(cmd)
        return path

    def query_turn(self, name, query_dtype, softmax_scale=None, **flags):
        """A make-turn turn with each layer's prompt.score replaced by gen.q
        [score_heads, n_gen, head_dim] of random queries in query_dtype, and
        softmax_scale (a string) in the metadata when given; (path of the
        gen.q turn, path of the make-turn turn it came from)."""
        source = self.make_turn(name + "-scores", **flags)
        meta, tensors = read_st(source)
        rng = np.random.default_rng(int(flags.get("seed", 1)) + 1000)
        out = {}
        for key, t in tensors.items():
            if not key.endswith(".prompt.score"):
                out[key] = t
                continue
            p = key[:-len("prompt.score")]
            heads = t[1][0]
            _, (_, n_gen, d), _ = tensors[p + "gen.k"]
            q = rng.standard_normal((heads, n_gen, d)).astype(np.float32)
            out[p + "gen.q"] = (query_dtype, (heads, n_gen, d), query_bytes(q, query_dtype))
        if softmax_scale is not None:
            meta = dict(meta, softmax_scale=softmax_scale)
        path = self.path(name + ".safetensors")
        write_st(path, meta, out)
        return path, source

    def history_turn(self, name, anchors, score_columns=None, **flags):
        """A make-turn turn (2 layers) with an uploaded history of 12 tokens
        at the even positions 0, 2, ..., 22 in every head (the prompt starts
        at 24), the metadata history_anchors (a string) and, with
        score_columns, every layer's history.score [score_heads, 12] putting
        100 on those columns and 0 elsewhere."""
        source = self.make_turn(name + "-source", layers=2, history=12, prompt=32, gen=4, **flags)
        meta, tensors = read_st(source)
        out = {}
        for key, t in tensors.items():
            out[key] = t
            if key.endswith(".history.pos"):
                heads = t[1][0]
                pos = np.broadcast_to(2 * np.arange(12, dtype="<i4"), (heads, 12))
                out[key] = ("I32", (heads, 12), np.ascontiguousarray(pos).tobytes())
                if score_columns is not None:
                    p = key[:-len("history.pos")]
                    s = tensors[p + "prompt.score"][1][0]
                    hs = np.zeros((s, 12), "<f4")
                    hs[:, score_columns] = 100.0
                    out[p + "history.score"] = ("F32", (s, 12), hs.tobytes())
        meta = dict(meta, history_anchors=anchors, prompt_pos0="24")
        path = self.path(name + ".safetensors")
        write_st(path, meta, out)
        return path

    def stats(self):
        out = check_run([self.kvrelayctl, "stats", "--addr", self.addr]).stdout
        return {k: v for k, v in re.findall(r"^(\w+): (\S+)$", out, re.M)}


class RelayCases:
    """The cases, for a unittest.TestCase subclass (see the module docstring)."""

    LANG = None
    USAGE_ERROR = None
    live = None

    @staticmethod
    def example(*args, timeout=60):
        raise NotImplementedError("the driver's RelayTest sets example")

    def assert_same_tensors(self, got, want, what):
        # acc (accumulated importance) is relay-side state: an offline
        # compression writes it, a delivery does not carry it.
        want = {k: v for k, v in want.items() if not k.endswith(".acc")}
        self.assertEqual(sorted(got), sorted(want), f"{what}: tensor names")
        for name, (dtype, shape, data) in want.items():
            g = got[name]
            self.assertEqual((g[0], g[1]), (dtype, shape), f"{what}: {name} dtype/shape")
            if g[2] != data:
                a, b = np.frombuffer(g[2], np.uint8), np.frombuffer(data, np.uint8)
                first = int(np.argmax(a != b)) if len(a) == len(b) else -1
                self.fail(f"{what}: {name}: bytes differ (first at byte {first} of {len(b)})")

    def assert_full_equals_turn(self, msg, turn_path):
        tmeta, t = read_st(turn_path)
        layers = sum(1 for n in t if n.endswith(".prompt.k"))
        self.assertEqual(len(msg), 3 * layers)
        for l in range(layers):
            p = f"layer.{l}."
            hist = [p + "history.k"] if p + "history.k" in t else []
            for kv in ("k", "v"):
                parts = [rows(t[n]) for n in [p + f"history.{kv}"] * len(hist) +
                         [p + f"prompt.{kv}", p + f"gen.{kv}"]]
                want = np.concatenate(parts, axis=1).tobytes()
                self.assertEqual(msg[p + kv][0], t[p + f"prompt.{kv}"][0])
                self.assertTrue(msg[p + kv][2] == want, f"{p}{kv}: differs from the turn's K/V")
            H, n_prompt = t[p + "prompt.k"][1][:2]
            n_gen = t[p + "gen.k"][1][1]
            n_hist = t[p + "history.k"][1][1] if hist else 0
            pos0 = int(tmeta.get("prompt_pos0", n_hist))
            own = np.broadcast_to(pos0 + np.arange(n_prompt + n_gen, dtype=np.int32), (H, n_prompt + n_gen))
            want_pos = own if not hist else np.concatenate(
                [np.frombuffer(t[p + "history.pos"][2], "<i4").reshape(H, n_hist), own], axis=1)
            self.assertTrue(msg[p + "pos"][2] == np.ascontiguousarray(want_pos, "<i4").tobytes(), f"{p}pos")

    def publish_fetch(self, name, policy, turn, msg_id=None, addr=None):
        out = self.live.path(f"msg-{name}.safetensors")
        args = ["--in", turn, "--out", out, "--session", f"s-{name}", "--from", "planner", "--to", "critic"]
        if policy is not None:
            args += ["--policy", policy]
        if msg_id:
            args += ["--id", msg_id]
        p = self.example(*args, addr=addr)
        self.assertEqual(p.returncode, 0, f"{name}: rc={p.returncode}\n{p.stdout}\n{p.stderr}")
        pub = re.search(r"^published message_id=(\S+) duplicate=false ", p.stdout, re.M)
        got = re.search(r"^fetched message_id=(\S+) delivery_attempt=1 .* acked=true ", p.stdout, re.M)
        self.assertTrue(pub and got, p.stdout)
        self.assertEqual(pub.group(1), got.group(1))
        if msg_id:
            self.assertEqual(pub.group(1), msg_id)
        return out, pub.group(1)

    def test_messages_match_offline_compress(self):
        live = self.live
        before = live.stats()
        for i, (name, policy, flags) in enumerate(CASES):
            with self.subTest(case=name):
                turn = live.make_turn(name, **flags)
                out, msg_id = self.publish_fetch(name, policy, turn,
                                                 msg_id=f"{self.LANG}-{i}" if i % 2 else None)
                meta, msg = read_st(out)
                self.assertEqual((meta["message_id"], meta["session"], meta["from"], meta["delivery_attempt"]),
                                 (msg_id, f"s-{name}", "planner", "1"))
                # The file is a well-formed message file for kvrelayctl too.
                check_run([live.kvrelayctl, "inspect", out])
                # The same turn compressed offline, with the canonical policy the relay applied.
                ref = live.path(f"ref-{name}.safetensors")
                check_run([live.kvrelayctl, "compress", "--policy", meta["policy"], "--in", turn,
                           "--out", ref, "--threads", "2"])
                rmeta, rmsg = read_st(ref)
                for key in MESSAGE_KEYS:
                    self.assertEqual(meta.get(key), rmeta.get(key), key)
                self.assert_same_tensors(msg, rmsg, name)
                if policy == "full":
                    self.assertEqual(meta["full_bytes"], meta["sent_bytes"])
                    self.assert_full_equals_turn(msg, turn)
                if policy is None:
                    self.assertTrue(meta["policy"].startswith("h2o-"), meta["policy"])
                held_end = max(int(np.frombuffer(t[2], "<i4").max()) + 1
                               for k, t in msg.items() if k.endswith(".pos"))
                if name == "evicted-tail-no-gen":
                    self.assertGreater(int(meta["next_pos"]), held_end)
                else:
                    self.assertGreaterEqual(int(meta["next_pos"]), held_end)
        # Every message was acked: the relay holds nothing and counted each ack.
        after = live.stats()
        n = len(CASES)
        for key in ("messages_committed", "messages_delivered", "messages_acked"):
            self.assertEqual(int(after[key]) - int(before[key]), n, key)
        self.assertEqual(after["mailbox_messages"], "0")

    def test_unix_socket(self):
        live = self.live
        self.assertTrue(live.unix_addr.startswith("unix:"), live.unix_addr)
        turn = live.make_turn("unix", dtype="BF16", history=4, seed=31)
        before = live.stats()  # over TCP: the same relay
        out, msg_id = self.publish_fetch("unix", "h2o-head:k=8+obf:p=4", turn, addr=live.unix_addr)
        meta, msg = read_st(out)
        self.assertEqual((meta["message_id"], meta["session"], meta["delivery_attempt"]), (msg_id, "s-unix", "1"))
        ref = live.path("ref-unix.safetensors")
        check_run([live.kvrelayctl, "compress", "--policy", meta["policy"], "--in", turn, "--out", ref])
        rmeta, rmsg = read_st(ref)
        for key in MESSAGE_KEYS:
            self.assertEqual(meta.get(key), rmeta.get(key), key)
        self.assert_same_tensors(msg, rmsg, "over unix:PATH")
        after = live.stats()
        for key in ("messages_committed", "messages_delivered", "messages_acked"):
            self.assertEqual(int(after[key]) - int(before[key]), 1, key)

    def compress(self, policy, turn, out):
        """The client's stateless Compress of `turn` with `policy`, written to
        `out`; returns the CompletedProcess, whose output carries next_pos=N
        or the error's CODE: details."""
        raise NotImplementedError("the driver's RelayTest sets compress")

    def test_compress_matches_offline(self):
        for policy, flags in (("h2o-head:k=8+obf:p=4", dict(dtype="BF16", seed=21)),
                              ("h2o-layer:k=8+int4:group=16,rotate=hadamard", dict(dtype="F32", seed=22)),
                              ("h2o-layer:k=2", dict(dtype="BF16", gen=0, seed=18))):
            with self.subTest(policy=policy):
                turn = self.live.make_turn(f"cmp-{flags['seed']}", **flags)
                out, ref = self.live.path(f"cmp-{self.LANG}.safetensors"), self.live.path("cmp-ref.safetensors")
                p = self.compress(policy, turn, out)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                check_run([self.live.kvrelayctl, "compress", "--policy", policy, "--in", turn, "--out", ref])
                meta, msg = read_st(out)
                rmeta, rmsg = read_st(ref)
                for key in MESSAGE_KEYS:
                    self.assertEqual(meta.get(key), rmeta.get(key), key)
                self.assert_same_tensors(msg, rmsg, policy)
                self.assertIn(f"next_pos={rmeta['next_pos']}", p.stdout)
        p = self.compress("h2o-head:k=8+bogus", turn, out)
        self.assertEqual(p.returncode, 1)
        self.assertIn("INVALID_ARGUMENT: header.policy 'h2o-head:k=8+bogus'", p.stdout + p.stderr)

    def offline(self, policy, turn, name):
        """kvrelayctl compress of `turn` with `policy`: (metadata, tensors)."""
        ref = self.live.path(f"ref-{name}.safetensors")
        check_run([self.live.kvrelayctl, "compress", "--policy", policy, "--in", turn, "--out", ref,
                   "--threads", "2"])
        return read_st(ref)

    def test_queries_match_offline_compress(self):
        # Publish (and Compress) of gen.q turns: the relay computes the
        # scores from the queries the client sent as GEN_Q, with the
        # query_dtype and softmax_scale it put in the geometry, exactly as
        # kvrelayctl compress does from the same file.
        live = self.live
        before = live.stats()
        for name, policy, flags, qdtype, scale in QUERY_CASES:
            with self.subTest(case=name):
                turn, source = live.query_turn(name, qdtype, scale, **flags)
                out, msg_id = self.publish_fetch(name, policy, turn)
                meta, msg = read_st(out)
                self.assertEqual((meta["message_id"], meta["session"]), (msg_id, f"s-{name}"))
                rmeta, rmsg = self.offline(meta["policy"], turn, name)
                for key in MESSAGE_KEYS:
                    self.assertEqual(meta.get(key), rmeta.get(key), key)
                self.assert_same_tensors(msg, rmsg, name)
                # The queries (and the scale) chose the tokens: other scores,
                # or the default scale, keep others.
                if "window=" not in policy:
                    _, smsg = self.offline(meta["policy"], source, name + "-scores")
                    self.assertTrue(any(msg[k][2] != smsg[k][2] for k in msg if k.endswith(".pos")),
                                    f"{name}: the same positions as the turn with scores")
                if scale is not None:
                    plain = live.path(f"{name}-no-scale.safetensors")
                    smeta, st = read_st(turn)
                    write_st(plain, {k: v for k, v in smeta.items() if k != "softmax_scale"}, st)
                    _, dmsg = self.offline(meta["policy"], plain, name + "-no-scale")
                    self.assertTrue(any(msg[k][2] != dmsg[k][2] for k in msg if k.endswith(".pos")),
                                    f"{name}: softmax_scale {scale} keeps what 1/sqrt(head_dim) keeps")
                # The stateless Compress sends the same turn.
                cout = live.path(f"cmp-{name}.safetensors")
                p = self.compress(policy, turn, cout)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                cmeta, cmsg = read_st(cout)
                for key in MESSAGE_KEYS:
                    self.assertEqual(cmeta.get(key), rmeta.get(key), key)
                self.assert_same_tensors(cmsg, rmsg, name + " (compress)")
        after = live.stats()
        for key in ("messages_committed", "messages_delivered", "messages_acked"):
            self.assertEqual(int(after[key]) - int(before[key]), len(QUERY_CASES), key)

    def test_bad_query_turn_fails_before_any_call(self):
        # gen.q together with prompt.score, gen.q in a third dtype, a
        # softmax_scale outside [1e-6, 1e3]: the example refuses the
        # file, naming the tensor or the key, and publishes nothing.
        live = self.live
        turn, source = live.query_turn("q-bad", "F32", "0.5", dtype="BF16", layers=2, seed=61)
        meta, tensors = read_st(turn)
        _, scores = read_st(source)
        both = dict(tensors)
        both["layer.0.prompt.score"] = scores["layer.0.prompt.score"]
        f16 = dict(tensors)
        f16["layer.1.gen.q"] = f16["layer.0.gen.q"] = (
            "F16", tensors["layer.0.gen.q"][1], tensors["layer.0.gen.q"][2][:len(tensors["layer.0.gen.q"][2]) // 2])
        mixed = dict(tensors)
        del mixed["layer.1.gen.q"]
        mixed["layer.1.prompt.score"] = scores["layer.1.prompt.score"]
        cases = [
            ("both", meta, both, "layer.0.gen.q: given together with layer.0.prompt.score, "
                                 "expected exactly one of the two"),
            ("f16", meta, f16, "layer.0.gen.q: dtype F16, expected F32 or BF16 (the K/V dtype)"),
            ("mixed", meta, mixed, "layer.1.prompt.score: given, expected layer.1.gen.q like layer.0"),
        ]
        for v in ("-1", "0", "inf", "nan", "abc", "1e300"):
            cases.append((f"scale {v}", dict(meta, softmax_scale=v), tensors,
                          f'metadata softmax_scale: "{v}", expected a finite decimal number in [1e-06, 1000]'))
        before = live.stats()
        for name, m, ts, want in cases:
            with self.subTest(case=name):
                bad = live.path("q-bad-file.safetensors")
                write_st(bad, m, ts)
                out = live.path("q-never.safetensors")
                p = self.example("--in", bad, "--out", out, "--session", "s-q-bad")
                self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
                self.assertIn("kvrelay-example: read turn: ", p.stderr)
                self.assertIn(want, p.stderr)
                self.assertFalse(os.path.exists(out))
        after = live.stats()
        for key in ("messages_committed", "messages_failed"):
            self.assertEqual(after[key], before[key], key)

    def history_sets(self, msg, meta):
        """Per layer, per head: the set of position ids of the message's history part."""
        n, nh = sum(int(meta[k]) for k in ("n_history", "n_anchor", "n_kept", "n_gen")), int(meta["n_history"])
        out = []
        for key in sorted(k for k in msg if k.endswith(".pos")):
            dtype, (heads, _), data = msg[key]
            pos = np.frombuffer(data, "<i4").reshape(heads, n)
            out.append([set(row[:nh].tolist()) for row in pos])
        return out

    def test_attention_error_is_reported(self):
        # A turn with queries: the example prints the relay's fidelity figure
        # and writes it into the message file, equal to kvrelayctl's for the
        # same turn; a turn with scores has none.
        live = self.live
        turn, source = live.query_turn("ae", "F32", None, dtype="BF16", layers=2, seed=71)
        policy = "h2o-head:k=8+obf:p=4"
        for name, path in (("ae-queries", turn), ("ae-scores", source)):
            with self.subTest(turn=name):
                out = live.path(f"msg-{name}.safetensors")
                p = self.example("--in", path, "--out", out, "--session", f"s-{name}", "--policy", policy)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                meta, _ = read_st(out)
                rmeta, _ = self.offline(meta["policy"], path, name)
                printed = re.search(r"^published .* attention_error=(\S+)", p.stdout, re.M)
                if path == turn:
                    self.assertIn("attention_error", rmeta)
                    want = float(rmeta["attention_error"])
                    self.assertGreater(want, 0.0)
                    self.assertTrue(printed, p.stdout)
                    self.assertEqual(float(printed.group(1)), want)
                    self.assertEqual(float(meta["attention_error"]), want)
                else:
                    self.assertNotIn("attention_error", rmeta)
                    self.assertIsNone(printed, p.stdout)
                    self.assertNotIn("attention_error", meta)

    def test_history_anchors_from_the_turn_file(self):
        # The file's history_anchors travel in the geometry: under a history
        # budget every head keeps them, and the message equals kvrelayctl's
        # for the same file. An anchor the history does not hold (5: the
        # history holds even positions) is the relay's INVALID_ARGUMENT.
        live = self.live
        policy = "h2o-head:k=4,hist=2"
        turn = live.history_turn("anchors", "6,14", dtype="BF16", seed=72)
        out, _ = self.publish_fetch("anchors", policy, turn)
        meta, msg = read_st(out)
        self.assertEqual((meta["n_history"], meta["anchor_pos"]), ("4", "6,14"))
        for l, heads in enumerate(self.history_sets(msg, meta)):
            for h, held in enumerate(heads):
                self.assertLessEqual({6, 14}, held, f"layer.{l} head {h}")
        rmeta, rmsg = self.offline(meta["policy"], turn, "anchors")
        for key in MESSAGE_KEYS:
            self.assertEqual(meta.get(key), rmeta.get(key), key)
        self.assert_same_tensors(msg, rmsg, "anchors")
        bad = live.history_turn("anchors-bad", "0,5", dtype="BF16", seed=72)
        before = live.stats()
        p = self.example("--in", bad, "--out", live.path("anchors-never.safetensors"), "--session", "s-anchors-bad",
                         "--policy", policy)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertRegex(p.stderr, r"kvrelay-example: publish: INVALID_ARGUMENT: .*history_anchors.*\b5\b")
        self.assertEqual(live.stats()["messages_committed"], before["messages_committed"])

    def test_history_score_from_the_turn_file(self):
        # NEEDS a relay that accepts PART_HISTORY_SCORE. The file's
        # history.score (mass on history tokens 9 and 11: positions 18, 22)
        # travels after prompt.score: hist=2 keeps those two besides the
        # anchors, as kvrelayctl does from the same file.
        live = self.live
        policy = "h2o-head:k=4,hist=2"
        turn = live.history_turn("hscore", "0,4", score_columns=[9, 11], dtype="F16", seed=73)
        out, _ = self.publish_fetch("hscore", policy, turn)
        meta, msg = read_st(out)
        self.assertEqual((meta["n_history"], meta["anchor_pos"]), ("4", "0,4"))
        for l, heads in enumerate(self.history_sets(msg, meta)):
            for h, held in enumerate(heads):
                self.assertEqual(held, {0, 4, 18, 22}, f"layer.{l} head {h}")
        rmeta, rmsg = self.offline(meta["policy"], turn, "hscore")
        for key in MESSAGE_KEYS:
            self.assertEqual(meta.get(key), rmeta.get(key), key)
        self.assert_same_tensors(msg, rmsg, "hscore")

    def test_parent_from_the_command_line(self):
        # --parent: the recipient continues the relayed cache. Its turn file
        # has no history but history.score over the parent's tokens (all
        # its mass on a generated token, whose acc is 0 so far): the relay
        # composes the turn on the message it holds, and hist=2 keeps that
        # token in every head, as kvrelayctl compress --parent does offline
        # on the same chain.
        live = self.live
        policy = "h2o-head:k=4,hist=2"
        first = live.make_turn("par-1", layers=2, prompt=16, gen=4, dtype="BF16", seed=74)
        parent_out, parent_id = self.publish_fetch("par", policy, first)
        pmeta, pmsg = read_st(parent_out)
        ref_parent = live.path("ref-par.safetensors")
        check_run([live.kvrelayctl, "compress", "--policy", pmeta["policy"], "--in", first, "--out", ref_parent])
        source = live.make_turn("par-2-source", layers=2, prompt=8, gen=2, dtype="BF16", seed=75,
                                first_agent="false")
        meta, tensors = read_st(source)
        out, want = {}, []
        for key, t in tensors.items():
            out[key] = t
            if key.endswith(".prompt.score"):
                p = key[:-len("prompt.score")]
                heads, n = pmsg[p + "pos"][1]
                column = n - 2
                hs = np.zeros((t[1][0], n), "<f4")
                hs[:, column] = 100.0
                out[p + "history.score"] = ("F32", (t[1][0], n), hs.tobytes())
                pos = np.frombuffer(pmsg[p + "pos"][2], "<i4").reshape(heads, n)
                want.append([int(pos[h, column]) for h in range(heads)])
        child = live.path("par-2.safetensors")
        write_st(child, meta, out)
        got = live.path("msg-par-2.safetensors")
        p = self.example("--in", child, "--out", got, "--session", "s-par", "--from", "critic", "--to", "judge",
                         "--policy", policy, "--parent", parent_id)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        cmeta, cmsg = read_st(got)
        self.assertEqual(cmeta["parent_id"], parent_id)
        for l, heads in enumerate(self.history_sets(cmsg, cmeta)):
            for h, held in enumerate(heads):
                self.assertIn(want[l][h], held, f"layer.{l} head {h}")
        ref = live.path("ref-par-2.safetensors")
        check_run([live.kvrelayctl, "compress", "--policy", cmeta["policy"], "--parent", ref_parent,
                   "--in", child, "--out", ref])
        rmeta, rmsg = read_st(ref)
        for key in MESSAGE_KEYS:
            self.assertEqual(cmeta.get(key), rmeta.get(key), key)
        self.assert_same_tensors(cmsg, rmsg, "par-2")
        # A parent the session does not hold, or one the sender may not see
        # (neither its sender nor a recipient), is the relay's NOT_FOUND with
        # the same words for both; nothing is committed.
        before = live.stats()
        for name, parent, sender in (("par-none", "m-nosuch", "critic"), ("par-other", parent_id, "judge")):
            p = self.example("--in", child, "--out", live.path(f"{name}.safetensors"), "--session", "s-par",
                             "--from", sender, "--to", "critic", "--policy", policy, "--parent", parent)
            self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
            self.assertRegex(p.stderr, rf"kvrelay-example: publish: NOT_FOUND: header\.parent_id: no message "
                                       rf"'{parent}' visible to agent \"{sender}\" in session 's-par'")
        self.assertEqual(live.stats()["messages_committed"], before["messages_committed"])

    def test_bad_policy_is_invalid_argument(self):
        live = self.live
        turn = live.make_turn("bad-policy", seed=21)
        before = live.stats()
        p = self.example("--in", turn, "--out", live.path("never.safetensors"), "--session", "s-bad",
                         "--policy", "h2o-head:k=8+bogus")
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertRegex(p.stderr, r"kvrelay-example: publish: INVALID_ARGUMENT: header\.policy .*'bogus'")
        self.assertNotIn("published", p.stdout)
        self.assertFalse(os.path.exists(live.path("never.safetensors")))
        after = live.stats()
        self.assertEqual(after["messages_committed"], before["messages_committed"])
        self.assertEqual(int(after["messages_failed"]), int(before["messages_failed"]) + 1)

    def test_malformed_turn_file_fails_before_any_call(self):
        live = self.live
        good = live.make_turn("malformed", layers=2, seed=22)
        with open(good, "rb") as f:
            buf = f.read()
        (n,) = struct.unpack("<Q", buf[:8])
        header = json.loads(buf[8:8 + n])
        del header["layer.1.gen.v"]
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        bad = live.path("malformed-bad.safetensors")
        with open(bad, "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h + buf[8 + n:])
        p = self.example("--in", bad, "--out", live.path("never2.safetensors"))
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn("read turn: ", p.stderr)
        self.assertIn("layer.1.gen.v: missing", p.stderr)

    def test_usage_error(self):
        p = self.example("--in", "x.safetensors")
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn(self.USAGE_ERROR, p.stderr)


# ---- TLS and tokens ----------------------------------------------------------------

class TlsLive(Live):
    """A kvrelay-server serving TLS on 127.0.0.1:0 (addr) with the
    certificate `server_cert` for localhost and 127.0.0.1, signed by `ca`;
    client certificates signed by `ca` are verified (`client_cert`, for
    planner); `other_ca` signed nothing the relay has. --tokens-file holds
    planner's and critic's tokens (tokens[agent], in token_files[agent]); a
    plaintext local listener at unix_addr requires them too (--local-auth
    token)."""

    AGENTS = ("planner", "critic")

    def __init__(self, server, kvrelayctl, prefix):
        self.kvrelayctl = kvrelayctl
        self.tmp = tempfile.mkdtemp(prefix=prefix)
        try:
            pki = TestPki(self.path("pki"))
            self.ca = pki.ca("kvrelay-test-ca")
            self.server_cert = pki.issue(self.ca, "relay", dns=["localhost"], ips=["127.0.0.1"])
            self.client_cert = pki.issue(self.ca, "planner-client", dns=["planner.test"])
            self.other_ca = pki.ca("other-ca")
            self.tokens, self.token_files = {}, {}
            with open(self.path("tokens"), "w") as f:
                f.write("# agent sha256:hex\n")
                for agent in self.AGENTS:
                    token = secrets.token_urlsafe(24)
                    self.tokens[agent] = token
                    f.write(f"{agent} sha256:{hashlib.sha256(token.encode()).hexdigest()}\n")
                    self.token_files[agent] = self.path(f"{agent}.token")
                    with open(self.token_files[agent], "w") as t:
                        t.write(token + "\n")
            sock = self.path("local.sock")
            self.server = Server(server, args=[
                "--listen", "127.0.0.1:0", "--tls-cert", self.server_cert.cert, "--tls-key", self.server_cert.key,
                "--tls-client-ca", self.ca.cert, "--tokens-file", self.path("tokens"),
                "--local-listen", f"unix:{sock}", "--local-auth", "token",
                "--metrics-listen", "127.0.0.1:0"], timeout=20)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.addr = next(a for a in self.server.addrs if not a.startswith("unix:"))
        self.unix_addr = next(a for a in self.server.addrs if a.startswith("unix:"))

    def metric(self, name, **labels):
        """The sum of the samples of `name` whose labels include `labels` (0 when none)."""
        with urllib.request.urlopen(f"http://{self.server.metrics}/metrics", timeout=10) as r:
            samples = parse_exposition(r.read().decode())
        want = set(labels.items())
        return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)

    def counts(self):
        return {o: self.metric("kvrelay_messages_total", outcome=o) for o in ("committed", "delivered", "acked")}

    def auth_failures(self, reason):
        return self.metric("kvrelay_auth_failures_total", reason=reason)


class TlsCases:
    """The TLS and token cases, for a unittest.TestCase subclass (see the
    module docstring)."""

    LANG = None
    BINARIES = None  # (kvrelay-server, kvrelayctl), set by the driver
    POLICY = "h2o-head:k=8+obf:p=4"
    tls = None

    @staticmethod
    def example(*args, timeout=60, addr=None, env=None):
        raise NotImplementedError("the driver's TlsTest sets example")

    @classmethod
    def setUpClass(cls):
        cls.tls = TlsLive(*cls.BINARIES, prefix=f"kvrelay-{cls.LANG}-tls-")
        cls.turn = cls.tls.make_turn("tls", dtype="BF16", seed=41)

    @classmethod
    def tearDownClass(cls):
        if cls.tls:
            cls.tls.close()

    def exchange(self, name, *flags, sender="planner", to="planner", addr=None, env=None):
        """Runs the example: publish self.turn as `sender` to `to`, fetch as
        `to`, ack; (CompletedProcess, out path)."""
        out = self.tls.path(f"msg-{name}.safetensors")
        p = self.example("--in", self.turn, "--out", out, "--session", f"s-{self.LANG}-{name}", "--from", sender,
                         "--to", to, "--policy", self.POLICY, *flags, addr=addr or self.tls.addr, env=env or {})
        for token in self.tls.tokens.values():
            self.assertNotIn(token, p.stdout + p.stderr, f"{name}: the example printed a token")
        return p, out

    def assert_delivered(self, name, *flags, addr=None, env=None):
        before = self.tls.counts()
        p, out = self.exchange(name, *flags, addr=addr, env=env)
        self.assertEqual(p.returncode, 0, f"{name}: rc={p.returncode}\n{p.stdout}\n{p.stderr}")
        pub = re.search(r"^published message_id=(\S+) duplicate=false ", p.stdout, re.M)
        got = re.search(r"^fetched message_id=(\S+) delivery_attempt=1 .* acked=true ", p.stdout, re.M)
        self.assertTrue(pub and got, p.stdout)
        self.assertEqual(pub.group(1), got.group(1))
        meta, msg = read_st(out)
        self.assertEqual((meta["message_id"], meta["session"], meta["from"]),
                         (pub.group(1), f"s-{self.LANG}-{name}", "planner"))
        self.assertEqual(len(msg), 3 * 4, sorted(msg))  # k, v, pos of make-turn's 4 layers
        after = self.tls.counts()
        self.assertEqual({k: after[k] - before[k] for k in after}, {"committed": 1, "delivered": 1, "acked": 1})

    def assert_refused(self, name, step, code, *flags, sender="planner", to="planner", addr=None, env=None,
                       reason=None):
        """The example fails `step` with `code` (exit 1), commits nothing more
        than what steps before it did, and the relay counts `reason`; the
        stderr line."""
        before = self.tls.counts()
        failures = self.tls.auth_failures(reason) if reason else None
        p, out = self.exchange(name, *flags, sender=sender, to=to, addr=addr, env=env)
        self.assertEqual(p.returncode, 1, f"{name}: rc={p.returncode}\n{p.stdout}\n{p.stderr}")
        m = re.search(rf"^kvrelay-example: {step}: {code}: .*$", p.stderr, re.M)
        self.assertTrue(m, f"{name}: want '{step}: {code}: ...' in stderr:\n{p.stderr}")
        self.assertFalse(os.path.exists(out), f"{name}: wrote a message")
        after = self.tls.counts()
        published = step != "publish"
        self.assertEqual(after["committed"] - before["committed"], 1 if published else 0, name)
        self.assertEqual(after["acked"], before["acked"], name)
        if reason:
            self.assertGreaterEqual(self.tls.auth_failures(reason), failures + 1, f"{name}: {reason} not counted")
        return m.group(0)

    def test_tls_with_token_file(self):
        self.assert_delivered("token-file", "--tls-ca", self.tls.ca.cert,
                              "--token-file", self.tls.token_files["planner"])

    def test_tls_with_token_from_environment(self):
        self.assert_delivered("token-env", "--tls-ca", self.tls.ca.cert,
                              env={"KVRELAY_TOKEN": self.tls.tokens["planner"]})

    def test_tls_with_client_certificate_and_token(self):
        self.assert_delivered("client-cert", "--tls-ca", self.tls.ca.cert, "--tls-cert", self.tls.client_cert.cert,
                              "--tls-key", self.tls.client_cert.key, "--token-file", self.tls.token_files["planner"])

    def test_token_over_plaintext_local_listener(self):
        self.assert_delivered("unix-token", "--token-file", self.tls.token_files["planner"], addr=self.tls.unix_addr)
        self.assert_refused("unix-no-token", "publish", "UNAUTHENTICATED", addr=self.tls.unix_addr,
                            reason="missing_credentials")

    def test_no_token_is_unauthenticated(self):
        self.assert_refused("no-token", "publish", "UNAUTHENTICATED", "--tls-ca", self.tls.ca.cert,
                            reason="missing_credentials")

    def test_wrong_token_is_unauthenticated(self):
        wrong = secrets.token_urlsafe(24)
        path = self.tls.path("wrong.token")
        with open(path, "w") as f:
            f.write(wrong + "\n")
        line = self.assert_refused("wrong-token", "publish", "UNAUTHENTICATED", "--tls-ca", self.tls.ca.cert,
                                   "--token-file", path, reason="bad_token")
        self.assertNotIn(wrong, line)
        log = self.tls.server.log()
        for token in [wrong, *self.tls.tokens.values()]:
            self.assertNotIn(token, log, "the relay logged a token")

    def test_untrusted_ca_is_unavailable(self):
        self.assert_refused("other-ca", "publish", "UNAVAILABLE", "--tls-ca", self.tls.other_ca.cert,
                            "--token-file", self.tls.token_files["planner"])

    def test_plaintext_client_on_tls_port_is_unavailable(self):
        self.assert_refused("plaintext", "publish", "UNAVAILABLE", "--token-file", self.tls.token_files["planner"])

    def test_publishing_as_another_agent_is_permission_denied(self):
        line = self.assert_refused("as-critic", "publish", "PERMISSION_DENIED", "--tls-ca", self.tls.ca.cert,
                                   "--token-file", self.tls.token_files["planner"], sender="critic",
                                   reason="forbidden")
        self.assertIn('PERMISSION_DENIED: header.sender: caller is agent "planner", not "critic"', line)
        # critic's token, publishing as planner (the default --from).
        line = self.assert_refused("critic-token", "publish", "PERMISSION_DENIED", "--tls-ca", self.tls.ca.cert,
                                   "--token-file", self.tls.token_files["critic"], reason="forbidden")
        self.assertIn('PERMISSION_DENIED: header.sender: caller is agent "critic", not "planner"', line)

    def test_fetching_another_agents_mailbox_is_permission_denied(self):
        # planner may publish to critic, but not fetch critic's mailbox.
        line = self.assert_refused("fetch-critic", "fetch", "PERMISSION_DENIED", "--tls-ca", self.tls.ca.cert,
                                   "--token-file", self.tls.token_files["planner"], to="critic", reason="forbidden")
        self.assertRegex(line, r'PERMISSION_DENIED: agent: .*"planner".*"critic"')
