#include "router/connection_slots.h"

#include "util/lifecycle.h"

namespace pd::router {

const char* state_name(SlotHold h) {
  switch (h) {
    case SlotHold::kNone: return "none";
    case SlotHold::kHeld: return "held";
    case SlotHold::kLost: return "lost";
  }
  return "?";
}

bool legal(SlotHold from, SlotHold to) { return from == SlotHold::kHeld && to == SlotHold::kLost; }

const char* admission_name(Admission a) {
  switch (a) {
    case Admission::kUnlimited: return "unlimited";
    case Admission::kSlot: return "slot";
    case Admission::kOverflow: return "overflow";
    case Admission::kRefused: return "refused";
  }
  return "?";
}

AdmitResult ConnectionSlots::admit(Clock::time_point now) {
  AdmitResult r;
  // The candidate listed longest ago: the oldest idle holder, or the oldest
  // reading one when it has been silent for stall_after (the reading list is
  // in order of last bytes, so only its first entry needs a look).
  std::map<Key, uint64_t>* from = nullptr;
  if (max_connections_ != 0 && slots_used_ >= max_connections_) {
    if (!idle_.empty()) from = &idle_;
    if (!reading_.empty() && reading_.begin()->first.first + stall_after_ <= now &&
        (from == nullptr || reading_.begin()->first < idle_.begin()->first)) {
      from = &reading_;
    }
  }
  if (max_connections_ == 0) {
    r.admission = Admission::kUnlimited;
  } else if (conns_.size() >= max_connections_ + max_overflow_) {
    return r;  // kRefused
  } else if (slots_used_ < max_connections_) {
    r.admission = Admission::kSlot;
    ++slots_used_;
  } else if (from != nullptr) {
    // Take the slot of the candidate listed longest ago.
    const uint64_t victim = from->begin()->second;
    Entry& e = conns_.at(victim);
    r.evicted = victim;
    r.evicted_reading = from == &reading_;
    unlist(e);
    transition(e.hold, SlotHold::kLost, victim, "connection slots");
    r.admission = Admission::kSlot;
  } else {
    r.admission = Admission::kOverflow;
  }
  r.id = next_id_++;
  conns_.emplace(r.id, Entry{r.admission == Admission::kSlot ? SlotHold::kHeld : SlotHold::kNone, Listing::kNone, {}});
  // Nothing of a request has come yet: idle from its accept on, so the
  // holders go in the order they came, whenever the server gets to start them.
  if (r.admission == Admission::kSlot) list(r.id, Listing::kIdle, now);
  return r;
}

void ConnectionSlots::unlist(Entry& e) {
  if (e.listed == Listing::kIdle) idle_.erase(e.key);
  if (e.listed == Listing::kReading) reading_.erase(e.key);
  e.listed = Listing::kNone;
}

void ConnectionSlots::list(uint64_t id, Listing how, Clock::time_point now) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  Entry& e = it->second;
  if (e.hold != SlotHold::kHeld || (how == Listing::kIdle && e.listed == Listing::kIdle)) return;
  unlist(e);
  if (how == Listing::kNone) return;
  e.listed = how;
  e.key = Key{now, next_seq_++};
  (how == Listing::kIdle ? idle_ : reading_).emplace(e.key, id);
}

void ConnectionSlots::remove(uint64_t id) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  if (it->second.hold == SlotHold::kHeld) --slots_used_;
  unlist(it->second);
  conns_.erase(it);
}

bool ConnectionSlots::holds_slot(uint64_t id) const {
  auto it = conns_.find(id);
  return it != conns_.end() && it->second.hold == SlotHold::kHeld;
}

}  // namespace pd::router
