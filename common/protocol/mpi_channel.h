// The ControlChannel over MPI (see protocol/control_channel.h): protocol
// messages to and from rank ids over the links of protocol/mpi_links.h.
// Starting MPI, the role table, death detection and the join handshake live
// beside it (mpi_runtime.h, role_table.h, cluster_env.h, join_handshake.h).
//
// Threading: MPI is called from one thread at a time per process
// (MPI_THREAD_SERIALIZED): a worker's communication thread
// (kvtransfer/comm_side.h), the router's link thread; every object here
// belongs to the thread that calls it.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "protocol/control_channel.h"
#include "protocol/link_auth.h"
#include "protocol/messages.h"
#include "protocol/mpi_links.h"
#include "util/status.h"

namespace pd {

// The ControlChannel of the cluster: protocol messages on kTagControl, to and
// from rank ids (MpiLinks: the world's ranks, and the links of joined ranks).
// A link this rank accepted (from a rank that joined later) is challenged
// first (protocol/link_auth.h): its first message must be a Join (on the
// router) or a Hello (on a worker) carrying the proof of the cluster secret in
// `secret_path`. A Hello then binds the link to the rank it names, which must
// not have a link already (the world's ranks included); it is delivered as
// from that rank. A link whose first message is anything else, whose proof
// is wrong, or that proves nothing within kProofWait is freed and counted
// (refused_links()); nothing it sent is delivered.
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
  int receive(const std::function<void(int source, proto::Message& m)>& fn, int max = 64) override;
  // Completes finished sends (frees their buffers): one MPI_Testsome over
  // them all (each MPI test of an unfinished send runs the progress engine,
  // which on an oversubscribed node may yield the core). Call once per loop.
  void progress() override;
  size_t pending_sends() const override { return sends_.size(); }
  // Waits up to `deadline` for pending sends (shutdown); false if some remain.
  bool flush(std::chrono::milliseconds deadline) override;
  void forget(int rank) override { links_->forget(rank); }
  // Accepted links freed without a valid proof of the cluster secret, since start.
  int64_t refused_links() const override { return refused_links_; }

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
  // How long an accepted link may take to prove the cluster secret, and the
  // most its first message (a Join or a Hello, well under 1 KiB) may weigh.
  static constexpr std::chrono::seconds kProofWait{30};
  static constexpr int kMaxProofBytes = 4096;
  struct Unproven {
    std::string challenge;
    std::chrono::steady_clock::time_point drop_at;
  };
  void isend(int dest, const MpiLinks::Endpoint& to, std::vector<uint8_t> bytes, const char* name);
  void send_unlinked();
  // Challenges the links accepted since the last call; frees those past kProofWait.
  void challenge_accepted();
  // The first message `got` on unproven link `got.source`: whether it proves
  // the secret (a Hello's link is then bound to its rank and `got.source` set
  // to it). Otherwise the link is freed.
  bool admit(Received& got);
  void refuse(int link, const std::string& why);
  std::shared_ptr<MpiLinks> links_;
  std::optional<ClusterSecret> secret_;  // read from links_->secret_path() at the first accepted link
  std::unordered_map<int, Unproven> unproven_;  // accepted links not yet proven, by link id
  int64_t refused_links_ = 0;
  std::deque<Unlinked> unlinked_;
  size_t next_link_ = 0;  // probing starts here (round robin over the links)
  std::deque<PendingSend> sends_;
  std::vector<MPI_Request> sweep_reqs_;  // progress()'s arrays, kept between calls
  std::vector<int> sweep_done_;
  std::vector<uint8_t> recv_buf_;
};

}  // namespace pd
