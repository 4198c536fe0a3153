#!/usr/bin/python3
"""The Node.js client (client/node) against a real kvrelay-server.

    /usr/bin/python3 test_node_client.py --server BIN --kvrelayctl BIN \
        --node BIN --npm BIN --source-dir REPO --work-dir DIR

Installs the client's npm dependencies, devDependencies included, with `npm
ci` (package.json and package-lock.json copied into DIR/npm, so the source
tree stays clean; the client in the source tree finds them through
NODE_PATH), packs the client with `npm pack` (a copy of client/node and
proto/ under DIR/pack, whose prepack puts relay.proto into the package) and
installs the tarball into a scratch project DIR/app with `npm install
TARBALL`, as a user does. Checks the package: exactly its files, relay.proto
byte for byte, its version the project's (CMakeLists.txt), the example's bin
link, the installed client loading its own relay.proto; every name client.js,
safetensors.js and crc32c.js export declared in their .d.ts and no other;
typecheck.ts type-checked with `tsc --noEmit --strict` against client/node's
declarations and against the installed package (the misuses it marks
refused). Runs the offline unit tests (unit.test.js, node:test) on the
source tree, then starts kvrelay-server on 127.0.0.1:0 and a Unix socket,
runs the live tests against it (live.test.js with KVRELAY_LIVE_ADDR:
attentionError, historyAnchors, historyScore over an uploaded history and
over a parent) and drives the installed package's example.js (and once the
source tree's, which loads the repository's relay.proto): publish a turn
made by `kvrelayctl make-turn`, fetch the message, write it, ack. Checks:
the fetched message equals `kvrelayctl compress` of the same turn bit for bit (every tensor's
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
import json
import os
import re
import shutil
import sys
import tarfile
import time
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "testlib"))
import lang_cases  # noqa: E402
from kvrelay_testlib import check_run, completed, unittest_main  # noqa: E402

ARGS = None
LIVE = None
NODE_ENV = None      # the source tree's client: NODE_PATH names DIR/npm/node_modules
INSTALLED_ENV = None  # the installed package's: no NODE_PATH, it has its own node_modules
PACKAGE = None        # what pack_and_install() made
WATCHDOG_S = 540
NPM_FLAGS = ("--no-audit", "--no-fund", "--prefer-offline")
# The module files of the package, each with its declarations beside it.
MODULES = ("client", "safetensors", "crc32c")


# ---- the client under test -------------------------------------------------------

def example(*args, timeout=60, addr=None, env=None):
    """Runs the installed package's example.js (what its bin kvrelay-example
    links) with args against addr (default LIVE.addr), with the relay.proto
    the package carries; returns the CompletedProcess. env: None, INSTALLED_ENV; a dict,
    INSTALLED_ENV without its KVRELAY_* variables but these."""
    run_env = INSTALLED_ENV
    if env is not None:
        run_env = {k: v for k, v in INSTALLED_ENV.items() if not k.startswith("KVRELAY_")}
        run_env.update(env)
    return completed([ARGS.node, os.path.join(PACKAGE.installed, "example.js"), "--addr", addr or LIVE.addr, *args],
                     timeout=timeout, env=run_env)


def source_path(*parts):
    return os.path.join(ARGS.source_dir, *parts)


def timed_run(what, cmd, cwd, timeout=300):
    t = time.monotonic()
    p = check_run(cmd, timeout=timeout, cwd=cwd)
    print(f"{what}: {time.monotonic() - t:.1f} s", flush=True)
    return p


def install_dependencies():
    """npm ci into WORK/npm; returns the environment in which the source
    tree's client finds the packages."""
    for tool, path in (("node", ARGS.node), ("npm", ARGS.npm)):
        if not path or not os.access(path, os.X_OK):
            raise RuntimeError(f"{tool}: not found ({path!r}); install Node.js and npm "
                               "(scripts/install_deps.sh)")
    deps = os.path.join(ARGS.work_dir, "npm")
    os.makedirs(deps, exist_ok=True)
    for f in ("package.json", "package-lock.json"):
        shutil.copyfile(source_path("client", "node", f), os.path.join(deps, f))
    timed_run("npm ci", [ARGS.npm, "ci", "--ignore-scripts", *NPM_FLAGS], cwd=deps)
    env = dict(os.environ)
    env["NODE_PATH"] = os.path.join(deps, "node_modules")
    env["KVRELAY_NODE_CLIENT_DIR"] = source_path("client", "node")
    return env


def pack_and_install():
    """`npm pack` of a copy of client/node (beside a copy of proto/, as in
    the repository, for its prepack), then `npm install TARBALL` into the
    scratch project WORK/app. Returns the tarball, npm pack's report of it,
    the scratch project and the installed package's folder."""
    stage = os.path.join(ARGS.work_dir, "pack")
    app = os.path.join(ARGS.work_dir, "app")
    for d in (stage, app):
        shutil.rmtree(d, ignore_errors=True)
    # The package's own files; what a developer's checkout may also hold
    # there (node_modules, a tarball, a pack's leftover proto/) stays out.
    shutil.copytree(source_path("client", "node"), os.path.join(stage, "client", "node"),
                    ignore=shutil.ignore_patterns("node_modules", "proto", "*.tgz"))
    proto_dir = os.path.join(stage, "proto", "kvrelay", "v1")
    os.makedirs(proto_dir)
    shutil.copyfile(source_path("proto", "kvrelay", "v1", "relay.proto"), os.path.join(proto_dir, "relay.proto"))
    p = timed_run("npm pack", [ARGS.npm, "pack", "--json", "--pack-destination", ARGS.work_dir],
                  cwd=os.path.join(stage, "client", "node"))
    report = json.loads(p.stdout)[0]
    tarball = os.path.join(ARGS.work_dir, report["filename"])
    os.makedirs(app)
    with open(os.path.join(app, "package.json"), "w") as f:
        json.dump({"name": "kvrelay-node-app", "version": "0.0.0", "private": True}, f)
    timed_run("npm install TARBALL", [ARGS.npm, "install", *NPM_FLAGS, tarball], cwd=app)
    return types.SimpleNamespace(tarball=tarball, report=report, app=app,
                                 installed=os.path.join(app, "node_modules", report["name"]))


def setUpModule():
    global LIVE, NODE_ENV, INSTALLED_ENV, PACKAGE
    NODE_ENV = install_dependencies()
    INSTALLED_ENV = {k: v for k, v in os.environ.items() if k != "NODE_PATH"}
    PACKAGE = pack_and_install()
    LIVE = lang_cases.Live(ARGS.server, ARGS.kvrelayctl, prefix="kvrelay-node-")
    RelayTest.live = LIVE
    TlsTest.BINARIES = (ARGS.server, ARGS.kvrelayctl)


def tearDownModule():
    if LIVE:
        LIVE.close()


# ---- tests -------------------------------------------------------------------------

class PackageTest(unittest.TestCase):
    """The tarball `npm pack` makes of client/node, and the package it installs."""

    FILES = {"package.json", "README.md", "client.js", "client.d.ts", "crc32c.js", "crc32c.d.ts", "safetensors.js",
             "safetensors.d.ts", "example.js", "proto/kvrelay/v1/relay.proto"}

    def members(self):
        """{path in the package: bytes} of the tarball."""
        with tarfile.open(PACKAGE.tarball) as tar:
            return {m.name.removeprefix("package/"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}

    def test_tarball_holds_the_package_files_only(self):
        self.assertEqual(set(self.members()), self.FILES)
        self.assertEqual({f["path"] for f in PACKAGE.report["files"]}, self.FILES)

    def test_tarball_carries_the_repositorys_relay_proto(self):
        with open(source_path("proto", "kvrelay", "v1", "relay.proto"), "rb") as f:
            self.assertEqual(self.members()["proto/kvrelay/v1/relay.proto"], f.read())

    def test_pack_leaves_no_proto_copy_behind(self):
        # postpack removes what prepack copied.
        self.assertFalse(os.path.exists(os.path.join(ARGS.work_dir, "pack", "client", "node", "proto")))

    def test_package_version_is_the_projects(self):
        with open(source_path("CMakeLists.txt")) as f:
            version = re.search(r"project\(kvrelay VERSION ([0-9.]+)", f.read()).group(1)
        meta = json.loads(self.members()["package.json"])
        self.assertEqual((meta["name"], meta["version"]), ("kvrelay-client", version))
        self.assertEqual((meta["main"], meta["types"]), ("client.js", "client.d.ts"))

    def test_bin_links_the_example(self):
        link = os.path.join(PACKAGE.app, "node_modules", ".bin", "kvrelay-example")
        self.assertEqual(os.path.realpath(link), os.path.realpath(os.path.join(PACKAGE.installed, "example.js")))

    def test_installed_client_loads_its_own_relay_proto(self):
        p = check_run([ARGS.node, "-e", "const c = require('kvrelay-client');"
                       "console.log(c.DEFAULT_PROTO_PATH); console.log(c.loadRelayService().serviceName);"],
                      env=INSTALLED_ENV, cwd=PACKAGE.app)
        self.assertEqual(p.stdout.split("\n")[:2],
                         [os.path.join(PACKAGE.installed, "proto", "kvrelay", "v1", "relay.proto"), "Relay"])

    def test_source_tree_example_loads_the_repositorys_relay_proto(self):
        # In the source tree (no packed copy) the default is the repository's.
        turn = LIVE.make_turn("source-tree", layers=1, prompt=64, gen=4)
        out = LIVE.path("source-tree-msg.safetensors")
        p = completed([ARGS.node, source_path("client", "node", "example.js"), "--addr", LIVE.addr, "--in", turn,
                       "--out", out, "--session", "s-node-source-tree", "--policy", "full"], timeout=60, env=NODE_ENV)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("acked=true", p.stdout)

    def test_declarations_name_every_export(self):
        for module in MODULES:
            with self.subTest(module=module):
                p = check_run([ARGS.node, "-e", f"console.log(JSON.stringify(Object.keys(require('./{module}.js'))))"],
                              env=NODE_ENV, cwd=source_path("client", "node"))
                with open(source_path("client", "node", f"{module}.d.ts")) as f:
                    declared = self.declared_values(f.read())
                self.assertEqual(sorted(json.loads(p.stdout)), sorted(declared))

    @staticmethod
    def declared_values(dts):
        """Names of the values a .d.ts exports: `export declare const|function|class NAME`
        and `export { NAME, ... } from` (types are no exports of the .js)."""
        names = re.findall(r"^export declare (?:const|function|class) (\w+)", dts, re.M)
        for group in re.findall(r"^export \{([^}]*)\} from", dts, re.M):
            names += [n.strip() for n in group.split(",") if n.strip()]
        return names


class TypeScriptTest(unittest.TestCase):
    """typecheck.ts (the public API as a TypeScript user writes it, and the
    misuses the declarations must refuse) under `tsc --noEmit --strict`,
    against client/node's declarations and as installed from the tarball."""

    def tsc(self, folder, options):
        """Writes folder/tsconfig.json for typecheck.ts with options; runs tsc."""
        deps = os.path.join(ARGS.work_dir, "npm", "node_modules")
        config = {
            "compilerOptions": {"strict": True, "noEmit": True, "target": "es2022", "module": "node16",
                                "moduleResolution": "node16", "skipLibCheck": False, "types": ["node"],
                                "typeRoots": [os.path.join(deps, "@types")], **options},
            "files": [os.path.join(folder, "typecheck.ts")],
        }
        os.makedirs(folder, exist_ok=True)
        shutil.copyfile(os.path.join(HERE, "typecheck.ts"), os.path.join(folder, "typecheck.ts"))
        with open(os.path.join(folder, "tsconfig.json"), "w") as f:
            json.dump(config, f, indent=2)
        tsc = os.path.join(deps, "typescript", "bin", "tsc")
        t = time.monotonic()
        p = completed([ARGS.node, tsc, "-p", folder, "--noEmit", "--strict"], timeout=180, cwd=folder)
        print(f"tsc ({os.path.basename(folder)}): {time.monotonic() - t:.1f} s", flush=True)
        self.assertEqual((p.returncode, p.stdout + p.stderr), (0, ""))

    def test_against_the_source_declarations(self):
        src = source_path("client", "node")
        deps = os.path.join(ARGS.work_dir, "npm", "node_modules")
        self.tsc(os.path.join(ARGS.work_dir, "tsc-source"), {"paths": {
            "kvrelay-client": [os.path.join(src, "client.d.ts")],
            "kvrelay-client/*": [os.path.join(src, "*.d.ts")],
            "@grpc/grpc-js": [os.path.join(deps, "@grpc", "grpc-js")],
        }})

    def test_against_the_installed_package(self):
        self.tsc(PACKAGE.app, {})


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

    # RelayClient.compress for lang_cases' test_compress_matches_offline,
    # run in the scratch project: the installed package by its name.
    COMPRESS_JS = """
const { RelayClient, statusName } = require('kvrelay-client');
const { readTurnFile, writeMessageFile } = require('kvrelay-client/safetensors');
const [addr, policy, input, output] = process.argv.slice(2);
(async () => {
  const relay = new RelayClient(addr);
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
        script = os.path.join(PACKAGE.app, "compress.js")
        with open(script, "w") as f:
            f.write(self.COMPRESS_JS)
        return completed([ARGS.node, script, LIVE.addr, policy, turn, out], timeout=60, env=INSTALLED_ENV)


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
