#!/usr/bin/env bash
# The RL loop at the 0.5B shape on one GPU (configs/synthetic_0.5B_gpu.yaml), with the GPU's
# utilisation and memory sampled every 0.5 s beside it; leaves in OUT_DIR the run's log, its
# metrics.jsonl and SFT's (sft_metrics.jsonl), results.json, the rollout server's log, the
# run's own log (run_log.txt: programs compiled ahead, shapes met), the samples (gpu.csv) and
# the compilation summary (compile_share.md); the run directory itself
# (checkpoints, exports: gigabytes) is removed at the end. Records numbers, asserts nothing.
# Usage: bash benchmarks/gpu_loop.sh OUT_DIR [TIME_LIMIT_S [KEY=VALUE ...]]
set -u
out=${1:?usage: gpu_loop.sh OUT_DIR [TIME_LIMIT_S [KEY=VALUE ...]]}
limit=${2:-480}
shift $(( $# < 2 ? $# : 2 ))
work=$(mktemp -d)
run_dir=$work/run
mkdir -p "$out"
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits \
    -lms 500 >"$out/gpu.csv" 2>/dev/null &
sampler=$!
start=$(date +%s)
timeout "$limit" python3 -m areal_jax.cli train --config configs/synthetic_0.5B_gpu.yaml \
    run_dir="$run_dir" "$@" >"$out/train.log" 2>&1
echo "exit $? after $(( $(date +%s) - start )) s" >>"$out/train.log"
kill "$sampler" 2>/dev/null
trap 'rm -rf "$work"' EXIT
for f in metrics.jsonl results.json logs/rollout_server_0.log; do
    [ -f "$run_dir/$f" ] && cp "$run_dir/$f" "$out/"
done
[ -f "$run_dir/sft/metrics.jsonl" ] && cp "$run_dir/sft/metrics.jsonl" "$out/sft_metrics.jsonl"
[ -f "$run_dir/logs/train.log" ] && cp "$run_dir/logs/train.log" "$out/run_log.txt"
python3 benchmarks/compile_share.py "$run_dir" >"$out/compile_share.md" 2>&1
tail -5 "$out/train.log"
