#include "kvtransfer/handoff_sender.h"

#include <algorithm>
#include <utility>

namespace pd {

const char* handoff_phase_name(HandoffSender::Phase p) {
  switch (p) {
    case HandoffSender::Phase::kOffered: return "offered";
    case HandoffSender::Phase::kSending: return "sending";
    case HandoffSender::Phase::kSent: return "sent";
    case HandoffSender::Phase::kFailed: return "failed";
  }
  return "?";
}

HandoffSender::HandoffSender(int peer, uint64_t request_id, uint32_t epoch, int n_layers, int n_segments)
    : peer_(peer), request_id_(request_id), epoch_(epoch), n_layers_(n_layers), n_segments_(std::max(1, n_segments)),
      checksums_(static_cast<size_t>(n_layers), 0) {}

bool HandoffSender::accept(int tag) {
  if (accepted_) return false;
  accepted_ = true;
  tag_ = tag;
  return true;
}

void HandoffSender::layer_written(int layer, uint64_t checksum) {
  if (layer < 0 || layer >= n_layers_) return;
  checksums_[static_cast<size_t>(layer)] = checksum;
  if (layer + 1 > layers_written_) layers_written_ = layer + 1;
}

void HandoffSender::segments_done(int k) { segments_done_ = std::max(segments_done_, std::min(k, n_segments_)); }

bool HandoffSender::written(int message) const {
  return message / n_layers_ < segments_done_ || message % n_layers_ < layers_written_;
}

void HandoffSender::post_written(Transport& t, const RegionOf& region_of, TimePoint now) {
  if (!accepted_ || phase_ == Phase::kFailed || phase_ == Phase::kSent) return;
  const int messages = n_segments_ * n_layers_;
  while (posted_ < messages && written(posted_) && phase_ != Phase::kFailed) post(t, posted_, region_of, now);
  if (finish_called_ && !trailer_posted_ && posted_ == messages && phase_ != Phase::kFailed) {
    KvTrailer tr;
    tr.request_id = request_id_;
    tr.epoch = epoch_;
    tr.first_token = first_token_;
    tr.finished = finished_at_first_ ? 1 : 0;
    tr.checksums = checksums_;
    trailer_ = tr.serialize();
    post(t, -1, region_of, now);
    // Token 1 is out and the decode rank starts once these land: ahead of
    // segments of prompts still computing (kvtransfer/send_order.h).
    if (trailer_posted_) t.expedite(ops_.back().op);
  }
}

void HandoffSender::finish(int32_t first_token, bool finished_at_first, Transport& t, const RegionOf& region_of,
                           TimePoint now) {
  finish_called_ = true;
  first_token_ = first_token;
  finished_at_first_ = finished_at_first;
  layers_written_ = n_layers_;
  segments_done_ = n_segments_;
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
    fail(std::string(layer >= 0 ? "KV send failed: " : "KV trailer send failed: ") + op.status().message());
    return;
  }
  if (ops_.empty() && bytes_posted_ == 0) send_started_ = now;
  if (layer < 0) trailer_posted_ = true;
  else {
    ++posted_;
    bytes_posted_ += bytes;
  }
  ops_.push_back({*op, bytes});
  last_progress_ = now;
  phase_ = Phase::kSending;
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
  if (phase_ == Phase::kSending && trailer_posted_ && ops_.empty()) phase_ = Phase::kSent;
  return phase_;
}

void HandoffSender::fail(const std::string& why) {
  if (phase_ == Phase::kFailed) return;
  phase_ = Phase::kFailed;
  error_ = why;
}

void HandoffSender::abandon(Transport& t, std::deque<std::vector<uint8_t>>& graveyard) {
  // Last first: a send still waiting for the send budget (send_budget.h) is
  // dropped before an earlier one in flight gives its budget back, which
  // would post it — bytes for a handoff that is over.
  for (auto it = ops_.rbegin(); it != ops_.rend(); ++it) t.abandon(it->op);
  const bool had_ops = !ops_.empty();
  ops_.clear();
  if (had_ops && trailer_posted_ && !trailer_.empty()) {
    graveyard.push_back(std::move(trailer_));
    if (graveyard.size() > 4096) graveyard.pop_front();  // long done or never coming: bounded
  }
  if (phase_ != Phase::kSent) fail("abandoned");
}

}  // namespace pd
