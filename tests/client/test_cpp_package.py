#!/usr/bin/python3
"""The installed C++ client package, used the way a user's project uses it.

Installs the build tree (`cmake --install BUILD --prefix TMP/prefix`), copies
tests/client/cpp_package/ out of the source tree, configures it with only
the prefix on CMAKE_PREFIX_PATH (find_package(kvrelay CONFIG REQUIRED),
target_link_libraries(... kvrelay::client)), builds it, and runs its
binary against the installed kvrelay-server: a publish with policy `full`,
its fetch checked byte for byte, ack, stats, close.

Checks besides: the package files and binaries are installed; no installed
text file and no command of the consumer's build names the source or build
tree (the consumer compiles against the prefix alone). Stdlib only.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testlib"))
from kvrelay_testlib import FAILURES, Server, check, completed  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def consumer_env():
    """This environment without what could point find_package(kvrelay)
    elsewhere than the prefix (CMAKE_*, kvrelay_DIR, kvrelay_ROOT) or
    configure the client (KVRELAY_*)."""
    return {k: v for k, v in os.environ.items()
            if not (k.startswith(("CMAKE_", "KVRELAY_")) or k in ("kvrelay_DIR", "kvrelay_ROOT"))}


def step(what, cmd, timeout, env=None, cwd=None):
    """Runs `cmd`; True when it exits 0, else records a failure with its output."""
    t0 = time.monotonic()
    p = completed(cmd, timeout=timeout, env=env if env is not None else consumer_env(), cwd=cwd)
    print(f"{what}: rc={p.returncode} in {time.monotonic() - t0:.1f} s", flush=True)
    return check(p.returncode == 0, f"{what}: {' '.join(cmd)} exited {p.returncode}\n"
                                    f"stdout:\n{p.stdout[-6000:]}\nstderr:\n{p.stderr[-6000:]}")


def files_naming(root, needles, suffixes):
    """Files under `root` ending in one of `suffixes` whose text holds one of `needles`."""
    hits = []
    for d, _, names in os.walk(root):
        for n in names:
            if not n.endswith(suffixes):
                continue
            path = os.path.join(d, n)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            hits += [f"{path} names {s}" for s in needles if s in text]
    return hits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--cmake", required=True)
    ap.add_argument("--generator", required=True)
    ap.add_argument("--make-program", default="")
    ap.add_argument("--cxx", required=True)
    ap.add_argument("--launcher", default="", help="CMAKE_CXX_COMPILER_LAUNCHER of the build (ccache)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()
    source_dir = os.path.realpath(args.source_dir)
    build_dir = os.path.realpath(args.build_dir)
    tree = [source_dir, build_dir]

    work = tempfile.mkdtemp(prefix="kvrelay_cpp_package_")
    prefix = os.path.join(work, "prefix")
    try:
        if not step("install", [args.cmake, "--install", build_dir, "--prefix", prefix], 120):
            return 1
        package = os.path.join(prefix, "lib", "cmake", "kvrelay")
        for path in (os.path.join(package, "kvrelayConfig.cmake"),
                     os.path.join(package, "kvrelayConfigVersion.cmake"),
                     os.path.join(package, "kvrelayTargets.cmake"),
                     os.path.join(prefix, "include", "kvrelay", "client", "relay_client.h"),
                     os.path.join(prefix, "bin", "kvrelay-server"),
                     os.path.join(prefix, "bin", "kvrelayctl")):
            check(os.path.isfile(path), f"not installed: {os.path.relpath(path, prefix)}")
        for hit in files_naming(prefix, tree, (".cmake", ".h")):
            check(False, f"installed file names the source or build tree: {hit}")

        # Out of the source tree, so that nothing relative to it can be found.
        src = os.path.join(work, "consumer")
        shutil.copytree(os.path.join(HERE, "cpp_package"), src)
        build = os.path.join(work, "consumer-build")
        configure = [args.cmake, "-S", src, "-B", build, "-G", args.generator,
                     "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_CXX_COMPILER={args.cxx}",
                     f"-DCMAKE_PREFIX_PATH={prefix}",
                     "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"]
        if args.make_program:
            configure.append(f"-DCMAKE_MAKE_PROGRAM={args.make_program}")
        if args.launcher:
            configure.append(f"-DCMAKE_CXX_COMPILER_LAUNCHER={args.launcher}")
        if not step("configure consumer", configure, 120):
            return 1
        if not step("build consumer", [args.cmake, "--build", build, "-j", "2"], 300):
            return 1
        for hit in files_naming(build, tree, ("compile_commands.json", "build.ninja", "Makefile",
                                               "link.txt", "flags.make")):
            check(False, f"consumer build reaches into the kvrelay tree: {hit}")

        binary = os.path.join(build, "relay_roundtrip")
        with Server(os.path.join(prefix, "bin", "kvrelay-server"), work, name="server") as server:
            t0 = time.monotonic()
            p = completed([binary, "--addr", server.addr], timeout=60, env=consumer_env())
            print(f"relay_roundtrip: rc={p.returncode} in {time.monotonic() - t0:.1f} s\n"
                  f"{p.stdout}{p.stderr}", end="", flush=True)
            check(p.returncode == 0 and p.stdout.startswith("relay_roundtrip ok "),
                  f"relay_roundtrip against {server.addr}: rc={p.returncode}")
    finally:
        if args.keep or FAILURES:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if FAILURES:
        print(f"{len(FAILURES)} failure(s)")
        return 1
    print("cpp_client_package: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
