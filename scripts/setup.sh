#!/usr/bin/env bash
# Create .venv and install ftrun with its training and test dependencies (CPU torch here, never a CUDA build),
# every package the image has at the image's version: docker/requirements.txt is the constraint.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PINS=docker/requirements.txt
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.ftrun-installed
# Re-installed when the dependencies or the pins change.
want=$(cat pyproject.toml "$PINS" | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing ftrun and its dependencies into .venv (about a minute; log in .venv/pip.log) ..."
  pipi() { .venv/bin/python -m pip install -q -c "$PINS" "$@" >>.venv/pip.log 2>&1 || { tail -30 .venv/pip.log; exit 1; }; }
  pipi pip
  # torch first, at the pinned version: here that is the local CPU wheel (2.13.0+cpu satisfies ==2.13.0);
  # left to another package's requirement pip would pull a CUDA build of several GB.
  pipi torch
  pipi -e ".[train,export,test]"
  echo "$want" > "$stamp"
fi
