// Who is who in the job: every rank's role (router, prefill, decode), host and
// pid, exchanged once at start-up (one collective over MPI_COMM_WORLD), and
// the checks that the job is a cluster (one router, some decode rank).
//
// Threading: exchange_roles() is a collective call, made once per rank by the
// thread that initialized MPI; a RoleTable is a plain value.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "util/status.h"

namespace pd {

enum class Role : int32_t { kRouter = 0, kPrefill = 1, kDecode = 2 };

// Rank ids index tables (a RoleTable's vectors): one from another process is
// refused unless it is in [0, kMaxRankId).
inline constexpr int kMaxRankId = 1 << 16;
const char* role_name(Role r);

struct RoleTable {
  std::vector<Role> roles;         // by rank
  std::vector<std::string> hosts;  // by rank (MPI_Get_processor_name)
  std::vector<int> pids;           // by rank (getpid)
  int self = -1;
  int router = -1;
  std::vector<int> prefill;        // ranks, ascending
  std::vector<int> decode;
  bool joined_disaggregated = false;  // a joined rank of a cluster with prefill ranks (maybe none it links to)
  bool joined = false;                // this rank joined a running router (which answered it: it is up)
  // A joined rank: the current epoch of each peer the router linked it to
  // (rank, epoch), so that a peer re-admitted before it joined is not taken
  // for one that changed incarnation since.
  std::vector<std::pair<int, uint32_t>> peer_epochs;
  bool colocated() const { return prefill.empty() && !joined_disaggregated; }
};

// Every rank announces its role (one MPI_Allgather). InvalidArgument unless
// there is exactly one router and at least one decode rank — or, for the ranks
// of a pool joining a running cluster (`joining`), no router at all. A job that
// accepts pools (`elastic`) may start with no worker at all (the router alone).
// `kv_dtype`: this rank's KV cache element name (kv.dtype with --kv-dtype
// applied; "" when its config did not parse): every rank that names one must
// name the same, or each gets InvalidArgument naming the ranks that differ (a
// KV cache handed between them could never land).
Result<RoleTable> exchange_roles(Role mine, bool joining = false, bool elastic = false, const std::string& kv_dtype = "");

}  // namespace pd
