#include "decode_node/kv_tags.h"

namespace pd {

std::optional<int> KvTagPool::acquire() {
  for (int i = 0; i < span_; ++i) {
    const int tag = first_ + next_;
    next_ = (next_ + 1) % span_;
    if (!in_use_.count(tag) && !retired_.count(tag)) {
      in_use_.insert(tag);
      return tag;
    }
  }
  return std::nullopt;
}

void KvTagPool::release(int tag) { in_use_.erase(tag); }

void KvTagPool::retire(int tag) {
  in_use_.erase(tag);
  retired_.insert(tag);
}

}  // namespace pd
