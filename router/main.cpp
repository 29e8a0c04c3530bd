// pd-router: the cluster's HTTP front end (see router.h).
//   mpirun -np 1 pd-router CFG : -np P pd-prefill CFG : -np D pd-decode CFG
#include <spdlog/spdlog.h>

#include <iostream>

#include "gguf/gguf_reader.h"
#include "model/llama_config.h"
#include "protocol/job_processes.h"
#include "protocol/join_handshake.h"
#include "protocol/link_auth.h"
#include "protocol/mpi_channel.h"
#include "protocol/mpi_runtime.h"
#include "protocol/role_table.h"
#include "router/router.h"
#include "config/cluster_args.h"

namespace {

int abort_job(const std::string& what) {
  spdlog::critical("{}", what);
  MPI_Abort(MPI_COMM_WORLD, 2);
  return 2;
}

// A start-up error once the workers are known. mpirun runs the job with
// orte_enable_recovery (a rank that dies does not take the others down), so
// MPI_Abort ends this process alone: every worker is told to stop first
// (Shutdown, as at the end of a drain), or they would wait timeouts.startup_ms
// for a router that is gone — a cluster half started.
int abort_cluster(const std::string& what, const pd::RoleTable& roles, std::shared_ptr<pd::MpiLinks> links) {
  pd::MpiControlChannel channel(std::move(links));
  for (int r : roles.prefill) channel.send(r, pd::proto::Shutdown{});
  for (int r : roles.decode) channel.send(r, pd::proto::Shutdown{});
  channel.flush(std::chrono::milliseconds(2000));
  return abort_job(what);
}

// What the router needs of the model file: the tokenizer, the chat template
// and the context length (not the weights), and the KV cache's geometry. The
// error's message is what the job aborts with.
pd::Result<pd::router::ModelInfo> load_model_info(const pd::ClusterConfig& cfg) {
  auto file = pd::GgufFile::open(cfg.model);
  if (!file.is_ok()) return pd::Status::invalid_argument(file.status().to_string() + " (config key 'model' / --model)");
  pd::router::ModelInfo info;
  auto tok = pd::Tokenizer::from_gguf(**file);
  if (!tok.is_ok()) return pd::Status::invalid_argument(tok.status().to_string());
  info.tokenizer = std::move(tok).value();
  // The chat template: cluster.json's "chat_template" when set, else the file's. A file
  // without one (or with one not recognized) still serves completions; chats get a 400.
  if (std::string why = pd::router::choose_chat_template(cfg.chat_template, **file, info); !why.empty())
    spdlog::warn("router: chat requests will be refused: {}", why);
  auto mc = pd::LlamaConfig::from_gguf(**file);
  if (!mc.is_ok()) return pd::Status::invalid_argument(mc.status().to_string());
  info.context = mc->context;
  const pd::GgmlType kv_dtype = *pd::parse_kv_dtype(cfg.kv.dtype, "kv.dtype");  // validated with the config
  info.kv_dtype = pd::kv_dtype_name(kv_dtype);
  info.kv_bytes_per_token = mc->kv_geometry(kv_dtype).bytes_per_token();
  info.name = cfg.model_name();
  info.fingerprint = pd::gguf_fingerprint(**file);
  return info;
}

// Elastic pools (--join-file): ranks started later connect to this port and
// get ids from the world size up. The error's message is what the job aborts with.
pd::Status accept_joins(const pd::LaunchFlags& flags, const pd::RoleTable& roles, pd::MpiLinks& links) {
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  // The secret every joining rank must prove: the operator's, or a new one
  // (owner-only) written before the join file, so no one can join before it exists.
  const std::string secret_path = flags.secret_path();
  if (auto secret = pd::ClusterSecret::load_or_create(secret_path); !secret.is_ok())
    return pd::Status::invalid_argument(secret.status().to_string() + " (--secret-file)");
  if (pd::Status st = links.listen(world, secret_path); !st.is_ok())
    return pd::Status::invalid_argument(st.to_string());
  if (pd::Status st = pd::write_join_file(
          flags.join_file, {links.port(), roles.self, roles.hosts[roles.self], roles.pids[roles.self]});
      !st.is_ok())
    return pd::Status::invalid_argument(st.to_string() + " (--join-file)");
  spdlog::info("router: accepting joining pools (join file {})", flags.join_file);
  return pd::Status::ok();
}

}  // namespace

int main(int argc, char** argv) {
  if (pd::Status st = pd::mpi_init(&argc, &argv, pd::wants_elastic(argc, argv)); !st.is_ok()) {
    std::cerr << "pd-router: " << st.to_string() << "\n";
    return 1;
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  spdlog::set_pattern("[%H:%M:%S.%e] [router " + std::to_string(rank) + "] [%l] %v");
  bool help = false;
  pd::LaunchFlags flags;
  auto cfg = pd::parse_cluster_args(argc, argv, "pd-router", &help, &flags);
  auto roles = pd::exchange_roles(pd::Role::kRouter, false, cfg.is_ok() && !flags.join_file.empty(),
                                  cfg.is_ok() ? pd::kv_dtype_name(*pd::parse_kv_dtype(cfg->kv.dtype, "kv.dtype")) : "");
  if (help) {
    MPI_Finalize();
    return 0;
  }
  if (!cfg.is_ok()) return abort_job(cfg.status().message());
  if (!roles.is_ok()) return abort_job(roles.status().message());
  for (const std::string& w : cfg->warnings) spdlog::warn("{}", w);
  auto links = std::make_shared<pd::MpiLinks>();
  auto info = load_model_info(*cfg);
  if (!info.is_ok()) return abort_cluster(info.status().message(), *roles, links);

  if (!flags.join.empty() || flags.elastic)
    return abort_cluster("pd-router takes --join-file, not --join/--elastic", *roles, links);
  if (!flags.join_file.empty()) {
    if (pd::Status st = accept_joins(flags, *roles, *links); !st.is_ok()) return abort_cluster(st.message(), *roles, links);
  }
  int rc = 0;
  {
    // A down rank's end is confirmed from mpirun's process table, on any host.
    const pd::JobProcessEnv processes;
    pd::router::Router router(*cfg, *roles, std::move(info).value(), std::make_unique<pd::MpiControlChannel>(links));
    router.set_env(&processes);
    pd::Status st = router.run();
    if (!st.is_ok()) return abort_cluster(st.to_string(), *roles, links);
  }
  pd::mpi_finalize_bounded(rc);
  return rc;
}
