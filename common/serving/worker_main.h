// Start-up shared by pd-prefill and pd-decode: arguments, MPI, the role table,
// the config, the engine; then the worker's loop; then MPI_Finalize (bounded).
#pragma once

#include <functional>
#include <memory>

#include "config/cluster_config.h"
#include "protocol/mpi_channel.h"
#include "serving/engine.h"

namespace pd {

using WorkerBody = std::function<Status(const ClusterConfig&, const RoleTable&, std::unique_ptr<Engine>)>;

// Usage: pd-<role> [CONFIG.json] [--model PATH] [--threads N]. A start-up
// error (bad flag, unreadable config, model that does not load) is printed
// naming the flag or file and aborts the whole MPI job, so a cluster never
// half-starts. Returns the process exit code.
int worker_main(int argc, char** argv, Role role, const WorkerBody& body);

// Parses the common command line into a config (used by pd-router too).
// Returns nullopt-like error Status naming the flag or file; `help` is set when
// --help was asked for (usage already printed).
Result<ClusterConfig> parse_cluster_args(int argc, char** argv, const char* program, bool* help);

}  // namespace pd
