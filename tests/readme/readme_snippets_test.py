#!/usr/bin/env python3
"""Runs the documentation's runnable snippets against the built tree.

A fenced block counts as runnable when the line right before its opening
fence is `<!-- test: NAME -->`, or `<!-- test: NAME with-relay -->` for a
block that expects a relay on 127.0.0.1:50051 (the test starts one,
in-memory, before the block and stops it after). It is run as it stands: a `sh` block with
bash (-e -o pipefail), a `python` block with --python. Each runs in a
scratch directory where `build` links to the build tree (the parent of
--bin) and `.venv` to the project's environment, so that the paths the docs
use (`build/bin/kvrelayctl`, `.venv/bin/python`) work. The relay addresses
the docs use, 127.0.0.1:50051 (gRPC) and 127.0.0.1:9464 (metrics), are
rewritten to free ports so that the test can run beside others. A block
that starts a relay in the background must stop it itself; whatever is
left in the block's process group is killed when it ends. Each block has
--timeout seconds; a non-zero exit or a timeout fails the test.

Usage:
  readme_snippets_test.py --bin build/bin [--python .venv/bin/python]
                          [--source-dir .] [--list] [NAME...]
Exit 0 when every block selected passed, 1 otherwise.
"""

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

DOCS = ["README.md", "docs/*.md"]
MARKER = re.compile(r"^<!-- test: ([A-Za-z0-9_.-]+)( with-relay)? -->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
LANGS = {"sh", "bash", "python"}
GRPC_ADDR = "127.0.0.1:50051"
METRICS_ADDR = "127.0.0.1:9464"


def doc_files(source_dir):
    files = [os.path.join(source_dir, "README.md")]
    docs = os.path.join(source_dir, "docs")
    if os.path.isdir(docs):
        files += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    return files


def extract(path):
    """[(name, lang, code, line, with_relay)] of the marked blocks of one file; a marker
    not followed by a fence of a language we run is an error."""
    lines = open(path, encoding="utf-8").read().split("\n")
    blocks = []
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if not m:
            i += 1
            continue
        name = m.group(1)
        f = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if not f or f.group(1) not in LANGS:
            raise SystemExit(f"{path}:{i + 1}: marker '{name}' is not followed by a ```sh or ```python fence")
        j = i + 2
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if j == len(lines):
            raise SystemExit(f"{path}:{i + 2}: block '{name}' has no closing fence")
        blocks.append((name, f.group(1), "\n".join(lines[i + 2:j]) + "\n", i + 2, bool(m.group(2))))
        i = j + 1
    return blocks


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_relay(args, port, log):
    """kvrelay-server on 127.0.0.1:port, once it prints its ready line."""
    relay = subprocess.Popen([os.path.join(args.bin, "kvrelay-server"), "--listen", f"127.0.0.1:{port}",
                              "--metrics-listen", "off"], stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    deadline = time.time() + 20
    while time.time() < deadline:
        log.flush()
        with open(log.name, encoding="utf-8", errors="replace") as f:
            if "kvrelay-server ready" in f.read():
                return relay
        if relay.poll() is not None:
            break
        time.sleep(0.05)
    kill_group(relay.pid)
    raise SystemExit(f"readme_snippets: kvrelay-server on port {port} did not get ready (log {log.name})")


def run_block(name, lang, code, args, where, with_relay=False):
    port = free_port()
    code = code.replace(GRPC_ADDR, f"127.0.0.1:{port}")
    code = code.replace(METRICS_ADDR, f"127.0.0.1:{free_port()}")
    with tempfile.TemporaryDirectory(prefix=f"readme-{name}-") as work:
        os.symlink(os.path.dirname(os.path.abspath(args.bin)), os.path.join(work, "build"))
        venv = os.path.dirname(os.path.dirname(os.path.abspath(args.python)))
        os.symlink(venv, os.path.join(work, ".venv"))
        relay = None
        if with_relay:
            relay_log = open(os.path.join(work, "kvrelay-server.log"), "w")
            relay = start_relay(args, port, relay_log)
        if lang == "python":
            cmd = [args.python, "-c", code]
        else:
            cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=args.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            out, _ = proc.communicate()
            rc = None
        kill_group(proc.pid)  # whatever the block left behind
        if relay is not None:
            kill_group(relay.pid)
            relay.wait()
            relay_log.close()
        took = time.time() - start
    ok = rc == 0
    status = "ok" if ok else ("TIMEOUT" if rc is None else f"FAILED (exit {rc})")
    print(f"readme_snippets: {name} ({where}, {lang}): {status} in {took:.1f} s", flush=True)
    if not ok:
        print("---- output ----\n" + out.rstrip() + "\n----------------", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="folder with kvrelay-server and kvrelayctl (build/bin)")
    ap.add_argument("--python", default=None, help="the Python that has the kvrelay package (default: .venv/bin/python of --source-dir)")
    ap.add_argument("--source-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per block")
    ap.add_argument("--list", action="store_true", help="list the marked blocks and exit")
    ap.add_argument("names", nargs="*", help="run only these blocks")
    args = ap.parse_args()
    args.source_dir = os.path.abspath(args.source_dir)
    if args.python is None:
        args.python = os.path.join(args.source_dir, ".venv", "bin", "python")

    blocks = []
    for path in doc_files(args.source_dir):
        rel = os.path.relpath(path, args.source_dir)
        for name, lang, code, line, with_relay in extract(path):
            blocks.append((name, lang, code, f"{rel}:{line}", with_relay))
    names = [b[0] for b in blocks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SystemExit(f"readme_snippets: marker names used twice: {', '.join(dup)}")
    if args.list:
        for name, lang, _, where, with_relay in blocks:
            print(f"{name}\t{lang}\t{where}" + ("\twith-relay" if with_relay else ""))
        return 0
    if args.names:
        unknown = sorted(set(args.names) - set(names))
        if unknown:
            raise SystemExit(f"readme_snippets: no marked block named {', '.join(unknown)}")
        blocks = [b for b in blocks if b[0] in args.names]
    if not blocks:
        raise SystemExit("readme_snippets: no marked blocks found")
    for tool in ("kvrelay-server", "kvrelayctl"):
        if not os.access(os.path.join(args.bin, tool), os.X_OK):
            raise SystemExit(f"readme_snippets: {os.path.join(args.bin, tool)} is missing")

    failed = [b[0] for b in blocks if not run_block(b[0], b[1], b[2], args, b[3], b[4])]
    print(f"readme_snippets: {len(blocks) - len(failed)} of {len(blocks)} blocks passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
