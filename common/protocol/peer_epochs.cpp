#include "protocol/peer_epochs.h"

namespace pd {

proto::Epoch PeerEpochs::epoch(int rank) const {
  auto it = epoch_.find(rank);
  return it == epoch_.end() ? 0 : it->second;
}

PeerEpochs::Verdict PeerEpochs::check(int rank, proto::Epoch e) const {
  const proto::Epoch known = epoch(rank);
  if (e < known) return Verdict::kStale;
  if (e > known) return Verdict::kNewer;  // only the router hands out epochs
  return is_down(rank) ? Verdict::kDown : Verdict::kCurrent;
}

bool PeerEpochs::down(int rank, proto::Epoch e) {
  if (e < epoch(rank)) return false;
  down_.insert(rank);
  return true;
}

bool PeerEpochs::up(int rank, proto::Epoch e) {
  if (e < epoch(rank)) return false;
  epoch_[rank] = e;
  down_.erase(rank);
  return true;
}

}  // namespace pd
