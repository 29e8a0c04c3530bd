#include "router/connection_slots.h"

namespace pd::router {

const char* admission_name(Admission a) {
  switch (a) {
    case Admission::kUnlimited: return "unlimited";
    case Admission::kSlot: return "slot";
    case Admission::kOverflow: return "overflow";
    case Admission::kRefused: return "refused";
  }
  return "?";
}

AdmitResult ConnectionSlots::admit() {
  AdmitResult r;
  if (max_connections_ == 0) {
    r.admission = Admission::kUnlimited;
  } else if (conns_.size() >= max_connections_ + max_overflow_) {
    return r;  // kRefused
  } else if (slots_used_ < max_connections_) {
    r.admission = Admission::kSlot;
    ++slots_used_;
  } else if (!idle_.empty()) {
    // Take the slot of the longest idle keep-alive connection.
    const auto oldest = idle_.begin();
    Entry& e = conns_.at(oldest->second);
    r.evicted = oldest->second;
    idle_.erase(oldest);
    e.idle_seq = 0;
    e.slot = false;
    r.admission = Admission::kSlot;
  } else {
    r.admission = Admission::kOverflow;
  }
  r.id = next_id_++;
  conns_.emplace(r.id, Entry{r.admission == Admission::kSlot, 0});
  return r;
}

void ConnectionSlots::set_idle(uint64_t id, bool idle) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  Entry& e = it->second;
  if (idle && e.slot && e.idle_seq == 0) {
    e.idle_seq = next_idle_seq_++;
    idle_.emplace(e.idle_seq, id);
  } else if (!idle && e.idle_seq != 0) {
    idle_.erase(e.idle_seq);
    e.idle_seq = 0;
  }
}

void ConnectionSlots::remove(uint64_t id) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  if (it->second.slot) --slots_used_;
  if (it->second.idle_seq != 0) idle_.erase(it->second.idle_seq);
  conns_.erase(it);
}

bool ConnectionSlots::holds_slot(uint64_t id) const {
  auto it = conns_.find(id);
  return it != conns_.end() && it->second.slot;
}

}  // namespace pd::router
