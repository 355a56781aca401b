#!/usr/bin/env bash
# Build (once per source change, cached) the llama-cpp-python wheel speculant runs on, and print its path.
#
# The wheel is portable: llama.cpp's CPU backend is built once per ISA level (GGML_BACKEND_DL +
# GGML_CPU_ALL_VARIANTS; libggml-cpu-<variant>.so) and the best one for the CPU is picked by CPUID at run
# time (speculant/backends/llamacpp.py loads them). No instruction set is chosen here, so a wheel built on
# an AVX-512 machine runs on an AVX2-only one and back; it is cached by the hash of everything that goes
# into it (sdist, patch, flags), never by the machine.
#
# What goes in: the pinned llama-cpp-python sdist (sha256-checked), our patch (native/*.patch: the variant
# list, the build reporting itself in llama_print_system_info, and a hook that sends passes of a few tokens
# to our batch-invariant kernels, native/src/speculant-mm.c, and lets llamafile's sgemm serve only passes over
# more tokens, i.e. prompt processing). Weights load repacked (our kernels keep the repacked layout invariant).
# The AMX
# variant is left out (its matmul path crashed on quantized models).
#
#   native/build-llama.sh            # -> prints .../llama_cpp_python-0.3.36+spec.<key>-py3-none-linux_x86_64.whl
#   PIP=.venv/bin/pip JOBS=2 native/build-llama.sh
set -euo pipefail

VERSION=0.3.36
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
VARIANTS=x64,haswell,skylakex,icelake,zen4   # x86 ISA levels: baseline, AVX2, AVX-512, +VBMI/VNNI, +BF16
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${SPECULANT_HOME:-$HOME/.cache/speculant}/wheels"
PIP="${PIP:-python3 -m pip}"
export CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-$(nproc)}"

CMAKE_FLAGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_CPU_VARIANTS=$VARIANTS \
-DGGML_LLAMAFILE=ON -DGGML_RPC=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
KEY="$( (echo "$VERSION $SDIST_SHA256 $CMAKE_FLAGS"; cat "$HERE"/*.patch "$HERE"/src/* "$0") | sha256sum | cut -c1-12)"
LOCAL_VERSION="$VERSION+spec.$KEY"

mkdir -p "$CACHE"
for whl in "$CACHE"/llama_cpp_python-"$LOCAL_VERSION"-*.whl; do
  if [ -f "$whl" ]; then echo "$whl"; exit 0; fi
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/speculant-llama.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT INT TERM
SDIST="$CACHE/llama_cpp_python-$VERSION.tar.gz"
if ! echo "$SDIST_SHA256  $SDIST" | sha256sum -c --status 2>/dev/null; then
  echo "fetching the llama-cpp-python $VERSION sdist" >&2
  $PIP download -q --disable-pip-version-check --no-deps --no-binary :all: -d "$WORK/dl" "llama-cpp-python==$VERSION" >&2
  echo "$SDIST_SHA256  $WORK/dl/llama_cpp_python-$VERSION.tar.gz" | sha256sum -c --status \
    || { echo "build-llama: the sdist's sha256 is not $SDIST_SHA256" >&2; exit 1; }
  mv "$WORK/dl/llama_cpp_python-$VERSION.tar.gz" "$SDIST.part" && mv "$SDIST.part" "$SDIST"
fi
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION"
for p in "$HERE"/*.patch; do
  patch -s -p1 -d "$SRC" < "$p" || { echo "build-llama: $p does not apply to llama-cpp-python $VERSION" >&2; exit 1; }
done
mkdir -p "$SRC/vendor/llama.cpp/ggml/src/ggml-cpu/speculant"  # our kernels (native/src), wired in by the patch
cp "$HERE"/src/* "$SRC/vendor/llama.cpp/ggml/src/ggml-cpu/speculant/"
sed -i "s/^__version__ = \"$VERSION\"/__version__ = \"$LOCAL_VERSION\"/" "$SRC/llama_cpp/__init__.py"
grep -q "$LOCAL_VERSION" "$SRC/llama_cpp/__init__.py" || { echo "build-llama: cannot set the version" >&2; exit 1; }
LLAMA_COMMIT="$(git -C "$SRC/vendor/llama.cpp" rev-parse HEAD 2>/dev/null || echo unknown)"
printf '{"version": "%s", "key": "%s", "llama_cpp_commit": "%s", "cmake_args": "%s", "variants": "%s"}\n' \
  "$LOCAL_VERSION" "$KEY" "$LLAMA_COMMIT" "$CMAKE_FLAGS -DSPECULANT_BUILD=$KEY" "$VARIANTS" \
  > "$SRC/llama_cpp/speculant_build.json"

echo "building llama-cpp-python $LOCAL_VERSION (llama.cpp, CPU variants $VARIANTS; ~10-15 min on 2 cores)" >&2
CMAKE_ARGS="$CMAKE_FLAGS -DSPECULANT_BUILD=$KEY" $PIP wheel -q --disable-pip-version-check --no-deps \
  -w "$WORK/wheel" "$SRC" > "$WORK/build.log" 2>&1 || { tail -n 40 "$WORK/build.log" >&2; exit 1; }
built="$(ls "$WORK"/wheel/llama_cpp_python-*.whl)"
name="$(basename "$built")"
cp "$built" "$CACHE/$name.part" && mv "$CACHE/$name.part" "$CACHE/$name"
echo "$CACHE/$name"
