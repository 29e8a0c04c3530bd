// What a worker knows of the other workers' incarnations (messages.h,
// "Epochs"): each peer's current epoch and whether the router has declared it
// down. Both workers judge every message from another worker by it.
#pragma once

#include <unordered_map>
#include <unordered_set>

#include "protocol/messages.h"

namespace pd {

class PeerEpochs {
 public:
  enum class Verdict {
    kCurrent,  // from the peer's live incarnation
    kStale,    // from an epoch that is over: drop it
    kDown,     // the peer is down (not re-admitted yet): drop it
    kNewer,    // the peer was re-admitted before the PeerDown/PeerUp reached us:
               // end the work of its old incarnation, then up(rank, epoch)
  };
  Verdict check(int rank, proto::Epoch epoch) const;
  // PeerDown: false when `epoch` is already over (nothing to do).
  bool down(int rank, proto::Epoch epoch);
  // PeerUp: false when `epoch` is older than the one known.
  bool up(int rank, proto::Epoch epoch);
  // PeerLeft: the rank is gone for good.
  void forget(int rank) {
    epoch_.erase(rank);
    down_.erase(rank);
  }
  bool is_down(int rank) const { return down_.count(rank) > 0; }
  bool any_down() const { return !down_.empty(); }
  proto::Epoch epoch(int rank) const;

 private:
  std::unordered_map<int, proto::Epoch> epoch_;
  std::unordered_set<int> down_;
};

}  // namespace pd
