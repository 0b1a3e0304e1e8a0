#!/usr/bin/env bash
# GPU checks for a lent CUDA machine (written for one H200): each component's CUDA paths, checked for
# correctness against the CPU reference and timed. Output: JSON lines on stdout. Must finish in < 8 min
# (one device call may run 10).
#
#   bash benchmarks/gpu_check.sh            # all sections
#   bash benchmarks/gpu_check.sh fp8_gemm   # only the named sections
#
# Adding a component: write benchmarks/gpu_<name>.py (JSON lines out, exit 1 on a failed check, keep it
# well under a minute) and add `run_section <name>` at the bottom.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SECTION_TIMEOUT=${SECTION_TIMEOUT:-150}

# The GPU image brings its own CUDA torch: never reinstall over it. Install (with our pins) only where
# torch is missing; otherwise import dsv3 straight from the source tree.
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q -c constraints.txt -e . >&2 || { echo '{"check": "setup", "error": "pip install failed"}'; exit 1; }
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

"$PY" - <<'PYEOF'
import json, platform, torch
print(json.dumps({"check": "machine", "python": platform.python_version(), "torch": torch.__version__,
                  "cuda": torch.version.cuda, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))
PYEOF

failed=()
run_section() {  # name [timeout in seconds, default SECTION_TIMEOUT]
    local name=$1 limit=${2:-$SECTION_TIMEOUT}
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    local start=$SECONDS
    timeout "$limit" "$PY" "benchmarks/gpu_${name}.py"
    local rc=$?
    echo "{\"check\": \"section\", \"name\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}"
    [ "$rc" -eq 0 ] || failed+=("$name")
}
ONLY="$*"

run_section fp8_gemm
run_section model
run_section logfmt
run_section accumulation
run_section ep
run_section decode
run_section static_decode
run_section graph_decode
run_section big_decode 180  # a 31 GB model: made on the GPU, two graphs compiled
run_section seam

if [ "${#failed[@]}" -gt 0 ]; then
    echo "{\"check\": \"summary\", \"failed\": \"${failed[*]}\"}"
    exit 1
fi
echo '{"check": "summary", "failed": ""}'
