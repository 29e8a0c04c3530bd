// An in-process Transport for tests: a LoopbackNetwork shared by several
// ranks, each with its own Transport endpoint. Operations match as MPI
// matches them: a send from A to B under tag T meets the oldest unmatched
// receive B posted from A under T (FIFO per (source, dest, tag)); once both
// are posted the bytes are copied region to region and both ops complete
// (test() then reports kDone once). cancel() completes an unmatched op as
// kCancelled; a matched one has already completed. A receive smaller than
// its send is an error, reported by the receive's test().
//
// hang_sends(true): sends posted from then on never match and never complete
// until cancelled (a stuck link, for deadline tests).
//
// Threading: one thread (the test's) uses the network and its endpoints.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <unordered_map>

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
  // Bytes copied from senders to receivers so far.
  int64_t bytes_moved() const;

  struct State;  // shared with the endpoints

 private:
  std::shared_ptr<State> state_;
};

}  // namespace pd::test
