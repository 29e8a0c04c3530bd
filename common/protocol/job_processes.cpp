#include "protocol/job_processes.h"

#include <spdlog/spdlog.h>

#ifdef PD_HAVE_PMIX
#include <pmix.h>
#endif

namespace pd {

#ifdef PD_HAVE_PMIX
namespace {

// PMIx for this process (OpenMPI initialized it already: this only adds a
// reference), or null when it cannot be had.
const pmix_proc_t* pmix_self() {
  static pmix_proc_t self;
  static const bool ok = [] {
    const pmix_status_t rc = PMIx_Init(&self, nullptr, 0);
    if (rc != PMIX_SUCCESS) spdlog::warn("PMIx_Init failed ({}): deaths on other hosts cannot be confirmed",
                                         PMIx_Error_string(rc));
    return rc == PMIX_SUCCESS;
  }();
  return ok ? &self : nullptr;
}

bool ended_state(pmix_proc_state_t s) { return s >= PMIX_PROC_STATE_TERMINATED; }

// The ranks the PMIX_QUERY_PROC_TABLE answer says have ended: an array of
// pmix_info_t, each holding one pmix_proc_info_t.
void read_table(const pmix_info_t& result, std::vector<bool>& ended) {
  if (result.value.type != PMIX_DATA_ARRAY || result.value.data.darray == nullptr) return;
  const pmix_data_array_t& outer = *result.value.data.darray;
  auto note = [&](const pmix_proc_info_t& p) {
    if (p.proc.rank >= ended.size()) ended.resize(p.proc.rank + 1, false);
    ended[p.proc.rank] = ended_state(p.state);
  };
  if (outer.type == PMIX_PROC_INFO) {
    const auto* procs = static_cast<const pmix_proc_info_t*>(outer.array);
    for (size_t i = 0; i < outer.size; ++i) note(procs[i]);
  } else if (outer.type == PMIX_INFO) {
    const auto* infos = static_cast<const pmix_info_t*>(outer.array);
    for (size_t i = 0; i < outer.size; ++i)
      if (infos[i].value.type == PMIX_PROC_INFO && infos[i].value.data.pinfo != nullptr) note(*infos[i].value.data.pinfo);
  }
}

}  // namespace

std::optional<std::vector<bool>> query_ended_ranks() {
  const pmix_proc_t* self = pmix_self();
  if (self == nullptr) return std::nullopt;
  pmix_query_t* query = nullptr;
  PMIX_QUERY_CREATE(query, 1);
  pmix_status_t rc = PMIX_SUCCESS;
  PMIX_ARGV_APPEND(rc, query[0].keys, PMIX_QUERY_PROC_TABLE);
  PMIX_INFO_CREATE(query[0].qualifiers, 1);
  query[0].nqual = 1;
  PMIX_INFO_LOAD(&query[0].qualifiers[0], PMIX_NSPACE, self->nspace, PMIX_STRING);
  pmix_info_t* results = nullptr;
  size_t n = 0;
  rc = PMIx_Query_info(query, 1, &results, &n);
  std::optional<std::vector<bool>> out;
  if (rc == PMIX_SUCCESS) {
    out.emplace();
    for (size_t i = 0; i < n; ++i) read_table(results[i], *out);
  }
  PMIX_QUERY_FREE(query, 1);
  if (results != nullptr) PMIX_INFO_FREE(results, n);
  return out;
}
#else
std::optional<std::vector<bool>> query_ended_ranks() { return std::nullopt; }
#endif

bool JobProcessEnv::rank_gone(int rank) const {
  const auto now = Clock::now();
  if (!asked_ || now - *asked_ >= refresh_) {
    asked_ = now;
    auto table = query_ended_ranks();
    ended_ = table ? std::move(*table) : std::vector<bool>();
  }
  return rank >= 0 && static_cast<size_t>(rank) < ended_.size() && ended_[static_cast<size_t>(rank)];
}

}  // namespace pd
