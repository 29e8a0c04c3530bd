// The MPI tags a decode rank receives KV under, per prefill peer. A tag is
// reissued only when no message of the peer can still be pending under it:
// MPI cannot cancel a send, so a handoff that ended without every message
// arriving (receives cancelled) may leave sends that would match the next
// receive posted under the same (peer, tag) — another request's KV written
// into this one's blocks.
//
// A tag's life (TagState; every change checked, util/lifecycle.h):
//   kFree -> kHeld        acquire(): a handoff receives under it
//   kHeld -> kFree        release(): every receive under it completed, so
//                         every send the peer made under it matched one
//   kHeld -> kUnsealed    reclaim(): its handoff ended early with the peer up
//                         (a receive cancelled, failed or fed foreign data)
//   kUnsealed -> kSealing sealing(): the peer was asked to seal the tag
//                         (proto::KvTagSeal) and a reclaim is posted
//                         (Transport::post_reclaim: it takes what the peer
//                         sent under the tag, up to the peer's empty seal)
//   kSealing -> kFree     poll(): the reclaim took the seal
//   kHeld | kUnsealed | kSealing -> kRetired
//                         retire(): the peer went down (it may resume and send
//                         under the tag), the handoff took a device path (no
//                         seal orders its KV), or the reclaim failed or took
//                         longer than its limit. Never reissued: the peer's
//                         tags come back only when it leaves (the pool is dropped).
// Tags being reclaimed block nothing but themselves: acquire() hands out the
// others.
//
// Threading: the decode worker's engine loop; the transport is its
// communication side's end (kvtransfer/comm_side.h).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "kvtransfer/transport.h"
#include "protocol/messages.h"

namespace pd {

class KvTagPool {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  enum class TagState { kFree, kHeld, kUnsealed, kSealing, kRetired };
  // A tag whose handoff ended early, to be sealed: its last handoff's request.
  struct Unsealed {
    int tag;
    proto::RequestId id;
  };

  explicit KvTagPool(int first = proto::kTagKvFirst, int span = proto::kKvTagSpan) : first_(first), span_(span) {}

  // A free tag (round robin from the last one handed out); nullopt when every
  // tag is held, being reclaimed or retired.
  std::optional<int> acquire();
  // kHeld -> kFree: every message of the handoff under `tag` arrived.
  void release(int tag);
  // kHeld -> kUnsealed: handoff `id` under `tag` ended early with its sender up.
  void reclaim(int tag, proto::RequestId id, TimePoint now);
  // The kUnsealed tags, oldest first.
  std::vector<Unsealed> unsealed() const;
  // kUnsealed -> kSealing: `op` (post_reclaim) takes what the peer sent under `tag`.
  void sealing(int tag, TransferOp op);
  // Tests each reclaim: one that took the seal frees its tag; one that ended
  // otherwise (cancelled, failed) retires it; one older than `limit` (from
  // reclaim()) is cancelled, and retired once it ends. True when a tag changed state.
  bool poll(Transport& t, TimePoint now, std::chrono::milliseconds limit);
  // -> kRetired (a kSealing tag's reclaim is abandoned): never reissued.
  void retire(int tag, Transport& t);
  // The peer went down: every tag being reclaimed is retired (its reclaim abandoned).
  void retire_unsealed(Transport& t);
  // Shutdown: reclaims are cancelled (they end through poll()).
  void cancel_reclaims(Transport& t);

  size_t held() const { return count(TagState::kHeld); }
  size_t reclaiming() const { return count(TagState::kUnsealed) + count(TagState::kSealing); }
  size_t retired() const { return count(TagState::kRetired); }
  TagState state(int tag) const;

 private:
  struct Entry {
    TagState state = TagState::kFree;
    proto::RequestId id = 0;       // the handoff that held it last
    TimePoint since{};             // kUnsealed, kSealing: when its handoff ended
    std::optional<TransferOp> op;  // kSealing: the reclaim
    bool cancelled = false;        // kSealing: the reclaim was cancelled (past its limit, shutdown)
  };
  void set(int tag, Entry& e, TagState to);
  size_t count(TagState s) const { return counts_[static_cast<size_t>(s)]; }
  int first_, span_;
  std::array<size_t, 5> counts_{};  // tags in each state (kFree's unused)
  int next_ = 0;
  std::map<int, Entry> tags_;  // every tag not free
};

const char* state_name(KvTagPool::TagState s);
bool legal(KvTagPool::TagState from, KvTagPool::TagState to);

}  // namespace pd
