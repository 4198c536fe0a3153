#!/usr/bin/python3
"""The Go client (client/go) against a real kvrelay-server.

    /usr/bin/python3 test_go_client.py --server BIN --kvrelayctl BIN --go BIN \
        --protoc BIN --source-dir REPO --work-dir DIR

client/go is the Go module github.com/kvrelay/kvrelay/client/go, with the
stubs of proto/kvrelay/v1/relay.proto committed in kvrelay/v1. The test
builds in module mode offline (GOPROXY=off, GOFLAGS=-mod=readonly,
GOTOOLCHAIN=local, GOWORK=off): the module cache that
scripts/install_go_tools.sh filled (go mod download) must hold every
dependency, at the versions of go.mod and go.sum. Checks: the Go is at least
go.mod's go line; client/go/generate.sh, with the protoc-gen-go and
protoc-gen-go-grpc that scripts/install_go_tools.sh pins and installs and
with --protoc, regenerates the stubs into DIR/gen byte-identical to the
committed ones; gofmt -l, go vet ./... and go test -race ./... (the unit
tests; -race needs cgo and a C compiler) pass. Then it starts
kvrelay-server on 127.0.0.1:0 and a Unix socket, runs the package's live
tests against it (kvrelay/live_test.go, TestLive*, with KVRELAY_LIVE_ADDR,
under -race: attention_error, history_anchors, history.score over an
uploaded history and over a parent) and drives cmd/kvrelay-example: publish
a turn made by `kvrelayctl make-turn`, fetch the message, write it, ack.
Checks: the fetched message equals `kvrelayctl compress` of the same turn
bit for bit (every tensor's dtype, shape and bytes, and the accounting
metadata) for dense, quantized and default policies, multi-chunk F32
tensors, F16/BF16, GQA and uploaded history, and for turns carrying gen.q
(queries) instead of scores, through publish and -compress; with `full` it
equals the input K/V (and positions); the message was acked (the relay
holds nothing, stats count every ack); a bad policy fails with
INVALID_ARGUMENT naming header.policy and commits nothing; a malformed turn
file fails before any call, naming the tensor; a publish and a fetch over
the relay's Unix socket (--addr unix:PATH) work; and against a TLS relay
with a tokens file (lang_cases.TlsCases): publish, fetch and ack over TLS
with a token, with a client certificate, and with the token over a
plaintext Unix socket; UNAUTHENTICATED for no or a wrong token, UNAVAILABLE
for an untrusted CA or plaintext on the TLS port, PERMISSION_DENIED for
another agent's sender or mailbox. A missing go or protoc, a Go older than
go.mod's, or missing or other-version plugins fail the test, naming what to
install. The whole run is bounded by a watchdog and the server is always
stopped. The live-relay cases are shared with the Node.js test:
tests/client/lang_cases.py; the server helpers are
tests/testlib/kvrelay_testlib.py.
"""
import argparse
import difflib
import os
import re
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
WATCHDOG_S = 540
INSTALL = "scripts/install_go_tools.sh"
STUBS = os.path.join("kvrelay", "v1")  # in client/go, where generate.sh places them


# ---- the client under test -------------------------------------------------------

def client_dir():
    return os.path.join(ARGS.source_dir, "client", "go")


def example(*args, timeout=60, addr=None, env=None):
    """Runs kvrelay-example with args against addr (default LIVE.addr);
    returns the CompletedProcess. env: None, this environment; a dict, the
    KVRELAY_* variables to run with (no others)."""
    return completed([EXAMPLE, "--addr", addr or LIVE.addr, *args], timeout=timeout,
                     env=None if env is None else clean_env(**env))


def go_env():
    """The environment go runs in: module mode, offline, go.mod and go.sum
    as committed, this Go only, no go.work; cgo off (-race turns it on)."""
    env = dict(os.environ)
    env.update(GO111MODULE="on", GOPROXY="off", GOFLAGS="-mod=readonly -buildvcs=false",
               GOTOOLCHAIN="local", GOWORK="off", CGO_ENABLED="0")
    if not env.get("GOCACHE") and not env.get("HOME"):
        env["GOCACHE"] = os.path.join(ARGS.work_dir, "gocache")
    return env


def version_tuple(v):
    return tuple(int(x) for x in re.findall(r"\d+", v))


def check_go_version(env):
    """Raises unless ARGS.go is at least the version of go.mod's go line."""
    with open(os.path.join(client_dir(), "go.mod")) as f:
        want = re.search(r"^go (\S+)$", f.read(), re.M).group(1)
    have = check_run([ARGS.go, "env", "GOVERSION"], env=env).stdout.strip()
    # A release before Go 1.21 cannot refuse a newer go.mod by itself.
    if version_tuple(have.removeprefix("go")) < version_tuple(want):
        raise RuntimeError(f"{ARGS.go}: {have}, expected go >= {want} (client/go/go.mod); "
                           f"install Go from https://go.dev/dl/ and run {INSTALL} with it")


def build():
    """Checks the toolchain and the formatting, builds kvrelay-example and
    vets the module; returns (environment for go, path of the binary)."""
    for tool in ("go", "protoc"):
        path = getattr(ARGS, tool)
        if not path or not os.access(path, os.X_OK):
            raise RuntimeError(f"{tool}: not found ({path!r}); install Go (https://go.dev/dl/) and "
                               f"protobuf-compiler (scripts/install_deps.sh, {INSTALL})")
    env = go_env()
    check_go_version(env)
    gofmt = os.path.join(os.path.dirname(os.path.realpath(ARGS.go)), "gofmt")
    unformatted = check_run([gofmt, "-l", client_dir()]).stdout.strip()
    if unformatted:
        raise AssertionError(f"gofmt -l: not formatted:\n{unformatted}")
    binary = os.path.join(ARGS.work_dir, "bin", "kvrelay-example")
    t = time.monotonic()
    p = completed([ARGS.go, "build", "-o", binary, "./cmd/kvrelay-example"], timeout=400, env=env,
                  cwd=client_dir())
    if p.returncode != 0:
        raise AssertionError(f"go build (offline, GOPROXY=off): rc={p.returncode}\n{p.stderr}\n"
                             f"a missing module means the module cache lacks go.mod's "
                             f"dependencies: run {INSTALL}")
    print(f"go build: {time.monotonic() - t:.1f} s", flush=True)
    check_run([ARGS.go, "vet", "./..."], timeout=300, env=env, cwd=client_dir())
    return env, binary


def run_go_test(*args, env=None):
    """go test -race -count=1 -v ARGS in client/go; the CompletedProcess."""
    env = dict(env or GO_ENV, CGO_ENABLED="1")
    return completed([ARGS.go, "test", "-race", "-count=1", "-v", *args], timeout=300, env=env,
                     cwd=client_dir())


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

class StubsTest(unittest.TestCase):
    def test_committed_stubs_are_what_the_pinned_generators_make(self):
        # client/go/generate.sh refuses plugins other than the pinned ones,
        # naming scripts/install_go_tools.sh; protoc is --protoc's.
        out = os.path.join(ARGS.work_dir, "gen")
        shutil.rmtree(out, ignore_errors=True)
        p = completed(["bash", os.path.join(client_dir(), "generate.sh"), out], timeout=120,
                      env=dict(GO_ENV, GO=ARGS.go, PROTOC=ARGS.protoc))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        committed_dir = os.path.join(client_dir(), STUBS)
        committed = sorted(os.listdir(committed_dir))
        generated = sorted(os.listdir(os.path.join(out, STUBS)))
        self.assertEqual(committed, generated, f"client/go/{STUBS}: files")
        for name in generated:
            with open(os.path.join(committed_dir, name), "rb") as f:
                want = f.read()
            with open(os.path.join(out, STUBS, name), "rb") as f:
                got = f.read()
            if got != want:
                diff = difflib.unified_diff(want.decode(errors="replace").splitlines(),
                                            got.decode(errors="replace").splitlines(),
                                            f"client/go/{STUBS}/{name} (committed)",
                                            f"{out}/{STUBS}/{name} (generated)", lineterm="", n=1)
                self.fail(f"client/go/{STUBS}/{name} differs from what client/go/generate.sh makes "
                          f"(regenerate with it and commit):\n" + "\n".join(list(diff)[:60]))


class UnitTest(unittest.TestCase):
    def test_go_unit_tests(self):
        p = run_go_test("./...")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertRegex(p.stdout, r"--- PASS: Test")
        self.assertNotIn("--- FAIL", p.stdout)


class LiveApiTest(unittest.TestCase):
    """The package's live tests (kvrelay/live_test.go, TestLive*) against
    the relay: go test -race -run with KVRELAY_LIVE_ADDR, one test each."""

    def go_test(self, name):
        p = run_go_test("-run", f"^{name}$", "./kvrelay", env=dict(GO_ENV, KVRELAY_LIVE_ADDR=LIVE.addr))
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
    for flag in ("--server", "--kvrelayctl", "--go", "--protoc", "--source-dir", "--work-dir"):
        ap.add_argument(flag, required=True)
    ARGS, rest = ap.parse_known_args()
    sys.exit(unittest_main(rest, WATCHDOG_S))


if __name__ == "__main__":
    main()
