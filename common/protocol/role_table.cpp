#include "protocol/role_table.h"

#include <mpi.h>
#include <unistd.h>

namespace pd {

const char* role_name(Role r) {
  switch (r) {
    case Role::kRouter: return "router";
    case Role::kPrefill: return "prefill";
    case Role::kDecode: return "decode";
  }
  return "?";
}

namespace {

// Each rank's KV element name (at most 15 characters; "" = unknown), gathered;
// the error naming two ranks that differ, if any do.
Status check_kv_dtypes(const std::string& mine, const std::vector<Role>& roles, int size) {
  constexpr int kWidth = 16;
  char my_name[kWidth] = {};
  mine.copy(my_name, kWidth - 1);
  std::vector<char> names(static_cast<size_t>(size) * kWidth);
  MPI_Allgather(my_name, kWidth, MPI_CHAR, names.data(), kWidth, MPI_CHAR, MPI_COMM_WORLD);
  int first = -1;
  for (int r = 0; r < size; ++r) {
    const std::string name(names.data() + static_cast<size_t>(r) * kWidth);
    if (name.empty()) continue;
    if (first < 0) {
      first = r;
      continue;
    }
    const std::string want(names.data() + static_cast<size_t>(first) * kWidth);
    if (name != want)
      return Status::invalid_argument("the ranks disagree on the KV cache's elements: rank " + std::to_string(first) +
                                      " (" + role_name(roles[first]) + ") runs " + want + ", rank " + std::to_string(r) +
                                      " (" + role_name(roles[r]) + ") " + name +
                                      " (kv.dtype / --kv-dtype must be the same on every rank)");
  }
  return Status::ok();
}

}  // namespace

Result<RoleTable> exchange_roles(Role mine, bool joining, bool elastic, const std::string& kv_dtype) {
  RoleTable t;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &t.self);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int32_t me = static_cast<int32_t>(mine);
  std::vector<int32_t> all(size);
  MPI_Allgather(&me, 1, MPI_INT32_T, all.data(), 1, MPI_INT32_T, MPI_COMM_WORLD);
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  std::vector<char> names(static_cast<size_t>(size) * MPI_MAX_PROCESSOR_NAME);
  MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR,
                MPI_COMM_WORLD);
  const int32_t my_pid = static_cast<int32_t>(::getpid());
  std::vector<int32_t> pids(size);
  MPI_Allgather(&my_pid, 1, MPI_INT32_T, pids.data(), 1, MPI_INT32_T, MPI_COMM_WORLD);
  for (int r = 0; r < size; ++r) {
    const Role role = static_cast<Role>(all[r]);
    t.roles.push_back(role);
    t.pids.push_back(pids[r]);
    t.hosts.emplace_back(names.data() + static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME);
    switch (role) {
      case Role::kRouter:
        if (t.router >= 0)
          return Status::invalid_argument("two routers in the job (ranks " + std::to_string(t.router) + " and " +
                                          std::to_string(r) + "); start exactly one pd-router");
        t.router = r;
        break;
      case Role::kPrefill: t.prefill.push_back(r); break;
      case Role::kDecode: t.decode.push_back(r); break;
    }
  }
  if (Status st = check_kv_dtypes(kv_dtype, t.roles, size); !st.is_ok()) return st;
  if (joining) {
    if (t.router >= 0) return Status::invalid_argument("a pool joining a running cluster has no pd-router rank");
    return t;
  }
  if (t.router < 0) return Status::invalid_argument("no pd-router rank in the job");
  if (t.decode.empty() && !(elastic && t.prefill.empty()))
    return Status::invalid_argument("no pd-decode rank in the job (need at least one)");
  return t;
}

}  // namespace pd
