#include "protocol/mpi_channel.h"

#include <spdlog/spdlog.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cerrno>
#include <fstream>
#include <thread>

namespace pd {

const char* role_name(Role r) {
  switch (r) {
    case Role::kRouter: return "router";
    case Role::kPrefill: return "prefill";
    case Role::kDecode: return "decode";
  }
  return "?";
}

Status mpi_init(int* argc, char*** argv) {
  int provided = 0;
  if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
    return Status::internal("MPI_Init_thread failed");
  if (provided < MPI_THREAD_FUNNELED)
    return Status::unsupported("the MPI library provides thread level " + std::to_string(provided) +
                               ", pdcluster needs MPI_THREAD_FUNNELED");
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  return Status::ok();
}

void mpi_finalize_bounded(int code, std::chrono::seconds limit) {
  std::thread([code, limit] {
    std::this_thread::sleep_for(limit);
    spdlog::warn("MPI_Finalize did not return within {} s (a rank of the job is gone); exiting without it",
                 limit.count());
    spdlog::default_logger()->flush();
    std::_Exit(code);
  }).detach();
  MPI_Finalize();
}

Result<RoleTable> exchange_roles(Role mine) {
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
  if (t.router < 0) return Status::invalid_argument("no pd-router rank in the job");
  if (t.decode.empty()) return Status::invalid_argument("no pd-decode rank in the job (need at least one)");
  return t;
}

bool rank_confirmed_dead(const RoleTable& t, int rank) {
  if (rank < 0 || rank >= static_cast<int>(t.pids.size()) || t.self < 0) return false;
  if (t.hosts[rank] != t.hosts[t.self]) return false;
  const pid_t pid = t.pids[rank];
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  // Still a process table entry: dead if it is a zombie not yet reaped.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && (line[close + 2] == 'Z' || line[close + 2] == 'X');
}

MpiControlChannel::~MpiControlChannel() {
  // Unfinished sends at destruction: the peer is gone or never received; free
  // the requests without waiting (MPI may still be finalizing).
  for (PendingSend& s : sends_)
    if (s.req != MPI_REQUEST_NULL) MPI_Request_free(&s.req);
}

void MpiControlChannel::send(int dest, const proto::Message& m) {
  PendingSend& s = sends_.emplace_back();
  s.bytes = proto::serialize(m);
  MPI_Isend(s.bytes.data(), static_cast<int>(s.bytes.size()), MPI_BYTE, dest, proto::kTagControl, comm_, &s.req);
}

std::optional<MpiControlChannel::Received> MpiControlChannel::poll() {
  int flag = 0;
  MPI_Status st;
  MPI_Iprobe(MPI_ANY_SOURCE, proto::kTagControl, comm_, &flag, &st);
  if (!flag) return std::nullopt;
  int count = 0;
  MPI_Get_count(&st, MPI_BYTE, &count);
  recv_buf_.resize(static_cast<size_t>(std::max(count, 1)));
  MPI_Recv(recv_buf_.data(), count, MPI_BYTE, st.MPI_SOURCE, proto::kTagControl, comm_, MPI_STATUS_IGNORE);
  return Received{st.MPI_SOURCE, proto::deserialize(recv_buf_.data(), static_cast<size_t>(count))};
}

int MpiControlChannel::drain(const std::function<void(int, proto::Message&)>& fn, int max) {
  int n = 0;
  for (; n < max; ++n) {
    auto msg = poll();
    if (!msg) break;
    if (!msg->message.is_ok()) {
      spdlog::error("control message from rank {}: {}", msg->source, msg->message.status().to_string());
      continue;
    }
    fn(msg->source, *msg->message);
  }
  return n;
}

void MpiControlChannel::progress() {
  while (!sends_.empty()) {
    int done = 0;
    MPI_Test(&sends_.front().req, &done, MPI_STATUS_IGNORE);
    if (!done) break;
    sends_.pop_front();
  }
  // Later sends may finish before the front one; test them too so buffers don't pile up.
  for (auto it = sends_.begin(); it != sends_.end();) {
    int done = 0;
    MPI_Test(&it->req, &done, MPI_STATUS_IGNORE);
    it = done ? sends_.erase(it) : it + 1;
  }
}

bool MpiControlChannel::flush(std::chrono::milliseconds deadline) {
  const auto end = std::chrono::steady_clock::now() + deadline;
  while (!sends_.empty() && std::chrono::steady_clock::now() < end) {
    progress();
    if (!sends_.empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return sends_.empty();
}

}  // namespace pd
