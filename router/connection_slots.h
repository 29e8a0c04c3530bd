// The HTTP server's connection-limit policy (HttpServerConfig::max_connections),
// apart from sockets and threads: which connections hold one of the
// max_connections slots, which slot holders are idle keep-alive connections
// (eviction candidates, longest idle first), and what a newly accepted
// connection gets — a free slot, the slot of the longest idle holder, an
// overflow place, or nothing.
//
// Plain bookkeeping over connection ids: no locking (the server calls it under
// its connections mutex), no I/O. The server closes an evicted connection; this
// only says which one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <unordered_map>

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
  uint64_t id = 0;                 // the new connection's id (unset when refused)
  std::optional<uint64_t> evicted;  // the idle slot holder whose slot it took
};

class ConnectionSlots {
 public:
  // `max_connections` 0 = unlimited.
  ConnectionSlots(size_t max_connections, size_t max_overflow_connections)
      : max_connections_(max_connections), max_overflow_(max_overflow_connections) {}

  // Admits a newly accepted connection and, unless refused, registers it under
  // a fresh id. When every slot is taken and some holder is idle, the longest
  // idle one loses its slot (it stays registered, slotless and unlisted, until
  // remove()) and its id comes back in `evicted`.
  AdmitResult admit();
  // Lists `id` as idle (an eviction candidate) or unlists it. Only a slot
  // holder is listed; listing a listed one keeps its place. Unknown ids are
  // ignored.
  void set_idle(uint64_t id, bool idle);
  // Forgets a closed connection, freeing its slot. Unknown ids are ignored.
  void remove(uint64_t id);

  size_t open() const { return conns_.size(); }  // registered connections
  size_t slots_used() const { return slots_used_; }
  size_t idle() const { return idle_.size(); }     // listed slot holders
  bool holds_slot(uint64_t id) const;

 private:
  struct Entry {
    bool slot = false;      // holds one of the max_connections slots
    uint64_t idle_seq = 0;  // its key in idle_ while listed there, else 0
  };

  const size_t max_connections_;
  const size_t max_overflow_;
  std::unordered_map<uint64_t, Entry> conns_;
  uint64_t next_id_ = 0;
  size_t slots_used_ = 0;  // entries with slot
  // Listed slot holders, longest idle first (idle_seq -> connection id).
  std::map<uint64_t, uint64_t> idle_;
  uint64_t next_idle_seq_ = 1;
};

}  // namespace pd::router
