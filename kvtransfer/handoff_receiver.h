// One KV handoff on the receiving (decode) side: a receive per (segment,
// layer) straight into the sequence's blocks, in the order the sender sends
// them (kv_region.h), then the trailer, all under the tag this rank gave the
// sender.
//
//   HandoffReceiver h(prefill_rank, n_layers, n_segments);
//   h.post(t, tag, region_of, now);          // with the HandoffAccept
//   h.poll(t, now) ...                       // the engine loop, until all_ended()
//   h.clean() ? h.trailer() : ...            // landed: verify; else failed
//   h.cancel(t)                              // ended early: cancel what is unmatched, keep polling
//   h.abandon(t)                             // the sender is confirmed gone: forget the rest
//
// Phases (poll()):
//   kIdle      -> kReceiving (post)
//   kReceiving -> kLanded    (every receive completed: the trailer is here)
//   kReceiving -> kBroken    (every receive ended, some did not complete: cancelled or failed)
// When may the blocks be reused? Only once all_ended(): a receive already
// matched to a send cannot be cancelled (OpenMPI's ob1), so cancel() asks and
// poll() reports when MPI is done with the memory — or abandon(), when the
// sender's process is confirmed gone and nothing can write any more. Whether
// the tag may be used again is clean(): every receive under it completed, so
// every send the peer made under it matched one of them.
//
// Threading: the worker's engine loop (a compute thread) calls everything; the
// transport is the communication side's end (kvtransfer/comm_side.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "kvtransfer/kv_region.h"
#include "kvtransfer/transport.h"

namespace pd {

class HandoffReceiver {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  enum class Phase { kIdle, kReceiving, kLanded, kBroken };
  using RegionOf = std::function<KvRegion(int layer, int segment)>;

  HandoffReceiver() = default;
  HandoffReceiver(int peer, int n_layers, int n_segments = 1);

  Phase phase() const { return phase_; }
  // Nothing of this handoff is pending in the transport (posted ones all ended).
  bool all_ended() const { return ops_.empty(); }
  size_t pending() const { return ops_.size(); }
  // Every receive that ended so far completed (none cancelled, failed or foreign).
  bool clean() const { return clean_; }
  // The last post or completion (the silent-sender deadline counts from it).
  TimePoint last_progress() const { return last_progress_; }

  // Posts a receive per (segment, layer), then one for the trailer, under `tag`. On an
  // error the receives posted so far stay posted (cancel() them) and the
  // handoff is not clean.
  Status post(Transport& t, int tag, const RegionOf& region_of, TimePoint now);
  // Tests the receives still pending; returns the phase.
  Phase poll(Transport& t, TimePoint now);
  // Asks the transport to cancel every pending receive; they still end
  // through poll() (a matched one completes).
  void cancel(Transport& t);
  // Forgets every pending receive (their sender is confirmed gone). Not clean.
  void abandon(Transport& t);
  // What landed was not this handoff's (a stale transfer under the tag): its
  // own sends may still be pending, so the tag must not be reused.
  void mark_foreign() { clean_ = false; }
  // The trailer as received (after kLanded); Corruption if malformed.
  Result<KvTrailer> trailer() const { return KvTrailer::deserialize(trailer_, n_layers_); }

 private:
  int peer_ = -1;
  int n_layers_ = 0;
  int n_segments_ = 1;
  Phase phase_ = Phase::kIdle;
  bool clean_ = true;
  std::vector<TransferOp> ops_;
  std::vector<uint8_t> trailer_;
  TimePoint last_progress_{};
};

}  // namespace pd
