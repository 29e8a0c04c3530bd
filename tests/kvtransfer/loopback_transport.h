// An in-process Transport for tests: a LoopbackNetwork shared by several
// ranks, each with its own Transport endpoint. Operations match as MPI
// matches them: a send from A to B under tag T meets the oldest unmatched
// receive B posted from A under T (FIFO per (source, dest, tag)); once both
// are posted the bytes are copied region to region and both ops complete
// (test() then reports kDone once). A receive smaller than its send is an
// error, reported by the receive's test().
//
// Cancellation as OpenMPI's ob1 layer does it: cancel() completes an
// unmatched receive as kCancelled; a send, or a receive already matched, is
// not cancelled (it stays pending). A send nobody receives waits, and matches
// the next receive posted under its (source, dest, tag) — a stale send meeting
// a new receive. abandon() forgets an op (never reported again), but an
// abandoned op still matches and still moves bytes, as MPI's would.
// post_reclaim() posts a receive-side reclaim: in its turn among the receives
// of (source, dest, tag) it takes every send (each completes; its bytes go
// nowhere) up to and including the first empty one, then completes kDone;
// cancel() ends it kCancelled between two sends.
//
// Faults: hang_sends(true): sends posted from then on never match (a stuck
// link). freeze(rank): the rank is stopped — a matched pair whose sender is
// frozen does not move its bytes until thaw(rank), which moves them then
// (from the sender's memory as it is at that moment). kill(rank): the rank is
// dead: its matched pairs never complete.
//
// Threading: one thread (the test's) uses the network and its endpoints.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kvtransfer/transport.h"

namespace pd::test {

class LoopbackNetwork {
 public:
  LoopbackNetwork();
  ~LoopbackNetwork();
  LoopbackNetwork(const LoopbackNetwork&) = delete;
  LoopbackNetwork& operator=(const LoopbackNetwork&) = delete;

  // The Transport of `rank`. Endpoints may outlive the network object (they
  // share its state).
  std::unique_ptr<Transport> endpoint(int rank);
  void hang_sends(bool on);
  void freeze(int rank);
  void thaw(int rank);
  void kill(int rank);
  // Bytes copied from senders to receivers so far.
  int64_t bytes_moved() const;
  // Messages (seals included) taken by reclaims (Transport::post_reclaim) so far.
  int64_t messages_reclaimed() const;

  struct State;  // shared with the endpoints

 private:
  std::shared_ptr<State> state_;
};

// A region that is all of `buf`, in one piece.
inline KvRegion whole_region(std::vector<uint8_t>& buf) {
  KvRegion r;
  r.base = buf.data();
  r.piece_bytes = static_cast<int64_t>(buf.size());
  r.offsets = {0};
  return r;
}

}  // namespace pd::test
