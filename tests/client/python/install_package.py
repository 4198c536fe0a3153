#!/usr/bin/env python3
"""Installs the Python client package into the running interpreter's environment.

    .venv/bin/python tests/client/python/install_package.py --source client/python

The way a user installs it (pip install DIR), with its dependencies taken
from the environment (--no-deps: they are pinned by python/requirements.lock)
and from a copy of DIR, so the build (build/, *.egg-info) never writes into the
source tree while other tests read it. Prints where kvrelay now imports from.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True, help="client/python")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvrelay-pkg-") as tmp:
        src = os.path.join(tmp, "python")
        shutil.copytree(args.source, src, ignore=shutil.ignore_patterns(
            "build", "*.egg-info", "__pycache__"))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--no-deps", "--no-build-isolation", "--force-reinstall", src], check=True)
    out = subprocess.run([sys.executable, "-c", "import kvrelay, kvrelay.v1; print(kvrelay.__file__)"],
                         check=True, capture_output=True, text=True, cwd=tempfile.gettempdir()).stdout.strip()
    site = os.path.dirname(os.path.dirname(out))
    if os.path.realpath(os.path.dirname(out)).startswith(os.path.realpath(args.source)):
        sys.exit(f"kvrelay imports from the source tree ({out}), not from the installed package")
    print(f"kvrelay installed in {site}")


if __name__ == "__main__":
    main()
