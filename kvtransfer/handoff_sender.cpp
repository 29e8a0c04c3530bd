#include "kvtransfer/handoff_sender.h"

#include <algorithm>
#include <utility>

#include "util/lifecycle.h"

namespace pd {

const char* state_name(HandoffSender::Phase p) {
  using P = HandoffSender::Phase;
  switch (p) {
    case P::kOffered: return "offered";
    case P::kHeld: return "held";
    case P::kAccepted: return "accepted";
    case P::kFinishing: return "finishing";
    case P::kSending: return "sending";
    case P::kSent: return "sent";
    case P::kFailed: return "failed";
  }
  return "?";
}

bool legal(HandoffSender::Phase from, HandoffSender::Phase to) {
  using P = HandoffSender::Phase;
  switch (from) {
    case P::kOffered: return to == P::kAccepted || to == P::kHeld || to == P::kFailed;
    case P::kHeld:
    case P::kAccepted: return to == P::kFinishing || to == P::kFailed;
    case P::kFinishing: return to == P::kSending || to == P::kFailed;
    case P::kSending: return to == P::kSent || to == P::kFailed;
    case P::kSent:
    case P::kFailed: return false;
  }
  return false;
}

HandoffSender::HandoffSender(int peer, uint64_t request_id, uint32_t epoch, int n_layers, int n_segments)
    : peer_(peer), n_layers_(n_layers), n_segments_(std::max(1, n_segments)) {
  trailer_fields_.request_id = request_id;
  trailer_fields_.epoch = epoch;
  trailer_fields_.checksums.assign(static_cast<size_t>(n_layers), 0);
}

void HandoffSender::set_phase(Phase to) { transition(phase_, to, trailer_fields_.request_id, "handoff sender"); }

bool HandoffSender::accept(int tag) {
  if (accepted()) return false;
  tag_ = tag;
  // A failed handoff keeps its tag (the worker seals and answers by it) but stays failed.
  if (phase_ == Phase::kOffered) set_phase(Phase::kAccepted);
  else if (phase_ == Phase::kHeld) set_phase(Phase::kFinishing);
  return true;
}

void HandoffSender::layer_written(int layer, uint64_t checksum) {
  if (layer < 0 || layer >= n_layers_) return;
  trailer_fields_.checksums[static_cast<size_t>(layer)] = checksum;
  if (layer + 1 > layers_written_) layers_written_ = layer + 1;
}

void HandoffSender::segments_done(int k) { segments_done_ = std::max(segments_done_, std::min(k, n_segments_)); }

bool HandoffSender::written(int message) const {
  return message / n_layers_ < segments_done_ || message % n_layers_ < layers_written_;
}

void HandoffSender::post_written(Transport& t, const RegionOf& region_of, TimePoint now) {
  if (phase_ != Phase::kAccepted && phase_ != Phase::kFinishing) return;
  const int messages = n_segments_ * n_layers_;
  while (posted_ < messages && written(posted_) && phase_ != Phase::kFailed) post(t, posted_, region_of, now);
  if (phase_ == Phase::kFinishing && posted_ == messages) {
    trailer_ = trailer_fields_.serialize();
    post(t, -1, region_of, now);
    // Token 1 is out and the decode rank starts once these land: ahead of
    // segments of prompts still computing (kvtransfer/send_order.h).
    if (phase_ == Phase::kSending) t.expedite(ops_.back().op);
  }
}

void HandoffSender::finish(int32_t first_token, bool finished_at_first, Transport& t, const RegionOf& region_of,
                           TimePoint now) {
  trailer_fields_.first_token = first_token;
  trailer_fields_.finished = finished_at_first ? 1 : 0;
  layers_written_ = n_layers_;
  segments_done_ = n_segments_;
  if (phase_ == Phase::kOffered) set_phase(Phase::kHeld);
  else if (phase_ == Phase::kAccepted) set_phase(Phase::kFinishing);
  post_written(t, region_of, now);
}

void HandoffSender::post(Transport& t, int message, const RegionOf& region_of, TimePoint now) {
  int64_t bytes = 0;
  const int layer = message;  // < 0: the trailer
  Result<TransferOp> op = [&]() -> Result<TransferOp> {
    if (message < 0) {
      bytes = static_cast<int64_t>(trailer_.size());
      return t.post_send_bytes(peer_, tag_, trailer_.data(), trailer_.size());
    }
    const KvRegion region = region_of(message % n_layers_, message / n_layers_);
    bytes = region.total_bytes();
    return t.post_send(peer_, tag_, region);
  }();
  if (!op.is_ok()) {
    if (layer < 0) trailer_.clear();  // never posted: nothing reads it
    fail(std::string(layer >= 0 ? "KV send failed: " : "KV trailer send failed: ") + op.status().message());
    return;
  }
  if (ops_.empty() && bytes_posted_ == 0) send_started_ = now;
  if (layer < 0) set_phase(Phase::kSending);
  else {
    ++posted_;
    bytes_posted_ += bytes;
  }
  ops_.push_back({*op, bytes});
  last_progress_ = now;
}

HandoffSender::Phase HandoffSender::poll(Transport& t, TimePoint now) {
  for (auto it = ops_.begin(); it != ops_.end();) {
    Result<OpState> r = t.test(it->op);
    if (r.is_ok() && *r == OpState::kPending) {
      ++it;
      continue;
    }
    if (r.is_ok() && *r == OpState::kDone) bytes_sent_ += it->bytes;
    else if (!r.is_ok()) fail("KV send failed: " + r.status().message());
    else fail("KV send was cancelled");
    it = ops_.erase(it);
    last_progress_ = now;
  }
  if (phase_ == Phase::kSending && ops_.empty()) set_phase(Phase::kSent);
  return phase_;
}

void HandoffSender::fail(const std::string& why) {
  if (phase_ == Phase::kFailed || phase_ == Phase::kSent) return;
  set_phase(Phase::kFailed);
  error_ = why;
}

void HandoffSender::abandon(Transport& t, std::deque<std::vector<uint8_t>>& graveyard) {
  // Last first: a send still waiting for the send budget (send_budget.h) is
  // dropped before an earlier one in flight gives its budget back, which
  // would post it — bytes for a handoff that is over.
  for (auto it = ops_.rbegin(); it != ops_.rend(); ++it) t.abandon(it->op);
  const bool had_ops = !ops_.empty();
  ops_.clear();
  if (had_ops && !trailer_.empty()) {  // the trailer was posted and MPI may still read it
    graveyard.push_back(std::move(trailer_));
    if (graveyard.size() > 4096) graveyard.pop_front();  // long done or never coming: bounded
  }
  if (phase_ != Phase::kSent) fail("abandoned");
}

}  // namespace pd
