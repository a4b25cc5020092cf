#!/usr/bin/env bash
# Create .venv and install ftrun with its training and test dependencies (CPU torch here, never a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.ftrun-installed
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing ftrun and its dependencies into .venv (about a minute; log in .venv/pip.log) ..."
  pipi() { .venv/bin/python -m pip install -q "$@" >>.venv/pip.log 2>&1 || { tail -30 .venv/pip.log; exit 1; }; }
  pipi --upgrade pip
  # torch first and pinned: 2.13.0 is the local CPU wheel on this kind of machine; an unpinned
  # torch asked for by another package would pull a CUDA build of several GB.
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    pipi "torch==${FTRUN_TORCH:-2.13.0}"
  fi
  pipi -e ".[train,export,test]"
  echo "$want" > "$stamp"
fi
