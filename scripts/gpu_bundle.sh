#!/usr/bin/env bash
# Prepares .gpu-bundle/ (git-ignored): what a GPU machine without this
# project's Debian packages needs to run scripts/gpu_check.sh there. Run it
# here, on a Debian 12 machine with the CUDA toolkit and scripts/setup.sh's
# packages, before each device run (it is incremental and idempotent):
#
#   bash scripts/gpu_bundle.sh [--build DIR] [--no-dev]
#
# What it holds:
#   build/      the executables gpu_check.sh runs (servers, tools, the gpu tests), built here in DIR
#               (default build-gpu/: Release, CUDA sm_90 code for the H100/H200, x86-64-v3 host code),
#               stripped, at their paths in the build tree (deploy/launch.sh --build finds them)
#   gpu_tests.json  the gpu-labelled ctest tests (`ctest --show-only=json-v1`) with the build tree, the
#               source tree, mpirun and python3 as placeholders: gpu_check.sh runs them with ctest from there
#   debs/       Debian packages, unpacked there with `dpkg -x` into a private prefix (never into /):
#               the executables' shared libraries and OpenMPI's runtime (mpirun, its MCA plugins and
#               help files; relocated with OPAL_PREFIX), and, unless --no-dev, the -dev packages
#               scripts/setup.sh installs, for building there when these executables do not run
#   tokenizer.gguf  the default model's tokenizer (metadata only, no tensors): the default model
#               (98 MB) does not fit the 64 MiB a device run carries; gpu_check.sh writes a
#               random-weight model of its shape with this tokenizer (pd-make-model --tokenizer-from)
#   MANIFEST.txt what is in it, the commit, the sizes
#
# The CUDA libraries (cudart, cuBLAS) are not carried: the GPU machine's CUDA
# toolkit has them (the same major version, 13, as here). Prints what it
# bundled and the size of what a device run carries (bundle + tracked tree,
# which must stay under 64 MiB).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUNDLE="$ROOT/.gpu-bundle"
BUILD="$ROOT/build-gpu"
DEV=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD="$(realpath -m "${2:?--build needs a directory}")"; shift 2 ;;
    --no-dev) DEV=0; shift ;;
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_bundle.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
say() { echo "gpu_bundle.sh: $*"; }
die() { echo "gpu_bundle.sh: error: $*" >&2; exit 1; }
command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]] ||
  die "no nvcc: the CUDA toolkit is needed to build the CUDA backend"
export PATH="$PATH:/usr/local/cuda/bin"
MPIRUN_HERE="$(command -v mpirun)" || die "no mpirun: run scripts/setup.sh first"

# ---- 1. build (CUDA for Hopper; host code for any x86-64 with AVX2, not -march=native)
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  say "configuring $BUILD"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DPD_NATIVE=OFF -DCMAKE_C_FLAGS=-march=x86-64-v3 -DCMAKE_CXX_FLAGS=-march=x86-64-v3 >/dev/null
fi
grep -q '^CMAKE_CUDA_COMPILER:[A-Z]*=.\+' "$BUILD/CMakeCache.txt" || die "$BUILD was configured without CUDA"
TARGETS=(pd-router pd-prefill pd-decode pd-generate pd-bench-engine pd-make-model pd-make-tiny-model pd-plan)
# The gpu-labelled tests' executables (the Catch2 gpu suite and any MPI device-transport test).
gpu_test_targets() {
  ctest --test-dir "$BUILD" -L gpu --show-only=json-v1 2>/dev/null | python3 -c '
import json, os, sys
build = sys.argv[1]
names = set()
for t in json.load(sys.stdin).get("tests", []):
    for a in t.get("command") or []:
        if a.startswith(build + "/") and os.path.basename(a).startswith("pd_"):
            names.add(os.path.basename(a).replace("_NOT_BUILT", ""))
print(" ".join(sorted(names)))' "$BUILD"
}
read -r -a TEST_TARGETS <<<"$(gpu_test_targets)"
[[ " ${TEST_TARGETS[*]} " == *" pd_gpu_tests "* ]] || TEST_TARGETS+=(pd_gpu_tests)
say "building ${TARGETS[*]} ${TEST_TARGETS[*]} in $BUILD"
cmake --build "$BUILD" -j "$(nproc)" --target "${TARGETS[@]}" "${TEST_TARGETS[@]}"
read -r -a MORE <<<"$(gpu_test_targets)"  # discovered only once built
for t in "${MORE[@]}"; do
  [[ " ${TEST_TARGETS[*]} " == *" $t "* ]] || { TEST_TARGETS+=("$t"); cmake --build "$BUILD" --target "$t"; }
done

# ---- 2. executables, stripped, at their build-tree paths
rm -rf "$BUNDLE/build"
mkdir -p "$BUNDLE/build"
EXES=()
for t in "${TARGETS[@]}" "${TEST_TARGETS[@]}"; do
  f="$(find "$BUILD" -type f -name "$t" -perm -u+x -not -path '*/CMakeFiles/*' | head -1)"
  [[ -n "$f" ]] || die "built target $t not found under $BUILD"
  rel="${f#"$BUILD"/}"
  mkdir -p "$BUNDLE/build/$(dirname "$rel")"
  strip --strip-unneeded -o "$BUNDLE/build/$rel" "$f"
  EXES+=("$BUNDLE/build/$rel")
done

# ---- 3. the gpu tests, with placeholders for the paths that differ there
ctest --test-dir "$BUILD" -L gpu --show-only=json-v1 | python3 -c '
import json, sys
build, root, mpirun, python = sys.argv[1:5]
def fix(s):
    s = s.replace(build, "@BUILD@").replace(mpirun, "@MPIRUN@").replace(root, "@ROOT@")
    return s.replace(python, "@PYTHON@") if python else s
tests = []
for t in json.load(sys.stdin).get("tests", []):
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    tests.append({"name": t["name"], "command": [fix(a) for a in t.get("command") or []],
                  "labels": props.get("LABELS", []), "timeout": props.get("TIMEOUT"),
                  "skip_return_code": props.get("SKIP_RETURN_CODE"),
                  "environment": [fix(e) for e in props.get("ENVIRONMENT", [])],
                  "working_directory": fix(props.get("WORKING_DIRECTORY", "@BUILD@"))})
json.dump({"tests": tests}, open(sys.argv[5], "w"), indent=1)
print("gpu_bundle.sh: %d gpu tests listed" % len(tests))' \
  "$BUILD" "$ROOT" "$(readlink -f "$MPIRUN_HERE")" \
  "$(sed -n 's/^_\{0,1\}Python3_EXECUTABLE:[A-Z]*=//p' "$BUILD/CMakeCache.txt" | head -1)" "$BUNDLE/gpu_tests.json"
# mpirun is named by its resolved path in the tests' commands when CMake resolved it; cover both.
sed -i "s#$MPIRUN_HERE#@MPIRUN@#g" "$BUNDLE/gpu_tests.json"

# ---- 4. Debian packages: the executables' libraries, OpenMPI's runtime, the -dev packages
# Packages never carried: the C library and compiler runtime (the machine's own, newer ones must be used).
BASE_PKGS=" libc6 libgcc-s1 libstdc++6 libc-bin "
declare -A PKG=()
add_pkg_of_file() {  # the package owning a file, unless it is a base package or no package's
  local owner
  owner="$(dpkg -S "$1" 2>/dev/null | head -1 | cut -d: -f1)" || true
  [[ -n "$owner" && "$BASE_PKGS" != *" $owner "* ]] && PKG[$owner]=1
  return 0
}
OMPI_PLUGINS="$(dirname "$(readlink -f /usr/lib/x86_64-linux-gnu/libmpi.so.40)")/openmpi3"
LIBS_OF=("${EXES[@]}" "$(readlink -f "$MPIRUN_HERE")" /usr/bin/orted)
[[ -d "$OMPI_PLUGINS" ]] && while IFS= read -r p; do LIBS_OF+=("$p"); done < <(find "$OMPI_PLUGINS" -name 'mca_*.so')
# The GPU machine's CUDA libraries are used there (hundreds of MB; the driver must match them).
CUDA_LIBS='^lib(cuda|cudart|cublas|cublasLt|nccl|nvidia-|nvrtc|nvJitLink|cusparse|cufft|curand|cusolver|nvToolsExt)[.-]'
for f in "${LIBS_OF[@]}"; do
  while IFS= read -r lib; do
    [[ -z "$lib" || "$(basename "$lib")" =~ $CUDA_LIBS || "$lib" == */cuda* ]] && continue
    add_pkg_of_file "$(readlink -f "$lib")"
    add_pkg_of_file "$lib"
  done < <(ldd "$f" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3}')
done
# OpenMPI's runtime as a whole (mpirun, orted, plugins, help files, ompi-server), its PMIx.
for p in openmpi-bin openmpi-common libopenmpi3 libpmix2 libhwloc15 libevent-core-2.1-7 libevent-pthreads-2.1-7; do
  PKG[$p]=1
done
# Plugins whose libraries are not carried (InfiniBand, UCX, OFI, PSM2) fail to load there, silently.
for p in libfabric1 libucx0 libibverbs1 librdmacm1 libpsm2-2 libpsm-infinipath1 libxnvctrl0 libnl-3-200 \
    libnl-route-3-200 libefa1 libcxi1 libnuma1; do
  unset "PKG[$p]"
done
if [[ "$DEV" == 1 ]]; then
  # scripts/setup.sh's -dev packages and the -dev packages their CMake/pkg-config files lead to.
  for p in libboost1.74-dev nlohmann-json3-dev catch2 libopenblas-dev libopenblas-pthread-dev libxxhash-dev \
      libcli11-dev libspdlog-dev libfmt-dev libpcre2-dev libopenmpi-dev libpmix-dev libhwloc-dev libevent-dev \
      prometheus-cpp-dev libprometheus-cpp-pull1.0 libprometheus-cpp-push1.0 libcivetweb-dev libcivetweb1 \
      libcurl4-openssl-dev zlib1g-dev pkgconf pkgconf-bin libpkgconf3; do
    PKG[$p]=1
  done
fi
mkdir -p "$BUNDLE/debs"
WANT=()
for p in "${!PKG[@]}"; do
  v="$(dpkg-query -W -f='${Version}' "$p" 2>/dev/null || apt-cache policy "$p" | awk '/Candidate:/{print $2}')"
  [[ -n "$v" && "$v" != "(none)" ]] || die "package $p: no installed or candidate version"
  WANT+=("$p=$v")
done
# Drop packages of earlier runs that are no longer wanted; fetch the missing ones.
deb_prefix() { local v="${1#*=}"; echo "${1%%=*}_${v//:/%3a}_"; }  # apt-get download's file name: NAME_VERSION_ARCH.deb
keep=" "
for pv in "${WANT[@]}"; do keep+="$(deb_prefix "$pv") "; done
for f in "$BUNDLE"/debs/*.deb; do
  [[ -e "$f" ]] || continue
  b="$(basename "$f")"
  [[ "$keep" == *" ${b%_*}_ "* ]] || rm -f "$f"
done
MISSING=()
for pv in "${WANT[@]}"; do
  compgen -G "$BUNDLE/debs/$(deb_prefix "$pv")*.deb" >/dev/null || MISSING+=("$pv")
done
if [[ ${#MISSING[@]} -gt 0 ]]; then
  say "downloading ${#MISSING[@]} packages"
  (cd "$BUNDLE/debs" && apt-get download -qq "${MISSING[@]}") ||
    { apt-get update -qq && (cd "$BUNDLE/debs" && apt-get download -qq "${MISSING[@]}"); }
fi

# ---- 5. the default model's tokenizer, without the model's tensors
MODEL="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ -f "$MODEL" ]]; then
  python3 - "$MODEL" "$BUNDLE/tokenizer.gguf" <<'PY'
# Copies the header and the tokenizer.* (and general.architecture) metadata of a
# GGUF file into a GGUF with no tensors.
import struct, sys
src, dst = sys.argv[1:]
data = open(src, "rb").read(64 << 20)
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
def skip_value(t, o):
    if t == 8:
        (n,) = struct.unpack_from("<Q", data, o); return o + 8 + n
    if t == 9:
        et, n = struct.unpack_from("<IQ", data, o); o += 12
        if et in SIZES: return o + SIZES[et] * n
        for _ in range(n): o = skip_value(et, o)
        return o
    return o + SIZES[t]
magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", data, 0)
assert magic == 0x46554747, "not a GGUF file"
o, kept = 24, []
for _ in range(n_kv):
    (klen,) = struct.unpack_from("<Q", data, o)
    key = data[o + 8:o + 8 + klen].decode()
    (t,) = struct.unpack_from("<I", data, o + 8 + klen)
    end = skip_value(t, o + 12 + klen)
    if key.startswith("tokenizer.") or key == "general.architecture":
        kept.append(data[o:end])
    o = end
with open(dst, "wb") as f:
    f.write(struct.pack("<IIQQ", magic, 3, 0, len(kept)))
    for k in kept: f.write(k)
    f.write(b"\0" * ((-f.tell()) % 32))
PY
else
  say "warning: $MODEL missing (scripts/fetch_model.sh): no tokenizer.gguf; gpu_check.sh uses the tiny test vocabulary"
  rm -f "$BUNDLE/tokenizer.gguf"
fi

# ---- 6. manifest and sizes
COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
DIRTY="$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null | wc -l)"
TREE_KB="$(cd "$ROOT" && { git ls-files -z; git ls-files -z --others --exclude-standard; } |
  du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)"
BUNDLE_KB="$(du -sk "$BUNDLE" --exclude=MANIFEST.txt | cut -f1)"
{
  echo "pdcluster GPU bundle, made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) from commit $COMMIT" \
       "($DIRTY modified tracked files), build $BUILD"
  echo "nvcc: $(nvcc --version | tail -1)"
  echo "executables:"; (cd "$BUNDLE/build" && find . -type f -printf '  %P %s\n' | sort)
  echo "packages ($(ls "$BUNDLE/debs" | wc -l)):"; ls "$BUNDLE/debs" | sed 's/^/  /'
  echo "tokenizer.gguf: $( [[ -f "$BUNDLE/tokenizer.gguf" ]] && stat -c %s "$BUNDLE/tokenizer.gguf" || echo none)"
  echo "sizes (KiB): build $(du -sk "$BUNDLE/build" | cut -f1), debs $(du -sk "$BUNDLE/debs" | cut -f1)," \
       "bundle $BUNDLE_KB, working tree $TREE_KB, together $((BUNDLE_KB + TREE_KB)) of 65536"
} >"$BUNDLE/MANIFEST.txt"
cat "$BUNDLE/MANIFEST.txt" | sed -n '1,2p;/^sizes/p'
say "executables: ${#EXES[@]}, packages: $(ls "$BUNDLE/debs" | wc -l)"
if (( BUNDLE_KB + TREE_KB > 64 * 1024 )); then
  die "bundle + working tree = $(( (BUNDLE_KB + TREE_KB) / 1024 )) MiB:" \
      "over the 64 MiB a device run carries (try --no-dev)"
fi
say "device run: carry [\".gpu-bundle\"], command: bash scripts/gpu_check.sh --out \"\$OUT/gpu\""
