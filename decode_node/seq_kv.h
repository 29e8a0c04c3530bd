// A decode sequence's blocks in the engine's block manager, as one checked
// state (util/lifecycle.h) instead of "has blocks" and "KV complete" flags:
//
//   kNone -> kWriting  (allocated: its KV is being received or computed; the
//                       blocks stay private, nothing may reuse them)
//   kWriting -> kWritten (every block's KV is written: registered for reuse)
//   kWriting | kWritten -> kNone (released: written blocks are freed into the
//                       prefix cache, unwritten ones discarded)
//
// Used by the handoff intake (KV received) and the decode worker (KV computed
// here); both run on the engine loop.
#pragma once

#include "kv/kv_block_manager.h"
#include "protocol/messages.h"

namespace pd {

class SeqKv {
 public:
  enum class State { kNone, kWriting, kWritten };
  friend const char* state_name(State s);
  friend bool legal(State from, State to);

  State state() const { return state_; }
  // The block manager holds blocks for the sequence.
  bool held() const { return state_ != State::kNone; }
  // Blocks were allocated for sequence `id` (kWriting).
  void allocated(proto::RequestId id);
  // Every block has its KV written: they are published for reuse (kWritten).
  // A publish error is logged (decode rank `self`), not returned: the blocks
  // stay usable, only not shared.
  void written(KvBlockManager& blocks, proto::RequestId id, int self);
  // Frees (kWritten) or discards (kWriting) the blocks; nothing when kNone.
  void release(KvBlockManager& blocks, proto::RequestId id, int self);

 private:
  State state_ = State::kNone;
};

}  // namespace pd
