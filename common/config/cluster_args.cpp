#include "config/cluster_args.h"

#include <CLI/CLI.hpp>

#include <iostream>
#include <string>

#include "gguf/ggml_types.h"
#include "protocol/link_auth.h"

namespace pd {

std::string LaunchFlags::secret_path() const {
  if (!secret_file.empty()) return secret_file;
  if (!join.empty()) return secret_file_beside(join);
  if (!join_file.empty()) return secret_file_beside(join_file);
  return std::string();
}

bool wants_elastic(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--elastic" || a == "--join" || a.rfind("--join=", 0) == 0 || a == "--join-file" ||
        a.rfind("--join-file=", 0) == 0)
      return true;
  }
  return false;
}

Result<ClusterConfig> parse_cluster_args(int argc, char** argv, const char* program, bool* help, LaunchFlags* flags) {
  std::string config_path, model, host, port_file, kv_dtype, backend;
  LaunchFlags launch;
  int threads = -1, port = -1, device = -1;
  CLI::App app{std::string(program) + ": a pdcluster rank (start all ranks with one mpirun; see deploy/launch.sh)"};
  app.add_option("config", config_path, "cluster config JSON (deploy/cluster.json); defaults apply without one");
  app.add_option("--model", model, "GGUF model file (overrides the config's 'model')");
  app.add_option("--threads", threads, "compute threads of this rank (overrides prefill/decode.threads)")
      ->check(CLI::Range(0, 1024));
  app.add_option("--kv-dtype", kv_dtype, "KV cache elements: f16, q8_0 or f32 (overrides kv.dtype; every rank must agree)");
  app.add_option("--backend", backend, "worker: compute backend, cpu or cuda (overrides engine.backend)");
  app.add_option("--device", device, "worker: CUDA device ordinal of this rank (overrides engine.devices)")
      ->check(CLI::Range(0, 1023));
  app.add_option("--host", host, "HTTP bind address (router; overrides http.host)");
  app.add_option("--port", port, "HTTP port (router; overrides http.port; 0 = any free port)")->check(CLI::Range(0, 65535));
  app.add_option("--port-file", port_file, "file the router writes its bound port to (overrides http.port_file)");
  app.add_flag("--elastic", launch.elastic, "worker: accept ranks that join the cluster later (launch.sh --join-file)");
  app.add_option("--join", launch.join, "worker: join the running cluster this file (the router's --join-file) names");
  app.add_option("--join-file", launch.join_file,
                 "router: accept joining ranks; write where to join to this file. Worker (with --elastic): the file "
                 "to find a new router in when this one is gone");
  app.add_option("--secret-file", launch.secret_file,
                 "the cluster secret every joining rank proves (default: the join file's name + '.secret'; the "
                 "router creates it, readable by its owner only, when it does not exist)");
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
  if (!backend.empty()) cfg.engine.backend = backend;
  if (device >= 0) cfg.engine.devices = {device};
  if (!host.empty()) cfg.http.host = host;
  if (!port_file.empty()) cfg.http.port_file = port_file;
  if (!kv_dtype.empty()) {
    PD_RETURN_IF_ERROR(parse_kv_dtype(kv_dtype, "--kv-dtype").status());
    cfg.kv.dtype = kv_dtype;
  }
  PD_RETURN_IF_ERROR(cfg.validate());
  if (launch.elastic && !launch.join.empty()) return Status::invalid_argument("--elastic and --join exclude each other");
  if (!launch.secret_file.empty() && launch.join.empty() && launch.join_file.empty())
    return Status::invalid_argument("--secret-file needs --join or --join-file (only joining ranks prove it)");
  if (flags != nullptr) *flags = launch;
  return cfg;
}

}  // namespace pd
