#!/usr/bin/env bash
# CMake flags for building llama-cpp-python on this CPU: the instruction sets /proc/cpuinfo reports, but never AMX.
# (llama.cpp's AMX kernels segfault on some virtual machines that report amx_int8, and a native build turns them on.)
set -euo pipefail
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]]; }
args=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
[ "$(uname -m)" = x86_64 ] || { echo "${args[@]:0:1}"; exit 0; }   # non-x86: let llama.cpp pick (no AMX there)
has avx && args+=(-DGGML_AVX=ON)
has avx2 && args+=(-DGGML_AVX2=ON)
has fma && args+=(-DGGML_FMA=ON)
has f16c && args+=(-DGGML_F16C=ON)
has bmi2 && args+=(-DGGML_BMI2=ON)
has avx_vnni && args+=(-DGGML_AVX_VNNI=ON)
if has avx512f; then
  args+=(-DGGML_AVX512=ON)
  has avx512vbmi && args+=(-DGGML_AVX512_VBMI=ON)
  has avx512_vnni && args+=(-DGGML_AVX512_VNNI=ON)
  has avx512_bf16 && args+=(-DGGML_AVX512_BF16=ON)
fi
echo "${args[@]}"
