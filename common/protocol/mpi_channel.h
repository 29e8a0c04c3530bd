// The MPI side of the control plane: who is who in the job (the role table)
// and the ControlChannel over MPI (see protocol/control_channel.h).
//
// Threading: MPI is called from one thread at a time per process
// (MPI_THREAD_SERIALIZED): a worker's communication thread
// (kvtransfer/comm_side.h), the router's link thread; every object here
// belongs to the thread that calls it.
#pragma once

#include <mpi.h>

#include <chrono>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "protocol/control_channel.h"
#include "protocol/messages.h"
#include "protocol/mpi_links.h"
#include "util/env.h"
#include "util/status.h"

namespace pd {

enum class Role : int32_t { kRouter = 0, kPrefill = 1, kDecode = 2 };
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
  bool colocated() const { return prefill.empty() && !joined_disaggregated; }
};

// MPI_Init_thread(SERIALIZED, or MULTIPLE for `elastic` ranks: their MpiLinks
// accept on a background thread) with an error naming what was provided
// instead; MPI_COMM_WORLD then returns errors instead of aborting the job, so
// one rank's death is this rank's to handle (mpirun --mca orte_enable_recovery 1).
Status mpi_init(int* argc, char*** argv, bool elastic = false);
// MPI_Finalize, bounded: with a rank of the job dead (mpirun --mca
// orte_enable_recovery 1), OpenMPI 4.1's finalize can wait for it for ever
// (seen about once in ten chaos runs). After `limit` the process exits with
// `code` without finishing it; mpirun then ends the job as usual.
void mpi_finalize_bounded(int code, std::chrono::seconds limit = std::chrono::seconds(5));

// Every rank announces its role (one MPI_Allgather). InvalidArgument unless
// there is exactly one router and at least one decode rank — or, for the ranks
// of a pool joining a running cluster (`joining`), no router at all. A job that
// accepts pools (`elastic`) may start with no worker at all (the router alone).
Result<RoleTable> exchange_roles(Role mine, bool joining = false, bool elastic = false);

// Whether `rank`'s process is known to have ended: it ran on this host and its
// pid is gone (or a zombie). False when it cannot be known (another host).
// A rank that is merely stopped (SIGSTOP) is not dead: it may resume and
// complete the transfers it had begun.
bool rank_confirmed_dead(const RoleTable& t, int rank);

// The workers' Env in the cluster (util/env.h): the steady clock, and
// rank_confirmed_dead over the rank's role table.
class ClusterEnv final : public Env {
 public:
  explicit ClusterEnv(RoleTable roles) : roles_(std::move(roles)) {}
  bool rank_gone(int rank) const override { return rank_confirmed_dead(roles_, rank); }

 private:
  RoleTable roles_;
};

// Sends one control message and waits for it to leave (MPI_Send): for the few
// messages sent before a rank's channel exists (Listening, the join handshake).
Status send_now(MpiLinks& links, int dest, const proto::Message& m);

// The join handshake of a pool started by its own mpirun (`--join FILE`; FILE
// is what the router wrote for --join-file: its port and rank). One rank of
// the pool at a time: connect to the router, Join, get an id (JoinAccepted),
// connect to every worker it names and say Hello. Returns this rank's table
// in the cluster's ids (self = its new id; world-mates mapped too). An error
// names what failed (the file, a refusal and its reason, a timeout).
Result<RoleTable> join_cluster(MpiLinks& links, const std::string& join_file, const RoleTable& world,
                               int32_t block_size, const std::string& kv_dtype,
                               std::chrono::milliseconds timeout = std::chrono::seconds(60));

// The router's side of --join-file: FILE gets {"port": ..., "router": rank}
// (written to a temporary name and renamed, so a reader never sees half).
Status write_join_file(const std::string& path, const std::string& port, int router_rank);

// The ControlChannel of the cluster: protocol messages on kTagControl, to and
// from rank ids (MpiLinks: the world's ranks, and the links of joined ranks).
// A link accepted by a worker is bound to its rank by the Hello on it (which
// is then delivered as from that rank); anything else on an unbound link is
// dropped.
class MpiControlChannel final : public ControlChannel {
 public:
  explicit MpiControlChannel(std::shared_ptr<MpiLinks> links = std::make_shared<MpiLinks>()) : links_(std::move(links)) {}
  ~MpiControlChannel() override;
  MpiControlChannel(const MpiControlChannel&) = delete;
  MpiControlChannel& operator=(const MpiControlChannel&) = delete;

  // Posts the message (MPI_Isend); its bytes are kept until the send completes.
  void send(int dest, const proto::Message& m) override;
  // The next received message, if one is waiting (MPI_Iprobe, never blocks).
  // A message that does not parse comes back as its Status (with the source).
  struct Received {
    int source;
    Result<proto::Message> message;
  };
  std::optional<Received> poll();
  // Polls up to `max` messages and hands each well-formed one to `fn`; a
  // malformed one is logged (naming its source) and dropped. Returns how many
  // messages arrived.
  int drain(const std::function<void(int source, proto::Message& m)>& fn, int max = 64) override;
  // Completes finished sends (frees their buffers). Call once per loop.
  void progress() override;
  size_t pending_sends() const override { return sends_.size(); }
  // Waits up to `deadline` for pending sends (shutdown); false if some remain.
  bool flush(std::chrono::milliseconds deadline) override;
  void forget(int rank) override { links_->forget(rank); }

 private:
  struct PendingSend {
    std::vector<uint8_t> bytes;
    MPI_Request req = MPI_REQUEST_NULL;
  };
  // A message to a rank whose link is not bound yet (a rank that joined a
  // moment ago: its Hello may still be on the way), sent once it is, dropped
  // after kUnlinkedWait.
  struct Unlinked {
    int dest;
    std::vector<uint8_t> bytes;
    const char* name;
    std::chrono::steady_clock::time_point drop_at;
  };
  static constexpr std::chrono::seconds kUnlinkedWait{5};
  void isend(int dest, const MpiLinks::Endpoint& to, std::vector<uint8_t> bytes, const char* name);
  void send_unlinked();
  std::shared_ptr<MpiLinks> links_;
  std::deque<Unlinked> unlinked_;
  size_t next_link_ = 0;  // probing starts here (round robin over the links)
  std::deque<PendingSend> sends_;
  std::vector<uint8_t> recv_buf_;
};

}  // namespace pd
