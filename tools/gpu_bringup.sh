#!/usr/bin/env bash
# One-shot GPU bring-up: the pre-flight check, expert numerics, MoE-layer speed, a short training
# run and what only a GPU confirms (empty FP8 experts under CUDA_LAUNCH_BLOCKING=1, the syncs and the
# exposed exchanges of a step with overlap on), in one report (tools/gpu_bringup.py says what each
# section measures; --only 5 runs the last alone).
#
#   bash tools/gpu_bringup.sh --prepare              # with network: wheels a bare GPU box lacks -> .whl/
#   bash tools/gpu_bringup.sh [--out DIR] [ARGS...]  # on the GPU box (no network needed): DIR/gpu_bringup.md
#   bash tools/gpu_bringup.sh --cpu-smoke --out DIR  # the same script on CPU at toy sizes (CI runs it)
#
# A box with PyTorch (CUDA), numpy, PyYAML and transformers but without hydra-core / omegaconf gets
# them from .whl/ (pure-Python wheels, filled by --prepare and carried with the source tree), installed
# with `pip install --no-index --no-deps --target .whl/site`. The run is bounded: 8 minutes in all
# (FOLDING_BRINGUP_LIMIT_S), and each section starts only if its expected time is left.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
LIMIT_S=${FOLDING_BRINGUP_LIMIT_S:-480}
# the packages (and versions) the engine's entry point needs beyond what the GPU box has
PINS=(hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3)

if [[ "${1:-}" == "--prepare" ]]; then
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  # pure-Python wheels serve any Python 3 (the box runs 3.12); antlr4's runtime is published as an sdist only,
  # so it is built into a wheel here
  pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 -d "$WHEELS" "${PINS[0]}" "${PINS[1]}"
  pip wheel --quiet --no-deps -w "$WHEELS" "${PINS[2]}"
  ls -l "$WHEELS"
  wheels_kib=$(du -sk "$WHEELS" | cut -f1)
  tree_kib=$(git ls-files -z | du -ck --files0-from=- | tail -1 | cut -f1)
  echo "wheel folder $WHEELS: $((wheels_kib)) KiB; tracked source tree: $((tree_kib)) KiB;" \
       "together $(( (wheels_kib + tree_kib) / 1024 )) MiB of the 64 MiB that travel with the tree"
  if (( wheels_kib + tree_kib > 64 * 1024 )); then
    echo "error: more than 64 MiB; remove what is not needed from $WHEELS" >&2
    exit 1
  fi
  exit 0
fi

# FOLDING_BRINGUP_USE_WHEELS=1 takes the wheels even where the packages are installed (to check them)
if [[ -n "${FOLDING_BRINGUP_USE_WHEELS:-}" ]] || ! python -c "import hydra, omegaconf" 2>/dev/null; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "error: hydra-core / omegaconf are not installed and $WHEELS/ holds no wheels:" \
         "run 'bash tools/gpu_bringup.sh --prepare' on a machine with network and carry $WHEELS/ along" >&2
    exit 2
  fi
  rm -rf "$WHEELS/site"
  if ! python -m pip install --quiet --no-index --no-deps --target "$WHEELS/site" "$WHEELS"/*.whl; then
    # no pip: a pure-Python wheel is a zip of the package, so unpacking it installs it
    python -c 'import glob, sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1] + "/site") for w in glob.glob(sys.argv[1] + "/*.whl")]' "$WHEELS"
  fi
  export PYTHONPATH="$WHEELS/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the script's own deadline leaves a margin inside the hard limit for writing the report
exec timeout --signal=TERM --kill-after=20 "$LIMIT_S" python -m tools.gpu_bringup --deadline-s $((LIMIT_S - 30)) "$@"
