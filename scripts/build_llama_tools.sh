#!/usr/bin/env bash
# Build llama.cpp's own tools (the benchmark's peers: speculative decoding, lookup, llama-bench) the way a
# user gets them: the llama.cpp sources vendored in the llama-cpp-python sdist we pin, built with llama.cpp's
# OWN defaults (GGML_NATIVE=ON, llamafile sgemm, repacking and the tiled kernels on), not our exactness flags.
# A native build runs only on the CPU it was built for, so the tools are kept per CPU (a hash of its model and
# flags): a machine of another kind builds its own.
#
#   scripts/build_llama_tools.sh            # -> prints $SPECULANT_HOME/llama-tools/<cpu>/bin
#   JOBS=4 scripts/build_llama_tools.sh
#
# Idempotent: exits at once when every tool is already built for this CPU. Run it with `nice -n 19` on a
# shared machine.
set -euo pipefail

VERSION=0.3.36
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
HOME_DIR="${SPECULANT_HOME:-$HOME/.cache/speculant}"
# llama.cpp's AMX kernels (compiled in by a native build on CPUs with AMX) crash on our quantized models
# (llama-bench segfaults while repacking Q4_K/Q6_K into its AMX buffer, on the default flags). A user who meets
# that builds without AMX and keeps every other default (the CPU_REPACK kernels included), and so do we.
NATIVE_FLAGS=""
if grep -m1 '^flags' /proc/cpuinfo | grep -qw amx_int8; then
  NATIVE_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
CPU_KEY="$( (grep -m1 '^model name' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo; echo "$NATIVE_FLAGS") | sha256sum | cut -c1-10)"
OUT="${LLAMA_TOOLS_DIR:-$HOME_DIR/llama-tools/$CPU_KEY}"
JOBS="${JOBS:-$(nproc)}"
TARGETS=(llama-simple llama-speculative-simple llama-speculative llama-lookup llama-bench)
PIP="${PIP:-python3 -m pip}"

missing=0
for t in "${TARGETS[@]}"; do [ -x "$OUT/bin/$t" ] || missing=1; done
if [ "$missing" = 0 ]; then echo "$OUT/bin"; exit 0; fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-tools.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT INT TERM
SDIST="$HOME_DIR/wheels/llama_cpp_python-$VERSION.tar.gz"  # shared with native/build-llama.sh
if ! echo "$SDIST_SHA256  $SDIST" | sha256sum -c --status 2>/dev/null; then
  echo "fetching the llama-cpp-python $VERSION sdist" >&2
  $PIP download -q --disable-pip-version-check --no-deps --no-binary :all: -d "$WORK/dl" "llama-cpp-python==$VERSION" >&2
  echo "$SDIST_SHA256  $WORK/dl/llama_cpp_python-$VERSION.tar.gz" | sha256sum -c --status \
    || { echo "build_llama_tools: the sdist's sha256 is not $SDIST_SHA256" >&2; exit 1; }
  mkdir -p "$(dirname "$SDIST")"
  mv "$WORK/dl/llama_cpp_python-$VERSION.tar.gz" "$SDIST.part" && mv "$SDIST.part" "$SDIST"
fi
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"

echo "configuring llama.cpp with its own defaults (native CPU build)" >&2
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_C_FLAGS="$NATIVE_FLAGS" -DCMAKE_CXX_FLAGS="$NATIVE_FLAGS" \
  > "$WORK/cmake.log" 2>&1 \
  || { tail -n 30 "$WORK/cmake.log" >&2; exit 1; }
echo "building ${TARGETS[*]} with $JOBS jobs (several minutes)" >&2
cmake --build "$WORK/build" --config Release -j "$JOBS" --target "${TARGETS[@]}" > "$WORK/build.log" 2>&1 \
  || { tail -n 30 "$WORK/build.log" >&2; exit 1; }

mkdir -p "$OUT/bin.tmp"
for t in "${TARGETS[@]}"; do cp "$WORK/build/bin/$t" "$OUT/bin.tmp/"; done
printf 'llama-cpp-python %s (llama.cpp %s)\nbuild: llama.cpp defaults%s, native for: %s\n' "$VERSION" \
  "$(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo unknown)" "${NATIVE_FLAGS:+ (AMX off: $NATIVE_FLAGS)}" \
  "$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2)" \
  > "$OUT/bin.tmp/BUILD_INFO"
rm -rf "$OUT/bin" && mv "$OUT/bin.tmp" "$OUT/bin"
echo "$OUT/bin"
