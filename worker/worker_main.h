// Start-up shared by pd-prefill and pd-decode: arguments, MPI, the role table,
// the config, the engine; then the worker's loop; then MPI_Finalize (bounded).
#pragma once

#include <functional>
#include <memory>

#include "config/cluster_args.h"
#include "config/cluster_config.h"
#include "protocol/mpi_links.h"
#include "protocol/role_table.h"
#include "serving/engine.h"

namespace pd {

// The body gets the rank's links (shared by its control channel and KV transport).
// It is called again, with the same engine, each time the rank joins a new
// router after its own was lost (run() ended Unavailable).
using WorkerBody = std::function<Status(const ClusterConfig&, const RoleTable&, std::shared_ptr<Engine>,
                                        std::shared_ptr<MpiLinks>)>;

// Usage: pd-<role> [CONFIG.json] [--model PATH] [--threads N] [--elastic [--join-file FILE] | --join FILE].
// A joining rank (--join) links to the running cluster before its loop starts
// and, on SIGTERM, asks the router to drain and remove it. When the router is
// gone, a rank with a join file (--join, or --elastic --join-file) waits up
// to timeouts.rejoin_ms for a new router to be named there and joins it
// alone, keeping its engine; otherwise, or past that, it exits. A start-up
// error (bad flag, unreadable config, model that does not load) is printed
// naming the flag or file and aborts the whole MPI job, so a cluster never
// half-starts. Returns the process exit code.
int worker_main(int argc, char** argv, Role role, const WorkerBody& body);

// Set by SIGTERM in a joined rank: the worker asks the router to drain it (Leave).
bool leave_requested();
// A worker that was drained out of the cluster says so before its loop ends:
// a rank of the launching job then exits without MPI_Finalize (which would
// wait for the rest of the job), a joined rank finalizes its own job.
void note_left();

}  // namespace pd
