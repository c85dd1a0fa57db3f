#!/usr/bin/env bash
# Build llama.cpp's own HTTP server (llama-server) from the llama.cpp sources that the pinned llama-cpp-python source
# distribution vendors, with the same CPU flags as the Python binding (tools/llama_cmake_args.sh), the web UI off and
# nothing else downloaded. Idempotent: the binary is cached at .cache/llama-server/<version>-<flags hash>/llama-server
# and the build is skipped when it exists. Prints the binary's path on its last line.
# Only the llama-server target and what it links (libllama, ggml, common, mtmd) is compiled, never llama.cpp's other
# tools, tests or examples; on every core unless told (jobs: the argument, else $CMAKE_BUILD_PARALLEL_LEVEL, else nproc).
# Usage: bash tools/build_llama_server.sh [jobs]     (about 4-8 minutes on 2 cores, once)
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${1:-${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}}
PY=${VENV:-.venv}/bin/python
version=$(grep -o 'llama-cpp-python[^ ]*==[0-9.]*' settings.ini | sed 's/.*==//')
flags=$(bash tools/llama_cmake_args.sh)
tag="$version-$(echo "$flags" | sha256sum | cut -c1-10)"
out="$PWD/.cache/llama-server/$tag"
if [ -x "$out/llama-server" ]; then echo "$out/llama-server"; exit 0; fi
mkdir -p "$out"
work=$(mktemp -d "$out/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" >&2
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
t0=$(date +%s)
# shellcheck disable=SC2086
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF $flags >&2
cmake --build "$work/build" --target llama-server -j "$JOBS" >&2
cp "$work/build/bin/llama-server" "$out/llama-server.tmp" && mv "$out/llama-server.tmp" "$out/llama-server"
echo "built llama-server $version in $(( $(date +%s) - t0 )) s with $JOBS jobs (flags: $flags)" | tee "$out/BUILD_INFO" >&2
echo "$out/llama-server"
