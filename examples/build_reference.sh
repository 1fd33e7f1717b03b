#!/usr/bin/env bash
# Build the reference implementation (ArcticInference's C++ suffix tree, what vLLM's
# method="suffix" runs) from the arctic-inference 0.3.0 source package and install only its
# suffix_decoding part into one Python's site-packages, where specx's `bench index`, `replay`
# and examples find it as `arctic_inference.suffix_decoding._C`.
#
#     examples/build_reference.sh                 # into python3
#     examples/build_reference.sh .venv/bin/python
#
# It skips everything when `from arctic_inference.suffix_decoding import SuffixDecodingCache`
# already works in that Python. Needs a C++20 compiler and network access to PyPI; installs
# nanobind==2.9.2, numpy (if missing) and, when the system has no cmake, the `cmake` package.
# Work files go to $SPECX_REF_WORKDIR (default ~/.cache/specx/reference); a downloaded source
# package there is reused.
set -euo pipefail

PY="${1:-python3}"
VERSION=0.3.0
WORKDIR="${SPECX_REF_WORKDIR:-$HOME/.cache/specx/reference}"
STEP=""

fail() { echo "build_reference: $*" >&2; exit 1; }
step() { STEP="$1"; echo "build_reference: $1" >&2; }
on_exit() {
    local rc=$?
    if [ "$rc" -ne 0 ] && [ -n "$STEP" ]; then
        echo "build_reference: failed while: $STEP (exit status $rc; see the output above)" >&2
        exit 1
    fi
}
trap on_exit EXIT

command -v "$PY" >/dev/null 2>&1 || fail "no python executable '$PY'"
PY="$(command -v "$PY")"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || fail "$PY is older than Python 3.10 (the reference's CMake file requires 3.10+)"
"$PY" -m pip --version >/dev/null 2>&1 || fail "$PY has no pip (python -m ensurepip first)"

CHECK='from arctic_inference.suffix_decoding import SuffixDecodingCache'
if "$PY" -c "$CHECK" 2>/dev/null; then
    echo "build_reference: already installed in $PY; nothing to do" >&2
    exit 0
fi

mkdir -p "$WORKDIR"
SDIST="$WORKDIR/arctic_inference-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    step "downloading the arctic-inference $VERSION source package"
    # pip download prepares the package's metadata, which runs its setup.py, which imports
    # torch at the top (for a build we do not use) and would otherwise pull torch and grpc
    # into an isolated build environment. So: no build isolation, with setuptools, wheel and a
    # stand-in torch module put on the path from the work folder (nothing of this goes into
    # the target Python).
    DEPS="$WORKDIR/download-deps"
    rm -rf "$DEPS"
    "$PY" -m pip install --quiet --target "$DEPS" "setuptools>=61" wheel
    mkdir -p "$DEPS/torch"
    echo '"""Stand-in so that arctic-inference setup.py imports, for its metadata."""' \
        > "$DEPS/torch/__init__.py"
    PYTHONPATH="$DEPS" "$PY" -m pip download --quiet \
        --no-deps --no-binary :all: --no-build-isolation "arctic-inference==$VERSION" -d "$WORKDIR"
    [ -f "$SDIST" ] || fail "pip download did not produce $SDIST"
fi

step "unpacking $SDIST"
SRC="$WORKDIR/arctic_inference-$VERSION"
rm -rf "$SRC"
tar xzf "$SDIST" -C "$WORKDIR"
[ -f "$SRC/csrc/suffix_decoding/CMakeLists.txt" ] || fail "$SDIST has no csrc/suffix_decoding"

step "installing nanobind==2.9.2 (and numpy, cmake where missing) into $PY"
"$PY" -m pip install --quiet nanobind==2.9.2
"$PY" -c 'import numpy' 2>/dev/null || "$PY" -m pip install --quiet numpy
CMAKE="$(command -v cmake || true)"
if [ -z "$CMAKE" ]; then
    "$PY" -m pip install --quiet cmake
    CMAKE="$(dirname "$PY")/cmake"
    [ -x "$CMAKE" ] || fail "pip installed cmake but $CMAKE is not there"
fi

step "building csrc/suffix_decoding (Release, -j2)"
BUILD="$WORKDIR/build-$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
rm -rf "$BUILD"
"$CMAKE" -S "$SRC/csrc/suffix_decoding" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$PY"
"$CMAKE" --build "$BUILD" -j2
SO="$(find "$BUILD" -maxdepth 2 -name '_C*.so' | head -n 1)"
[ -n "$SO" ] || fail "the build produced no _C*.so under $BUILD"

step "installing into $PY's site-packages"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
DEST="$SITE/arctic_inference"
mkdir -p "$DEST/suffix_decoding"
# arctic_inference/__init__.py is empty; the package's other subpackages need vLLM and torch.
cp "$SRC/arctic_inference/__init__.py" "$DEST/__init__.py"
cp "$SRC"/arctic_inference/suffix_decoding/*.py "$DEST/suffix_decoding/"
cp "$SO" "$DEST/suffix_decoding/"

step "checking the import"
"$PY" -c "$CHECK" || fail "installed into $DEST but '$CHECK' fails"
STEP=""
echo "build_reference: installed arctic_inference.suffix_decoding into $DEST" >&2
