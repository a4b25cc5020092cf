#!/usr/bin/env bash
# Run the tests: default tier (CPU, under 6 minutes on 2 cores: 4 min 29 s for 1,291 tests on 2026-12-06, a fresh clone after the demo, two workers); --slow adds multi-process and long tests; --all both;
# --unsloth: the Unsloth engine tier, in its own environment .venv-unsloth (built on first use; --unsloth --build-only
# builds it and stops);
# --gguf: the GGUF export through llama.cpp (builds llama-cpp-python once, about 7 minutes; --gguf --build-only
# builds it and stops).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
# OpenMP threads that wait for work sleep instead of spinning (libgomp's OMP_WAIT_POLICY, which torch's CPU build
# uses): the tests run several training processes at once on 2 cores, and spinning threads burnt the cores the others
# needed. A 30-step test run beside a loaded box: 19 s of CPU and 40-57 s of wall time passive, 49-81 s of CPU and
# 131-267 s spinning (2026-12-05). Numerics do not change: only how idle threads wait.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
if [ "${1:-}" = "--unsloth" ]; then
  # The Unsloth tier runs in its own environment, .venv-unsloth, the image's /opt/ftrun-unsloth: Unsloth caps
  # transformers, trl and datasets below .venv's stack (docs/engines.md). Every package the image's environment has
  # is held at the image's version by docker/requirements-unsloth.txt. Built once, re-installed when the pins change.
  shift
  V=.venv-unsloth
  PINS=docker/requirements-unsloth.txt
  stamp=$V/.ftrun-installed
  want=$(cat pyproject.toml "$PINS" | sha256sum | cut -c1-16)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "building $V (Unsloth and its pinned stack, several minutes; log in $V/pip.log) ..."
    [ -x $V/bin/python ] || "${PYTHON:-python3}" -m venv $V
    pipi() { $V/bin/python -m pip install -q -c "$PINS" "$@" >>$V/pip.log 2>&1 || { tail -30 $V/pip.log; exit 1; }; }
    pipi pip
    # torch first (the local CPU wheel of the pinned version here), then held by the pins: unsloth (through
    # torchvision/xformers) would otherwise "upgrade" it to a CUDA build of several GB (seen: torch 2.14.1 +
    # 3.2 GB of nvidia libs).
    pipi torch
    pipi unsloth
    # The torchvision that unsloth pulls is a CUDA build that does not match the CPU torch: its
    # missing operator ("torchvision::nms does not exist") breaks `import unsloth` and even
    # `from transformers import Trainer`. Nothing here needs torchvision (text models only).
    $V/bin/python -m pip uninstall -q -y torchvision >>$V/pip.log 2>&1 || true
    pipi -e ".[train,export,test]"
    echo "$want" > "$stamp"
  fi
  [ "${1:-}" = "--build-only" ] && exit 0  # .ci/run builds it while the slow tier runs
  exec $V/bin/python -m pytest -m unsloth "$@"
fi
# The copy tests start a real sshd on 127.0.0.1 and copy with rsync (tests/store/test_sync.py): installed here where
# this runs as root with apt-get (CI, a fresh box); elsewhere those tests are skipped with the install line.
if { ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; } || ! command -v rsync >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing openssh-server and rsync for the copy tests (apt-get) ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q openssh-server rsync >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q openssh-server rsync >/dev/null 2>&1; } \
      || echo "could not install openssh-server and rsync: the copy tests will be skipped"
  fi
fi
scripts/setup.sh
if [ "${1:-}" = "--gguf" ]; then
  # The GGUF tier: llama-cpp-python built from its source distribution (about 7 minutes on 2 cores, once; pip
  # keeps the wheel) without -march=native (a native build traps with "Illegal instruction" on VMs that report
  # AMX), and llama.cpp's converter copied from the same version (`ftrun llamacpp install`).
  # --gguf --build-only builds the wheel into .cache/gguf-wheels and fetches the converter without touching .venv's
  # packages, at the lowest priority: .ci/run runs it beside the slow tier, whose tests leave a core idle much of
  # the time. The install below then takes the built wheel (pip prefers a wheel to the sdist of the same version).
  shift
  WHEELS=.cache/gguf-wheels
  export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
  have() { .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('llama-cpp-python') != '0.3.36')" 2>/dev/null; }
  if [ "${1:-}" = "--build-only" ]; then
    if ! have && ! compgen -G "$WHEELS/llama_cpp_python-0.3.36-*.whl" >/dev/null; then
      echo "building the llama-cpp-python 0.3.36 wheel (about 7 minutes on 2 cores) ..."
      nice -n 19 .venv/bin/python -m pip wheel -q --no-deps -c docker/requirements.txt -w "$WHEELS" llama-cpp-python==0.3.36
    fi
  elif ! have; then
    echo "installing llama-cpp-python 0.3.36 (built from source when $WHEELS has no wheel: about 7 minutes on 2 cores; log in .venv/pip.log) ..."
    .venv/bin/python -m pip install -q --find-links "$WHEELS" -c docker/requirements.txt -e ".[gguf]" >>.venv/pip.log 2>&1 || { tail -30 .venv/pip.log; exit 1; }
  fi
  .venv/bin/python -c "from launcher.plan import gguf_readiness as l; c = l.converter(); raise SystemExit(c is None or c.version != l.PINNED)" \
    || nice -n 19 .venv/bin/ftrun llamacpp install
  [ "${1:-}" = "--build-only" ] && exit 0
  exec .venv/bin/python -m pytest -m gguf "$@"
fi
# Two pytest workers (pytest-xdist), each taking whole test files (module fixtures such as a reference run are built
# once): the tests wait on processes as much as they compute (CPU 61% busy over a serial slow tier on 2 cores,
# 2026-12-02), and the default tier halves (6 min 51 s serial, 3 min 03 s with two). FTRUN_TEST_WORKERS=0 runs
# serially; a later -n on the command line wins.
PAR=(-n "${FTRUN_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)  # files in tests/conftest.py LONGEST_FIRST order
# The slow tier's tests wait on the processes they start (a run's workers, torchrun's ranks): with a third worker the
# 2 cores are busy throughout (0% idle, 2026-12-05; docs/BENCHMARKS.md "Where CI's time went").
SLOW_PAR=(-n "${FTRUN_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder)
# The code's format and lint first (pyproject.toml [tool.ruff]): seconds, and a failure says the file and line.
lint() { .venv/bin/ruff format --check --quiet launcher gpu_check tests scripts && .venv/bin/ruff check --quiet launcher gpu_check tests scripts; }
case "${1:-}" in
  --slow) shift; exec .venv/bin/python -m pytest "${SLOW_PAR[@]}" -m "slow and not gpu and not unsloth" "$@" ;;
  --all)  shift; lint; exec .venv/bin/python -m pytest "${PAR[@]}" -m "not gpu and not unsloth and not gguf" "$@" ;;
  *)      lint; exec .venv/bin/python -m pytest "${PAR[@]}" "$@" ;;
esac
