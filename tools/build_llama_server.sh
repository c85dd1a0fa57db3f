#!/usr/bin/env bash
# Build llama.cpp's own HTTP server (llama-server) from the llama.cpp sources that the pinned llama-cpp-python source
# distribution vendors, linked against the binding's own compiled libllama and ggml (tools/link_binding_libs.py): the
# server and the local backend then run the very same model code, and only llama-server, its common library and
# libmtmd are compiled here (libllama and ggml, most of llama.cpp, were compiled once by `make install`). Web UI off,
# nothing downloaded but the sdist. Idempotent: the binary and copies of the libraries it loads are cached at
# .cache/llama-server/<version>-<flags hash>-<libllama hash>/ and the build is skipped when they exist. Prints the
# binary's path on its last line. On every core unless told (jobs: the argument, else $CMAKE_BUILD_PARALLEL_LEVEL, else nproc).
# Usage: bash tools/build_llama_server.sh [jobs]     (a few minutes on 2 cores, once)
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${1:-${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}}
PY=${VENV:-.venv}/bin/python
version=$(grep -o 'llama-cpp-python[^ ]*==[0-9.]*' settings.ini | sed 's/.*==//')
installed=$("$PY" -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))" 2>/dev/null || echo none)
if [ "$installed" != "$version" ]; then
  echo "llama-server links the binding's libraries: llama-cpp-python $version must be installed (found: $installed); run make install" >&2
  exit 1
fi
libdir=$("$PY" -c "import importlib.util as u, pathlib; print(pathlib.Path(u.find_spec('llama_cpp').origin).parent / 'lib')")
flags=$(bash tools/llama_cmake_args.sh)
tag="$version-$(echo "$flags" | sha256sum | cut -c1-10)-$(sha256sum "$libdir/libllama.so" | cut -c1-8)"
out="$PWD/.cache/llama-server/$tag"
if [ -x "$out/llama-server" ]; then echo "$out/llama-server"; exit 0; fi
mkdir -p "$out"
work=$(mktemp -d "$out/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" >&2
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
"$PY" tools/link_binding_libs.py "$src" "$libdir"
t0=$(date +%s)
# shellcheck disable=SC2086
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_COMMON=ON \
      -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' $flags >&2
cmake --build "$work/build" --target llama-server -j "$JOBS" >&2
# the libraries under their SONAMEs beside the binary (its RPATH is $ORIGIN): a later reinstall of the binding
# cannot change the code a cached server runs
for lib in llama ggml ggml-base ggml-cpu; do
  soname=$(objdump -p "$libdir/lib$lib.so" | awk '/SONAME/ {print $2}')
  cp -L "$libdir/lib$lib.so" "$out/${soname:-lib$lib.so}"
done
cp "$work/build/bin/llama-server" "$out/llama-server.tmp"
if LD_LIBRARY_PATH= ldd "$out/llama-server.tmp" | grep -E 'lib(llama|ggml)' | grep -v "$out/" >&2; then
  echo "llama-server would load libraries from outside $out (above)" >&2; exit 1
fi
mv "$out/llama-server.tmp" "$out/llama-server"
echo "built llama-server $version in $(( $(date +%s) - t0 )) s with $JOBS jobs, on the binding's libllama and ggml (flags: $flags)" | tee "$out/BUILD_INFO" >&2
echo "$out/llama-server"
