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
#include <vector>

#include "protocol/control_channel.h"
#include "protocol/messages.h"
#include "protocol/mpi_links.h"
#include "util/status.h"

namespace pd {

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
  int receive(const std::function<void(int source, proto::Message& m)>& fn, int max = 64) override;
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
