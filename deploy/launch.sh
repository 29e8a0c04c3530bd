#!/usr/bin/env bash
# Starts a pdcluster as one MPI job (MPMD): 1 router + P prefill + D decode ranks,
# or 1 router + N colocated workers (each runs both phases: the baseline).
#
#   deploy/launch.sh --prefill 1 --decode 1                 # localhost, port 8000
#   deploy/launch.sh --colocated 2                          # conventional server, 2 workers
#   deploy/launch.sh --prefill 2 --decode 4 --hostfile deploy/hostfile.example --host 0.0.0.0   # needs http.api_key, or --insecure
#   deploy/launch.sh --prefill 1 --decode 1 --dry-run       # print the mpirun line only
#   deploy/launch.sh --prefill 1 --decode 1 --kv-dtype q8_0 # 8-bit KV cache (default: the config's kv.dtype, f16)
#   deploy/launch.sh --prefill 1 --decode 1 --join-file /tmp/pd.join   # accept pools that join later
#   deploy/launch.sh --join /tmp/pd.join --decode 2         # a pool joining that cluster (Ctrl-C: it leaves)
#   deploy/launch.sh --prefill 0 --decode 0 --join-file F   # the router alone; every host's ranks join as pools
#   deploy/launch.sh --new-router F                         # a router for the pools of F's cluster, whose router died
#   deploy/launch.sh --supervise --prefill 1 --decode 2     # keep the pools at size: replace dead ranks and a dead router
#
# Waits for GET /health, prints the URL and a curl to try, then stays in the
# foreground until the cluster exits; Ctrl-C / SIGTERM drains it cleanly. Exits
# 2 when the cluster never came up (a start-up error is printed above it).
#
# Options: --prefill N, --decode N, --colocated N (worker counts); --config FILE
# (deploy/cluster.json); --model FILE; --port N; --host ADDR; --insecure (a
# non-loopback --host without http.api_key); --threads N (per worker rank);
# --kv-dtype f16|q8_0|f32; --hostfile FILE (mpirun's); --mca NAME VALUE (passed
# to mpirun); --build DIR (build); --join-file F, --join F, --secret-file F,
# --new-router F (elastic pools: docs/CLUSTER.md); --supervise; --dry-run;
# --no-wait (exec mpirun in the foreground, no health wait).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# --supervise: deploy/supervise.py runs this script (without the flag) and keeps the pools at size.
for a in "$@"; do
  if [[ "$a" == --supervise ]]; then
    rest=(); for b in "$@"; do [[ "$b" == --supervise ]] || rest+=("$b"); done
    exec python3 "$ROOT/deploy/supervise.py" "${rest[@]}"
  fi
done

P=1 D=1 COLOCATED="" HOSTFILE="" PORT="" HOST="" MODEL="" CONFIG="$ROOT/deploy/cluster.json"
BUILD="$ROOT/build" THREADS="" KV_DTYPE="" DRY=0 WAIT=1 MPI_EXTRA=() JOIN_FILE="" JOIN="" P_SET=0 D_SET=0 NEW_ROUTER=""
INSECURE=0 SECRET_FILE=""
usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "launch.sh: $*" >&2; exit 2; }
# A flag's value: present, and not the next flag.
need_val() { [[ -n "${2:-}" && "${2:-}" != --* ]] || die "$1 needs a value"; }
# A non-negative integer of at most `max` (default 1024) for flag $1.
need_int() {
  [[ "${2:-}" =~ ^[0-9]{1,6}$ ]] && (( 10#$2 <= ${3:-1024} )) || die "$1 needs an integer in [0, ${3:-1024}], got '${2:-}'"
}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prefill) need_int "$1" "${2:-}"; P="$2"; P_SET=1; shift 2 ;;
    --decode) need_int "$1" "${2:-}"; D="$2"; D_SET=1; shift 2 ;;
    --join-file) need_val "$1" "${2:-}"; JOIN_FILE="$2"; shift 2 ;;
    --join) need_val "$1" "${2:-}"; JOIN="$2"; [[ -f "$JOIN" ]] || die "--join: no such file '$JOIN' (the running cluster's --join-file)"; shift 2 ;;
    --secret-file) need_val "$1" "${2:-}"; SECRET_FILE="$2"; shift 2 ;;
    --new-router) need_val "$1" "${2:-}"; NEW_ROUTER="$2"; shift 2 ;;
    --colocated) need_int "$1" "${2:-}"; COLOCATED="$2"; shift 2 ;;
    --hostfile) need_val "$1" "${2:-}"; HOSTFILE="$2"; [[ -f "$HOSTFILE" ]] || die "--hostfile: no such file '$HOSTFILE'"; shift 2 ;;
    --port) need_int "$1" "${2:-}" 65535; PORT="$2"; shift 2 ;;
    --host) need_val "$1" "${2:-}"; HOST="$2"; shift 2 ;;
    --insecure) INSECURE=1; shift ;;  # serve on a non-loopback host without an API key (a trusted network only)
    --model) need_val "$1" "${2:-}"; MODEL="$2"; [[ -f "$MODEL" ]] || die "--model: no such file '$MODEL' (scripts/fetch_model.sh fetches the default)"; shift 2 ;;
    --config) need_val "$1" "${2:-}"; CONFIG="$2"; [[ -f "$CONFIG" ]] || die "--config: no such file '$CONFIG'"; shift 2 ;;
    --build) need_val "$1" "${2:-}"; BUILD="$2"; shift 2 ;;
    --threads) need_int "$1" "${2:-}"; THREADS="$2"; shift 2 ;;
    --kv-dtype) KV_DTYPE="${2:-}"; [[ "$KV_DTYPE" =~ ^(f16|q8_0|f32)$ ]] || die "--kv-dtype must be f16, q8_0 or f32, got '$KV_DTYPE'"; shift 2 ;;
    --mca) need_val "$1" "${2:-}"; need_val "$1 $2" "${3:-}"; MPI_EXTRA+=(--mca "$2" "$3"); shift 3 ;;
    --dry-run) DRY=1; shift ;;
    --no-wait) WAIT=0; shift ;;
    -h|--help) usage 0 ;;
    *) echo "launch.sh: unknown option '$1'" >&2; usage 2 ;;
  esac
done
if [[ -n "$NEW_ROUTER" ]]; then
  # The pools of a cluster whose router died wait (timeouts.rejoin_ms) for a
  # router named in its join file: this one, through the same ompi-server.
  [[ -z "$COLOCATED$JOIN$JOIN_FILE" && "$P_SET$D_SET" == 00 ]] ||
    die "--new-router takes no --prefill, --decode, --colocated, --join or --join-file (the pools are running)"
  [[ -f "$NEW_ROUTER.ompi-server" ]] ||
    die "--new-router: no '$NEW_ROUTER.ompi-server' beside the join file (was the cluster started with --join-file?)"
  JOIN_FILE="$NEW_ROUTER" P=0 D=0
elif [[ -n "$JOIN" ]]; then
  [[ -z "$COLOCATED" && -z "$JOIN_FILE" ]] || die "--join takes --prefill/--decode counts (not --colocated or --join-file)"
  [[ "$P_SET" == 1 ]] || P=0
  [[ "$D_SET" == 1 ]] || D=0
  (( P + D >= 1 )) || die "--join needs --prefill N and/or --decode N (at least one rank)"
  [[ -f "$JOIN.ompi-server" ]] || die "--join: no '$JOIN.ompi-server' beside the join file (is the cluster running with --join-file?)"
elif [[ -n "$COLOCATED" ]]; then
  [[ "$COLOCATED" -ge 1 ]] || die "--colocated needs at least 1 worker"
  [[ "$P_SET$D_SET" == 00 ]] || die "--colocated N takes no --prefill or --decode (its workers run both phases)"
  P=0 D="$COLOCATED"
elif [[ -n "$JOIN_FILE" && "$P" == 0 && "$D" == 0 ]]; then
  :  # the router alone: every worker joins later as a pool (one mpirun per host: docs/CLUSTER.md)
else
  [[ "$P" -ge 1 ]] || die "--prefill needs at least 1 rank (or use --colocated N)"
  [[ "$D" -ge 1 ]] || die "--decode needs at least 1 rank"
fi
# A router bound beyond loopback serves whoever reaches it: only with an API key
# (http.api_key), or with --insecure for a network where every client is trusted.
# (A pool joining with --join runs no router.)
if [[ -z "$JOIN" ]]; then
  read -r BIND_HOST HAS_KEY < <(python3 - "$CONFIG" "$HOST" <<'PY'
import json, re, sys
try: http = json.loads(re.sub(r'//[^\n]*', '', open(sys.argv[1]).read())).get("http", {})
except Exception: http = {}
print(sys.argv[2] or http.get("host") or "127.0.0.1", 1 if http.get("api_key") else 0)
PY
)
  case "$BIND_HOST" in
    127.*|localhost|::1|"[::1]") ;;
    *) [[ "$HAS_KEY" == 1 || "$INSECURE" == 1 ]] ||
         die "refusing to serve on $BIND_HOST (reachable from other machines) without an API key: set http.api_key in $CONFIG, or pass --insecure to serve without one (a trusted network only)" ;;
  esac
fi
for b in router/pd-router prefill_node/pd-prefill decode_node/pd-decode; do
  [[ -x "$BUILD/$b" ]] || die "missing $BUILD/$b: build first (cmake -S . -B build -G Ninja && cmake --build build)"
done

# Per-rank compute threads on one machine: share the cores among the workers.
if [[ -z "$THREADS" && -z "$HOSTFILE" ]]; then
  THREADS=$(( $(nproc) / (P + D > 0 ? P + D : 1) )); [[ "$THREADS" -ge 1 ]] || THREADS=1
fi
ARGS=("$CONFIG")
[[ -n "$MODEL" ]] && ARGS+=(--model "$MODEL")
[[ -n "$THREADS" ]] && ARGS+=(--threads "$THREADS")
[[ -n "$KV_DTYPE" ]] && ARGS+=(--kv-dtype "$KV_DTYPE")
RARGS=("$CONFIG")
[[ -n "$MODEL" ]] && RARGS+=(--model "$MODEL")
[[ -n "$KV_DTYPE" ]] && RARGS+=(--kv-dtype "$KV_DTYPE")
[[ -n "$PORT" ]] && RARGS+=(--port "$PORT")
[[ -n "$HOST" ]] && RARGS+=(--host "$HOST")

MPIRUN=(mpirun)
[[ "$(id -u)" == 0 ]] && MPIRUN+=(--allow-run-as-root)
if [[ -n "$HOSTFILE" ]]; then MPIRUN+=(--hostfile "$HOSTFILE"); else MPIRUN+=(--oversubscribe); fi
# Idle ranks sleep instead of spinning (the router shares cores with the
# workers). OpenMP threads wait passively too when the workers' threads
# outnumber the cores (or the hosts are unknown: --hostfile); when every
# thread has a core, spinning briefly between a forward pass's parallel
# regions is faster (batch-1 decode ~25% on a 2-core machine).
# orte_enable_recovery: a rank that dies (killed, crashed) does not take the job
# down with it; the router declares it down after timeouts.heartbeat_ms and
# serves on with the ranks left.
OMP_ENV=(-x OMP_WAIT_POLICY=PASSIVE)
if [[ -z "$HOSTFILE" && -n "$THREADS" ]] && (( (P + D) * THREADS <= $(nproc) )); then OMP_ENV=(); fi
MPIRUN+=(--mca mpi_yield_when_idle 1 --mca orte_enable_recovery 1 "${OMP_ENV[@]}" "${MPI_EXTRA[@]}")
if [[ -n "$JOIN" ]]; then
  # A pool joining a running cluster: its own MPI job, no router; the ranks
  # connect through the cluster's ompi-server (MPI_Comm_connect).
  MPIRUN+=(--ompi-server "file:$JOIN.ompi-server")
  ARGS+=(--join "$JOIN")
  [[ -n "$SECRET_FILE" ]] && ARGS+=(--secret-file "$SECRET_FILE")
  SEP=()
  [[ "$P" -gt 0 ]] && { MPIRUN+=(-np "$P" "$BUILD/prefill_node/pd-prefill" "${ARGS[@]}"); SEP=(:); }
  [[ "$D" -gt 0 ]] && MPIRUN+=("${SEP[@]}" -np "$D" "$BUILD/decode_node/pd-decode" "${ARGS[@]}")
  echo "+ ${MPIRUN[*]}"
  [[ "$DRY" == 1 ]] && exit 0
  setsid "${MPIRUN[@]}" &
  PID=$!
  set +e
  # Ctrl-C / SIGTERM: each rank of the pool asks the router to drain it, then exits.
  leave() {
    echo "launch.sh: the pool is leaving the cluster (its requests finish first; Ctrl-C again to kill)" >&2
    trap 'kill -KILL -- -$PID 2>/dev/null' INT TERM
    pkill -TERM -s "$PID" -x pd-prefill; pkill -TERM -s "$PID" -x pd-decode
    wait "$PID"; exit $?
  }
  trap leave INT TERM
  wait "$PID"; exit $?
fi
OMPI_SERVER_PID=""
if [[ -n "$JOIN_FILE" ]]; then
  # Elastic pools: an ompi-server lets separate mpiruns connect (MPI_Comm_connect/accept);
  # the router writes its port to JOIN_FILE, the server's address goes beside it.
  command -v ompi-server >/dev/null || die "--join-file needs OpenMPI's ompi-server"
  if [[ "$DRY" == 0 && -z "$NEW_ROUTER" ]]; then  # (a new router uses the running cluster's server)
    # A fresh cluster: a fresh secret (the router writes it, owner-only, before
    # the join file), unless the operator gives one (--secret-file).
    rm -f "$JOIN_FILE" "$JOIN_FILE.ompi-server"
    [[ -z "$SECRET_FILE" ]] && rm -f "$JOIN_FILE.secret"
    # The server listens where the ranks do: the interfaces given for mpirun
    # (--mca *_if_include / *_if_exclude), else loopback for a one-host cluster.
    SERVER_MCA=()
    for ((i = 0; i < ${#MPI_EXTRA[@]}; i += 3)); do
      case "${MPI_EXTRA[i+1]}" in
        *tcp_if_include | *tcp_if_exclude) SERVER_MCA+=(--mca "oob_tcp_${MPI_EXTRA[i+1]##*tcp_}" "${MPI_EXTRA[i+2]}") ;;
      esac
    done
    [[ ${#SERVER_MCA[@]} -eq 0 && -z "$HOSTFILE" ]] && SERVER_MCA=(--mca oob_tcp_if_include lo)
    (umask 077; exec ompi-server "${SERVER_MCA[@]}" --no-daemonize -r "$JOIN_FILE.ompi-server") &
    OMPI_SERVER_PID=$!
    for _ in $(seq 1 100); do [[ -s "$JOIN_FILE.ompi-server" ]] && break; sleep 0.1; done
    [[ -s "$JOIN_FILE.ompi-server" ]] || die "ompi-server did not start"
  fi
  MPIRUN+=(--ompi-server "file:$JOIN_FILE.ompi-server")
  RARGS+=(--join-file "$JOIN_FILE")
  # Workers accept pools, and join the next router named in the file if this one dies.
  ARGS+=(--elastic --join-file "$JOIN_FILE")
  if [[ -n "$SECRET_FILE" ]]; then RARGS+=(--secret-file "$SECRET_FILE"); ARGS+=(--secret-file "$SECRET_FILE"); fi
fi
MPIRUN+=(-np 1 "$BUILD/router/pd-router" "${RARGS[@]}")
[[ "$P" -gt 0 ]] && MPIRUN+=(: -np "$P" "$BUILD/prefill_node/pd-prefill" "${ARGS[@]}")
[[ "$D" -gt 0 ]] && MPIRUN+=(: -np "$D" "$BUILD/decode_node/pd-decode" "${ARGS[@]}")

echo "+ ${MPIRUN[*]}"
[[ "$DRY" == 1 ]] && exit 0
if [[ -n "$OMPI_SERVER_PID" ]]; then
  trap 'kill "$OMPI_SERVER_PID" 2>/dev/null; rm -f "$JOIN_FILE" "$JOIN_FILE.ompi-server" "$JOIN_FILE.secret"' EXIT
  if [[ "$WAIT" == 0 ]]; then "${MPIRUN[@]}"; exit $?; fi
fi
[[ "$WAIT" == 0 ]] && exec "${MPIRUN[@]}"

# Port and host as the router will use them (flags, else the config, else defaults).
cfg_get() { python3 - "$CONFIG" "$1" "$2" <<'PY'
import json, re, sys
text = open(sys.argv[1]).read()
text = re.sub(r'//[^\n]*', '', text)
try: v = json.loads(text).get("http", {}).get(sys.argv[2], sys.argv[3])
except Exception: v = sys.argv[3]
print(v)
PY
}
PORT="${PORT:-$(cfg_get port 8000)}"
HOST="${HOST:-$(cfg_get host 127.0.0.1)}"
API_KEY="$(cfg_get api_key '')"
# The router writes the port it bound to a file (http.port_file, else one of
# ours): the cluster is up once that file exists and GET /health says ok — not
# when some other server that holds the port answers.
PORT_FILE="$(cfg_get port_file '')" PORT_DIR=""
if [[ -z "$PORT_FILE" ]]; then
  PORT_DIR=$(mktemp -d)
  PORT_FILE="$PORT_DIR/port"
  for i in "${!MPIRUN[@]}"; do
    if [[ "${MPIRUN[$i]}" == "$BUILD/router/pd-router" ]]; then
      MPIRUN=("${MPIRUN[@]:0:$((i + 1))}" --port-file "$PORT_FILE" "${MPIRUN[@]:$((i + 1))}")
      break
    fi
  done
else
  rm -f "$PORT_FILE"  # a stale one from an earlier run would say the router bound
fi
CHOST="$HOST"; [[ "$CHOST" == 0.0.0.0 ]] && CHOST=127.0.0.1

# mpirun gets its own session, so a Ctrl-C reaches only this script, which then asks the
# router to drain (SIGTERM to pd-router): in-flight requests finish, workers shut down,
# mpirun exits 0. (A SIGINT to mpirun itself would kill every rank at once.)
setsid "${MPIRUN[@]}" &
PID=$!
# From here on nothing may end this script while the job runs undrained: no
# set -e, and any exit other than the cluster's own drains it first.
set +e
drain() {
  echo "launch.sh: draining the cluster (in-flight requests finish; Ctrl-C again to kill)" >&2
  trap 'kill -KILL -- -$PID 2>/dev/null' INT TERM
  local router; router=$(pgrep -s "$PID" -x pd-router | head -1)
  if [[ -n "$router" ]]; then kill -TERM "$router"; else kill -TERM "$PID" 2>/dev/null; fi
  wait "$PID"; exit $?
}
trap drain INT TERM
AUTH=() AUTH_HINT=""
if [[ -n "$API_KEY" ]]; then
  AUTH=(-H "Authorization: Bearer $API_KEY")
  AUTH_HINT=" -H 'Authorization: Bearer <http.api_key>'"
fi
ANNOUNCED=0 UP=0
METRICS_AUTH=""; [[ "$(cfg_get metrics_require_key False)" == True ]] && METRICS_AUTH="$AUTH_HINT"
while :; do
  if [[ "$ANNOUNCED" == 0 && -s "$PORT_FILE" ]]; then
    PORT=$(cat "$PORT_FILE"); [[ -n "$PORT_DIR" ]] && rm -rf "$PORT_DIR"
    echo "launch.sh: the router answers at http://$CHOST:$PORT (waiting for GET /health to say ok)"; ANNOUNCED=1
  fi
  if [[ "$ANNOUNCED" == 1 ]] && curl -sf "http://$CHOST:$PORT/health" >/dev/null 2>&1; then
    UP=1
    MODEL_NAME=$(curl -s "${AUTH[@]}" "http://$CHOST:$PORT/v1/models" |
                 python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])' 2>/dev/null)
    [[ -n "$MODEL_NAME" ]] || MODEL_NAME="<model>"
    cat <<MSG

pdcluster is up: http://$CHOST:$PORT  ($P prefill + $D decode ranks${COLOCATED:+, colocated})
Try:
  curl http://$CHOST:$PORT/v1/chat/completions -H 'Content-Type: application/json'$AUTH_HINT \\
    -d '{"model": "$MODEL_NAME", "messages": [{"role": "user", "content": "Give me three tips for staying healthy."}], "max_tokens": 96}'
Metrics: curl http://$CHOST:$PORT/metrics$METRICS_AUTH     Stop: Ctrl-C (drains in-flight requests)
MSG
    break
  fi
  kill -0 $PID 2>/dev/null || break
  sleep 0.5
done
wait $PID
RC=$?
[[ -n "$PORT_DIR" ]] && rm -rf "$PORT_DIR"
if [[ "$UP" == 0 ]]; then
  # mpirun runs the job with orte_enable_recovery, so it exits 0 even when a
  # rank aborted at start-up: a cluster that never came up is a failure here.
  echo "launch.sh: the cluster did not start (its error is above)" >&2
  [[ "$RC" != 0 ]] && exit "$RC"
  exit 2
fi
exit $RC
