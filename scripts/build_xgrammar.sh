#!/usr/bin/env bash
# Fetches xgrammar's source package from PyPI (checked against its sha256) and
# builds its C++ core as a static library into .deps/xgrammar (git-ignored):
# the grammar engine behind structured output and tool calls (response_format,
# tools). CMake finds it there; a build without it serves every other request
# and answers those two with a 400 saying the build lacks it. Idempotent: a
# no-op when the library of this version is already installed.
#
#   scripts/build_xgrammar.sh [--jobs N]
set -euo pipefail

VERSION=0.2.9
URL="https://files.pythonhosted.org/packages/3a/2f/5bf8e8fa6619cff534932f79b0abc81a417d354bc5093252c1a6081d0a93/xgrammar-${VERSION}.tar.gz"
SHA256="87b466bca2475e29bb0323abc62c6c33cbcbcff47e5fb800a3e2099ac9620b90"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="$ROOT/.deps/xgrammar"
JOBS="$(nproc)"
if [[ "${1:-}" == "--jobs" ]]; then JOBS="$2"; fi

if [[ -f "$PREFIX/lib/libxgrammar.a" && "$(cat "$PREFIX/VERSION" 2>/dev/null)" == "$VERSION" ]]; then
  echo "build_xgrammar.sh: xgrammar $VERSION present in $PREFIX"
  exit 0
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
echo "build_xgrammar.sh: downloading xgrammar $VERSION"
if command -v curl >/dev/null; then
  curl -sSfL -o "$TMP/src.tar.gz" "$URL"
else
  python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' "$URL" "$TMP/src.tar.gz"
fi
echo "$SHA256  $TMP/src.tar.gz" | sha256sum --check --status || {
  echo "build_xgrammar.sh: sha256 mismatch for xgrammar-$VERSION.tar.gz (expected $SHA256)" >&2
  exit 1
}
tar -xzf "$TMP/src.tar.gz" -C "$TMP"
SRC="$TMP/xgrammar-$VERSION"
mkdir -p "$SRC/build"
# The project's cmake/config.cmake sets its options unconditionally; a
# config.cmake in the build folder is read instead of it.
cat > "$SRC/build/config.cmake" <<'CFG'
set(XGRAMMAR_BUILD_PYTHON_BINDINGS OFF)
set(XGRAMMAR_BUILD_CXX_TESTS OFF)
set(XGRAMMAR_ENABLE_CPPTRACE OFF)
set(XGRAMMAR_ENABLE_COVERAGE OFF)
set(XGRAMMAR_ENABLE_INTERNAL_CHECK OFF)
CFG
echo "build_xgrammar.sh: building (static, Release, $JOBS jobs)"
# -fno-lto: the archive holds plain objects any linker reads (the project's
# flags ask for LTO); -Wno-error: a newer compiler's warnings do not stop it.
cmake -S "$SRC" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS="-fno-lto -Wno-error" -DCMAKE_INSTALL_PREFIX="$PREFIX" >/dev/null
cmake --build "$SRC/build" -j "$JOBS" --target xgrammar
rm -rf "$PREFIX"
cmake --install "$SRC/build" >/dev/null
cp "$SRC/LICENSE" "$PREFIX/LICENSE"
echo "$VERSION" > "$PREFIX/VERSION"
echo "build_xgrammar.sh: installed $PREFIX/lib/libxgrammar.a"
