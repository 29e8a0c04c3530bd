#include "decode_node/handoff_intake.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "util/lifecycle.h"

namespace pd {
namespace {

SeqId seq_id(proto::RequestId id) { return SeqId{static_cast<int64_t>(id)}; }

std::vector<int32_t> block_ids(const KvBlockManager& blocks, proto::RequestId id) {
  std::vector<int32_t> table;
  for (BlockId b : blocks.block_table(seq_id(id))) table.push_back(b.value);
  return table;
}

}  // namespace

const char* state_name(HandoffIntake::State s) {
  using S = HandoffIntake::State;
  switch (s) {
    case S::kOffered: return "offered";
    case S::kReceiving: return "receiving";
    case S::kCancelling: return "cancelling";
  }
  return "?";
}

bool legal(HandoffIntake::State from, HandoffIntake::State to) {
  using S = HandoffIntake::State;
  switch (from) {
    case S::kOffered: return to == S::kReceiving;
    case S::kReceiving: return to == S::kCancelling;  // or landed (erased)
    case S::kCancelling: return false;                // only ended (erased) from here
  }
  return false;
}

HandoffIntake::Handoff* HandoffIntake::find(proto::RequestId id) {
  auto it = handoffs_.find(id);
  return it == handoffs_.end() ? nullptr : &it->second;
}

std::optional<int> HandoffIntake::source_of(proto::RequestId id) const {
  auto it = handoffs_.find(id);
  if (it == handoffs_.end()) return std::nullopt;
  return it->second.source;
}

bool HandoffIntake::on_offer(proto::HandoffOffer m, int source, bool known, uint64_t order) {
  const proto::RequestId id = m.header.request_id;
  auto reject = [&](const std::string& reason, bool cancelled) {
    ctx_.channel->send(source, proto::HandoffReject{id, reason, cancelled, *ctx_.epoch});
    return false;
  };
  if (was_cancelled(id)) return reject("cancelled", true);
  if (known) return reject("duplicate request id " + std::to_string(id), false);
  if (Status st = proto::check_compatible(*ctx_.header, m.header); !st.is_ok()) {
    spdlog::error("decode rank {}: offer from rank {}: {}", ctx_.self, source, st.message());
    return reject(st.message(), false);
  }
  if (m.header.n_tokens != static_cast<int32_t>(m.prompt.size()) || m.prompt.empty())
    return reject("offer header says " + std::to_string(m.header.n_tokens) + " tokens, prompt has " +
                      std::to_string(m.prompt.size()),
                  false);
  if (Status st = m.sampling.validate(); !st.is_ok()) return reject(st.message(), false);
  // Compiled in the background while the prompt runs on the prefill rank
  // (cached after the first); the landing makes a matcher from it.
  ctx_.engine->grammars->compile_in_background(m.sampling.grammar);
  const KvBlockManager& blocks = *ctx_.engine->blocks;
  const int64_t bs = blocks.block_size();
  const int64_t need = (static_cast<int64_t>(m.prompt.size()) + m.sampling.max_tokens + bs - 1) / bs;
  if (need > blocks.num_blocks())
    return reject("request needs " + std::to_string(need) + " KV blocks at its longest; this decode rank has " +
                      std::to_string(blocks.num_blocks()) + " (raise kv.decode_budget_mb)",
                  false);
  Handoff& h = handoffs_[id];
  h.id = id;
  h.source = source;
  h.path = choose_kv_path(m.endpoint, *ctx_.endpoint);
  const int64_t n_prompt = static_cast<int64_t>(m.prompt.size());
  h.prompt = std::move(m.prompt);
  h.params = m.sampling;
  h.arrived = ctx_.channel->arrival().value_or(now());  // taken off the network by the communication side
  h.order = order;
  h.receiver = HandoffReceiver(source, ctx_.header->n_layers, kv_segments((n_prompt + bs - 1) / bs));
  offers_.push_back(id);
  return true;
}

void HandoffIntake::on_cancel(proto::RequestId id, bool from_prefill) {
  Handoff* found = find(id);
  if (found == nullptr) {
    // The router's cancel can overtake the prefill rank's offer: remember it.
    if (!from_prefill) cancelled_[id] = now();
    return;
  }
  Handoff& h = *found;
  switch (h.state) {
    case State::kOffered:
      if (!from_prefill) ctx_.channel->send(h.source, proto::HandoffReject{id, "cancelled", true, *ctx_.epoch});
      return erase(h);
    case State::kReceiving:
      // An aborting prefill rank will never send: cancel the receives now. A
      // router cancel waits for the prefill rank's abort or its data (a
      // receive cancelled under a live sender costs the tag a reclaim).
      if (from_prefill) return cancel_receives(h);
      transition(h.state, State::kCancelling, h.id, "decode");
      return;
    case State::kCancelling:
      if (from_prefill) h.receiver.cancel(*ctx_.transport);
      return;
  }
}

bool HandoffIntake::accept_offers(int64_t reserved) {
  bool any = false;
  KvBlockManager& blocks = *ctx_.engine->blocks;
  while (!offers_.empty()) {
    Handoff* offered = find(offers_.front());
    if (offered == nullptr || offered->state != State::kOffered) {  // ended while it waited
      offers_.pop_front();
      continue;
    }
    Handoff& h = *offered;
    // The whole prompt's KV arrives into fresh blocks, registered for reuse once it has.
    const AllocateOptions received{.reuse = false, .publish = false};
    const int64_t need = blocks.blocks_needed_for_prompt(h.prompt, received);
    if (need + reserved > blocks.num_free_blocks()) break;
    KvTagPool& pool = tags_of(h.source);
    std::optional<int> tag = pool.acquire();
    // A tag comes back when a handoff under one ends or a reclaim takes its
    // seal: wait for it (in order, as for blocks; the offer's deadline holds).
    if (!tag && pool.held() + pool.reclaiming() > 0) break;
    if (!tag) {  // every tag of this peer retired: refuse this handoff
      ctx_.channel->send(h.source, proto::HandoffReject{h.id, "decode rank has no free KV transfer tag for this prefill rank",
                                                        false, *ctx_.epoch});
      offers_.pop_front();
      erase(h);
      continue;
    }
    if (!blocks.allocate(seq_id(h.id), h.prompt, received).is_ok()) {
      pool.release(*tag);  // nothing was posted under it
      break;
    }
    h.kv.allocated(h.id);
    offers_.pop_front();
    h.tag = *tag;
    const std::vector<int32_t> table = block_ids(blocks, h.id);
    h.accepted = now();
    Status st = ctx_.transport->select_path(h.source, h.path);
    const Engine& engine = *ctx_.engine;
    if (st.is_ok())
      st = h.receiver.post(*ctx_.transport, h.tag, [&](int l, int segment) {
        return kv_layer_region(engine.cache.buffer->data(), engine.cache.layout, l, kv_segment(table, segment));
      }, h.accepted);
    else
      h.receiver.mark_foreign();  // nothing was posted; the tag ends as a failed handoff's (end_tag)
    transition(h.state, State::kReceiving, h.id, "decode");
    if (!st.is_ok()) {
      ctx_.channel->send(h.source, proto::HandoffReject{h.id, "decode rank could not post receives: " + st.message(),
                                                        false, *ctx_.epoch});
      cancel_receives(h);
      continue;
    }
    ctx_.channel->send(h.source, proto::HandoffAccept{h.id, h.tag, *ctx_.epoch, *ctx_.endpoint});
    any = true;
  }
  return any;
}

bool HandoffIntake::progress(std::vector<Landed>& landed) {
  bool any = false;
  std::vector<proto::RequestId> done;
  const TimePoint t = now();
  for (auto& [id, h] : handoffs_) {
    if (h.receiver.all_ended()) continue;
    const size_t before = h.receiver.pending();
    h.receiver.poll(*ctx_.transport, t);
    any |= h.receiver.pending() != before;
    if (h.receiver.all_ended()) done.push_back(id);
  }
  for (proto::RequestId id : done) {
    Handoff* found = find(id);
    if (found == nullptr) continue;
    Handoff& h = *found;
    if (h.state == State::kCancelling) erase(h);
    else if (h.state == State::kReceiving && !h.receiver.clean())
      fail(h, "KV transfer from prefill rank " + std::to_string(h.source) + " failed", proto::FailureKind::kTransfer);
    else if (h.state == State::kReceiving) finish_transfer(h, landed);
  }
  // The reclaims: true when a tag came back (or was retired).
  const auto limit = std::chrono::milliseconds(ctx_.timeouts.transfer_ms);
  for (auto& [rank, pool] : tags_) any |= pool.poll(*ctx_.transport, now(), limit);
  return any;
}

void HandoffIntake::finish_transfer(Handoff& h, std::vector<Landed>& landed) {
  const TimePoint received = now();
  auto trailer = h.receiver.trailer();
  if (!trailer.is_ok()) return fail(h, trailer.status().message(), proto::FailureKind::kTransfer);
  const proto::Epoch sender_epoch = ctx_.peers->epoch(h.source);
  if (trailer->request_id != h.id || trailer->epoch != sender_epoch) {
    // Another handoff's data under this tag: this one's own sends may still be
    // pending (fail() retires the tag). Never decoded.
    h.receiver.mark_foreign();
    return fail(h, "KV transfer from prefill rank " + std::to_string(h.source) + " carried request " +
                       std::to_string(trailer->request_id) + " (epoch " + std::to_string(trailer->epoch) +
                       "), expected " + std::to_string(h.id) + " (epoch " + std::to_string(sender_epoch) +
                       "): a stale transfer, dropped",
                proto::FailureKind::kTransfer);
  }
  const Engine& engine = *ctx_.engine;
  const std::vector<int32_t> table = block_ids(*engine.blocks, h.id);
  for (int l = 0; l < ctx_.header->n_layers; ++l) {
    if (trailer->checksums[l] == 0) continue;  // the sender does not checksum
    const Result<uint64_t> got = kv_region_checksum(
        *engine.backend, *engine.cache.buffer, kv_layer_region(engine.cache.buffer->data(), engine.cache.layout, l, table));
    if (!got.is_ok())
      return fail(h, "KV checksum of layer " + std::to_string(l) + " failed: " + got.status().message(),
                  proto::FailureKind::kTransfer);
    if (*got != trailer->checksums[l])
      return fail(h, "KV checksum mismatch at layer " + std::to_string(l) + " (transfer from prefill rank " +
                         std::to_string(h.source) + " corrupted)",
                  proto::FailureKind::kTransfer);
  }
  // Every message under the tag arrived: the peer has no send pending on it.
  end_tag(h);
  h.kv.written(*engine.blocks, h.id, ctx_.self);
  if (trailer->finished) return erase(h);  // ended at its first token; the prefill rank told the router
  const proto::RequestId id = h.id;
  landed.push_back(
      Landed{id, h.source, std::move(h.prompt), std::move(h.params), trailer->first_token, h.order, received, h.kv});
  handoffs_.erase(id);  // its blocks are the worker's now (Landed::kv)
}

// Sent from the engine loop's work (not as a handoff ends), so a rank that
// ends its handoffs while it rejoins asks under its new epoch, which the
// prefill rank acts on.
bool HandoffIntake::seal_tags() {
  bool asked = false;
  for (auto& [rank, pool] : tags_) {
    if (ctx_.peers->is_down(rank)) continue;  // on_peer_down retired them
    for (const KvTagPool::Unsealed& u : pool.unsealed()) {
      Result<TransferOp> op = ctx_.transport->post_reclaim(rank, u.tag);
      if (!op.is_ok()) {
        spdlog::warn("decode rank {}: KV tag {} of prefill rank {}: {}; retired", ctx_.self, u.tag, rank,
                     op.status().to_string());
        pool.retire(u.tag, *ctx_.transport);
        continue;
      }
      pool.sealing(u.tag, *op);
      ctx_.channel->send(rank, proto::KvTagSeal{u.id, u.tag, *ctx_.epoch});
      asked = true;
    }
  }
  return asked;
}

std::set<int> HandoffIntake::down_senders() const {
  std::set<int> ranks;
  for (const auto& [id, h] : handoffs_)
    if (h.state == State::kCancelling && !h.receiver.all_ended() && ctx_.peers->is_down(h.source)) ranks.insert(h.source);
  return ranks;
}

void HandoffIntake::check_deadlines(const std::set<int>& gone_senders) {
  const TimePoint t = now();
  const auto handoff = std::chrono::milliseconds(ctx_.timeouts.handoff_ms);
  const auto transfer = std::chrono::milliseconds(ctx_.timeouts.transfer_ms);
  std::vector<proto::RequestId> expired_offers;
  for (proto::RequestId id : offers_) {
    const Handoff* h = find(id);
    if (h != nullptr && h->state == State::kOffered && t - h->arrived > handoff) expired_offers.push_back(id);
  }
  for (proto::RequestId id : expired_offers) {
    Handoff& h = handoffs_.at(id);
    ctx_.channel->send(h.source, proto::HandoffReject{h.id, "no KV room on decode rank " + std::to_string(ctx_.self) +
                                                               " within " + std::to_string(ctx_.timeouts.handoff_ms) +
                                                               " ms",
                                                     false, *ctx_.epoch});
    erase(h);
  }
  // The prefill rank enforces timeouts.transfer_ms: it knows whether it is
  // computing the next layers or stalled, and aborts the handoff (HandoffAbort)
  // when its sends stop moving or its prompt waited prefill_queue_ms in its
  // queue. This side only guards against a prefill rank that went silent: no
  // layer landing for prefill_queue_ms + transfer_ms. Time spent queued or
  // computing between layers is never taken for a stall. (A prefill rank that
  // stops altogether is declared down by the router after heartbeat_ms.)
  const int backstop_ms = ctx_.timeouts.prefill_queue_ms + ctx_.timeouts.transfer_ms;
  const auto backstop = std::chrono::milliseconds(backstop_ms);
  std::vector<proto::RequestId> stalled, gone;
  for (auto& [id, h] : handoffs_) {
    if (h.state == State::kReceiving && t - h.receiver.last_progress() > backstop) {
      stalled.push_back(id);
    } else if (h.state == State::kCancelling && !h.receiver.all_ended()) {
      if (ctx_.peers->is_down(h.source) && gone_senders.count(h.source)) gone.push_back(id);
      else if (t - h.receiver.last_progress() > backstop)
        h.receiver.cancel(*ctx_.transport);  // a cancelled handoff whose data never came
    }
  }
  for (proto::RequestId id : stalled) {  // fail() may erase: not while iterating handoffs_
    Handoff* h = find(id);
    if (h == nullptr) continue;
    fail(*h, "KV transfer from prefill rank " + std::to_string(h->source) + " did not complete: nothing arrived for " +
                 std::to_string(backstop_ms) + " ms (timeouts.prefill_queue_ms + timeouts.transfer_ms)",
         proto::FailureKind::kTimeout);
  }
  for (proto::RequestId id : gone) {
    // The sender's process has ended: nothing can write into these blocks any
    // more (what it sent before dying was consumed by the progress calls since
    // it was declared down). Abandon the receives MPI cannot cancel; free the blocks.
    Handoff* h = find(id);
    if (h == nullptr) continue;
    spdlog::info("decode rank {}: prefill rank {} is gone; releasing request {}'s quarantined blocks", ctx_.self,
                 h->source, id);
    erase(*h);
  }
  const auto keep = std::max(handoff, transfer) * 2;
  for (auto it = cancelled_.begin(); it != cancelled_.end();)
    it = t - it->second > keep ? cancelled_.erase(it) : std::next(it);
}

void HandoffIntake::on_peer_down(int rank) {
  std::vector<proto::RequestId> ids;
  for (auto& [id, h] : handoffs_)
    if (h.source == rank && (h.state == State::kOffered || h.state == State::kReceiving)) ids.push_back(id);
  for (proto::RequestId id : ids)
    if (Handoff* h = find(id))
      fail(*h, "prefill rank " + std::to_string(rank) + " went down before the KV handoff completed",
           proto::FailureKind::kPeerDown);
  if (!ids.empty())
    spdlog::warn("decode rank {}: prefill rank {} is down; ended {} handoffs from it", ctx_.self, rank, ids.size());
  // Sequences whose KV arrived do not need it: they keep running. Tags being
  // reclaimed: a stopped sender may resume and send under them.
  if (auto it = tags_.find(rank); it != tags_.end()) it->second.retire_unsealed(*ctx_.transport);
}

void HandoffIntake::forget_peer(int rank) {
  // Left: it went down first (on_peer_down retired its tags being reclaimed).
  // Its whole pool goes: a rank id is never given to another rank.
  if (auto it = tags_.find(rank); it != tags_.end()) {
    it->second.retire_unsealed(*ctx_.transport);
    tags_.erase(it);
  }
}

void HandoffIntake::drop_all() {
  std::vector<proto::RequestId> ids;
  for (auto& [id, h] : handoffs_) ids.push_back(id);
  for (proto::RequestId id : ids) {
    Handoff* h = find(id);
    if (h == nullptr || h->state == State::kCancelling) continue;
    if (h->state == State::kReceiving) cancel_receives(*h);  // posted receives end (or are quarantined) as usual
    else erase(*h);
  }
  offers_.clear();
}

void HandoffIntake::before_exit() {
  for (auto& [id, h] : handoffs_) h.receiver.cancel(*ctx_.transport);
  for (auto& [rank, pool] : tags_) pool.cancel_reclaims(*ctx_.transport);
}

void HandoffIntake::fill_load(proto::LoadReport& r) const {
  r.waiting += static_cast<int32_t>(offers_.size());
  for (const auto& [rank, pool] : tags_) {
    r.kv_tags_retired += static_cast<int64_t>(pool.retired());
    r.kv_tags_reclaiming += static_cast<int64_t>(pool.reclaiming());
  }
  if (ctx_.peers->any_down())  // runs every iteration: walk the handoffs only when a quarantine can exist
    for (const auto& [id, h] : handoffs_)
      if (h.state == State::kCancelling && ctx_.peers->is_down(h.source) && h.kv.held())
        r.quarantined_blocks += static_cast<int64_t>(ctx_.engine->blocks->block_table(seq_id(id)).size());
}

void HandoffIntake::fail(Handoff& h, const std::string& reason, proto::FailureKind kind) {
  spdlog::warn("decode rank {}: request {} failed: {}", ctx_.self, h.id, reason);
  ctx_.channel->send(ctx_.router, proto::RequestFailed{h.id, reason, kind});
  std::erase(offers_, h.id);
  if (h.state == State::kReceiving) return cancel_receives(h);  // receives posted: blocks freed when they end
  if (h.state == State::kCancelling) return;
  erase(h);
}

void HandoffIntake::cancel_receives(Handoff& h) {
  h.receiver.cancel(*ctx_.transport);
  if (h.receiver.all_ended()) return erase(h);
  transition(h.state, State::kCancelling, h.id, "decode");
}

void HandoffIntake::end_tag(Handoff& h) {
  KvTagPool& pool = tags_of(h.source);
  // Every receive under the tag completed: each of the peer's sends under it
  // matched one and completed too. Otherwise one of its sends may still be
  // pending under the tag (MPI cannot cancel a send): reclaim the tag while
  // the peer is up — its seal orders everything it sent there on the mpi
  // path; a device path's KV travels apart from the tag, and a down peer
  // may resume (the receives were abandoned only if its process is gone).
  if (h.receiver.all_ended() && h.receiver.clean()) pool.release(h.tag);
  else if (h.receiver.all_ended() && h.path.path == KvPath::kMpi && !ctx_.peers->is_down(h.source))
    pool.reclaim(h.tag, h.id, now());
  else pool.retire(h.tag, *ctx_.transport);
  h.tag = 0;
}

void HandoffIntake::erase(Handoff& h) {
  if (h.tag != 0) end_tag(h);
  h.receiver.abandon(*ctx_.transport);  // only a confirmed-dead sender's leave any here
  h.kv.release(*ctx_.engine->blocks, h.id, ctx_.self);
  const proto::RequestId id = h.id;
  std::erase(offers_, id);
  handoffs_.erase(id);
}

}  // namespace pd
