#include "protocol/mpi_channel.h"

#include <spdlog/spdlog.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cerrno>
#include <fstream>

#include <nlohmann/json.hpp>
#include <condition_variable>
#include <mutex>
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

Status mpi_init(int* argc, char*** argv, bool elastic) {
  int provided = 0;
  // SERIALIZED: a worker's MPI calls are made by its communication thread, not
  // by the thread that called MPI_Init (kvtransfer/comm_side.h).
  const int need = elastic ? MPI_THREAD_MULTIPLE : MPI_THREAD_SERIALIZED;
  if (MPI_Init_thread(argc, argv, need, &provided) != MPI_SUCCESS)
    return Status::internal("MPI_Init_thread failed");
  if (provided < need)
    return Status::unsupported("the MPI library provides thread level " + std::to_string(provided) +
                               ", pdcluster needs " + (elastic ? "MPI_THREAD_MULTIPLE (elastic pools)"
                                                               : "MPI_THREAD_SERIALIZED"));
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

Status send_now(MpiLinks& links, int dest, const proto::Message& m) {
  const auto to = links.endpoint(dest);
  if (!to) return Status::not_found("no link to rank " + std::to_string(dest));
  std::vector<uint8_t> bytes = proto::serialize(m);
  if (MPI_Send(bytes.data(), static_cast<int>(bytes.size()), MPI_BYTE, to->rank, proto::kTagControl, to->comm) !=
      MPI_SUCCESS)
    return Status::io_error(std::string("sending ") + proto::message_name(m) + " to rank " + std::to_string(dest) +
                            " failed");
  return Status::ok();
}

namespace {

// The next control message from `from` within `timeout` (the handshake's only receive).
Result<proto::Message> receive_now(MpiLinks& links, int from, std::chrono::milliseconds timeout) {
  const auto ep = links.endpoint(from);
  if (!ep) return Status::not_found("no link to rank " + std::to_string(from));
  const auto end = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(ep->rank, proto::kTagControl, ep->comm, &flag, &st) != MPI_SUCCESS)
      return Status::io_error("probing rank " + std::to_string(from) + " failed");
    if (flag) {
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      std::vector<uint8_t> buf(static_cast<size_t>(std::max(count, 1)));
      MPI_Recv(buf.data(), count, MPI_BYTE, ep->rank, proto::kTagControl, ep->comm, MPI_STATUS_IGNORE);
      return proto::deserialize(buf.data(), static_cast<size_t>(count));
    }
    if (std::chrono::steady_clock::now() > end)
      return Status::timeout("no answer from rank " + std::to_string(from) + " within " +
                             std::to_string(timeout.count()) + " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

struct JoinTarget {
  std::string port;
  int router = -1;
};

Result<JoinTarget> read_join_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return Status::not_found("cannot read join file '" + path + "' (the router's --join-file)");
  try {
    const nlohmann::json j = nlohmann::json::parse(f);
    return JoinTarget{j.at("port").get<std::string>(), j.at("router").get<int>()};
  } catch (const std::exception& e) {
    return Status::invalid_argument("join file '" + path + "': " + e.what());
  }
}

}  // namespace

Status write_join_file(const std::string& path, const std::string& port, int router_rank) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << nlohmann::json{{"port", port}, {"router", router_rank}}.dump() << "\n";
    if (!f) return Status::io_error("cannot write join file '" + tmp + "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return Status::io_error("cannot rename to '" + path + "'");
  return Status::ok();
}

Result<RoleTable> join_cluster(MpiLinks& links, const std::string& join_file, const RoleTable& world,
                               int32_t block_size, const std::string& kv_dtype, std::chrono::milliseconds timeout) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto target = read_join_file(join_file);
  // The pool's own world ranks get cluster ids only at the end (no id is theirs yet).
  links.set_world_ids(std::vector<int>(static_cast<size_t>(size), -1));
  proto::JoinAccepted accepted;
  Status mine = target.status();
  // MPI_Comm_connect has no deadline of its own: a cluster that is gone (a
  // stale join file) would leave this pool waiting for ever. A watchdog ends
  // the pool's job, saying why, if the handshake has not finished in time.
  struct Watchdog {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  auto dog = std::make_shared<Watchdog>();
  const auto grace = timeout + std::chrono::seconds(5) * size;
  std::thread([dog, grace, join_file] {
    std::unique_lock lock(dog->mu);
    if (dog->cv.wait_for(lock, grace, [&] { return dog->done; })) return;
    spdlog::critical("could not join the cluster of '{}' within {} s: is it running (launch.sh --join-file)?",
                     join_file, std::chrono::duration_cast<std::chrono::seconds>(grace).count());
    spdlog::default_logger()->flush();
    MPI_Abort(MPI_COMM_WORLD, 2);
  }).detach();
  struct Disarm {
    std::shared_ptr<Watchdog> dog;
    ~Disarm() {
      std::lock_guard lock(dog->mu);
      dog->done = true;
      dog->cv.notify_all();
    }
  } disarm{dog};
  // The pool's name: where its first rank runs (the router links a pool's ranks to each other).
  const std::string pool = world.hosts[0] + ":" + std::to_string(world.pids[0]);
  // One rank of the pool at a time: the other side accepts links one by one.
  for (int k = 0; k < size; ++k) {
    if (k == world.self && mine.is_ok()) {
      mine = [&]() -> Status {
        PD_ASSIGN_OR_RETURN(int router, links.connect(target->port, target->router));
        PD_RETURN_IF_ERROR(send_now(links, router,
                                    proto::Join{static_cast<int32_t>(world.roles[world.self]), world.hosts[world.self],
                                                world.pids[world.self], block_size, links.port(), pool, kv_dtype}));
        PD_ASSIGN_OR_RETURN(proto::Message answer, receive_now(links, router, timeout));
        if (auto* refused = std::get_if<proto::JoinRefused>(&answer))
          return Status::invalid_argument("the router refused: " + refused->reason);
        auto* ok = std::get_if<proto::JoinAccepted>(&answer);
        if (ok == nullptr) return Status::corruption(std::string("expected JoinAccepted, got ") + proto::message_name(answer));
        accepted = *ok;
        for (const proto::JoinPeer& p : accepted.peers) {
          PD_RETURN_IF_ERROR(links.connect(p.port, p.rank).status());
          PD_RETURN_IF_ERROR(send_now(links, p.rank, proto::Hello{accepted.rank, accepted.epoch}));
        }
        return Status::ok();
      }();
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  // All or none of the pool joins (a rank that failed aborts the pool's job).
  int failed = mine.is_ok() ? 0 : 1, any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (!mine.is_ok()) return mine;
  if (any_failed) return Status::cancelled("another rank of this pool could not join");

  std::vector<int> ids(static_cast<size_t>(size));
  MPI_Allgather(&accepted.rank, 1, MPI_INT, ids.data(), 1, MPI_INT, MPI_COMM_WORLD);
  links.set_world_ids(ids);

  RoleTable t;
  const int max_id = std::max(*std::max_element(ids.begin(), ids.end()), target->router);
  int top = max_id;
  for (const proto::JoinPeer& p : accepted.peers) top = std::max(top, p.rank);
  t.roles.assign(static_cast<size_t>(top) + 1, Role::kDecode);
  t.hosts.assign(static_cast<size_t>(top) + 1, std::string());
  t.pids.assign(static_cast<size_t>(top) + 1, 0);
  t.self = accepted.rank;
  t.router = target->router;
  t.roles[t.router] = Role::kRouter;
  for (int r = 0; r < size; ++r) {
    t.roles[ids[r]] = world.roles[r];
    t.hosts[ids[r]] = world.hosts[r];
    t.pids[ids[r]] = world.pids[r];
    (world.roles[r] == Role::kPrefill ? t.prefill : t.decode).push_back(ids[r]);
  }
  for (const proto::JoinPeer& p : accepted.peers) {
    t.roles[p.rank] = static_cast<Role>(p.role);
    (p.role == static_cast<int32_t>(Role::kPrefill) ? t.prefill : t.decode).push_back(p.rank);
  }
  std::sort(t.prefill.begin(), t.prefill.end());
  std::sort(t.decode.begin(), t.decode.end());
  // A decode rank of a disaggregated cluster must not think it is colocated
  // (it would prefill prompts itself): it learns the mode from the router.
  t.joined_disaggregated = !accepted.colocated;
  return t;
}

MpiControlChannel::~MpiControlChannel() {
  // Unfinished sends at destruction: the peer is gone or never received; free
  // the requests without waiting (MPI may still be finalizing).
  for (PendingSend& s : sends_)
    if (s.req != MPI_REQUEST_NULL) MPI_Request_free(&s.req);
}

void MpiControlChannel::send(int dest, const proto::Message& m) {
  const auto to = links_->endpoint(dest);
  const bool waiting = std::any_of(unlinked_.begin(), unlinked_.end(), [&](const Unlinked& u) { return u.dest == dest; });
  if (!to || waiting) {  // keep the order of messages to one rank
    unlinked_.push_back({dest, proto::serialize(m), proto::message_name(m),
                         std::chrono::steady_clock::now() + kUnlinkedWait});
    return;
  }
  isend(dest, *to, proto::serialize(m), proto::message_name(m));
}

void MpiControlChannel::isend(int dest, const MpiLinks::Endpoint& to, std::vector<uint8_t> bytes, const char* name) {
  PendingSend& s = sends_.emplace_back();
  s.bytes = std::move(bytes);
  if (MPI_Isend(s.bytes.data(), static_cast<int>(s.bytes.size()), MPI_BYTE, to.rank, proto::kTagControl, to.comm,
                &s.req) != MPI_SUCCESS) {
    spdlog::warn("control message {} to rank {}: MPI_Isend failed", name, dest);
    sends_.pop_back();
  }
}

void MpiControlChannel::send_unlinked() {
  const auto now = std::chrono::steady_clock::now();
  std::deque<Unlinked> still;
  for (Unlinked& u : unlinked_) {
    const bool blocked = std::any_of(still.begin(), still.end(), [&](const Unlinked& s) { return s.dest == u.dest; });
    const auto to = blocked ? std::nullopt : links_->endpoint(u.dest);
    if (to) {
      isend(u.dest, *to, std::move(u.bytes), u.name);
    } else if (now >= u.drop_at) {
      spdlog::warn("control message {} to rank {}: no link to that rank; dropped", u.name, u.dest);
    } else {
      still.push_back(std::move(u));
    }
  }
  unlinked_ = std::move(still);
}

std::optional<MpiControlChannel::Received> MpiControlChannel::poll() {
  links_->take_accepted();
  if (!unlinked_.empty()) send_unlinked();
  for (;;) {
    const auto& links = links_->links();
    std::optional<Received> got;
    for (size_t k = 0; k < links.size() && !got; ++k) {
      const size_t i = (next_link_ + k) % links.size();
      const MpiLinks::Link link = links[i];
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, proto::kTagControl, link.comm, &flag, &st) != MPI_SUCCESS || !flag) continue;
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      recv_buf_.resize(static_cast<size_t>(std::max(count, 1)));
      MPI_Recv(recv_buf_.data(), count, MPI_BYTE, st.MPI_SOURCE, proto::kTagControl, link.comm, MPI_STATUS_IGNORE);
      next_link_ = i + 1;
      const int source = link.id == -1 ? links_->world_id(st.MPI_SOURCE) : link.id;
      got = Received{source, proto::deserialize(recv_buf_.data(), static_cast<size_t>(count))};
    }
    if (!got) return std::nullopt;
    if (got->source > MpiLinks::kProvisionalBase) return got;
    // An accepted link not bound yet: its first message says who is on it.
    if (got->message.is_ok()) {
      if (auto* hello = std::get_if<proto::Hello>(&*got->message)) {
        if (links_->bind(got->source, hello->rank)) {
          got->source = hello->rank;
          return got;
        }
        spdlog::warn("Hello from rank {} on a new link: that rank already has one; dropped", hello->rank);
        continue;
      }
    }
    spdlog::warn("control message on a new link before its Hello; dropped");
  }
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
