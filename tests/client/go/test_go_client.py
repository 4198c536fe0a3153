#!/usr/bin/python3
"""The Go client (client/go) against a real kvrelay-server.

    /usr/bin/python3 test_go_client.py --server BIN --kvrelayctl BIN --go BIN \
        --protoc BIN --protoc-gen-go BIN --protoc-gen-go-grpc BIN \
        --source-dir REPO --work-dir DIR

Builds offline against Debian's Go packages (golang-go 1.19,
golang-google-grpc-dev, golang-google-protobuf-dev; the module proxy is not
reachable): generates the stubs of proto/kvrelay/v1/relay.proto into
DIR/gopath/src/kvrelay/v1 with protoc-gen-go and protoc-gen-go-grpc, links
client/go in as DIR/gopath/src/kvrelay/client/go, and builds in GOPATH mode
(GO111MODULE=off, GOPATH=DIR/gopath:/usr/share/gocode, GOPROXY=off). Checks
gofmt, go vet and the package's unit tests (go test), then starts
kvrelay-server on 127.0.0.1:0 and a Unix socket, runs the package's live
tests against it (kvrelay/live_test.go, TestLive*, with KVRELAY_LIVE_ADDR:
attention_error, history_anchors, history.score over an uploaded history
and over a parent) and drives cmd/kvrelay-example: publish a turn
made by `kvrelayctl make-turn`, fetch the message, write it, ack. Checks: the
fetched message equals `kvrelayctl compress` of the same turn bit for bit
(every tensor's dtype, shape and bytes, and the accounting metadata) for
dense, quantized and default policies, multi-chunk F32 tensors, F16/BF16,
GQA and uploaded history, and for turns carrying gen.q (queries) instead of
scores, through publish and -compress; with `full` it equals the input K/V (and
positions); the message was acked (the relay holds nothing, stats count
every ack); a bad policy fails with INVALID_ARGUMENT naming header.policy
and commits nothing; a malformed turn file fails before any call, naming the
tensor; a publish and a fetch over the relay's Unix socket (--addr
unix:PATH) work; and against a TLS relay with a tokens file (lang_cases.TlsCases):
publish, fetch and ack over TLS with a token, with a client certificate,
and with the token over a plaintext Unix socket; UNAUTHENTICATED for no or
a wrong token, UNAVAILABLE for an untrusted CA or plaintext on the TLS port,
PERMISSION_DENIED for another agent's sender or mailbox. A missing go, protoc or plugin fails the test. The whole run is
bounded by a watchdog and the server is always stopped. The live-relay cases
are shared with the Node.js test: tests/client/lang_cases.py; the server
helpers are tests/testlib/kvrelay_testlib.py.
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
from kvrelay_testlib import check_run, clean_env, completed, unittest_main  # noqa: E402

ARGS = None
LIVE = None
GO_ENV = None
EXAMPLE = None
GOCODE = "/usr/share/gocode"
WATCHDOG_S = 540


# ---- the client under test -------------------------------------------------------

def example(*args, timeout=60, addr=None, env=None):
    """Runs kvrelay-example with args against addr (default LIVE.addr);
    returns the CompletedProcess. env: None, this environment; a dict, the
    KVRELAY_* variables to run with (no others)."""
    return completed([EXAMPLE, "--addr", addr or LIVE.addr, *args], timeout=timeout,
                     env=None if env is None else clean_env(**env))


def build():
    """Generates the stubs and builds kvrelay-example in GOPATH mode; returns
    (environment for go, path of the binary)."""
    for tool in ("go", "protoc", "protoc_gen_go", "protoc_gen_go_grpc"):
        path = getattr(ARGS, tool)
        if not path or not os.access(path, os.X_OK):
            raise RuntimeError(f"{tool.replace('_', '-')}: not found ({path!r}); install golang-go, "
                               "protobuf-compiler, protoc-gen-go and protoc-gen-go-grpc "
                               "(scripts/install_deps.sh)")
    for pkg in ("google.golang.org/grpc", "google.golang.org/protobuf"):
        if not os.path.isdir(os.path.join(GOCODE, "src", pkg)):
            raise RuntimeError(f"{GOCODE}/src/{pkg}: missing; install golang-google-grpc-dev and "
                               "golang-google-protobuf-dev (scripts/install_deps.sh)")
    gopath = os.path.join(ARGS.work_dir, "gopath")
    shutil.rmtree(gopath, ignore_errors=True)
    os.makedirs(os.path.join(gopath, "src", "kvrelay", "client"))
    client = os.path.join(ARGS.source_dir, "client", "go")
    os.symlink(client, os.path.join(gopath, "src", "kvrelay", "client", "go"))
    check_run([ARGS.protoc, "-I", os.path.join(ARGS.source_dir, "proto"),
               f"--plugin=protoc-gen-go={ARGS.protoc_gen_go}",
               f"--plugin=protoc-gen-go-grpc={ARGS.protoc_gen_go_grpc}",
               f"--go_out={os.path.join(gopath, 'src')}", f"--go-grpc_out={os.path.join(gopath, 'src')}",
               os.path.join(ARGS.source_dir, "proto", "kvrelay", "v1", "relay.proto")])
    env = dict(os.environ)
    env.update(GO111MODULE="off", GOPATH=f"{gopath}:{GOCODE}", GOPROXY="off", GOFLAGS="",
               GOTOOLCHAIN="local", CGO_ENABLED="0")
    if not env.get("GOCACHE") and not env.get("HOME"):
        env["GOCACHE"] = os.path.join(ARGS.work_dir, "gocache")
    gofmt = os.path.join(os.path.dirname(os.path.realpath(ARGS.go)), "gofmt")
    unformatted = check_run([gofmt, "-l", client]).stdout.strip()
    if unformatted:
        raise AssertionError(f"gofmt -l: not formatted:\n{unformatted}")
    pkgs = ["kvrelay/client/go/kvrelay", "kvrelay/client/go/cmd/kvrelay-example"]
    binary = os.path.join(ARGS.work_dir, "bin", "kvrelay-example")
    t = time.monotonic()
    check_run([ARGS.go, "build", "-o", binary, pkgs[1]], timeout=400, env=env, cwd=ARGS.work_dir)
    print(f"go build: {time.monotonic() - t:.1f} s", flush=True)
    check_run([ARGS.go, "vet", *pkgs], timeout=300, env=env, cwd=ARGS.work_dir)
    return env, binary


def setUpModule():
    global LIVE, GO_ENV, EXAMPLE
    GO_ENV, EXAMPLE = build()
    LIVE = lang_cases.Live(ARGS.server, ARGS.kvrelayctl, prefix="kvrelay-go-")
    RelayTest.live = LIVE
    TlsTest.BINARIES = (ARGS.server, ARGS.kvrelayctl)


def tearDownModule():
    if LIVE:
        LIVE.close()


# ---- tests -------------------------------------------------------------------------

class UnitTest(unittest.TestCase):
    def test_go_unit_tests(self):
        p = completed([ARGS.go, "test", "-count=1", "-v", "kvrelay/client/go/kvrelay"], timeout=300,
                      env=GO_ENV, cwd=ARGS.work_dir)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertRegex(p.stdout, r"--- PASS: Test")
        self.assertNotIn("--- FAIL", p.stdout)


class LiveApiTest(unittest.TestCase):
    """The package's live tests (kvrelay/live_test.go, TestLive*) against
    the relay: go test -run with KVRELAY_LIVE_ADDR, one test each."""

    def go_test(self, name):
        env = dict(GO_ENV, KVRELAY_LIVE_ADDR=LIVE.addr)
        p = completed([ARGS.go, "test", "-count=1", "-v", "-run", f"^{name}$", "kvrelay/client/go/kvrelay"],
                      timeout=300, env=env, cwd=ARGS.work_dir)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn(f"--- PASS: {name} ", p.stdout)
        self.assertNotIn("--- SKIP", p.stdout)

    def test_attention_error(self):
        self.go_test("TestLiveAttentionError")

    def test_history_anchors(self):
        self.go_test("TestLiveHistoryAnchors")

    def test_history_score_uploaded(self):
        # Needs a relay that accepts PART_HISTORY_SCORE.
        self.go_test("TestLiveHistoryScoreUploaded")

    def test_history_score_with_parent(self):
        # Needs a relay that accepts PART_HISTORY_SCORE.
        self.go_test("TestLiveHistoryScoreWithParent")


class RelayTest(lang_cases.RelayCases, unittest.TestCase):
    """The cases of tests/client/lang_cases.py, through kvrelay-example."""
    LANG, USAGE_ERROR, example = "go", "missing required flag -out", staticmethod(example)

    @staticmethod
    def compress(policy, turn, out):
        return example("-compress", "-policy", policy, "-in", turn, "-out", out)

    def test_parent_with_compress_is_a_usage_error(self):
        # Compress is stateless: it holds no parent to compose on.
        p = example("-compress", "-policy", "full", "-parent", "m-1", "-in", "x.safetensors", "-out", "y")
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("flag -parent: not with -compress", p.stderr)


class TlsTest(lang_cases.TlsCases, unittest.TestCase):
    """The TLS and token cases of tests/client/lang_cases.py, through
    kvrelay-example's --tls-ca, --tls-cert, --tls-key and --token-file."""
    LANG, example = "go", staticmethod(example)


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    for flag in ("--server", "--kvrelayctl", "--go", "--protoc", "--protoc-gen-go", "--protoc-gen-go-grpc",
                 "--source-dir", "--work-dir"):
        ap.add_argument(flag, required=True)
    ARGS, rest = ap.parse_known_args()
    sys.exit(unittest_main(rest, WATCHDOG_S))


if __name__ == "__main__":
    main()
