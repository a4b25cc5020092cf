#!/usr/bin/env bash
# Run the tests: default tier (CPU, under 10 minutes); --slow adds multi-process and long tests; --all both.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
case "${1:-}" in
  --slow) shift; exec .venv/bin/python -m pytest -m "slow and not gpu" "$@" ;;
  --all)  shift; exec .venv/bin/python -m pytest -m "not gpu" "$@" ;;
  *)      exec .venv/bin/python -m pytest "$@" ;;
esac
