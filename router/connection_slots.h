// The HTTP server's connection-limit policy (HttpServerConfig::max_connections),
// apart from sockets and threads: which connections hold one of the
// max_connections slots, which slot holders are eviction candidates (idle:
// nothing of a request received, be it their first or the next on keep-alive;
// or reading a request and silent for stall_after), longest idle first, and
// what a newly accepted connection gets — a free slot, the slot of the longest
// idle candidate, an overflow place, or nothing.
//
// Plain bookkeeping over connection ids: no locking (the server calls it under
// its connections mutex), no I/O. The server closes an evicted connection; this
// only says which one.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <unordered_map>
#include <utility>

namespace pd::router {

// What a newly accepted connection gets.
enum class Admission {
  kUnlimited,  // max_connections is 0: no slots, no overflow, no ceiling
  kSlot,       // one of the max_connections slots (maybe taken from an evicted idle holder)
  kOverflow,   // beyond max_connections: one restricted request, never a slot
  kRefused,    // beyond max_connections + max_overflow_connections: closed unanswered
};
const char* admission_name(Admission a);

struct AdmitResult {
  Admission admission = Admission::kRefused;
  uint64_t id = 0;                  // the new connection's id (unset when refused)
  std::optional<uint64_t> evicted;  // the listed slot holder whose slot it took
  bool evicted_reading = false;     // it was listed as reading (a stalled request), not idle
};

// What a slot holder is listed as (see ConnectionSlots::list).
enum class Listing {
  kNone,     // busy (its request is with the handler, or being answered): never evicted
  kIdle,     // nothing of a request received: its first, or the next on keep-alive
  kReading,  // part of a request received; a candidate once silent for stall_after
};

// A connection's hold on a slot: never had one (no connection limit, or an
// overflow connection), holds one, or lost it to a newer connection (evicted).
enum class SlotHold { kNone, kHeld, kLost };
const char* state_name(SlotHold h);
bool legal(SlotHold from, SlotHold to);

class ConnectionSlots {
 public:
  using Clock = std::chrono::steady_clock;
  // `max_connections` 0 = unlimited. `stall_after`: how long a holder listed
  // as reading must have received nothing before it is an eviction candidate.
  ConnectionSlots(size_t max_connections, size_t max_overflow_connections,
                  std::chrono::milliseconds stall_after = std::chrono::milliseconds(2000))
      : max_connections_(max_connections), max_overflow_(max_overflow_connections), stall_after_(stall_after) {}

  // Admits a newly accepted connection and, unless refused, registers it under
  // a fresh id; a new slot holder is listed idle at `now` (nothing of a request
  // received yet). When every slot is taken and some holder is a candidate — listed
  // idle, or listed reading since at least stall_after before `now` — the one
  // listed longest ago loses its slot (it stays registered, slotless and
  // unlisted, until remove()); its id comes back in `evicted`, and
  // `evicted_reading` says which list it was on.
  AdmitResult admit(Clock::time_point now = Clock::now());
  // Lists slot holder `id` as `how` at `now`, or unlists it (kNone). Listing as
  // idle one that is listed idle keeps its place; listing as reading always
  // moves it to `now` (bytes just arrived). Connections without a slot are
  // never listed; unknown ids are ignored.
  void list(uint64_t id, Listing how, Clock::time_point now = Clock::now());
  // list(id, kIdle) or list(id, kNone).
  void set_idle(uint64_t id, bool idle, Clock::time_point now = Clock::now()) {
    list(id, idle ? Listing::kIdle : Listing::kNone, now);
  }
  // Forgets a closed connection, freeing its slot. Unknown ids are ignored.
  void remove(uint64_t id);

  size_t open() const { return conns_.size(); }  // registered connections
  size_t slots_used() const { return slots_used_; }
  size_t idle() const { return idle_.size(); }        // holders listed idle
  size_t reading() const { return reading_.size(); }  // holders listed reading
  bool holds_slot(uint64_t id) const;

 private:
  using Key = std::pair<Clock::time_point, uint64_t>;  // (listed at, a sequence number: ties)
  struct Entry {
    SlotHold hold = SlotHold::kNone;  // kHeld: one of the max_connections slots
    Listing listed = Listing::kNone;
    Key key{};          // its key in idle_ or reading_ while listed there
  };
  void unlist(Entry& e);

  const size_t max_connections_;
  const size_t max_overflow_;
  const std::chrono::milliseconds stall_after_;
  std::unordered_map<uint64_t, Entry> conns_;
  uint64_t next_id_ = 0;
  size_t slots_used_ = 0;  // entries holding a slot
  // Listed slot holders, longest listed first (key -> connection id).
  std::map<Key, uint64_t> idle_;
  std::map<Key, uint64_t> reading_;
  uint64_t next_seq_ = 0;
};

}  // namespace pd::router
