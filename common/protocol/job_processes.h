// Which ranks of this MPI job have ended, as the job's launcher knows it:
// PMIx's process table (PMIX_QUERY_PROC_TABLE over the job's namespace), which
// mpirun keeps for every rank on every host — the one way to confirm that a
// rank on another host is dead rather than stopped or unreachable. (PMIx event
// notification would be the push form; it fails with BAD-PARAM on OpenMPI 4.1
// with PMIx 4.2, so the table is polled.) OpenMPI answers the query only to a
// process on mpirun's own host: the router, rank 0 of the launching job.
//
// Threading: one thread at a time (the router's link thread).
#pragma once

#include <chrono>
#include <optional>
#include <vector>

#include "util/env.h"

namespace pd {

// The states of the job's ranks, by world rank: true = ended (exited, killed,
// aborted). Nullopt when the table cannot be had (no PMIx, not on mpirun's
// host, the query failed): nothing is then known to have ended.
std::optional<std::vector<bool>> query_ended_ranks();

// An Env whose rank_gone() answers from that table for the ranks of this job
// (ids of joined ranks, from other jobs, are never known gone). The table is
// asked at most once per `refresh`.
class JobProcessEnv final : public Env {
 public:
  explicit JobProcessEnv(std::chrono::milliseconds refresh = std::chrono::milliseconds(500)) : refresh_(refresh) {}
  bool rank_gone(int rank) const override;

 private:
  std::chrono::milliseconds refresh_;
  mutable std::optional<Clock::time_point> asked_;
  mutable std::vector<bool> ended_;
};

}  // namespace pd
