// One KV handoff on the sending (prefill) side: one sequence's KV, segment by
// segment and in each layer by layer (kv_region.h: one message per (segment,
// layer)), to the decode rank that accepted it, then the trailer (first token,
// a checksum per layer over the whole sequence) under the same tag.
//
//   HandoffSender h(decode_rank, id, epoch, n_layers, n_segments);  // offered
//   h.accept(tag);                                         // the decode rank's HandoffAccept
//   h.segments_done(k); h.post_written(t, ...);            // after a chunk's pass: segments [0, k) complete
//   h.layer_written(l, checksum); h.post_written(t, ...);  // from the last pass's layer hook, as layers land
//   h.finish(first_token, finished, t, ...);               // the pass ended: the rest, then the trailer
//   while (h.poll(t, now) == Phase::kSending) ...          // the engine loop
//   h.abandon(t);                                          // an ended handoff (any phase)
//
// Phases (phase(), poll(); every change checked, util/lifecycle.h):
//   kOffered   -> kAccepted  (accept(): written layers go out as they land)
//   kOffered   -> kHeld      (finish() first: every layer written, the first
//                             token known; it all waits for the accept)
//   kAccepted  -> kFinishing (finish(): the rest and the trailer to post)
//   kHeld      -> kFinishing (accept())
//   kFinishing -> kSending   (the trailer posted; sends in flight)
//   kSending   -> kSent      (every send completed: the blocks may be reused)
//   any but kSent -> kFailed (a post or a send failed, or abandon(): error() says why)
// The worker owns the request's lifecycle, its blocks and its deadlines; this
// object owns the transfer: the tag, the order of sends, the trailer bytes
// (alive until MPI no longer reads them), the checksums, what was sent behind
// compute, and abandonment.
//
// Threading: the worker's engine loop (a compute thread) calls everything; the
// transport is the communication side's end (kvtransfer/comm_side.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "kvtransfer/kv_region.h"
#include "kvtransfer/transport.h"

namespace pd {

class HandoffSender {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  enum class Phase { kOffered, kHeld, kAccepted, kFinishing, kSending, kSent, kFailed };
  friend const char* state_name(Phase p);
  friend bool legal(Phase from, Phase to);
  // The region of one layer of one segment of this sequence's KV in the sender's cache.
  using RegionOf = std::function<KvRegion(int layer, int segment)>;

  HandoffSender() = default;
  HandoffSender(int peer, uint64_t request_id, uint32_t epoch, int n_layers, int n_segments = 1);

  int peer() const { return peer_; }
  Phase phase() const { return phase_; }
  const std::string& error() const { return error_; }
  // Whether the decode rank accepted (it gave a tag), in any phase, kFailed included.
  bool accepted() const { return tag_ != 0; }
  // The trailer went to the transport (the handoff's last post).
  bool finished() const { return !trailer_.empty(); }
  int tag() const { return tag_; }

  // The decode rank accepted under `tag` (nonzero: a KV tag). Duplicates are
  // ignored (false).
  bool accept(int tag);
  // Layer `layer`'s KV of the whole sequence is in the cache (its last chunk
  // wrote it) with this checksum (0 when off).
  void layer_written(int layer, uint64_t checksum);
  // Segments [0, k) are in the cache in every layer (earlier chunks wrote them).
  void segments_done(int k);
  // Posts, in order, every message not posted yet whose KV is written (needs accepted()).
  void post_written(Transport& t, const RegionOf& region_of, TimePoint now);
  // Every layer is written and the first token known: posts the rest and the
  // trailer (needs accepted(); else they go when accept() and then finish()
  // are called again), then expedites them (Transport::expedite: a decode
  // waits on them now). Called once per handoff.
  void finish(int32_t first_token, bool finished_at_first, Transport& t, const RegionOf& region_of, TimePoint now);
  // Tests the sends in flight; returns the phase.
  Phase poll(Transport& t, TimePoint now);
  // A failure outside the transport (a checksum, a path): the handoff fails,
  // nothing more goes out.
  void fail(const std::string& why);
  // Ends the handoff: sends in flight are abandoned, last first (MPI cannot
  // cancel a send; the decode rank discards what arrives of an ended handoff
  // and gives the tag out again only after the worker sealed it:
  // decode_node/kv_tags.h), so the blocks may be reused at once. The trailer
  // bytes, which MPI may still read, move to `graveyard` (bounded).
  void abandon(Transport& t, std::deque<std::vector<uint8_t>>& graveyard);

  // Figures for TransferStats.
  int64_t bytes_posted() const { return bytes_posted_; }
  int64_t bytes_sent() const { return bytes_sent_; }
  // The time of the last post or completion (the transfer deadline counts from it).
  TimePoint last_progress() const { return last_progress_; }
  TimePoint send_started() const { return send_started_; }
  size_t in_flight() const { return ops_.size(); }

 private:
  void post(Transport& t, int message, const RegionOf& region_of, TimePoint now);  // message -1 = the trailer
  bool written(int message) const;
  void set_phase(Phase to);
  int peer_ = -1;
  int n_layers_ = 0;
  int n_segments_ = 1;
  Phase phase_ = Phase::kOffered;
  std::string error_;
  int tag_ = 0;                      // 0 until accept()
  int layers_written_ = 0;           // layers [0, layers_written_) of every segment are in the cache
  int segments_done_ = 0;            // segments [0, segments_done_) of every layer are in the cache
  int posted_ = 0;                   // messages [0, posted_) went to the transport (message = segment * layers + layer)
  KvTrailer trailer_fields_;         // request, epoch, first token and checksums (per layer), for the trailer
  std::vector<uint8_t> trailer_;     // the trailer as posted (empty until then): alive while MPI may read it
  struct SendOp {
    TransferOp op;
    int64_t bytes;
  };
  std::vector<SendOp> ops_;
  int64_t bytes_posted_ = 0, bytes_sent_ = 0;
  TimePoint send_started_{}, last_progress_{};
};

}  // namespace pd
