#include "protocol/join_handshake.h"

#include <mpi.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "util/files.h"

namespace pd {

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

// The Challenge a rank that accepted our link sends first (link_auth.h).
Result<std::string> receive_challenge(MpiLinks& links, int from, std::chrono::milliseconds timeout) {
  PD_ASSIGN_OR_RETURN(proto::Message m, receive_now(links, from, timeout));
  if (auto* c = std::get_if<proto::Challenge>(&m)) return c->nonce;
  return Status::corruption(std::string("expected a Challenge from rank ") + std::to_string(from) + ", got " +
                            proto::message_name(m));
}

// MPI_Comm_connect has no deadline of its own: a cluster that is gone (a
// stale join file) would leave a joining pool waiting for ever. While this
// object lives, a detached thread ends the pool's job (MPI_Abort) — or, for a
// rank joining alone (rejoin_cluster), only this process — saying why, once
// `grace` has passed; destroying it (the handshake finished, however it ended)
// disarms the thread.
class JoinWatchdog {
 public:
  enum class OnExpiry { kAbortJob, kExitProcess };
  JoinWatchdog(const std::string& join_file, std::chrono::milliseconds grace, OnExpiry action = OnExpiry::kAbortJob)
      : state_(std::make_shared<State>()) {
    std::thread([state = state_, grace, join_file, action] {
      std::unique_lock lock(state->mu);
      if (state->cv.wait_for(lock, grace, [&] { return state->done; })) return;
      spdlog::critical("could not join the cluster of '{}' within {} s: is it running (launch.sh --join-file)?",
                       join_file, std::chrono::duration_cast<std::chrono::seconds>(grace).count());
      spdlog::default_logger()->flush();
      if (action == OnExpiry::kExitProcess) std::_Exit(2);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }).detach();
  }
  ~JoinWatchdog() {
    std::lock_guard lock(state_->mu);
    state_->done = true;
    state_->cv.notify_all();
  }
  JoinWatchdog(const JoinWatchdog&) = delete;
  JoinWatchdog& operator=(const JoinWatchdog&) = delete;

 private:
  struct State {  // shared with the thread, which may outlive this object
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;  // guarded by mu
  };
  std::shared_ptr<State> state_;
};

// What one rank of a joining pool sends and learns.
struct JoinRequest {
  const JoinTarget& target;
  const RoleTable& world;  // the pool's own world
  const std::string& pool;  // the pool's name
  int32_t block_size;
  const PoolIdentity& identity;
  const ClusterSecret& secret;
  std::chrono::milliseconds timeout;
};

// The ids a JoinAccepted hands out index this rank's tables: each must be a
// rank id (not negative, below kMaxRankId), the joiner's own not among its peers.
Status check_accepted(const proto::JoinAccepted& a) {
  auto bad = [](int32_t id) { return id < 0 || id >= kMaxRankId; };
  if (bad(a.rank)) return Status::corruption("JoinAccepted gives rank id " + std::to_string(a.rank));
  for (const proto::JoinPeer& p : a.peers) {
    if (bad(p.rank) || p.rank == a.rank)
      return Status::corruption("JoinAccepted names peer rank " + std::to_string(p.rank));
    if (p.role != static_cast<int32_t>(Role::kPrefill) && p.role != static_cast<int32_t>(Role::kDecode))
      return Status::corruption("JoinAccepted names peer rank " + std::to_string(p.rank) + " with role " +
                                std::to_string(p.role));
  }
  return Status::ok();
}

// This rank's turn: connect to the router, Join, take its answer, then connect
// to every worker it names and say Hello. Fills `accepted` on success.
Status join_one_rank(MpiLinks& links, const JoinRequest& req, proto::JoinAccepted& accepted) {
  const RoleTable& world = req.world;
  PD_ASSIGN_OR_RETURN(int router, links.connect(req.target.port, req.target.rank));
  // Every link this rank opens proves the cluster secret: the acceptor's
  // Challenge first, then the Join (or Hello) that answers it.
  PD_ASSIGN_OR_RETURN(std::string challenge, receive_challenge(links, router, req.timeout));
  proto::Join join{static_cast<int32_t>(world.roles[world.self]), world.hosts[world.self], world.pids[world.self],
                   req.block_size, links.port(), req.pool, req.identity.kv_dtype};
  join.model = req.identity.model;
  join.proof = req.secret.prove(challenge, join);
  PD_RETURN_IF_ERROR(send_now(links, router, join));
  PD_ASSIGN_OR_RETURN(proto::Message answer, receive_now(links, router, req.timeout));
  if (auto* refused = std::get_if<proto::JoinRefused>(&answer))
    return Status::invalid_argument("the router refused: " + refused->reason);
  auto* ok = std::get_if<proto::JoinAccepted>(&answer);
  if (ok == nullptr) return Status::corruption(std::string("expected JoinAccepted, got ") + proto::message_name(answer));
  PD_RETURN_IF_ERROR(check_accepted(*ok));
  accepted = *ok;
  for (const proto::JoinPeer& p : accepted.peers) {
    PD_RETURN_IF_ERROR(links.connect(p.port, p.rank).status());
    PD_ASSIGN_OR_RETURN(std::string peer_challenge, receive_challenge(links, p.rank, req.timeout));
    proto::Hello hello{accepted.rank, accepted.epoch};
    hello.proof = req.secret.prove(peer_challenge, hello);
    PD_RETURN_IF_ERROR(send_now(links, p.rank, hello));
  }
  return Status::ok();
}

// This rank's table in the cluster's ids, from the pool's world table, the
// ids its ranks were given (`ids`, by world rank) and this rank's JoinAccepted.
RoleTable joined_table(const RoleTable& world, const std::vector<int>& ids, const JoinTarget& router,
                       const proto::JoinAccepted& accepted) {
  RoleTable t;
  const int size = static_cast<int>(ids.size());
  const int max_id = std::max(*std::max_element(ids.begin(), ids.end()), router.rank);
  int top = max_id;
  for (const proto::JoinPeer& p : accepted.peers) top = std::max(top, p.rank);
  t.roles.assign(static_cast<size_t>(top) + 1, Role::kDecode);
  t.hosts.assign(static_cast<size_t>(top) + 1, std::string());
  t.pids.assign(static_cast<size_t>(top) + 1, 0);
  t.self = accepted.rank;
  t.router = router.rank;
  t.roles[t.router] = Role::kRouter;
  t.hosts[t.router] = router.host;  // who the router is (rejoin_cluster tells a new one from it)
  t.pids[t.router] = router.pid;
  for (int r = 0; r < size; ++r) {
    t.roles[ids[r]] = world.roles[r];
    t.hosts[ids[r]] = world.hosts[r];
    t.pids[ids[r]] = world.pids[r];
    (world.roles[r] == Role::kPrefill ? t.prefill : t.decode).push_back(ids[r]);
  }
  for (const proto::JoinPeer& p : accepted.peers) {
    t.roles[p.rank] = static_cast<Role>(p.role);
    t.peer_epochs.emplace_back(p.rank, p.epoch);
    (p.role == static_cast<int32_t>(Role::kPrefill) ? t.prefill : t.decode).push_back(p.rank);
  }
  std::sort(t.prefill.begin(), t.prefill.end());
  std::sort(t.decode.begin(), t.decode.end());
  // A decode rank of a disaggregated cluster must not think it is colocated
  // (it would prefill prompts itself): it learns the mode from the router.
  t.joined_disaggregated = !accepted.colocated;
  t.joined = true;
  return t;
}

}  // namespace

Result<JoinTarget> read_join_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return Status::not_found("cannot read join file '" + path + "' (the router's --join-file)");
  try {
    const nlohmann::json j = nlohmann::json::parse(f);
    return JoinTarget{j.at("port").get<std::string>(), j.at("router").get<int>(), j.value("host", std::string()),
                      j.value("pid", 0)};
  } catch (const std::exception& e) {
    return Status::invalid_argument("join file '" + path + "': " + e.what());
  }
}

Status write_join_file(const std::string& path, const JoinTarget& router) {
  const nlohmann::json j{{"port", router.port}, {"router", router.rank}, {"host", router.host}, {"pid", router.pid}};
  return write_file_atomically(path, j.dump() + "\n", "join file");
}

Result<RoleTable> join_cluster(MpiLinks& links, const std::string& join_file, const RoleTable& world,
                               int32_t block_size, const PoolIdentity& identity, const ClusterSecret& secret,
                               std::chrono::milliseconds timeout) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto target = read_join_file(join_file);
  // The pool's own world ranks get cluster ids only at the end (no id is theirs yet).
  links.set_world_ids(std::vector<int>(static_cast<size_t>(size), -1));
  proto::JoinAccepted accepted;
  Status mine = target.status();
  const JoinWatchdog watchdog(join_file, timeout + std::chrono::seconds(5) * size);
  // The pool's name: where its first rank runs (the router links a pool's ranks to each other).
  const std::string pool = world.hosts[0] + ":" + std::to_string(world.pids[0]);
  // One rank of the pool at a time: the other side accepts links one by one.
  for (int k = 0; k < size; ++k) {
    if (k == world.self && mine.is_ok())
      mine = join_one_rank(links, JoinRequest{*target, world, pool, block_size, identity, secret, timeout}, accepted);
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
  return joined_table(world, ids, *target, accepted);
}

Result<JoinTarget> wait_for_new_router(const std::string& join_file, const std::string& lost_host, int lost_pid,
                                       std::chrono::milliseconds wait) {
  const auto end = std::chrono::steady_clock::now() + wait;
  for (;;) {
    auto target = read_join_file(join_file);
    if (target.is_ok() && target->pid != 0 && (target->pid != lost_pid || target->host != lost_host)) return target;
    if (std::chrono::steady_clock::now() >= end)
      return Status::timeout("no new router took the cluster of '" + join_file + "' within " +
                             std::to_string(wait.count()) + " ms (timeouts.rejoin_ms)");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

Result<RoleTable> rejoin_cluster(MpiLinks& links, const JoinTarget& target, const RoleTable& lost, int32_t block_size,
                                 const PoolIdentity& identity, const ClusterSecret& secret,
                                 std::chrono::milliseconds timeout) {
  // Every old link goes: the dead router's, and those to peers (each is linked
  // again, under its new id, through the new router). The world-mates too are
  // reached through new links: their old ids mean nothing to the new router.
  links.close_all();
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  links.set_world_ids(std::vector<int>(static_cast<size_t>(size), -1));
  RoleTable alone;  // this rank as a pool of one
  alone.roles = {lost.roles[lost.self]};
  alone.hosts = {lost.hosts[lost.self]};
  alone.pids = {lost.pids[lost.self]};
  alone.self = 0;
  const std::string pool = alone.hosts[0] + ":" + std::to_string(alone.pids[0]);
  proto::JoinAccepted accepted;
  {
    const JoinWatchdog watchdog(target.port, timeout + std::chrono::seconds(5), JoinWatchdog::OnExpiry::kExitProcess);
    PD_RETURN_IF_ERROR(
        join_one_rank(links, JoinRequest{target, alone, pool, block_size, identity, secret, timeout}, accepted));
  }
  return joined_table(alone, {accepted.rank}, target, accepted);
}

}  // namespace pd
