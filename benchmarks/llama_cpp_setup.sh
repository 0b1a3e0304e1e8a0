#!/usr/bin/env bash
# llama.cpp for benchmarks/decode_speed.py's comparison rows, built in minutes instead of the tens of minutes
# `pip install llama-cpp-python` takes on a small CPU: it downloads the llama-cpp-python source release (the
# Python bindings plus the llama.cpp source they were written against), builds only the llama library with
# CMake for this CPU, and prints the environment that makes the bindings load it.
#
#   bash benchmarks/llama_cpp_setup.sh [DIR]          # default DIR: ./llama.cpp-bench
#   eval "$(bash benchmarks/llama_cpp_setup.sh --env [DIR])"
#   .venv/bin/python benchmarks/decode_speed.py --llama-convert "$DSV3_LLAMA_CONVERT"
#
# --avx2 (before DIR; default DIR ./llama.cpp-bench-avx2) builds for CPUs without AVX-512 instead of for this
# one (GGML_NATIVE off: SSE4.2, AVX, AVX2, BMI2, FMA, F16C, as llama.cpp's x86 build does by default), the
# llama.cpp that decode_speed.py --avx2 runs beside dsv3's AVX2 kernels on a CPU that has AVX-512:
#
#   bash benchmarks/llama_cpp_setup.sh --avx2 && eval "$(bash benchmarks/llama_cpp_setup.sh --avx2 --env)"
#
# Needs cmake, a C/C++ compiler and the package index; the bindings' own dependencies (numpy, diskcache,
# jinja2) are installed into .venv. CI never runs this.
set -euo pipefail

VERSION=0.3.36  # llama-cpp-python release (its vendor/llama.cpp is the matching llama.cpp source)
env_only=0
native=ON
default_dir=llama.cpp-bench
while [[ "${1:-}" == --* ]]; do
    case "$1" in
        --env) env_only=1 ;;
        --avx2) native=OFF; default_dir=llama.cpp-bench-avx2 ;;
        *) echo "error: unknown option $1 (options: --env, --avx2)" >&2; exit 2 ;;
    esac
    shift
done
dir=$(realpath -m "${1:-$default_dir}")
src="$dir/llama_cpp_python-$VERSION"
lib="$dir/build/bin"

print_env() {
    echo "export PYTHONPATH=\"$src:$src/vendor/llama.cpp/gguf-py\${PYTHONPATH:+:\$PYTHONPATH}\""
    echo "export LLAMA_CPP_LIB_PATH=\"$lib\""
    echo "export DSV3_LLAMA_CONVERT=\"$src/vendor/llama.cpp/convert_hf_to_gguf.py\""
    echo "export DSV3_LLAMA_QUANTIZE=\"$lib/llama-quantize\""
}

if [[ $env_only == 1 ]]; then
    [[ -f "$lib/libllama.so" ]] || { echo "error: no build in $dir (run without --env first)" >&2; exit 2; }
    print_env
    exit 0
fi

for tool in cmake c++ cc; do
    command -v "$tool" >/dev/null || { echo "error: $tool not found" >&2; exit 2; }
done
mkdir -p "$dir"
if [[ ! -d "$src" ]]; then
    .venv/bin/python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$dir"
    tar -xzf "$dir/llama_cpp_python-$VERSION.tar.gz" -C "$dir"
fi
.venv/bin/python -m pip install -q numpy diskcache jinja2
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$src/vendor/llama.cpp" -B "$dir/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=$native -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON >"$dir/cmake.log"
# llama-quantize writes the Q4_0 GGUF beside the converter's Q8_0 one (decode_speed.py's integer rows)
cmake --build "$dir/build" --target llama llama-quantize -j "$(nproc)" >"$dir/build.log"
echo "built $lib/libllama.so; to use it:" >&2
print_env
