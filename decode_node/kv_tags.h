// The MPI tags a decode rank receives KV under, per prefill peer. A tag is
// reissued only when no send under it can still be pending: MPI cannot cancel
// a send, so a handoff that ended without every message arriving (receives
// cancelled, a peer that was fenced) may leave sends that would match the
// next receive posted under the same (peer, tag) — another request's KV
// written into this one's blocks. Such a tag is retired for that peer for good.
#pragma once

#include <cstddef>
#include <optional>
#include <unordered_set>

#include "protocol/messages.h"

namespace pd {

class KvTagPool {
 public:
  explicit KvTagPool(int first = proto::kTagKvFirst, int span = proto::kKvTagSpan) : first_(first), span_(span) {}
  // A tag no handoff from this peer holds and none ever left unfinished;
  // nullopt when every tag is in use or retired.
  std::optional<int> acquire();
  // Every message of the handoff under `tag` arrived: the tag is free again.
  void release(int tag);
  // The peer may still send under `tag`: never reissued.
  void retire(int tag);
  size_t in_use() const { return in_use_.size(); }
  size_t retired() const { return retired_.size(); }

 private:
  int first_, span_;
  int next_ = 0;
  std::unordered_set<int> in_use_, retired_;
};

}  // namespace pd
