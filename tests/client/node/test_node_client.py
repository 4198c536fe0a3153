#!/usr/bin/python3
"""The Node.js client (client/node) against a real kvrelay-server.

    /usr/bin/python3 test_node_client.py --server BIN --kvrelayctl BIN \
        --node BIN --npm BIN --source-dir REPO --work-dir DIR

Installs the client's npm dependencies with `npm ci` (package.json and
package-lock.json copied into DIR/npm, so the source tree stays clean; the
client finds them through NODE_PATH), runs the offline unit tests
(unit.test.js, node:test), then starts kvrelay-server on 127.0.0.1:0 and
drives client/node/example.js: publish a turn made by `kvrelayctl
make-turn`, fetch the message, write it, ack. Checks: the fetched message
equals `kvrelayctl compress` of the same turn bit for bit (every tensor's
dtype, shape and bytes, and the accounting metadata) for dense, quantized
and default policies, multi-chunk F32 tensors, F16/BF16, GQA and uploaded
history; with `full` it equals the input K/V (and positions); the message
was acked (the relay holds nothing, stats count every ack); a bad policy
fails with INVALID_ARGUMENT naming header.policy and commits nothing; a
malformed turn file fails before any call, naming the tensor. A missing
node or npm fails the test. The whole run is bounded by a watchdog and the
server is always stopped.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import numpy as np

ARGS = None
SERVER = None
ADDR = None
TMP = None
NODE_ENV = None
WATCHDOG_S = 540
DTYPE_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "U8": 1}


# ---- helpers -------------------------------------------------------------------

def run(cmd, timeout=120, env=None, cwd=None):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def check_run(cmd, timeout=120, env=None, cwd=None):
    p = run(cmd, timeout=timeout, env=env, cwd=cwd)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}: rc={p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}")
    return p


def start_server(binary):
    proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = {}
    ready = threading.Event()

    def drain():
        for line in proc.stdout:
            m = re.match(r"kvrelay-server ready grpc=(\S+) metrics=(\S+)", line)
            if m and not ready.is_set():
                found["addr"] = m.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(20) or "addr" not in found:
        stop_server(proc)
        raise RuntimeError("kvrelay-server printed no ready line within 20 s")
    return proc, found["addr"]


def stop_server(proc):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def read_st(path):
    """(metadata, {name: (dtype, shape, bytes)}) of a safetensors file."""
    import json
    import struct
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, t in header.items():
        b, e = t["data_offsets"]
        out[name] = (t["dtype"], tuple(t["shape"]), buf[8 + n + b:8 + n + e])
    return meta, out


def rows(t):
    """A [H, n, ...] tensor as uint8 [H, n, row_bytes], for concatenating along tokens."""
    dtype, shape, data = t
    return np.frombuffer(data, np.uint8).reshape(shape[0], shape[1], -1)


def make_turn(name, **flags):
    path = os.path.join(TMP, name + ".safetensors")
    cmd = [ARGS.kvrelayctl, "make-turn", "--out", path]
    for k, v in flags.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    check_run(cmd)
    return path


def stats():
    out = check_run([ARGS.kvrelayctl, "stats", "--addr", ADDR]).stdout
    return {k: v for k, v in re.findall(r"^(\w+): (\S+)$", out, re.M)}


# ---- the client under test -------------------------------------------------------

def example(*args, timeout=60):
    """Runs client/node/example.js with args; returns the CompletedProcess."""
    script = os.path.join(ARGS.source_dir, "client", "node", "example.js")
    proto = os.path.join(ARGS.source_dir, "proto", "kvrelay", "v1", "relay.proto")
    return run([ARGS.node, script, "--addr", ADDR, "--proto", proto, *args], timeout=timeout, env=NODE_ENV)


def install_dependencies():
    """npm ci into WORK/npm; returns the environment that finds the packages."""
    for tool, path in (("node", ARGS.node), ("npm", ARGS.npm)):
        if not path or not os.access(path, os.X_OK):
            raise RuntimeError(f"{tool}: not found ({path!r}); install Node.js and npm "
                               "(scripts/install_deps.sh)")
    deps = os.path.join(ARGS.work_dir, "npm")
    os.makedirs(deps, exist_ok=True)
    for f in ("package.json", "package-lock.json"):
        shutil.copyfile(os.path.join(ARGS.source_dir, "client", "node", f), os.path.join(deps, f))
    t = time.monotonic()
    check_run([ARGS.npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--prefer-offline"],
              timeout=300, cwd=deps)
    print(f"npm ci: {time.monotonic() - t:.1f} s", flush=True)
    env = dict(os.environ)
    env["NODE_PATH"] = os.path.join(deps, "node_modules")
    env["KVRELAY_NODE_CLIENT_DIR"] = os.path.join(ARGS.source_dir, "client", "node")
    return env


def setUpModule():
    global SERVER, ADDR, TMP, NODE_ENV
    NODE_ENV = install_dependencies()
    TMP = tempfile.mkdtemp(prefix="kvrelay-node-")
    SERVER, ADDR = start_server(ARGS.server)


def tearDownModule():
    stop_server(SERVER)
    if TMP:
        shutil.rmtree(TMP, ignore_errors=True)


# ---- tests -------------------------------------------------------------------------

class UnitTest(unittest.TestCase):
    def test_node_unit_tests(self):
        unit = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit.test.js")
        p = run([ARGS.node, "--test", unit], env=NODE_ENV)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertRegex(p.stdout, r"# pass [1-9]")
        self.assertIn("# fail 0", p.stdout)


MESSAGE_KEYS = ("format", "policy", "dtype", "n_history", "n_anchor", "n_kept", "n_gen",
                "full_bytes", "sent_bytes", "quant_bits", "quant_group", "quant_rotate")

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
]


class RelayTest(unittest.TestCase):
    def assert_same_tensors(self, got, want, what):
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

    def publish_fetch(self, name, policy, turn, msg_id=None):
        out = os.path.join(TMP, f"msg-{name}.safetensors")
        args = ["--in", turn, "--out", out, "--session", f"s-{name}", "--from", "planner", "--to", "critic"]
        if policy is not None:
            args += ["--policy", policy]
        if msg_id:
            args += ["--id", msg_id]
        p = example(*args)
        self.assertEqual(p.returncode, 0, f"{name}: rc={p.returncode}\n{p.stdout}\n{p.stderr}")
        pub = re.search(r"^published message_id=(\S+) duplicate=false ", p.stdout, re.M)
        got = re.search(r"^fetched message_id=(\S+) delivery_attempt=1 .* acked=true ", p.stdout, re.M)
        self.assertTrue(pub and got, p.stdout)
        self.assertEqual(pub.group(1), got.group(1))
        if msg_id:
            self.assertEqual(pub.group(1), msg_id)
        return out, pub.group(1)

    def test_messages_match_offline_compress(self):
        before = stats()
        for i, (name, policy, flags) in enumerate(CASES):
            with self.subTest(case=name):
                turn = make_turn(name, **flags)
                out, msg_id = self.publish_fetch(name, policy, turn, msg_id=f"node-{i}" if i % 2 else None)
                meta, msg = read_st(out)
                self.assertEqual((meta["message_id"], meta["session"], meta["from"], meta["delivery_attempt"]),
                                 (msg_id, f"s-{name}", "planner", "1"))
                # The file is a well-formed message file for kvrelayctl too.
                check_run([ARGS.kvrelayctl, "inspect", out])
                # The same turn compressed offline, with the canonical policy the relay applied.
                ref = os.path.join(TMP, f"ref-{name}.safetensors")
                check_run([ARGS.kvrelayctl, "compress", "--policy", meta["policy"], "--in", turn,
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
        # Every message was acked: the relay holds nothing and counted each ack.
        after = stats()
        n = len(CASES)
        for key in ("messages_committed", "messages_delivered", "messages_acked"):
            self.assertEqual(int(after[key]) - int(before[key]), n, key)
        self.assertEqual(after["mailbox_messages"], "0")

    def test_bad_policy_is_invalid_argument(self):
        turn = make_turn("bad-policy", seed=21)
        before = stats()
        p = example("--in", turn, "--out", os.path.join(TMP, "never.safetensors"), "--session", "s-bad",
                    "--policy", "h2o-head:k=8+bogus")
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertRegex(p.stderr, r"kvrelay-example: publish: INVALID_ARGUMENT: header\.policy .*'bogus'")
        self.assertNotIn("published", p.stdout)
        self.assertFalse(os.path.exists(os.path.join(TMP, "never.safetensors")))
        after = stats()
        self.assertEqual(after["messages_committed"], before["messages_committed"])
        self.assertEqual(int(after["messages_failed"]), int(before["messages_failed"]) + 1)

    def test_malformed_turn_file_fails_before_any_call(self):
        import json
        import struct
        good = make_turn("malformed", layers=2, seed=22)
        with open(good, "rb") as f:
            buf = f.read()
        (n,) = struct.unpack("<Q", buf[:8])
        header = json.loads(buf[8:8 + n])
        del header["layer.1.gen.v"]
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        bad = os.path.join(TMP, "malformed-bad.safetensors")
        with open(bad, "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h + buf[8 + n:])
        p = example("--in", bad, "--out", os.path.join(TMP, "never2.safetensors"))
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn("read turn: ", p.stderr)
        self.assertIn("layer.1.gen.v: missing", p.stderr)

    def test_usage_error(self):
        p = example("--in", "x.safetensors")
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("missing required flag --out", p.stderr)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    for flag in ("--server", "--kvrelayctl", "--node", "--npm", "--source-dir", "--work-dir"):
        ap.add_argument(flag, required=True)
    ARGS, rest = ap.parse_known_args()

    def expire():
        print(f"FAIL: watchdog: the test ran past {WATCHDOG_S} s", file=sys.stderr, flush=True)
        try:
            if SERVER is not None:
                SERVER.kill()
        finally:
            os._exit(1)

    dog = threading.Timer(WATCHDOG_S, expire)
    dog.daemon = True
    dog.start()
    try:
        prog = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
    finally:
        dog.cancel()
        stop_server(SERVER)
    sys.exit(0 if prog.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
