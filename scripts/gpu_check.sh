#!/usr/bin/env bash
# The one command on a lent GPU machine (Python 3.12, torch, Triton, transformers there; no package registry):
#   bash scripts/gpu_wheels.sh          # here, once: the wheels the machine lacks, into .gpu_wheels/
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu_wheels"], timeout_s=560)
# Phases, each under its own timeout, a failed one never stopping the next:
#   env      install the carried wheels into a temporary target (--no-index --no-deps), versions, nvidia-smi
#   models   the random-weight models from configs (batchrun/gpucheck/models.py)
#   kernels  the Triton kernel tests on CUDA (scripts/gpu/tests.txt)
#   gpucheck python -m batchrun.gpucheck: the figures, in $OUT/gpu.json (rewritten after each section)
#   engine   the engine and job tests on CUDA
# Everything lands in $OUT (7 files: a log per phase, gpu.json, summary.txt). The whole stops itself after
# GPU_CHECK_BUDGET_S seconds (default 480), well inside a 10-minute call. A rerun in the same lease can take a part:
# GPU_CHECK_PHASES="env models gpucheck" (default: all five) and GPU_CHECK_SECTIONS=throughput,peer (gpucheck's
# --sections). GPU_CHECK_DRY=1 (a machine without CUDA, to try the script) builds toy models and runs gpucheck
# --dry-run; the CUDA tests skip there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
PHASES="$WORK/phases"
: > "$PHASES"
export PYTHONUNBUFFERED=1 PYTHONPATH="$WORK/site:$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export BATCHRUN_COMPILE=0          # CPU references run eager: no inductor compile (nor C++ compiler) needed
export BATCHRUN_CACHE="$WORK/cache" TRITON_CACHE_DIR="$WORK/triton"
PY=python3
DRY=()
[ "${GPU_CHECK_DRY:-0}" = 1 ] && DRY=(--dry-run)

PHASES_WANTED=" ${GPU_CHECK_PHASES:-env models kernels gpucheck engine} "
SECTIONS=()
[ -n "${GPU_CHECK_SECTIONS:-}" ] && SECTIONS=(--sections "$GPU_CHECK_SECTIONS")

# phase NAME LIMIT_S COMMAND...: runs it under min(LIMIT, what the budget leaves), its output in $OUT/NAME.log
phase() {
  local name=$1 limit=$2 left t start rc
  shift 2
  [[ "$PHASES_WANTED" == *" $name "* ]] || return 0
  left=$((BUDGET - SECONDS - 5))
  t=$((limit < left ? limit : left))
  if [ "$t" -lt 15 ]; then
    echo "$name: skipped, budget spent ($SECONDS s of $BUDGET s)" | tee -a "$PHASES"
    return
  fi
  echo "== $name (limit $t s, at $SECONDS s)"
  start=$SECONDS
  timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc$([ $rc -eq 124 ] && echo ' (TIMED OUT)') after $((SECONDS - start)) s (limit $t s)" | tee -a "$PHASES"
}

env_phase() {
  if ls .gpu_wheels/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
      .gpu_wheels/*.whl || return 1
  else
    echo "no .gpu_wheels/*.whl: run scripts/gpu_wheels.sh here and carry .gpu_wheels (imports below may fail)"
  fi
  nvidia-smi || true
  $PY - <<'PY'
import importlib, sys
print(sys.version)
failed = []
for name in ("torch", "triton", "transformers", "tokenizers", "typing_extensions", "pydantic", "pydantic_core",
             "xgrammar", "jsonschema", "pyarrow", "click", "yaml", "pytest", "batchrun.engine.llm", "batchrun.job",
             "batchrun.gpucheck", "batchrun.structured"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '')} {getattr(module, '__file__', '')}")
    except Exception as exc:
        failed.append(name)
        print(f"{name}: IMPORT FAILED {type(exc).__name__}: {exc}")
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
sys.exit(1 if failed else 0)
PY
}

export -f env_phase
export WORK PY

tests_of() { sed -e 's/#.*//' scripts/gpu/tests.txt | awk -v p="$1" '$2 == p {print $1}'; }

phase env 60 bash -c env_phase
phase models 90 $PY -m batchrun.gpucheck.models --out "$WORK/models" ${DRY[@]+--toy}
# shellcheck disable=SC2046
phase kernels 120 $PY -m pytest -q -p no:cacheprovider -m "not slow" -rfE --durations=10 $(tests_of kernels)
left=$((BUDGET - SECONDS - 100))   # the engine tests keep about 90 s
phase gpucheck $((left > 260 ? 260 : left)) $PY -m batchrun.gpucheck "${DRY[@]}" "${SECTIONS[@]}" \
  --models "$WORK/models" --json "$OUT/gpu.json" --deadline-s $((left > 260 ? 200 : left - 60))
# shellcheck disable=SC2046
phase engine 120 $PY -m pytest -q -p no:cacheprovider -m "not slow" -rfE --durations=10 $(tests_of engine)

{
  echo "gpu_check.sh $(date -u +%FT%TZ), $SECONDS s of a $BUDGET s budget"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  cat "$PHASES"
  for name in kernels engine; do
    [ -f "$OUT/$name.log" ] && { echo "$name tests: $(tail -n 1 "$OUT/$name.log")"; grep -E '^(FAILED|ERROR) ' "$OUT/$name.log" | head -n 15; }
  done
  if [ -f "$OUT/gpu.json" ]; then
    $PY -m batchrun.gpucheck.summary "$OUT/gpu.json" 2>&1
  else
    echo "gpucheck: no gpu.json"; tail -n 5 "$OUT/gpucheck.log" 2>/dev/null
  fi
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
status=0
grep -qv ': exit 0 ' "$PHASES" && status=1   # a phase failed, timed out or was skipped
rm -rf "$WORK"
exit $status
