// Joining a running cluster (an elastic pool started by its own mpirun,
// docs/CLUSTER.md): the router's join file, the handshake a pool's ranks make
// with the router and the workers it names, and the blocking send used for the
// few messages that go out before a rank's control channel exists.
//
// Threading: called by the thread that initialized MPI, before the rank's
// channel and KV transport start; join_cluster() is collective over the
// pool's MPI_COMM_WORLD.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "protocol/link_auth.h"
#include "protocol/messages.h"
#include "protocol/mpi_links.h"
#include "protocol/role_table.h"
#include "util/status.h"

namespace pd {

// Sends one control message and waits for it to leave (MPI_Send): for the few
// messages sent before a rank's channel exists (Listening, the join handshake).
Status send_now(MpiLinks& links, int dest, const proto::Message& m);

// What a joining rank must share with the cluster it joins: its KV cache
// elements (kv.dtype) and its model file (gguf_fingerprint; "" = not said).
struct PoolIdentity {
  std::string kv_dtype;
  std::string model;
};

// The join handshake of a pool started by its own mpirun (`--join FILE`; FILE
// is what the router wrote for --join-file: its port and rank). One rank of
// the pool at a time: connect to the router, Join, get an id (JoinAccepted),
// connect to every worker it names and say Hello; each link first answers its
// acceptor's Challenge with `secret` (link_auth.h). Returns this rank's table
// in the cluster's ids (self = its new id; world-mates mapped too; the
// router's host and pid from the file). An error
// names what failed (the file, a refusal and its reason, a timeout).
Result<RoleTable> join_cluster(MpiLinks& links, const std::string& join_file, const RoleTable& world,
                               int32_t block_size, const PoolIdentity& identity, const ClusterSecret& secret,
                               std::chrono::milliseconds timeout = std::chrono::seconds(60));

// What a join file says: the router's MPI port, its rank, and which process
// it is (host and pid: a rank whose router died tells a new one by them).
struct JoinTarget {
  std::string port;
  int rank = -1;
  std::string host;
  int pid = 0;
};

// The router's side of --join-file: FILE gets {"port", "router", "host",
// "pid"} (written to a temporary name and renamed, so a reader never sees half).
Status write_join_file(const std::string& path, const JoinTarget& router);
Result<JoinTarget> read_join_file(const std::string& path);

// A rank whose router is gone (WorkerCore::run() ended Unavailable) waits up
// to `wait` for `join_file` to name another router (not `lost_host`:
// `lost_pid`): the one deploy/launch.sh --new-router starts. Timeout names
// timeouts.rejoin_ms.
Result<JoinTarget> wait_for_new_router(const std::string& join_file, const std::string& lost_host, int lost_pid,
                                       std::chrono::milliseconds wait);

// Joins that router alone — a pool of one, its old links all freed: its
// world-mates, as every other rank, are linked again under their new ids —
// with the join handshake above. `lost` is the table it served under (its
// role, host and pid). Past `timeout` in MPI_Comm_connect this process exits
// (not the job: its world-mates may be joining too).
Result<RoleTable> rejoin_cluster(MpiLinks& links, const JoinTarget& target, const RoleTable& lost, int32_t block_size,
                                 const PoolIdentity& identity, const ClusterSecret& secret,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace pd
