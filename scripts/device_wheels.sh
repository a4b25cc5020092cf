#!/usr/bin/env bash
# The wheels a lent GPU box lacks, for its Python 3.12 on manylinux x86-64, into an ignored folder that a `run`
# call carries (docs/BENCHMARKS.md, "The next GPU loan"). The box has torch, transformers, peft, accelerate,
# pyarrow, huggingface_hub, numpy, pandas, requests, tqdm, xxhash, fsspec, filelock, pyyaml and packaging
# (as seen on the lent H200, and listed in the device's KINDS.md); each wheel's Requires-Dist was read (printed
# below) so that nothing else is missing there. gpu_check.sh installs them with
# `pip install --no-index --no-deps --target`, and its preflight imports every module a selected step needs on the box
# before the first step (gpu_check/preflight.py NEEDS), naming what does not import.
#   scripts/device_wheels.sh [DIR]             the first call's set, DIR defaults to .cache/device-wheels (ignored)
#   scripts/device_wheels.sh --unsloth [DIR]   the second call's, DIR defaults to .cache/device-wheels-unsloth
#                                              (Unsloth 2026.10.9 pins trl<=1.15 and datasets<5: a set of its own)
#   scripts/device_wheels.sh --check DIR       only the trial install below, of the wheels already in DIR (no
#                                              download): what `scripts/gpu_check.sh --dry-run` runs where DIR exists
# Prints each wheel's size, the carry's total, and the total with the project and a tiny model, against the 64 MiB
# a call carries; then installs the set as the box will (`pip install --no-index --no-deps --target`, into a
# temporary folder, for the box's Python 3.12 on manylinux x86-64): two versions of one package, a wheel for
# another Python or platform, fail here rather than on the loan. Needs pip and PyPI (here, never on the box).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
# The box's interpreter and platform, for pip's compatibility checks (pip matches a manylinux tag exactly:
# bitsandbytes 0.50.2 ships manylinux_2_24, pydantic-core manylinux_2_17, lxml manylinux_2_28).
TARGET=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
trial_install() {  # DIR: install its wheels as gpu_check.sh does on the box, into a temporary folder
  local dir=$1 site
  site=$(mktemp -d)
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --only-binary=:all: "${TARGET[@]}" \
    --target "$site" "$dir"/*.whl; then
    echo "device_wheels: the $(ls "$dir"/*.whl | wc -l) wheels of $dir install with pip install --target (as on the box)"
    rm -rf "$site"
  else
    rm -rf "$site"
    echo "device_wheels: the wheels of $dir do not install together (above); the box's install would fail the same" >&2
    return 1
  fi
}
if [ "${1:-}" = "--check" ]; then
  [ -n "${2:-}" ] || { echo "usage: scripts/device_wheels.sh --check DIR" >&2; exit 2; }
  compgen -G "$2/*.whl" >/dev/null || { echo "device_wheels: no wheels in $2" >&2; exit 2; }
  trial_install "$2"
  exit $?
fi
SET=first
[ "${1:-}" = "--unsloth" ] && { SET=unsloth; shift; }
DIR=${1:-.cache/device-wheels}
[ "$SET" = unsloth ] && DIR=${1:-.cache/device-wheels-unsloth}
# Exact versions: the ones run on the H200 (trl 1.16.0 needs datasets>=3 and accelerate; datasets 5.2.0 needs dill
# <0.4.2, multiprocess<0.70.20; pydantic 2.14.4 pins pydantic-core 2.50.5 and needs typing-inspection>=0.4.4 and
# typing-extensions>=4.16.0, newer than the image may hold: carried, it shadows the image's, which is compatible).
# sacrebleu (launcher/data/task_metrics.py: chrF, the task evaluation's text metric and GRPO's reward) with what it
# imports (lxml, tabulate, portalocker, colorama; regex for its tokenizers): the versions of docker/requirements.txt,
# whatever the image's are. numpy is the image's (its torch's); it is never carried.
SACREBLEU=(sacrebleu==2.6.0 portalocker==4.4.2 tabulate==0.10.0 colorama==0.4.6 regex==2026.11.19 lxml==6.1.3)
WHEELS=(
  trl==1.16.0
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.7.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  bitsandbytes==0.50.2
  "${SACREBLEU[@]}"
)
# Unsloth without bitsandbytes (43 MB, which would not fit beside it): unsloth 2026.10.9 imports it guarded
# (unsloth/device_type.py, kernels/utils.py) and trains LoRA in 16 bit without it. Its other needs that the box
# lacks and that it imports: unsloth_zoo, torchao, cut_cross_entropy, msgspec, tyro (docstring-parser, shtab,
# typeguard), structlog, json5, nest-asyncio; diffusers and hf_transfer are named but not imported for training.
# xformers 0.0.35 as the image has it (docker/requirements-unsloth.txt; 3.3 MB, py39-none, torch>=2.10): Unsloth's
# attention takes its xformers path where it imports, and without it SDPA with a dense mask and enable_gqa, which
# lands on the MATH kernel with cuDNN off; the unsloth step records which (gpu_check/unsloth_check.py).
if [ "$SET" = unsloth ]; then
  WHEELS=(
    unsloth==2026.10.9 unsloth-zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0 typing-inspection==0.4.5 typing-extensions==4.16.0
    torchao==0.18.0 cut-cross-entropy==25.1.1 msgspec==0.23.0 tyro==1.0.17 docstring-parser==0.18.0 shtab==1.13.0
    typeguard==4.6.1 structlog==26.1.0 json5==0.17.3 nest-asyncio==1.6.0 xformers==0.0.35 "${SACREBLEU[@]}"
  )
fi
mkdir -p "$DIR"
# One version of each: a stale wheel of another version beside it stops `pip install` of the folder.
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}
  stem=${name//-/_}
  for old in "$DIR"/"$stem"-*.whl; do
    [ -f "$old" ] && [[ "$old" != *"$stem-${spec#*==}-"* ]] && rm -f "$old"
  done
done
"$PY" -m pip download -q --no-deps --only-binary=:all: "${TARGET[@]}" -d "$DIR" "${WHEELS[@]}"
echo "wheels in $DIR:"
total=0
for wheel in "$DIR"/*.whl; do
  size=$(stat -c %s "$wheel")
  total=$((total + size))
  printf '  %8.1f MB  %s\n' "$(echo "$size / 1000000" | bc -l)" "$(basename "$wheel")"
  # what each needs beyond what it names here, for a reader to check against the box's packages
  unzip -p "$wheel" '*.dist-info/METADATA' | { grep '^Requires-Dist' || true; } | { grep -v 'extra ==' || true; } \
    | sed 's/^/              /'
done
# The project as a call carries it: tracked and untracked-not-ignored files (git ls-files), plus a tiny model
# (gpu_check.sh builds it on the box: 0.6 MB here, counted for a carried one).
project=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
tiny=650000
all=$((total + project + tiny))
limit=$((64 * 1024 * 1024))
printf 'carry: %s, %d wheels, %.1f MB\n' "$DIR" "$(ls "$DIR"/*.whl | wc -l)" "$(echo "$total / 1000000" | bc -l)"
printf 'wheels %.1f MB + project %.1f MB + tiny model %.1f MB = %.1f MB of the 67.1 MB (64 MiB) a call carries\n' \
  "$(echo "$total / 1000000" | bc -l)" "$(echo "$project / 1000000" | bc -l)" "$(echo "$tiny / 1000000" | bc -l)" \
  "$(echo "$all / 1000000" | bc -l)"
[ "$all" -lt "$limit" ] || { echo "device_wheels: over the 64 MiB a call carries" >&2; exit 1; }
trial_install "$DIR"
