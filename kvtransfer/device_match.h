// What the device KV transports (cuda_ipc_transport.h, nccl_transport.h) share
// and what can be tested without a GPU: their small MPI messages, and the
// table of their operations with FIFO matching of arrivals to posted receives.
//
// Messages: one kind byte, then fixed little-endian fields. A transport
// refuses (Corruption) a truncated message, one with trailing bytes or an
// unknown kind, so the kinds cannot be confused even on a shared tag.
//
// Operations move through one phase each:
//   kQueued   send: waiting for the compute stream (nothing sent yet)
//             receive: posted, no descriptor/envelope matched to it yet
//   kInFlight send: its descriptor/envelope went out; receive: matched, data moving
//   kDone / kCancelled / kFailed: ended; reported once by report(), then forgotten
// Only a queued operation can be cancelled (like MPI: a receive not matched,
// a send not started); an operation in flight completes normally. Arrivals
// from (peer, tag) match posted receives of (peer, tag) oldest first; an
// arrival with none posted (cancelled, abandoned) is drained by the transport.
// Calls on an unknown id are no-ops (the op was reported or abandoned while its
// bytes kept moving).
//
// DeviceMsgLink carries the messages over MPI. No CUDA here; the engine-loop
// thread is the only caller.
#pragma once

#include <mpi.h>

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <variant>
#include <vector>

#include "kvtransfer/transport.h"
#include "protocol/mpi_links.h"
#include "util/status.h"

namespace pd {

// ---- messages

enum class DeviceMsgKind : uint8_t { kIpcDescriptor = 1, kAck = 2, kNcclId = 3, kNcclEnvelope = 4 };

// CUDA IPC, sender -> receiver: where the region's bytes are in the sender's cache.
struct IpcDescriptor {
  int32_t tag = 0;
  uint64_t seq = 0;                  // the sender's op id, echoed by the ack
  std::array<uint8_t, 64> handle{};  // cudaIpcMemHandle_t of the sender's whole cache buffer
  int64_t piece_bytes = 0;
  std::vector<int64_t> offsets;  // from the cache base, in wire order
};
// CUDA IPC, receiver -> sender: done with descriptor `seq` (copied, refused or drained).
struct DeviceAck {
  int32_t tag = 0;
  uint64_t seq = 0;
};
// NCCL, lower rank id -> higher: the pair communicator's ncclUniqueId.
struct NcclIdMsg {
  std::array<uint8_t, 128> id{};
};
// NCCL, sender -> receiver: an ncclSend of `bytes` follows on the pair communicator.
struct NcclEnvelope {
  int32_t tag = 0;
  uint64_t bytes = 0;
};
using DeviceMsg = std::variant<IpcDescriptor, DeviceAck, NcclIdMsg, NcclEnvelope>;

std::vector<uint8_t> serialize_device_msg(const DeviceMsg& m);
size_t serialized_size(const DeviceMsg& m);
// Corruption naming the kind and the sizes for a truncated, overlong or unknown message.
Result<DeviceMsg> deserialize_device_msg(std::span<const uint8_t> bytes);

// One device transport's messages on its own MPI tag. Sends are MPI_Isend'ed,
// each buffer kept until MPI_Test reports it sent; MPI's non-overtaking order
// holds per peer. Never blocks.
class DeviceMsgLink {
 public:
  DeviceMsgLink(std::shared_ptr<MpiLinks> links, int tag) : links_(std::move(links)), tag_(tag) {}
  // Sends still in progress are released to MPI (MPI_Request_free) with their
  // buffers left allocated: MPI may still read them.
  ~DeviceMsgLink();
  DeviceMsgLink(const DeviceMsgLink&) = delete;
  DeviceMsgLink& operator=(const DeviceMsgLink&) = delete;

  // NotFound without a link to `peer`; IoError if MPI refuses the send.
  Status send(int peer, const DeviceMsg& m);
  // A message that arrived, with its sender's id (a malformed one as its Corruption).
  struct Arrived {
    int peer;
    Result<DeviceMsg> msg;
  };
  // Reaps finished sends, then returns every message that has arrived, in
  // arrival order (the caller acts on them after: nothing here calls back).
  std::vector<Arrived> poll();
  // This process's rank id.
  int self_id() const;

 private:
  struct Outgoing {
    std::unique_ptr<std::vector<uint8_t>> bytes;
    MPI_Request req = MPI_REQUEST_NULL;
  };
  std::shared_ptr<MpiLinks> links_;
  int tag_;
  std::list<Outgoing> outgoing_;
  std::vector<uint8_t> recv_buf_;
};

// ---- operations

enum class DevicePhase { kQueued, kInFlight, kDone, kCancelled, kFailed };

class DeviceOpTable {
 public:
  struct Op {
    bool send = false;
    int peer = -1;
    int tag = 0;
    DevicePhase phase = DevicePhase::kQueued;
    Status error;  // kFailed
  };

  // A new queued op; a receive joins the FIFO of its (peer, tag).
  int64_t add(bool send, int peer, int tag);
  // The oldest queued receive of (peer, tag), now in flight; nullopt when none
  // is posted (the arrival is drained).
  std::optional<int64_t> match(int peer, int tag);
  // A queued send goes in flight. False when it is not a queued send (cancelled, abandoned).
  bool start(int64_t id);
  // In flight -> kDone. No-op otherwise.
  void finish(int64_t id);
  // Queued or in flight -> kFailed with `why`. No-op otherwise.
  void fail(int64_t id, Status why);
  // Queued -> kCancelled (a receive leaves its FIFO). True if it was cancelled;
  // an op in flight is left to complete.
  bool cancel(int64_t id);
  // Forgets the id without reporting it (a queued receive leaves its FIFO).
  // Returns the phase it had, nullopt for an unknown id.
  std::optional<DevicePhase> abandon(int64_t id);
  // kPending while queued or in flight; an ended op is reported once and
  // forgotten (kFailed: its Status). NotFound for an unknown id.
  Result<OpState> report(int64_t id);

  const Op* find(int64_t id) const;
  // Ids of the ops with `peer` that have not ended, oldest first.
  std::vector<int64_t> live_ops_with(int peer) const;
  size_t size() const { return ops_.size(); }

 private:
  void unqueue(int64_t id, const Op& op);
  int64_t next_ = 0;
  std::map<int64_t, Op> ops_;                                        // ordered: oldest first
  std::map<std::pair<int, int>, std::deque<int64_t>> queued_recvs_;  // (peer, tag) -> posted, unmatched
};

}  // namespace pd
