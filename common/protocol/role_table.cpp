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

Result<RoleTable> exchange_roles(Role mine, bool joining, bool elastic) {
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
