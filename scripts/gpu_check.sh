#!/usr/bin/env bash
# Every GPU check of pdcluster in one run, for a GPU machine (one NVIDIA H200
# when written) that may be available only for minutes and may lack this
# project's Debian packages. Prepare on a build machine first (builds the CUDA
# executables and gathers the packages into .gpu-bundle/):
#
#   bash scripts/gpu_bundle.sh
#
# then, on the GPU machine, in a copy of the checkout with .gpu-bundle/ beside
# it (the script keeps to --budget, default 540 s, so it fits a 10-minute slot):
#
#   bash scripts/gpu_check.sh --out DIR
#
# Stages, each under its own `timeout`, each with a log and a line in
# OUT/summary.txt (PASS/FAIL/SKIP, seconds, a note); a failed stage does not
# stop the next:
#   0 probe     nvidia-smi, nvcc, OS, CPU, memory, disk, what is installed
#   1 setup     unpack .gpu-bundle/debs into a private prefix (dpkg -x), OpenMPI relocated there
#               (OPAL_PREFIX), the carried executables checked (every library found, --help runs,
#               a 2-rank mpirun); where they do not run, build there from the packages (-j 16,
#               Release, the needed targets only); write the test models (pd-make-model)
#   2 ctest     ctest -L gpu --output-on-failure: the CUDA backend's op tests and the MPI
#               device-transport test, from the carried test list (gpu_tests.json)
#   3 identity  1 prefill + 1 decode rank with engine.backend "cuda" on the one GPU: greedy
#               chat/completions output (32 tokens) token for token equal to pd-generate --backend
#               cuda (scripts/gpu_identity.py), on a SmolLM2-135M-shaped random-weight model with
#               the default model's tokenizer (the 98 MB default model does not fit a device run);
#               once with the f16 KV cache (the default), once with q8_0
#   4 bench     pd-bench-engine --backend cuda: prefill tok/s as a fraction of the H200's dense
#               tensor-core peak, decode tok/s at batch 1/8/32/128 as a fraction of its HBM
#               bandwidth; SmolLM2-135M shape (Q4_1, Q8_0 embeddings, as the default model) and
#               Llama-3.1-8B shape in Q4_0 and BF16 (random weights written there); fp32 SGEMM (the
#               backend's default) and, for SmolLM2 and the Q4_0 8B, --tf32 (TF32 tensor cores)
#   5 plan      pd-plan pools with the measured engine profiles against its roofline
# OUT gets at most 8 files (what a device run returns): summary.txt, probe.log,
# setup.log, ctest.log, identity.log, bench.log, results.json.
#
#   bash scripts/gpu_check.sh --out DIR [--budget S] [--rehearse] [--build-here] [--no-bf16]
#
# --rehearse runs the same stages on the CPU backend with small models (a dry
# run of the script where no GPU is); --build-here builds there even when the
# carried executables run; --no-bf16 leaves out the 16 GB BF16 8B model.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SELF="$ROOT/scripts/gpu_check.sh"
OUT="" BUDGET=540 REHEARSE=0 BUILD_HERE=0 BF16=1 STAGE=""
BUNDLE="${PD_GPU_BUNDLE:-$ROOT/.gpu-bundle}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
    --budget) BUDGET="${2:?--budget needs seconds}"; shift 2 ;;
    --rehearse) REHEARSE=1; shift ;;
    --build-here) BUILD_HERE=1; shift ;;
    --no-bf16) BF16=0; shift ;;
    --stage) STAGE="$2"; shift 2 ;;  # internal: run one stage (under timeout)
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[[ -n "$OUT" ]] || { echo "gpu_check.sh: --out DIR is required" >&2; exit 2; }
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="${PD_GPU_WORK:-/tmp/pd-gpu}"  # models, unpacked packages, per-stage files (not returned)
PDROOT="$WORK/root" PDLIB="$WORK/lib" PDBIN="$WORK/bin" MODELS="$WORK/models" RES="$WORK/results"
export ROOT OUT WORK PDROOT PDLIB PDBIN MODELS RES BUNDLE REHEARSE BUILD_HERE BF16
BACKEND=cuda
[[ "$REHEARSE" == 1 ]] && BACKEND=cpu
export BACKEND

# ------------------------------------------------------------------ stages
stage_probe() {
  set -x
  nvidia-smi || true
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem,power.limit --format=csv || true
  nvcc --version || /usr/local/cuda/bin/nvcc --version || true
  uname -a; cat /etc/os-release | head -4; ldd --version | head -1
  nproc; lscpu | grep -E 'Model name|Flags' | cut -c1-400; free -g; df -h / /tmp
  for c in mpirun cmake ctest ninja gcc g++ pkg-config dpkg python3 timeout; do
    printf '%-12s %s\n' "$c" "$(command -v "$c" || echo MISSING)"
  done
  ldconfig -p | grep -E 'libmpi|libopenblas|libcublas|libcudart|libnccl|libspdlog|libfmt|libpcre2-8|libxxhash' || true
  ldconfig -p | grep -E 'libgomp|libhwloc|libevent_core' || true
  ls -d /usr/local/cuda*/lib64 2>/dev/null
  ls "$BUNDLE" && cat "$BUNDLE/MANIFEST.txt" | sed -n '1,2p;/^sizes/p'
  { set +x; } 2>/dev/null
}

# Libraries the machine lacks, as links in PDLIB (the machine's own wins for a
# library both have, except OpenMPI's family, which must match the carried mpirun).
make_lib_farm() {
  rm -rf "$PDLIB"; mkdir -p "$PDLIB"
  local have; have="$(ldconfig -p | awk '{print $1}' | sort -u)"
  while IFS= read -r f; do
    local n; n="$(basename "$f")"
    case "$f" in */openmpi3/*|*/pmix2/lib/pmix/*|*/hwloc/*) continue ;; esac
    if [[ "$n" =~ ^lib(mpi|open-pal|open-rte|mca_common|pmix|hwloc|event|ompitrace|oshmem) ]] ||
        ! grep -qxF "$n" <<<"$have"; then
      [[ -e "$PDLIB/$n" ]] || ln -s "$f" "$PDLIB/$n"
    fi
  done < <(find "$PDROOT" \( -type f -o -type l \) -name 'lib*.so*' 2>/dev/null)
}

# The CUDA libraries (cudart, cuBLAS, NCCL): the toolkit's, else PyTorch's pip packages.
cuda_lib_dirs() {
  local d dirs=()
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib; do
    [[ -d "$d" ]] && dirs+=("$d")
  done
  local sp
  for sp in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
    for d in "$sp"/nvidia/*/lib "$sp"/nvidia/cu13/lib; do [[ -d "$d" ]] && dirs+=("$d"); done
  done
  (IFS=:; echo "${dirs[*]}")
}

write_env() {
  local build="$1"
  cat >"$WORK/env.sh" <<EOF
export PATH="$PDBIN:\$PATH:/usr/local/cuda/bin"
export LD_LIBRARY_PATH="$PDLIB:$(cuda_lib_dirs)\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export OPAL_PREFIX="$PDROOT/usr"  # OpenMPI's plugins, help files and orted, relocated
# PMIx (Debian's, under its own prefix): its plugins and help files, relocated.
export PMIX_PREFIX="$PDROOT/usr/lib/x86_64-linux-gnu/pmix2" PMIX_DATADIR="$PDROOT/usr/lib/x86_64-linux-gnu/pmix2/share"
export PMIX_PKGDATADIR="$PDROOT/usr/lib/x86_64-linux-gnu/pmix2/share/pmix"
export PMIX_MCA_mca_base_component_path="$PDROOT/usr/lib/x86_64-linux-gnu/pmix2/lib/pmix"
export OMPI_MCA_mca_base_component_show_load_errors=0 OMPI_MCA_btl_base_warn_component_unused=0
export OMPI_MCA_btl="^uct,openib,ofi" OMPI_MCA_mtl="^ofi" OMPI_MCA_pml="^ucx" OMPI_MCA_osc="^ucx,pt2pt"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PD_BUILD="$build"
EOF
}

executables_run() {  # every carried executable finds its libraries and answers --help
  local b="$1" ok=0 f
  for f in router/pd-router prefill_node/pd-prefill decode_node/pd-decode tools/pd-generate tools/pd-bench-engine \
      tools/pd-make-model tools/pd-plan; do
    [[ -x "$b/$f" ]] || { echo "missing $b/$f"; ok=1; continue; }
    if ldd "$b/$f" | grep -q 'not found'; then echo "$f: libraries not found:"; ldd "$b/$f" | grep 'not found'; ok=1; fi
    "$b/$f" --help >/dev/null 2>&1 || { echo "$f --help failed:"; "$b/$f" --help 2>&1 | tail -3; ok=1; }
  done
  return $ok
}

build_here() {
  local src="$WORK/build-src"
  echo "== building here in $src"
  local cuda=(-DCMAKE_CUDA_ARCHITECTURES=90)
  [[ "$REHEARSE" == 1 ]] && cuda=(-DPD_ENABLE_CUDA=OFF)
  local lib="$PDROOT/usr/lib/x86_64-linux-gnu"
  export CPATH="$PDROOT/usr/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$PDLIB:$lib:$lib/openblas-pthread${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export PKG_CONFIG_LIBDIR="$lib/pkgconfig:$PDROOT/usr/share/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$PDROOT"
  local gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  local pkgconf=(); command -v pkg-config >/dev/null || pkgconf=(-DPKG_CONFIG_EXECUTABLE="$PDROOT/usr/bin/pkgconf")
  cmake -S "$ROOT" -B "$src" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "${cuda[@]}" "${pkgconf[@]}" \
    -DCMAKE_PREFIX_PATH="$PDROOT/usr;$lib/cmake;$PDROOT/usr/lib/cmake;$PDROOT/usr/share/cmake" \
    -DCMAKE_LIBRARY_PATH="$lib/openblas-pthread;$lib" -DCMAKE_INCLUDE_PATH="$PDROOT/usr/include" \
    -DMPI_C_COMPILER="$PDROOT/usr/bin/mpicc.openmpi" -DMPI_CXX_COMPILER="$PDROOT/usr/bin/mpicxx.openmpi" \
    -DMPIEXEC_EXECUTABLE="$PDBIN/mpirun" || return 1
  local targets=(pd-router pd-prefill pd-decode pd-generate pd-bench-engine pd-make-model pd-make-tiny-model pd-plan)
  [[ "$REHEARSE" == 1 ]] || targets+=(pd_gpu_tests)
  cmake --build "$src" -j "$(nproc)" --target "${targets[@]}" || return 1
  # Any other gpu-labelled test executables (the MPI device-transport test).
  local more
  more="$(ctest --test-dir "$src" -L gpu --show-only=json-v1 2>/dev/null | python3 -c '
import json, os, sys
names = {os.path.basename(a).replace("_NOT_BUILT", "") for t in json.load(sys.stdin).get("tests", [])
         for a in t.get("command") or [] if os.path.basename(a).startswith("pd_")}
print(" ".join(sorted(names - {"pd_gpu_tests"})))')"
  [[ -z "$more" ]] || cmake --build "$src" -j "$(nproc)" --target $more || return 1
  echo "$src" >"$WORK/ctest_dir"
  BUILT="$src"
}

stage_setup() {
  set -e
  rm -rf "$PDROOT" "$PDBIN" "$MODELS" "$RES"; mkdir -p "$PDROOT" "$PDBIN" "$MODELS" "$RES"
  command -v dpkg >/dev/null || { echo "no dpkg on this machine: cannot unpack the packages"; return 1; }
  local n=0 d
  for d in "$BUNDLE"/debs/*.deb; do dpkg -x "$d" "$PDROOT"; n=$((n + 1)); done
  echo "unpacked $n packages into $PDROOT"
  local u="$PDROOT/usr/bin"
  ln -sf "$u/orterun" "$PDBIN/mpirun"; ln -sf "$u/orterun" "$PDBIN/mpiexec"
  [[ -e "$u/orte-server" ]] && ln -sf "$u/orte-server" "$PDBIN/ompi-server"
  if [[ ! -x "$u/orterun" ]] && command -v mpirun >/dev/null; then ln -sf "$(command -v mpirun)" "$PDBIN/mpirun"; fi
  make_lib_farm
  echo "libraries linked from the packages: $(ls "$PDLIB" | wc -l)"
  local build="$WORK/build"
  rm -rf "$build"
  if [[ -d "$BUNDLE/build" ]]; then cp -a "$BUNDLE/build" "$build"; chmod -R u+rwx "$build"; fi
  write_env "$build"
  # shellcheck disable=SC1091
  source "$WORK/env.sh"
  set +e
  local use_carried=1
  if [[ "$BUILD_HERE" == 1 || ! -d "$BUNDLE/build" ]]; then
    use_carried=0; echo "building here (--build-here, or no carried executables)"
  elif ! executables_run "$build"; then
    use_carried=0; echo "the carried executables do not run here: building here"
  fi
  if [[ "$use_carried" == 0 ]]; then
    BUILT=""
    build_here || { echo "build here failed"; return 1; }
    build="$BUILT"
    write_env "$build"; source "$WORK/env.sh"
    executables_run "$build" || return 1
  else
    echo "carried executables run here"
    rm -f "$WORK/ctest_dir"
  fi
  set -e
  echo "== mpirun (relocated OpenMPI)"
  timeout 60 mpirun --allow-run-as-root --oversubscribe -np 2 hostname
  echo "== models"
  "$build/tools/pd-make-tiny-model" -o "$MODELS/tiny.gguf"
  local tok=()
  [[ -f "$BUNDLE/tokenizer.gguf" ]] && tok=(--tokenizer-from "$BUNDLE/tokenizer.gguf")
  "$build/tools/pd-make-model" --shape smollm2-135m --type q4_1 --embed-type q8_0 "${tok[@]}" \
    --out "$MODELS/smollm2-135m-q4_1.gguf"
  echo "setup done: build $build"
}

# A CTestTestfile for the carried gpu tests (gpu_tests.json), paths of this machine.
write_ctest_file() {
  local dir="$WORK/ctest" mpirun; mpirun="$(command -v mpirun)"
  rm -rf "$dir"; mkdir -p "$dir"
  python3 - "$BUNDLE/gpu_tests.json" "$dir/CTestTestfile.cmake" "$PD_BUILD" "$ROOT" "$mpirun" \
    "$(command -v python3)" <<'PY'
import json, sys
src, dst, build, root, mpirun, python = sys.argv[1:]
def fix(s):
    s = s.replace("@BUILD@", build).replace("@ROOT@", root).replace("@MPIRUN@", mpirun)
    return s.replace("@PYTHON@", python)
def q(s): return "[==[" + s + "]==]"
with open(dst, "w") as f:
    for t in json.load(open(src))["tests"]:
        f.write("add_test(%s %s)\n" % (q(t["name"]), " ".join(q(fix(a)) for a in t["command"])))
        props = ["LABELS", q(";".join(t["labels"]) or "gpu"), "WORKING_DIRECTORY", q(fix(t["working_directory"]))]
        # Each test at most 90 s: the stage's limit must cover them all.
        props += ["TIMEOUT", str(min(float(t.get("timeout") or 90), 90))]
        if t.get("skip_return_code") is not None: props += ["SKIP_RETURN_CODE", str(t["skip_return_code"])]
        if t.get("environment"): props += ["ENVIRONMENT", q(";".join(fix(e) for e in t["environment"]))]
        f.write("set_tests_properties(%s PROPERTIES %s)\n" % (q(t["name"]), " ".join(props)))
PY
  echo "$dir"
}

stage_ctest() {
  source "$WORK/env.sh" || return 1
  local dir
  if [[ -f "$WORK/ctest_dir" ]]; then dir="$(cat "$WORK/ctest_dir")"; else dir="$(write_ctest_file)" || return 1; fi
  command -v ctest >/dev/null || { echo "no ctest on this machine"; return 1; }
  echo "ctest in $dir"
  ctest --test-dir "$dir" -L gpu --output-on-failure --timeout 150 2>&1 | tee "$WORK/ctest.out"
  local rc=${PIPESTATUS[0]}
  if grep -qE '^100% tests passed, 0 tests failed out of 0|No tests were found' "$WORK/ctest.out"; then
    echo "no gpu tests ran"; return 1
  fi
  echo "note: $(grep -c ' Passed ' "$WORK/ctest.out") passed, $(grep -c 'Skipped ' "$WORK/ctest.out") skipped," \
    "$(grep -cE '\*\*\*Failed|\*\*\*Timeout|\*\*\*Exception' "$WORK/ctest.out") failed"
  # All skipped = the device was not usable: report SKIP.
  if [[ $rc == 0 ]] && ! grep -q 'Passed' "$WORK/ctest.out"; then return 77; fi
  return $rc
}

stage_identity() {
  source "$WORK/env.sh" || return 1
  local threads=4; [[ "$REHEARSE" == 1 ]] && threads=1
  local rc=0 kv
  for kv in f16 q8_0; do  # the default KV cache, and the quantized one
    python3 -u "$ROOT/scripts/gpu_identity.py" --build "$PD_BUILD" --model "$MODELS/smollm2-135m-q4_1.gguf" \
      --backend "$BACKEND" --kv-dtype "$kv" --tokens 32 --threads "$threads" --json "$RES/identity_$kv.json" \
      --pid-file "$WORK/cluster.pid" || rc=$?
  done
  return $rc
}

# One benchmark: NAME MODEL [pd-bench-engine flags]; its JSON and profile into RES.
bench_one() {
  local name="$1" model="$2"; shift 2
  local args=(--backend "$BACKEND")
  [[ "$REHEARSE" == 1 ]] && args=(--threads 2 --batches 1,8)
  echo "== $name: pd-bench-engine -m $model ${args[*]} $*"
  local t0=$SECONDS
  "$PD_BUILD/tools/pd-bench-engine" -m "$model" "${args[@]}" --json "$RES/bench_$name.json" \
    --profile "$RES/profile_$name.json" "$@"
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s"
  echo "$name: $([[ $rc == 0 ]] && echo ok || echo "exit $rc") $((SECONDS - t0))s" >>"$RES/bench_status.txt"
  return $rc
}

stage_bench() {
  source "$WORK/env.sh" || return 1
  local rc=0 big=llama-3.1-8b
  : >"$RES/bench_status.txt"
  bench_one smollm2-135m-q4_1 "$MODELS/smollm2-135m-q4_1.gguf" --prefill-tokens 512 --prompt 128 --gen 64 || rc=1
  [[ "$REHEARSE" == 1 ]] || bench_one smollm2-135m-q4_1-tf32 "$MODELS/smollm2-135m-q4_1.gguf" --prefill-tokens 512 \
    --prompt 128 --gen 64 --tf32 || rc=1
  if [[ "$REHEARSE" == 1 ]]; then big=tiny; fi
  local types=(q4_0); [[ "$BF16" == 1 ]] && types+=(bf16)
  for ty in "${types[@]}"; do
    local m="$MODELS/$big-$ty.gguf" t0=$SECONDS
    df -h "$MODELS" | tail -1
    "$PD_BUILD/tools/pd-make-model" --shape "$big" --type "$ty" --out "$m" || { rc=1; continue; }
    echo "== wrote $m in $((SECONDS - t0)) s"
    bench_one "$big-$ty" "$m" --prefill-tokens 512 --prompt 128 --gen 32 --reps 2 || rc=1
    if [[ "$REHEARSE" == 0 && "$ty" == q4_0 ]]; then
      bench_one "$big-$ty-tf32" "$m" --prefill-tokens 512 --prompt 128 --gen 32 --reps 2 --tf32 || rc=1
    fi
    rm -f "$m"  # disk: the next one is larger
  done
  echo "note: $(tr '\n' ' ' <"$RES/bench_status.txt")"
  return $rc
}

stage_plan() {
  source "$WORK/env.sh" || return 1
  local rc=0 p found=0 hw=h200 model
  [[ "$REHEARSE" == 1 ]] && hw=cpu-2core
  for p in "$RES"/profile_*.json; do
    [[ -s "$p" ]] || continue
    found=1
    local name; name="$(basename "$p" .json)"; name="${name#profile_}"
    case "$name" in
      llama-3.1-8b*|tiny*) model=(--model llama-3.1-8b) ;;
      *) model=(--gguf "$MODELS/smollm2-135m-q4_1.gguf") ;;
    esac
    [[ "$name" == tiny* ]] && model=(--gguf "$MODELS/tiny.gguf")
    local w=int4; [[ "$name" == *bf16 ]] && w=bf16; [[ "$name" == *q8_0 ]] && w=int8
    echo "== $name: measured profile (pd-plan pools --profile)"
    "$PD_BUILD/tools/pd-plan" pools "${model[@]}" --hardware "$hw" --weights "$w" --kv fp16 --profile "$p" \
      --requests 2000 --rate 4 --prompt-len lognormal:512:0.8 --output-len exp:128 || rc=1
    echo "== $name: roofline of the $hw preset (no profile)"
    "$PD_BUILD/tools/pd-plan" pools "${model[@]}" --hardware "$hw" --weights "$w" --kv fp16 \
      --requests 2000 --rate 4 --prompt-len lognormal:512:0.8 --output-len exp:128 || rc=1
  done
  [[ "$found" == 1 ]] || { echo "no engine profile was written (stage bench)"; return 77; }
  return $rc
}

# ------------------------------------------------------------------ one stage (run under timeout)
if [[ -n "$STAGE" ]]; then
  "stage_$STAGE"
  exit $?
fi

# ------------------------------------------------------------------ driver
START=$SECONDS
[[ "$REHEARSE" == 1 ]] && BUDGET=$((BUDGET * 4))  # a CPU rehearsal: every stage's time scaled alike
mkdir -p "$WORK"
SUMMARY="$OUT/summary.txt"
{
  echo "# pdcluster GPU check $(date -u +%Y-%m-%dT%H:%M:%SZ), backend $BACKEND, budget ${BUDGET}s"
  echo "# commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')," \
       "bundle: $(head -1 "$BUNDLE/MANIFEST.txt" 2>/dev/null || echo none)"
} >"$SUMMARY"

# run_stage NAME LOG MAX_SECONDS: the stage under timeout (capped by what is left of the budget,
# keeping RESERVE seconds for the stages after it); appends to LOG and a summary line.
run_stage() {
  local name="$1" log="$OUT/$2" max="$3" reserve="${4:-0}"
  [[ "$REHEARSE" == 1 ]] && max=$((max * 4)) reserve=$((reserve * 4))  # small models, but on a CPU
  local base=540; [[ "$REHEARSE" == 1 ]] && base=2160
  reserve=$((reserve * BUDGET / base))  # the reserves are written for the default budget
  local left=$((BUDGET - (SECONDS - START) - reserve))
  local limit=$(( max < left ? max : left ))
  if (( limit < 10 )); then
    printf '%-9s SKIP %5ss  %s\n' "$name" 0 "no time left in the budget" | tee -a "$SUMMARY"
    return
  fi
  echo "=== stage $name (limit ${limit}s) $(date -u +%H:%M:%S)" >>"$log"
  local t0=$SECONDS
  timeout -k 10 "$limit" bash "$SELF" --out "$OUT" --budget "$BUDGET" --stage "$name" \
    $([[ "$REHEARSE" == 1 ]] && echo --rehearse) $([[ "$BUILD_HERE" == 1 ]] && echo --build-here) \
    $([[ "$BF16" == 0 ]] && echo --no-bf16) >>"$log" 2>&1
  local rc=$? secs=$((SECONDS - t0)) status note=""
  note="$(sed -n "/^=== stage $name /,\$p" "$log" | grep '^note: ' | tail -1 | cut -c7-200)"
  case $rc in
    0) status=PASS ;;
    77) status=SKIP; [[ -n "$note" ]] || note="$(tail -1 "$log")" ;;
    124|137) status=FAIL; note="timed out after ${limit}s" ;;
    *) status=FAIL; note="exit $rc: ${note:-$(grep -v '^$' "$log" | tail -1 | cut -c1-160)}" ;;
  esac
  printf '%-9s %s %5ss  %s\n' "$name" "$status" "$secs" "$note" | tee -a "$SUMMARY"
}

# Key figures from the results into the summary; every JSON into results.json.
collect() {
  python3 - "$RES" "$OUT/results.json" "$SUMMARY" <<'PY' || true
import glob, json, os, sys
res, out, summary = sys.argv[1:]
allj = {}
for p in sorted(glob.glob(os.path.join(res, "*.json"))):
    try:
        allj[os.path.basename(p)[:-5]] = json.load(open(p))
    except Exception as e:
        allj[os.path.basename(p)[:-5]] = {"unreadable": str(e)}
json.dump(allj, open(out, "w"), indent=1)
lines = []
for name, j in allj.items():
    if name.startswith("bench_") and "runs" in j and j["runs"]:
        r = j["runs"][0]
        p = r.get("prefill", {})
        frac = p.get("fraction_of_peak", p.get("fraction_of_fma"))
        lines.append("%-30s prefill %d tok: %.0f tok/s, %.2f TFLOP/s = %.2f%% of peak" % (
            name[6:], p.get("tokens", 0), p.get("tokens_per_s", 0), p.get("gflops", 0) / 1e3, 100 * (frac or 0)))
        for d in r.get("decode", []):
            f = d.get("fraction_of_bandwidth", d.get("fraction_of_triad", 0))
            lines.append("%-30s decode batch %3d: %8.1f tok/s, step %.2f ms, %.0f GB/s = %.1f%% of memory bandwidth" % (
                "", d["batch"], d["tokens_per_s"], d["median_step_s"] * 1e3, d["streamed_gbs"], 100 * f))
    if name.startswith("identity"):
        state = j.get("error", "ok" if j.get("ok") else "differs")
        lines.append("%s: %s of %s answers identical (%s)" % (name, j.get("identical"), j.get("compared"), state))
with open(summary, "a") as f:
    f.write("".join("# " + l + "\n" for l in lines))
PY
}

run_stage probe probe.log 30 480
run_stage setup setup.log 330 180
run_stage ctest ctest.log 150 150
run_stage identity identity.log 150 90
# A cluster the identity stage left behind (killed at its limit) must not share the GPU with the benchmarks.
if [[ -s "$WORK/cluster.pid" ]] && kill -0 "$(cat "$WORK/cluster.pid")" 2>/dev/null; then
  pgid="$(cat "$WORK/cluster.pid")"
  kill -TERM -- "-$pgid" 2>/dev/null; sleep 3; kill -KILL -- "-$pgid" 2>/dev/null
  echo "(stopped the cluster the identity stage left running)" >>"$OUT/identity.log"
fi
rm -f "$WORK/cluster.pid"
run_stage bench bench.log 300 15
run_stage plan bench.log 60
collect
echo "# total $((SECONDS - START))s" >>"$SUMMARY"
cat "$SUMMARY"
