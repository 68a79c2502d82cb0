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
#   scripts/run_all.sh --gpu --part=N   one resumable part of the full GPU set (N = 1..7, most
#                                   valuable first; `--part=list` lists them): one experiment,
#                                   resumed from results/<name>_gpu.json when that exists, within
#                                   $PAXKV_PART_BUDGET_S seconds (default 450) of starting points,
#                                   so one part fits a 10-minute slot. Run a part again until it
#                                   reports "complete"; commit its files to results/ between runs.
#   scripts/run_all.sh --gpu --resume   every GPU sweep resumes from results/<name>_gpu.json
#   PAXKV_RESUME_SINCE=2026-12-01T21:00:00Z scripts/run_all.sh --gpu --part=N
#                                   resume keeping only the points measured since that UTC time:
#                                   older points (an older engine's) are measured again
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
PART=""
RESUME=0
# The parts of the full GPU set, most valuable first: the four figures that have no GPU result
# yet, then the sweeps whose first GPU run stopped after its first points.
GPU_PARTS=(sampling_vs_rate shared_prefix chatbot batched_requests block_size_ablation preemption sharing_savings)
for arg in "$@"; do
  case "$arg" in
    --gpu) CPU=0; GPU=1 ;;
    --all) CPU=1; GPU=1 ;;
    --out_dir=*) OUT_DIR="${arg#--out_dir=}" ;;
    --only=*) ONLY=",${arg#--only=}," ;;
    --part=*) PART="${arg#--part=}" ;;
    --resume) RESUME=1 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (expected --gpu, --all, --out_dir=DIR, --only=a,b, --part=N, --resume)" >&2; exit 2 ;;
  esac
done

if [[ "$PART" == list ]]; then
  for i in "${!GPU_PARTS[@]}"; do echo "part $((i + 1)): ${GPU_PARTS[$i]}"; done
  exit 0
fi
if [[ -n "$PART" ]]; then
  if [[ "$GPU" != 1 || "$CPU" == 1 ]]; then echo "--part needs --gpu" >&2; exit 2; fi
  if ! [[ "$PART" =~ ^[0-9]+$ ]] || ((PART < 1 || PART > ${#GPU_PARTS[@]})); then
    echo "--part must be 1..${#GPU_PARTS[@]} (see --part=list), got $PART" >&2; exit 2
  fi
  ONLY=",${GPU_PARTS[$((PART - 1))]},"
  RESUME=1
fi

export PYTHONPATH=.
mkdir -p "$OUT_DIR"
OUT_FLAG=(--out_dir="$OUT_DIR")   # the experiments themselves default to scratch/results

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

# Whether a sweep's json holds every point, or which points a later run (resumed) must add.
report() {
  [[ -e "$1" ]] || return 0
  python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))["results"]
if "complete" not in r: sys.exit(0)
left = ", ".join(r.get("skipped") or []) or "none"
print(f"== {sys.argv[1]}: " + ("complete" if r["complete"] else f"incomplete, run it again to resume (left: {left})"),
      file=sys.stderr)' "$1"
}

FAILED=()
run() {
  local script="$1"; shift
  local stem; stem="$(basename "$script" .py)"
  if [[ -n "$ONLY" && "$ONLY" != *",$stem,"* ]]; then return 0; fi
  if [[ "$RESUME" == 1 && " $* " == *" --setting=gpu "* && " ${GPU_PARTS[*]} " == *" $stem "* ]]; then
    # Resume from the committed partial result; a part has its own budget for starting points.
    set -- "$@" --resume_from="results/${stem}_gpu.json"
    if [[ -n "${PAXKV_RESUME_SINCE:-}" ]]; then set -- "$@" --resume_measured_since="$PAXKV_RESUME_SINCE"; fi
    if [[ -n "$PART" ]]; then set -- "$@" --time_budget_s="${PAXKV_PART_BUDGET_S:-450}"; fi
  fi
  echo "== $(date +%H:%M:%S) $script $*" >&2
  local t0=$SECONDS
  if python3 "$script" "$@" "${OUT_FLAG[@]}"; then
    echo "== $stem $* done in $((SECONDS - t0)) s" >&2
    if [[ " $* " == *" --setting=gpu "* ]]; then report "$OUT_DIR/${stem}_gpu.json"; fi
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
  # The latency-against-load figures beyond Fig. 12 (real-time runs: a few minutes each).
  JAX_PLATFORMS=cpu run experiments/batched_requests.py --setting=cpu
  JAX_PLATFORMS=cpu run experiments/sampling_vs_rate.py --setting=cpu
  JAX_PLATFORMS=cpu run experiments/shared_prefix.py --setting=cpu
  JAX_PLATFORMS=cpu run experiments/chatbot.py --setting=cpu
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
  # The figures added since (each about 3-8 minutes: they need --part or a larger
  # PAXKV_GPU_TIME_S to get through).
  run experiments/sampling_vs_rate.py --setting=gpu
  run experiments/shared_prefix.py --setting=gpu
  run experiments/chatbot.py --setting=gpu
  run experiments/batched_requests.py --setting=gpu
fi

if ((${#FAILED[@]})); then
  echo "FAILED: ${FAILED[*]}" >&2
  exit 1
fi
echo "done: results in $OUT_DIR/${PACK:+ and $PACK}" >&2
