#!/usr/bin/env bash
# Build llama.cpp's own command-line binaries -- llama-server, llama-bench and
# llama-batched-bench -- into .peers/llama.cpp-bin/bin, for the benchmark peer
# that measures llama.cpp itself (its C++ server with parallel slots and
# continuous batching, and its raw pp/tg and batched throughput) rather than
# the llama-cpp-python wrapper that setup_llamacpp.sh installs.
#
# The source is the llama.cpp tree vendored in the PyPI sdist of
# llama-cpp-python==0.3.36 (vendor/llama.cpp), so both peers run the same
# llama.cpp commit; the commit is written to .peers/llama.cpp-bin/VERSION.
# Built with the system cmake + ninja: Release, CPU only, GGML_NATIVE=ON
# (-march=native, so the binaries only suit CPUs like the building one),
# static llama/ggml libraries (BUILD_SHARED_LIBS=OFF) so the binaries run
# without the build tree, no tests/examples, no web UI download, no curl or
# OpenSSL.  Only the three targets are built (214 ninja steps); at -j 2 that
# takes about 9 minutes.  The sdist, source and build trees are deleted
# afterwards (KEEP_BUILD=1 keeps them in .peers/llama.cpp-bin/{dl,src,build}).
# Needs a C/C++ compiler, cmake >= 3.18, ninja, tar, and pip (for `pip download`).
#
# Usage, from anywhere:
#   [PYTHON=python3] [JOBS=2] [NICE=10] [KEEP_BUILD=1] [CMAKE_ARGS=...] benchmarks/peers/setup_llamacpp_bin.sh
# Idempotent: does nothing when the three binaries of this version are there.
# Prints the install folder (.peers/llama.cpp-bin) on success.
set -euo pipefail

cd "$(dirname "$0")/../.."
BASE_PY="${PYTHON:-python3}"
VERSION=0.3.36
PREFIX="$PWD/.peers/llama.cpp-bin"
BIN="$PREFIX/bin"
SRC="$PREFIX/src"
BUILD="$PREFIX/build"
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
TARGETS=(llama-server llama-bench llama-batched-bench)
STAMP="llama-cpp-python==$VERSION"

installed() {
    local t
    for t in "${TARGETS[@]}"; do
        [ -x "$BIN/$t" ] || return 1
    done
    [ -f "$PREFIX/VERSION" ] && [ "$(head -n 1 "$PREFIX/VERSION")" = "$STAMP" ] || return 1
    "$BIN/llama-server" --version >/dev/null 2>&1
}

if installed; then
    echo "$PREFIX"
    exit 0
fi

for tool in "${CC:-cc}" "${CXX:-c++}" cmake ninja tar; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "setup_llamacpp_bin.sh: '$tool' not found; install it (e.g. apt-get install build-essential cmake ninja-build) first" >&2
        exit 1
    fi
done

mkdir -p "$PREFIX" "$BIN"

# 1. The sdist (kept in $PREFIX/dl so a rerun after a failed build needn't fetch it again).
SDIST="$PREFIX/dl/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    "$BASE_PY" -m pip download --quiet --no-binary :all: --no-deps \
        "llama-cpp-python==$VERSION" -d "$PREFIX/dl"
fi

# 2. Unpack only vendor/llama.cpp (plus its git metadata, which records the commit).
TOP="llama_cpp_python-$VERSION"
LCPP="$SRC/$TOP/vendor/llama.cpp"
if [ ! -f "$LCPP/CMakeLists.txt" ]; then
    rm -rf "$SRC"
    mkdir -p "$SRC"
    tar -xzf "$SDIST" -C "$SRC" "$TOP/vendor/llama.cpp" "$TOP/.git/modules/vendor/llama.cpp" "$TOP/CHANGELOG.md"
fi

GITDIR="$SRC/$TOP/.git/modules/vendor/llama.cpp"
COMMIT="$(tr -d '[:space:]' < "$GITDIR/HEAD" 2>/dev/null || true)"
if ! [[ "$COMMIT" =~ ^[0-9a-f]{40}$ ]]; then
    COMMIT="$(grep -m1 -o 'ggml-org/llama.cpp@[0-9a-f]*' "$SRC/$TOP/CHANGELOG.md" | cut -d@ -f2 || true)"
fi
COMMIT="${COMMIT:-unknown}"
COMMIT_INFO=""
if command -v git >/dev/null 2>&1; then
    COMMIT_INFO="$(git -C "$LCPP" log -1 --format='%cI %s' 2>/dev/null || true)"
fi

# 3. Configure and build the three targets.
CONFIG=(
    -G Ninja
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=ON
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF -DGGML_OPENCL=OFF
    -DGGML_BACKEND_DL=OFF
    -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_COMMIT="${COMMIT:0:7}"
)
# shellcheck disable=SC2206
EXTRA=(${CMAKE_ARGS:-})
nice -n "$NICE" cmake -S "$LCPP" -B "$BUILD" "${CONFIG[@]}" "${EXTRA[@]}"
nice -n "$NICE" cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}"

# 4. Install the binaries and check that they need nothing from the build tree.
for t in "${TARGETS[@]}"; do
    install -m 755 "$BUILD/bin/$t" "$BIN/$t"
    if command -v ldd >/dev/null 2>&1 && ldd "$BIN/$t" | grep -Eq 'libllama|libggml|libmtmd|not found'; then
        echo "setup_llamacpp_bin.sh: $BIN/$t still links a shared llama/ggml library or misses one:" >&2
        ldd "$BIN/$t" >&2
        exit 1
    fi
done
SERVER_VERSION="$("$BIN/llama-server" --version 2>&1 | grep -E '^(version|built with)' || true)"

{
    echo "$STAMP"
    echo "source: PyPI sdist llama-cpp-python==$VERSION, vendor/llama.cpp"
    echo "llama.cpp commit: $COMMIT (https://github.com/ggml-org/llama.cpp/commit/$COMMIT)"
    [ -z "$COMMIT_INFO" ] || echo "llama.cpp commit date/subject: $COMMIT_INFO"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $("${CXX:-c++}" --version | head -n 1)"
    echo "cmake flags: ${CONFIG[*]} ${EXTRA[*]}"
    echo "llama-server --version:"
    echo "$SERVER_VERSION" | sed 's/^/  /'
} > "$PREFIX/VERSION"

if [ "${KEEP_BUILD:-0}" != 1 ]; then
    rm -rf "$BUILD" "$SRC" "$PREFIX/dl"
fi

installed
echo "$PREFIX"
