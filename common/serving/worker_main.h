// Start-up shared by pd-prefill and pd-decode: arguments, MPI, the role table,
// the config, the engine; then the worker's loop; then MPI_Finalize (bounded).
#pragma once

#include <functional>
#include <memory>

#include "config/cluster_config.h"
#include "protocol/mpi_links.h"
#include "protocol/role_table.h"
#include "serving/engine.h"

namespace pd {

// The body gets the rank's links (shared by its control channel and KV transport).
using WorkerBody = std::function<Status(const ClusterConfig&, const RoleTable&, std::unique_ptr<Engine>,
                                        std::shared_ptr<MpiLinks>)>;

// Flags of elastic pools (docs/CLUSTER.md), not config keys: they say how this
// process was launched.
struct LaunchFlags {
  bool elastic = false;   // --elastic: a worker of the launching job that accepts ranks joining later
  std::string join;       // --join FILE: a worker joining the running cluster FILE describes
  std::string join_file;  // --join-file FILE: the router accepts joins and writes FILE
};
// Whether the command line asks for an elastic rank (read before MPI_Init: it
// decides the MPI thread level).
bool wants_elastic(int argc, char** argv);

// Usage: pd-<role> [CONFIG.json] [--model PATH] [--threads N] [--elastic | --join FILE].
// A joining rank (--join) links to the running cluster before its loop starts
// and, on SIGTERM, asks the router to drain and remove it. A start-up
// error (bad flag, unreadable config, model that does not load) is printed
// naming the flag or file and aborts the whole MPI job, so a cluster never
// half-starts. Returns the process exit code.
int worker_main(int argc, char** argv, Role role, const WorkerBody& body);

// Parses the common command line into a config (used by pd-router too).
// Returns nullopt-like error Status naming the flag or file; `help` is set when
// --help was asked for (usage already printed).
Result<ClusterConfig> parse_cluster_args(int argc, char** argv, const char* program, bool* help,
                                         LaunchFlags* flags = nullptr);

// Set by SIGTERM in a joined rank: the worker asks the router to drain it (Leave).
bool leave_requested();
// A worker that was drained out of the cluster says so before its loop ends:
// a rank of the launching job then exits without MPI_Finalize (which would
// wait for the rest of the job), a joined rank finalizes its own job.
void note_left();

}  // namespace pd
