#!/usr/bin/env bash
# Regenerate the results under results/ (json + png + md per experiment).
#
#   scripts/run_all.sh              CPU settings: simulations, arithmetic, and the serving
#                                   experiments on the embedded tiny model (about 15 minutes
#                                   on two cores)
#   scripts/run_all.sh --gpu        GPU settings only (one NVIDIA H200: Llama-3-8B shapes with
#                                   random bf16 weights; under 10 minutes: each sweep runs its
#                                   points in priority order within its time budget and within
#                                   $PAXKV_GPU_TIME_S seconds, default 530, for the whole GPU
#                                   part). Files: <name>_gpu.*, capacity_device.*
#   scripts/run_all.sh --all        both
#   scripts/run_all.sh --out_dir=DIR    write somewhere else than results/
#   scripts/run_all.sh --only=a,b   run only these experiments (file stems)
#
# With --gpu, when the environment variable OUT names a directory, every GPU result is also
# packed into one archive, $OUT/paxkv_gpu_results.tar (rebuilt after each experiment, so a
# run cut short still leaves what finished), next to the run's log, $OUT/run_all_gpu.log.
# Each experiment records the exact command that made it in its json and md.
set -euo pipefail
cd "$(dirname "$0")/.."

CPU=1
GPU=0
OUT_DIR=results
ONLY=""
for arg in "$@"; do
  case "$arg" in
    --gpu) CPU=0; GPU=1 ;;
    --all) CPU=1; GPU=1 ;;
    --out_dir=*) OUT_DIR="${arg#--out_dir=}" ;;
    --only=*) ONLY=",${arg#--only=}," ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (expected --gpu, --all, --out_dir=DIR, --only=a,b)" >&2; exit 2 ;;
  esac
done

export PYTHONPATH=.
mkdir -p "$OUT_DIR"
OUT_FLAG=()
if [[ "$OUT_DIR" != results ]]; then OUT_FLAG=(--out_dir="$OUT_DIR"); fi

PACK=""
if [[ "$GPU" == 1 && -n "${OUT:-}" && -d "${OUT:-}" ]]; then
  PACK="$OUT/paxkv_gpu_results.tar"
  exec > >(tee -a "$OUT/run_all_gpu.log") 2>&1
fi

# Pack every GPU result written so far into the one archive.
pack() {
  [[ -n "$PACK" ]] || return 0
  local files=()
  for f in "$OUT_DIR"/*_gpu.* "$OUT_DIR"/capacity_device.*; do
    if [[ -e "$f" ]]; then files+=("$(basename "$f")"); fi
  done
  if ((${#files[@]})); then tar -cf "$PACK.tmp" -C "$OUT_DIR" "${files[@]}" && mv "$PACK.tmp" "$PACK"; fi
}

FAILED=()
run() {
  local script="$1"; shift
  local stem; stem="$(basename "$script" .py)"
  if [[ -n "$ONLY" && "$ONLY" != *",$stem,"* ]]; then return 0; fi
  echo "== $(date +%H:%M:%S) $script $*" >&2
  local t0=$SECONDS
  if python3 "$script" "$@" "${OUT_FLAG[@]}"; then
    echo "== $stem $* done in $((SECONDS - t0)) s" >&2
  else
    echo "== $stem $* FAILED after $((SECONDS - t0)) s" >&2
    FAILED+=("$stem $*")
  fi
  pack
}

if [[ "$CPU" == 1 ]]; then
  # Host-side simulations and arithmetic.
  run experiments/capacity.py --setting=cpu
  run experiments/kv_utilization.py --setting=cpu
  # The engine on the embedded tiny model; kept off the accelerator so that "cpu" means CPU.
  JAX_PLATFORMS=cpu run experiments/kernel_overhead.py --setting=cpu
  JAX_PLATFORMS=cpu run experiments/throughput_vs_rate.py --setting=cpu
  JAX_PLATFORMS=cpu run experiments/block_size_ablation.py --setting=cpu
  JAX_PLATFORMS=cpu run experiments/sharing_savings.py --setting=cpu
  JAX_PLATFORMS=cpu run experiments/preemption.py --setting=cpu
fi

if [[ "$GPU" == 1 ]]; then
  # Let JAX plan against nearly the whole device, as a serving engine would.
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"
  # Llama-3-8B programs take seconds each to compile; experiments that share an engine
  # geometry find each other's programs in this cache instead of compiling them again.
  export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/paxkv/jax}"
  mkdir -p "$JAX_COMPILATION_CACHE_DIR"
  # Every sweep stops starting new points once this many seconds of the GPU part have passed
  # (each experiment also has its own budget in configs/experiments.py): the whole GPU part
  # then fits a 10-minute slot, whatever one experiment costs.
  export PAXKV_DEADLINE="${PAXKV_DEADLINE:-$(( $(date +%s) + ${PAXKV_GPU_TIME_S:-530} ))}"
  # Cheapest first, so that a run cut short keeps the most results.
  run experiments/kernel_overhead.py --setting=gpu
  # Writes capacity_device.{json,md,png}: the plans plus weights and pool allocated on the device.
  run experiments/capacity.py --setting=gpu
  run experiments/throughput_vs_rate.py --setting=gpu
  run experiments/sharing_savings.py --setting=gpu
  # Same engine geometry, block size by block size: preemption reuses these programs.
  run experiments/block_size_ablation.py --setting=gpu
  run experiments/preemption.py --setting=gpu
fi

if ((${#FAILED[@]})); then
  echo "FAILED: ${FAILED[*]}" >&2
  exit 1
fi
echo "done: results in $OUT_DIR/${PACK:+ and $PACK}" >&2
