#!/usr/bin/python3
"""`npm ci` of tests/deploy/package-lock.json into a build-tree folder (the ctest fixture).

    npm_ci.py --npm npm --source tests/deploy --dest BUILD/tests/deploy/npm

Copies package.json and package-lock.json to DEST and runs `npm ci` there,
unless DEST/node_modules was already installed from the same lock file (a
stamp holds its sha256), so repeated ctest runs do not reinstall.
"""
import argparse
import hashlib
import os
import shutil
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--npm", default="npm")
    ap.add_argument("--source", required=True)
    ap.add_argument("--dest", required=True)
    args = ap.parse_args()
    os.makedirs(args.dest, exist_ok=True)
    with open(os.path.join(args.source, "package-lock.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    stamp = os.path.join(args.dest, "node_modules", ".kvrelay-npm-ci")
    try:
        with open(stamp) as f:
            if f.read().strip() == digest:
                print(f"node_modules in {args.dest} is current ({digest[:12]})")
                return 0
    except FileNotFoundError:
        pass
    for name in ("package.json", "package-lock.json"):
        shutil.copyfile(os.path.join(args.source, name), os.path.join(args.dest, name))
    cmd = [args.npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"]
    print("+", " ".join(cmd), f"(in {args.dest})", flush=True)
    try:
        rc = subprocess.run(cmd, cwd=args.dest, timeout=540).returncode
    except FileNotFoundError:
        print(f"FAIL: {args.npm} not found (scripts/install_deps.sh installs npm)")
        return 1
    except subprocess.TimeoutExpired:
        print("FAIL: npm ci timed out")
        return 1
    if rc != 0:
        print(f"FAIL: npm ci exited {rc}")
        return 1
    with open(stamp, "w") as f:
        f.write(digest + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
