// Transport: moves KV bytes between ranks. Non-blocking: post a send or a
// receive, test for completion, cancel. The caller (a worker's engine loop)
// overlaps transfers with compute and owns every deadline.
//
// Contract: the memory a posted operation reads or writes stays valid and is
// not reused until test() has reported the operation complete (including a
// cancelled one). Nothing here blocks except where named.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvtransfer/kv_path.h"
#include "kvtransfer/kv_region.h"
#include "util/status.h"

namespace pd {

struct TransferOp {
  int64_t value = -1;
  friend bool operator==(TransferOp a, TransferOp b) { return a.value == b.value; }
};

enum class OpState { kPending, kDone, kCancelled };

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  // KV region to/from `peer` under `tag`; operations with the same peer and tag
  // complete in posting order.
  virtual Result<TransferOp> post_send(int peer, int tag, const KvRegion& region) = 0;
  virtual Result<TransferOp> post_recv(int peer, int tag, const KvRegion& region) = 0;
  // Small byte buffers (trailers). The buffer must outlive the operation.
  virtual Result<TransferOp> post_send_bytes(int peer, int tag, const void* data, size_t bytes) = 0;
  virtual Result<TransferOp> post_recv_bytes(int peer, int tag, void* data, size_t bytes) = 0;
  // Progress + completion check. kDone / kCancelled are reported once, after
  // which the op id is released. NotFound for an unknown op.
  virtual Result<OpState> test(TransferOp op) = 0;
  // Asks to cancel; the op still has to be test()ed until it leaves kPending
  // (it may complete normally if the data was already on its way).
  virtual void cancel(TransferOp op) = 0;
  // Gives up on an operation without waiting for it to end: the id is released
  // and never reported; the operation may still complete in the background.
  // Only for an operation whose peer is fenced or dead: the caller must know
  // that no byte can still land in (receive) the memory it reuses, or that
  // the peer discards what it reads from it (send). MPI cannot cancel a send,
  // nor a receive already matched to one, so this is how such an operation
  // with a vanished peer ends.
  virtual void abandon(TransferOp op) = 0;
  // Takes and drops, in order, every message `peer` sent under `tag` that no
  // receive took, up to and including the sender's seal: the first empty
  // message under the tag (post_send_bytes of 0 bytes, which a sender posts
  // once it will send nothing more under the tag until the tag is given to it
  // again). kDone once the seal is taken: nothing of the peer's is left under
  // (peer, tag), and a receive posted there later meets only what the peer
  // sends after it. cancel() ends it kCancelled (a message already being taken
  // lands first): what is left may still be pending. Post it only while no
  // receive of this rank under (peer, tag) is pending (one would take the
  // messages, or the seal, it waits for). Unsupported where the tag does not
  // order every message of a handoff (the device paths: their KV travels
  // apart from the trailer's tag).
  virtual Result<TransferOp> post_reclaim(int peer, int tag) = 0;
  virtual size_t pending() const = 0;
  // A decode waits on send `op` now (its handoff's token 1 is out): it, and
  // every send still waiting under its peer and tag, go ahead of sends that
  // nothing waits on yet (kvtransfer/send_order.h). Only a transport that
  // queues sends acts on it (send_budget.h); the rest post at once.
  virtual void expedite(TransferOp op) { (void)op; }

  // The paths this transport can carry (KvPaths: every path it holds).
  virtual std::vector<KvPath> paths() const { return {KvPath::kMpi}; }
  // Region operations with `peer` posted from now on take `choice.path`
  // (choose_kv_path, computed the same on both ends). Unsupported for a path
  // this transport lacks.
  // Small byte buffers (trailers) always travel over MPI.
  virtual Status select_path(int peer, const KvPathChoice& choice) {
    if (choice.path == KvPath::kMpi) return Status::ok();
    return Status::unsupported(std::string("transport '") + name() + "' has no " + kv_path_name(choice.path) +
                               " path to rank " + std::to_string(peer));
  }
  // `peer` left or was declared dead and every operation with it has ended or
  // been abandoned: release what is kept for it (mapped memory, a communicator).
  virtual void forget_peer(int peer) { (void)peer; }
  // Moves operations along without testing any (the engine loop calls it every
  // iteration): a device path answers its peer's messages here even when this
  // rank has nothing of its own to test. MPI needs nothing (its progress rides
  // on every MPI call).
  virtual void progress() {}
  // The calling thread makes every later call (a rank's communication side,
  // kvtransfer/comm_side.h): a device path makes the rank's device current on
  // it. Called once, before any other call from that thread.
  virtual void bind_thread() {}
};

}  // namespace pd
