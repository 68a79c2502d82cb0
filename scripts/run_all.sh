#!/usr/bin/env bash
# Regenerate every result under results/ (json + png + md per experiment).
#
#   scripts/run_all.sh          CPU settings: host-side simulations and arithmetic (minutes)
#   scripts/run_all.sh --gpu    also the GPU settings (Llama-3-8B shapes, random bf16 weights,
#                               one NVIDIA H200)
#   scripts/run_all.sh --out_dir=DIR    write somewhere else than results/
#
# Each experiment records the exact command that made it in its json and md.
set -euo pipefail
cd "$(dirname "$0")/.."

GPU=0
OUT_DIR=results
for arg in "$@"; do
  case "$arg" in
    --gpu) GPU=1 ;;
    --out_dir=*) OUT_DIR="${arg#--out_dir=}" ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (expected --gpu, --out_dir=DIR)" >&2; exit 2 ;;
  esac
done

export PYTHONPATH=.
OUT_FLAG=()
if [[ "$OUT_DIR" != results ]]; then OUT_FLAG=(--out_dir="$OUT_DIR"); fi

run() {
  echo "== $*" >&2
  python3 "$@" "${OUT_FLAG[@]}"
}

# CPU settings: no accelerator needed.
run experiments/capacity.py --setting=cpu
run experiments/kv_utilization.py --setting=cpu

if [[ "$GPU" == 1 ]]; then
  # Let JAX plan against nearly the whole device, as a serving engine would.
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"
  # Writes capacity_device.{json,md,png}: the plans plus weights and pool allocated on the device.
  run experiments/capacity.py --setting=gpu
fi
echo "done: results in $OUT_DIR/" >&2
