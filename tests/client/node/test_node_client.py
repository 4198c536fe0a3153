#!/usr/bin/python3
"""The Node.js client (client/node) against a real kvrelay-server.

    /usr/bin/python3 test_node_client.py --server BIN --kvrelayctl BIN \
        --node BIN --npm BIN --source-dir REPO --work-dir DIR

Installs the client's npm dependencies with `npm ci` (package.json and
package-lock.json copied into DIR/npm, so the source tree stays clean; the
client finds them through NODE_PATH), runs the offline unit tests
(unit.test.js, node:test), then starts kvrelay-server on 127.0.0.1:0 and a Unix socket,
runs the live tests against it (live.test.js with KVRELAY_LIVE_ADDR:
attentionError, historyAnchors, historyScore over an uploaded history and
over a parent) and drives client/node/example.js: publish a turn made by `kvrelayctl
make-turn`, fetch the message, write it, ack. Checks: the fetched message
equals `kvrelayctl compress` of the same turn bit for bit (every tensor's
dtype, shape and bytes, and the accounting metadata) for dense, quantized
and default policies, multi-chunk F32 tensors, F16/BF16, GQA and uploaded
history, and for turns carrying gen.q (queries) instead of scores, through
publish and compress; with `full` it equals the input K/V (and positions); the message
was acked (the relay holds nothing, stats count every ack); a bad policy
fails with INVALID_ARGUMENT naming header.policy and commits nothing; a
malformed turn file fails before any call, naming the tensor; a publish and
a fetch over the relay's Unix socket (--addr unix:PATH) work; and against a TLS relay with a tokens file
(lang_cases.TlsCases): publish, fetch and ack over TLS with a token, with a
client certificate, and with the token over a plaintext Unix socket;
UNAUTHENTICATED for no or a wrong token, UNAVAILABLE for an untrusted CA or
plaintext on the TLS port, PERMISSION_DENIED for another agent's sender or
mailbox. A missing
node or npm fails the test. The whole run is bounded by a watchdog and the
server is always stopped. The live-relay cases are shared with the Go test:
tests/client/lang_cases.py; the server helpers are
tests/testlib/kvrelay_testlib.py.
"""
import argparse
import os
import shutil
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "testlib"))
import lang_cases  # noqa: E402
from kvrelay_testlib import check_run, completed, unittest_main  # noqa: E402

ARGS = None
LIVE = None
NODE_ENV = None
WATCHDOG_S = 540


# ---- the client under test -------------------------------------------------------

def example(*args, timeout=60, addr=None, env=None):
    """Runs client/node/example.js with args against addr (default
    LIVE.addr); returns the CompletedProcess. env: None, NODE_ENV; a dict,
    NODE_ENV without its KVRELAY_* variables but these."""
    script = os.path.join(ARGS.source_dir, "client", "node", "example.js")
    proto = os.path.join(ARGS.source_dir, "proto", "kvrelay", "v1", "relay.proto")
    run_env = NODE_ENV
    if env is not None:
        run_env = {k: v for k, v in NODE_ENV.items() if not k.startswith("KVRELAY_")}
        run_env.update(env)
    return completed([ARGS.node, script, "--addr", addr or LIVE.addr, "--proto", proto, *args], timeout=timeout,
                     env=run_env)


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
    global LIVE, NODE_ENV
    NODE_ENV = install_dependencies()
    LIVE = lang_cases.Live(ARGS.server, ARGS.kvrelayctl, prefix="kvrelay-node-")
    RelayTest.live = LIVE
    TlsTest.BINARIES = (ARGS.server, ARGS.kvrelayctl)


def tearDownModule():
    if LIVE:
        LIVE.close()


# ---- tests -------------------------------------------------------------------------

class UnitTest(unittest.TestCase):
    def test_node_unit_tests(self):
        unit = os.path.join(HERE, "unit.test.js")
        p = completed([ARGS.node, "--test", unit], env=NODE_ENV)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertRegex(p.stdout, r"# pass [1-9]")
        self.assertIn("# fail 0", p.stdout)


class LiveApiTest(unittest.TestCase):
    """The client's live tests (live.test.js) against the relay: node --test
    with KVRELAY_LIVE_ADDR, one test each (by name pattern)."""

    def node_test(self, pattern):
        script = os.path.join(HERE, "live.test.js")
        env = dict(NODE_ENV, KVRELAY_LIVE_ADDR=LIVE.addr)
        p = completed([ARGS.node, "--test", f"--test-name-pattern={pattern}", script], env=env)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        # The one matching test passed (the others are reported skipped by name).
        self.assertIn("# pass 1\n", p.stdout)
        self.assertIn("# fail 0", p.stdout)
        self.assertNotIn("KVRELAY_LIVE_ADDR not set", p.stdout)

    def test_attention_error(self):
        self.node_test("^live attentionError")

    def test_history_anchors(self):
        self.node_test("^live historyAnchors")

    def test_history_score_uploaded(self):
        # Needs a relay that accepts PART_HISTORY_SCORE.
        self.node_test("^live historyScore, uploaded")

    def test_history_score_with_parent(self):
        # Needs a relay that accepts PART_HISTORY_SCORE.
        self.node_test("^live historyScore with a parent")


class RelayTest(lang_cases.RelayCases, unittest.TestCase):
    """The cases of tests/client/lang_cases.py, through client/node/example.js."""
    LANG, USAGE_ERROR, example = "node", "missing required flag --out", staticmethod(example)

    # RelayClient.compress for lang_cases' test_compress_matches_offline.
    COMPRESS_JS = """
const path = require('node:path');
const dir = process.env.KVRELAY_NODE_CLIENT_DIR;
const { RelayClient, statusName } = require(path.join(dir, 'client.js'));
const { readTurnFile, writeMessageFile } = require(path.join(dir, 'safetensors.js'));
const [addr, proto, policy, input, output] = process.argv.slice(2);
(async () => {
  const relay = new RelayClient(addr, { protoPath: proto });
  try {
    const m = await relay.compress(await readTurnFile(input), policy, { timeoutMs: 60000 });
    await writeMessageFile(output, m);
    console.log(`next_pos=${m.nextPos}`);
  } catch (err) {
    console.log(`error ${statusName(err)}: ${err.details}`);
    process.exitCode = 1;
  } finally {
    relay.close();
  }
})();
"""

    def compress(self, policy, turn, out):  # lang_cases.RelayCases.compress
        script = self.live.path("compress.js")
        with open(script, "w") as f:
            f.write(self.COMPRESS_JS)
        proto = os.path.join(ARGS.source_dir, "proto", "kvrelay", "v1", "relay.proto")
        return completed([ARGS.node, script, LIVE.addr, proto, policy, turn, out], timeout=60, env=NODE_ENV)


class TlsTest(lang_cases.TlsCases, unittest.TestCase):
    """The TLS and token cases of tests/client/lang_cases.py, through
    example.js's --tls-ca, --tls-cert, --tls-key and --token-file."""
    LANG, example = "node", staticmethod(example)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    for flag in ("--server", "--kvrelayctl", "--node", "--npm", "--source-dir", "--work-dir"):
        ap.add_argument(flag, required=True)
    ARGS, rest = ap.parse_known_args()
    sys.exit(unittest_main(rest, WATCHDOG_S))


if __name__ == "__main__":
    main()
