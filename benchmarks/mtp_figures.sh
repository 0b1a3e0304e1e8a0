#!/usr/bin/env bash
# Every MTP figure in one command: on a trained checkpoint (copied, so its folder is not written), the
# frequency-ranked draft vocabulary, acceptance and wall-clock speed-up with the full draft head and with
# K = 512, 1024, 2048 (greedy and T = 0.7), the step costs there; on random `small` weights (bf16 and fp32),
# a speculative step's cost next to a plain step's with each draft head, beside the byte bound, and, given a
# git revision, the same steps through that revision's engine.py (the bookkeeping before and after).
#
#   benchmarks/mtp_figures.sh CHECKPOINT [BASE_REV] > mtp_figures.jsonl
set -euo pipefail
ckpt=${1:?usage: benchmarks/mtp_figures.sh CHECKPOINT [BASE_REV]}
base=${2:-}
py=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$ckpt"/. "$work/ckpt"
"$py" -m dsv3 draft-vocab --model "$work/ckpt" >&2
"$py" benchmarks/mtp_speedup.py --model "$work/ckpt" --prompts 16 --new-tokens 128 --threads 1 \
    --draft-vocab 512,1024,2048 --json
"$py" benchmarks/mtp_step_cost.py --model "$work/ckpt" --context 64 --draft-vocab 512,1024,2048 --rounds 9 --json
baseline=()
if [ -n "$base" ]; then
    git show "$base:src/dsv3/infer/engine.py" > "$work/engine_before.py"
    baseline=(--baseline-engine "$work/engine_before.py")
fi
for dtype in bf16 fp32; do
    "$py" benchmarks/mtp_step_cost.py --preset small --dtype "$dtype" --draft-vocab 512,1024,2048 --rounds 9 \
        "${baseline[@]}" --json
done
