#include "serving/worker_main.h"

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <csignal>
#include <iostream>

namespace pd {

Result<ClusterConfig> parse_cluster_args(int argc, char** argv, const char* program, bool* help) {
  std::string config_path, model, host, port_file;
  int threads = -1, port = -1;
  CLI::App app{std::string(program) + ": a pdcluster rank (start all ranks with one mpirun; see deploy/launch.sh)"};
  app.add_option("config", config_path, "cluster config JSON (deploy/cluster.json); defaults apply without one");
  app.add_option("--model", model, "GGUF model file (overrides the config's 'model')");
  app.add_option("--threads", threads, "compute threads of this rank (overrides prefill/decode.threads)")
      ->check(CLI::Range(0, 1024));
  app.add_option("--host", host, "HTTP bind address (router; overrides http.host)");
  app.add_option("--port", port, "HTTP port (router; overrides http.port; 0 = any free port)")->check(CLI::Range(0, 65535));
  app.add_option("--port-file", port_file, "file the router writes its bound port to (overrides http.port_file)");
  *help = false;
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    std::cout << app.help();
    *help = true;
    return Status::cancelled("help");
  } catch (const CLI::ParseError& e) {
    return Status::invalid_argument(e.what());
  }
  ClusterConfig cfg;
  if (!config_path.empty()) {
    PD_ASSIGN_OR_RETURN(cfg, ClusterConfig::load(config_path));
  }
  if (!model.empty()) cfg.model = model;
  if (threads >= 0) cfg.prefill.threads = cfg.decode.threads = threads;
  if (port >= 0) cfg.http.port = port;
  if (!host.empty()) cfg.http.host = host;
  if (!port_file.empty()) cfg.http.port_file = port_file;
  PD_RETURN_IF_ERROR(cfg.validate());
  return cfg;
}

int worker_main(int argc, char** argv, Role role, const WorkerBody& body) {
  // Workers stop when the router says so (after it drained); a SIGTERM that
  // mpirun forwards to every rank must not cut a worker out from under it.
  std::signal(SIGTERM, SIG_IGN);
  std::signal(SIGINT, SIG_IGN);
  if (Status st = mpi_init(&argc, &argv); !st.is_ok()) {
    std::cerr << "pd-" << role_name(role) << ": " << st.to_string() << "\n";
    return 1;
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  spdlog::set_pattern(std::string("[%H:%M:%S.%e] [") + role_name(role) + " " + std::to_string(rank) + "] [%l] %v");
  auto abort_job = [&](const std::string& what) {
    spdlog::critical("{}", what);
    MPI_Abort(MPI_COMM_WORLD, 2);
    return 2;
  };
  bool help = false;
  auto cfg = parse_cluster_args(argc, argv, (std::string("pd-") + role_name(role)).c_str(), &help);
  // Every rank joins the role exchange before anyone may abort, so errors are reported once, clearly.
  auto roles = exchange_roles(role);
  if (help) {
    MPI_Finalize();
    return 0;
  }
  if (!cfg.is_ok()) return abort_job(cfg.status().message());
  if (!roles.is_ok()) return abort_job(roles.status().message());

  EngineConfig ec;
  ec.model_path = cfg->model;
  ec.block_size = cfg->kv.block_size;
  ec.kv_checksum = cfg->kv.checksum;
  ec.int8_activations = cfg->engine.int8_activations;
  if (role == Role::kPrefill) {
    ec.threads = cfg->prefill.threads;
    ec.kv_budget_bytes = cfg->kv.prefill_budget_mb << 20;
    ec.kv_fit_context = true;  // any prompt the router admits (< context) fits one prefill rank
    ec.prefix_sharing = true;
  } else {
    ec.threads = cfg->decode.threads;
    ec.kv_budget_bytes = cfg->kv.decode_budget_mb << 20;
    // Decode blocks are only ever filled by transfers and this rank's own
    // steps; sharing them would let a sequence read a block still in flight.
    // (Colocated mode prefills locally and could share; kept uniform.)
    ec.prefix_sharing = false;
  }
  auto engine = Engine::create(ec);
  if (!engine.is_ok()) return abort_job(engine.status().to_string());
  Status st = body(*cfg, *roles, std::move(engine).value());
  if (!st.is_ok()) spdlog::error("{}", st.to_string());
  const int code = st.is_ok() ? 0 : 1;
  mpi_finalize_bounded(code);
  return code;
}

}  // namespace pd
