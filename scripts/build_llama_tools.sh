#!/usr/bin/env bash
# Build llama.cpp's own speculative-decoding tools (the benchmark's peers) from the llama.cpp sources
# vendored in the llama-cpp-python sdist we depend on, with the same CMake flags as our Makefile, so
# the peers run the very same kernels as speculant. Only the needed targets are built.
#
#   scripts/build_llama_tools.sh            # -> $SPECULANT_HOME/llama-tools/bin (default ~/.cache/speculant)
#   LLAMA_TOOLS_DIR=/some/dir JOBS=4 scripts/build_llama_tools.sh
#
# Idempotent: exits at once when every tool is already built. Run it with `nice -n 19` on a shared machine.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${LLAMA_TOOLS_DIR:-${SPECULANT_HOME:-$HOME/.cache/speculant}/llama-tools}"
JOBS="${JOBS:-$(nproc)}"
TARGETS=(llama-simple llama-speculative-simple llama-speculative llama-lookup)
PIP="${PIP:-$HERE/.venv/bin/pip}"
[ -x "$PIP" ] || PIP="python3 -m pip"

missing=0
for t in "${TARGETS[@]}"; do [ -x "$OUT/bin/$t" ] || missing=1; done
if [ "$missing" = 0 ]; then echo "llama tools already built in $OUT/bin"; exit 0; fi

# the same flags as the Makefile's LLAMA_CMAKE_ARGS (read from it, so the two never drift apart)
ARGS="$(make -s -pn -f "$HERE/Makefile" -C "$HERE" 2>/dev/null | sed -n 's/^LLAMA_CMAKE_ARGS := //p' | head -n1)"
if [ -z "$ARGS" ]; then echo "build_llama_tools: cannot read LLAMA_CMAKE_ARGS from $HERE/Makefile" >&2; exit 1; fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-tools.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
SDIST="${LLAMA_SDIST:-}"
if [ -z "$SDIST" ]; then
  echo "fetching the llama-cpp-python $VERSION sdist"
  $PIP download -q --disable-pip-version-check --no-deps --no-binary :all: -d "$WORK" "llama-cpp-python==$VERSION"
  SDIST="$(ls "$WORK"/llama_cpp_python-"$VERSION".tar.gz)"
fi
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || { echo "build_llama_tools: no vendor/llama.cpp in $SDIST" >&2; exit 1; }

echo "configuring: $ARGS"
# shellcheck disable=SC2086
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF $ARGS > "$WORK/cmake.log" 2>&1 \
  || { tail -n 30 "$WORK/cmake.log" >&2; exit 1; }
echo "building ${TARGETS[*]} with $JOBS jobs (several minutes)"
cmake --build "$WORK/build" --config Release -j "$JOBS" --target "${TARGETS[@]}" > "$WORK/build.log" 2>&1 \
  || { tail -n 30 "$WORK/build.log" >&2; exit 1; }

mkdir -p "$OUT/bin.tmp"
for t in "${TARGETS[@]}"; do cp "$WORK/build/bin/$t" "$OUT/bin.tmp/"; done
printf 'llama-cpp-python %s\ncmake args: %s\n' "$VERSION" "$ARGS" > "$OUT/bin.tmp/BUILD_INFO"
rm -rf "$OUT/bin" && mv "$OUT/bin.tmp" "$OUT/bin"
echo "built: $OUT/bin (${TARGETS[*]})"
