#include "worker/worker_main.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <string>
#include <iostream>

#include "protocol/join_handshake.h"
#include "protocol/link_auth.h"
#include "protocol/mpi_runtime.h"

namespace pd {

namespace {
volatile std::sig_atomic_t g_leave = 0;
void on_leave_signal(int) { g_leave = 1; }
}  // namespace

bool leave_requested() { return g_leave != 0; }

namespace {
bool g_left = false;
}  // namespace

void note_left() { g_left = true; }

// This process's rank among the ranks of its mpirun on its host (0 when the
// launcher does not say).
static int node_local_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    const char* v = std::getenv(var);
    if (v != nullptr && *v != '\0') return std::max(0, std::atoi(v));
  }
  return 0;
}

namespace {

void set_rank_in_log(Role role, int id) {
  spdlog::set_pattern(std::string("[%H:%M:%S.%e] [") + role_name(role) + " " + std::to_string(id) + "] [%l] %v");
}

// A rank whose router is gone: waits for the join file to name a new router
// (timeouts.rejoin_ms) and joins it alone. Its new table, or why not.
Result<RoleTable> wait_and_rejoin(const ClusterConfig& cfg, const RoleTable& lost, const std::string& join_file,
                                  MpiLinks& links, const PoolIdentity& identity) {
  // The secret is read again: a new router may have been started with a new one.
  PD_ASSIGN_OR_RETURN(ClusterSecret secret, ClusterSecret::load(links.secret_path()));
  spdlog::info("waiting up to {} ms for a new router in '{}' (timeouts.rejoin_ms)", cfg.timeouts.rejoin_ms, join_file);
  PD_ASSIGN_OR_RETURN(JoinTarget target, wait_for_new_router(join_file, lost.hosts[lost.router], lost.pids[lost.router],
                                                             std::chrono::milliseconds(cfg.timeouts.rejoin_ms)));
  auto table = rejoin_cluster(links, target, lost, cfg.kv.block_size, identity, secret);
  if (!table.is_ok()) return Status::unavailable("joining the new router of '" + join_file + "': " + table.status().message());
  spdlog::info("joined the new router ({}:{}) as rank {}", target.host, target.pid, table->self);
  return table;
}

// Runs `body` under `table`. When the router is gone and this rank holds
// nothing (Unavailable), serves the next router named in `rejoin_file` (same
// engine: the model and the prefix cache stay) if one takes the cluster
// within timeouts.rejoin_ms. Returns the last body's status (or why no new
// router was joined); the links are closed.
Status serve_routers(const ClusterConfig& cfg, RoleTable table, const std::string& rejoin_file,
                     const PoolIdentity& identity, std::shared_ptr<Engine> engine, std::shared_ptr<MpiLinks> links,
                     const WorkerBody& body) {
  const Role role = table.roles[table.self];
  Status st = body(cfg, table, engine, links);
  while (st.is_unavailable() && !rejoin_file.empty() && cfg.timeouts.rejoin_ms > 0) {
    auto rejoined = wait_and_rejoin(cfg, table, rejoin_file, *links, identity);
    if (!rejoined.is_ok()) {
      st = rejoined.status();
      break;
    }
    table = std::move(rejoined).value();
    set_rank_in_log(role, table.self);
    std::signal(SIGTERM, on_leave_signal);  // like a joined rank now: SIGTERM asks to leave
    st = body(cfg, table, engine, links);
  }
  links->close_all();
  return st;
}

// The engine a rank of `role` runs, from the cluster config.
EngineConfig engine_config(const ClusterConfig& cfg, Role role) {
  EngineConfig ec;
  ec.model_path = cfg.model;
  ec.backend = cfg.engine.backend;
  // Ranks of a host spread over its GPUs (engine.devices, else local rank modulo the count).
  if (ec.backend == "cuda") ec.device = cfg.engine.device_of(node_local_rank(), backend_device_count("cuda"));
  ec.block_size = cfg.kv.block_size;
  ec.kv_checksum = cfg.kv.checksum;
  ec.int8_activations = cfg.engine.int8_activations;
  ec.kv_dtype = *parse_kv_dtype(cfg.kv.dtype, "kv.dtype");  // validated with the config
  if (role == Role::kPrefill) {
    ec.threads = cfg.prefill.threads;
    ec.kv_budget_bytes = cfg.kv.prefill_budget_mb << 20;
    ec.kv_fit_context = true;  // any prompt the router admits (< context) fits one prefill rank
    ec.prefix_sharing = cfg.kv.prefix_cache;
  } else {
    ec.threads = cfg.decode.threads;
    ec.kv_budget_bytes = cfg.kv.decode_budget_mb << 20;
    // A finished sequence's KV stays for a follow-up that extends it (the
    // router sends it back here). Blocks under a KV transfer register only
    // once their KV has arrived (decode_worker.cpp).
    ec.prefix_sharing = cfg.kv.prefix_cache;
  }
  return ec;
}

}  // namespace

namespace {

// A start-up error: said once, and the whole MPI job stops (a cluster never half-starts).
int abort_job(const std::string& what) {
  spdlog::critical("{}", what);
  MPI_Abort(MPI_COMM_WORLD, 2);
  return 2;
}

// The engine of a rank of `role`; the error names the backend and device.
Result<std::shared_ptr<Engine>> start_engine(const ClusterConfig& cfg, Role role) {
  const EngineConfig ec = engine_config(cfg, role);
  auto engine = Engine::create(ec);
  if (!engine.is_ok())
    return Status::invalid_argument(
        engine.status().to_string() +
        (ec.backend != "cpu" ? " (engine.backend / --backend '" + ec.backend + "', device " + std::to_string(ec.device) + ")"
                             : std::string()));
  if ((*engine)->backend->device_memory())
    spdlog::info("model and KV cache on {} device {} ({})", ec.backend, ec.device, (*engine)->backend->device_id());
  return std::shared_ptr<Engine>(std::move(engine).value());
}

// Opens this rank's MPI port when pools may join (elastic) and, for a rank of
// a pool joining a running cluster, joins it: the rank's table in that cluster.
Result<RoleTable> link_into_cluster(MpiLinks& links, const LaunchFlags& flags, bool joining, RoleTable table,
                                    const ClusterConfig& cfg, const PoolIdentity& identity) {
  if (flags.elastic || joining) {
    if (Status st = links.listen(-1, flags.secret_path()); !st.is_ok()) return Status::unavailable(st.to_string());
  }
  if (joining) {
    const std::string what = "joining the cluster of '" + flags.join + "': ";
    auto secret = ClusterSecret::load(flags.secret_path());
    if (!secret.is_ok()) return Status::unavailable(what + secret.status().message());
    auto joined = join_cluster(links, flags.join, table, cfg.kv.block_size, identity, *secret);
    if (!joined.is_ok()) return Status::unavailable(what + joined.status().message());
    table = std::move(joined).value();
    set_rank_in_log(table.roles[table.self], table.self);
    // SIGTERM to a joined rank: leave (drain, then exit); see leave_requested().
    std::signal(SIGTERM, on_leave_signal);
  } else if (flags.elastic) {
    if (Status st = send_now(links, table.router, proto::Listening{links.port()}); !st.is_ok())
      return Status::unavailable("telling the router this rank's MPI port: " + st.to_string());
  }
  return table;
}

// The process's end after serving: `st` logged, the exit code returned.
int finish_rank(const Status& st, bool joining) {
  if (st.is_unavailable()) spdlog::critical("{}; stopping", st.message());
  else if (!st.is_ok()) spdlog::error("{}", st.to_string());
  const int code = st.is_ok() ? 0 : 1;
  if (g_left && !joining) {
    // Drained out of the cluster; the rest of the job serves on. MPI_Finalize
    // would wait for every rank of the job (and mpirun --mca
    // orte_enable_recovery 1 lets the job go on without this process).
    spdlog::info("left the cluster; exiting (the rest of the job keeps serving)");
    spdlog::default_logger()->flush();
    std::_Exit(code);
  }
  mpi_finalize_bounded(code);
  return code;
}

}  // namespace

int worker_main(int argc, char** argv, Role role, const WorkerBody& body) {
  // Workers stop when the router says so (after it drained); a SIGTERM that
  // mpirun forwards to every rank must not cut a worker out from under it.
  std::signal(SIGTERM, SIG_IGN);
  std::signal(SIGINT, SIG_IGN);
  if (Status st = mpi_init(&argc, &argv, wants_elastic(argc, argv)); !st.is_ok()) {
    std::cerr << "pd-" << role_name(role) << ": " << st.to_string() << "\n";
    return 1;
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  set_rank_in_log(role, rank);
  bool help = false;
  LaunchFlags flags;
  auto cfg = parse_cluster_args(argc, argv, (std::string("pd-") + role_name(role)).c_str(), &help, &flags);
  const bool joining = wants_elastic(argc, argv) && cfg.is_ok() && !flags.join.empty();
  // Every rank joins the role exchange before anyone may abort, so errors are reported once, clearly.
  auto roles = exchange_roles(role, joining, cfg.is_ok() && flags.elastic,
                              cfg.is_ok() ? kv_dtype_name(engine_config(*cfg, role).kv_dtype) : "");
  if (help) {
    MPI_Finalize();
    return 0;
  }
  if (!cfg.is_ok()) return abort_job(cfg.status().message());
  if (!roles.is_ok()) return abort_job(roles.status().message());
  auto engine = start_engine(*cfg, role);
  if (!engine.is_ok()) return abort_job(engine.status().message());
  const PoolIdentity identity{kv_dtype_name(engine_config(*cfg, role).kv_dtype), gguf_fingerprint(*(*engine)->gguf)};
  auto links = std::make_shared<MpiLinks>();
  auto table = link_into_cluster(*links, flags, joining, *roles, *cfg, identity);
  if (!table.is_ok()) return abort_job(table.status().message());
  // Where a new router is named if this one goes (joined: the file joined by).
  // Not for a colocated rank: a new router (launch.sh --new-router) starts
  // disaggregated.
  const std::string rejoin_file =
      table->colocated() ? std::string() : joining ? flags.join : (flags.elastic ? flags.join_file : std::string());
  const Status st = serve_routers(*cfg, std::move(table).value(), rejoin_file, identity, std::move(engine).value(),
                                  std::move(links), body);
  return finish_rank(st, joining);
}

}  // namespace pd
