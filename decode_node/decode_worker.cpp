#include "decode_node/decode_worker.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <thread>

#include "decode_node/scheduler.h"
#include "serving/token_events.h"
#include "util/env.h"
#include "util/lifecycle.h"

namespace pd {
const char* state_name(DecodeWorker::SeqState s) {
  using S = DecodeWorker::SeqState;
  switch (s) {
    case S::kOffered: return "offered";
    case S::kReceiving: return "receiving";
    case S::kReady: return "ready";
    case S::kRunning: return "running";
    case S::kPreempted: return "preempted";
    case S::kPrefilling: return "prefilling";
    case S::kCancelling: return "cancelling";
  }
  return "?";
}

bool legal(DecodeWorker::SeqState from, DecodeWorker::SeqState to) {
  using S = DecodeWorker::SeqState;
  switch (from) {
    case S::kOffered: return to == S::kReceiving;
    case S::kReceiving: return to == S::kReady || to == S::kCancelling;
    case S::kReady: return to == S::kRunning || to == S::kPreempted || to == S::kPrefilling;
    case S::kRunning: return to == S::kPreempted;
    case S::kPreempted: return to == S::kRunning || to == S::kPrefilling;
    case S::kPrefilling: return to == S::kRunning || to == S::kPreempted;
    case S::kCancelling: return false;  // only ended (erased) from here
  }
  return false;
}

void DecodeWorker::set_state(Seq& s, SeqState to) { transition(s.state, to, s.id, "decode"); }

DecodeWorker::DecodeWorker(const ClusterConfig& cfg, const RoleTable& roles, std::shared_ptr<Engine> engine,
                           std::unique_ptr<Transport> transport, std::unique_ptr<ControlChannel> channel)
    : WorkerCore("decode", cfg, roles, std::move(engine), std::move(transport), std::move(channel)) {
  tag_span_ = cfg_.kv.tag_span;
  // Between layers of a long forward pass (a colocated prefill, a recompute):
  // keep sends moving and load reports flowing so /health stays truthful.
  engine_->model->set_kv_written_hook([this](int) {
    channel_->progress();
    report_load(false);
  });
}

bool DecodeWorker::work() {
  bool busy = seal_tags();
  busy |= accept_offers();
  busy |= step();
  return busy;
}

// Shutdown: receives still posted are cancelled (nothing more is coming), and
// so are the reclaims of tags (no handoff will take them again).
void DecodeWorker::before_exit() {
  for (auto& [id, s] : seqs_) s.handoff.cancel(*transport_);
  for (auto& [rank, pool] : tags_) pool.cancel_reclaims(*transport_);
}

void DecodeWorker::forget_peer(int rank) {
  // Left: it went down first (on_peer_down retired its tags being reclaimed).
  // Its whole pool goes: a rank id is never given to another rank.
  if (auto it = tags_.find(rank); it != tags_.end()) {
    it->second.retire_unsealed(*transport_);
    tags_.erase(it);
  }
}

// Sent from the engine loop's work (not as a handoff ends), so a rank that
// ends its handoffs while it rejoins asks under its new epoch, which the
// prefill rank acts on.
bool DecodeWorker::seal_tags() {
  bool asked = false;
  for (auto& [rank, pool] : tags_) {
    if (peers_.is_down(rank)) continue;  // on_peer_down retired them
    for (const KvTagPool::Unsealed& u : pool.unsealed()) {
      Result<TransferOp> op = transport_->post_reclaim(rank, u.tag);
      if (!op.is_ok()) {
        spdlog::warn("decode rank {}: KV tag {} of prefill rank {}: {}; retired", roles_.self, u.tag, rank,
                     op.status().to_string());
        pool.retire(u.tag, *transport_);
        continue;
      }
      pool.sealing(u.tag, *op);
      channel_->send(rank, proto::KvTagSeal{u.id, u.tag, epoch_});
      asked = true;
    }
  }
  return asked;
}

bool DecodeWorker::poll_tags() {
  bool any = false;
  const auto limit = std::chrono::milliseconds(cfg_.timeouts.transfer_ms);
  for (auto& [rank, pool] : tags_) any |= pool.poll(*transport_, env_->now(), limit);
  return any;
}

bool DecodeWorker::on_message(int source, proto::Message& msg) {
  if (auto* m = std::get_if<proto::HandoffOffer>(&msg)) {
    if (current(source, m->epoch)) on_offer(std::move(*m), source);
  } else if (auto* m = std::get_if<proto::PrefillRequest>(&msg)) {
    on_prompt(std::move(*m));
  } else if (auto* m = std::get_if<proto::Cancel>(&msg)) {
    on_cancel(m->id, false, "cancelled");
  } else if (auto* m = std::get_if<proto::HandoffAbort>(&msg)) {
    // Only the handoff's own prefill rank may abort it.
    if (current(source, m->epoch))
      if (const Seq* s = find_seq(m->id); s != nullptr && s->source == source) on_cancel(m->id, true, m->reason);
  } else {
    return false;
  }
  return true;
}

void DecodeWorker::on_drain() {
  spdlog::info("decode rank {}: draining (finishing {} sequences)", roles_.self, seqs_.size());
}

DecodeWorker::Seq* DecodeWorker::find_seq(proto::RequestId id) {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}

void DecodeWorker::on_peer_down(int rank) {
  std::vector<proto::RequestId> ids;
  for (auto& [id, s] : seqs_)
    if (s.source == rank && (s.state == SeqState::kOffered || s.state == SeqState::kReceiving)) ids.push_back(id);
  for (proto::RequestId id : ids)
    if (Seq* s = find_seq(id))
      fail(*s, "prefill rank " + std::to_string(rank) + " went down before the KV handoff completed",
           proto::FailureKind::kPeerDown);
  if (!ids.empty())
    spdlog::warn("decode rank {}: prefill rank {} is down; ended {} handoffs from it", roles_.self, rank, ids.size());
  // Sequences whose KV arrived do not need it: they keep running. Tags being
  // reclaimed: a stopped sender may resume and send under them.
  if (auto it = tags_.find(rank); it != tags_.end()) it->second.retire_unsealed(*transport_);
}

void DecodeWorker::drop_all() {
  std::vector<proto::RequestId> ids;
  for (auto& [id, s] : seqs_) ids.push_back(id);
  for (proto::RequestId id : ids) {
    Seq* s = find_seq(id);
    if (s == nullptr || s->state == SeqState::kCancelling) continue;
    if (s->state == SeqState::kReceiving) cancel_receives(*s);  // posted receives end (or are quarantined) as usual
    else erase(*s);
  }
  offers_.clear();
  running_.clear();
  prefilling_.clear();
  waiting_.clear();
}

void DecodeWorker::cancel_receives(Seq& s) {
  s.handoff.cancel(*transport_);
  if (s.handoff.all_ended()) return erase(s);
  set_state(s, SeqState::kCancelling);
}

void DecodeWorker::end_tag(Seq& s) {
  KvTagPool& pool = tags_of(s.source);
  // Every receive under the tag completed: each of the peer's sends under it
  // matched one and completed too. Otherwise one of its sends may still be
  // pending under the tag (MPI cannot cancel a send): reclaim the tag while
  // the peer is up — its seal orders everything it sent there on the mpi
  // path; a device path's KV travels apart from the tag, and a down peer
  // may resume (the receives were abandoned only if its process is gone).
  if (s.handoff.all_ended() && s.handoff.clean()) pool.release(s.tag);
  else if (s.handoff.all_ended() && s.path.path == KvPath::kMpi && !peers_.is_down(s.source))
    pool.reclaim(s.tag, s.id, env_->now());
  else pool.retire(s.tag, *transport_);
  s.tag = 0;
}

void DecodeWorker::erase(Seq& s) {
  if (s.tag != 0) end_tag(s);
  s.handoff.abandon(*transport_);  // only a confirmed-dead sender's leave any here
  release(s);
  const proto::RequestId id = s.id;
  std::erase(running_, id);
  std::erase(prefilling_, id);
  std::erase(waiting_, id);
  std::erase(offers_, id);
  seqs_.erase(id);
}

void DecodeWorker::remember_cancelled(proto::RequestId id) { cancelled_[id] = env_->now(); }
bool DecodeWorker::was_cancelled(proto::RequestId id) { return cancelled_.erase(id) > 0; }

void DecodeWorker::on_offer(proto::HandoffOffer m, int source) {
  const proto::RequestId id = m.header.request_id;
  auto reject = [&](const std::string& reason, bool cancelled) {
    channel_->send(source, proto::HandoffReject{id, reason, cancelled});
  };
  if (was_cancelled(id)) return reject("cancelled", true);
  if (seqs_.count(id)) return reject("duplicate request id " + std::to_string(id), false);
  if (Status st = proto::check_compatible(header_, m.header); !st.is_ok()) {
    spdlog::error("decode rank {}: offer from rank {}: {}", roles_.self, source, st.message());
    return reject(st.message(), false);
  }
  if (m.header.n_tokens != static_cast<int32_t>(m.prompt.size()) || m.prompt.empty())
    return reject("offer header says " + std::to_string(m.header.n_tokens) + " tokens, prompt has " +
                      std::to_string(m.prompt.size()),
                  false);
  if (Status st = m.sampling.validate(); !st.is_ok()) return reject(st.message(), false);
  const int64_t need = blocks_for_tokens(static_cast<int64_t>(m.prompt.size()) + m.sampling.max_tokens);
  if (need > engine_->blocks->num_blocks())
    return reject("request needs " + std::to_string(need) + " KV blocks at its longest; this decode rank has " +
                      std::to_string(engine_->blocks->num_blocks()) + " (raise kv.decode_budget_mb)",
                  false);
  Seq& s = seqs_[id];
  s.id = id;
  s.source = source;
  s.state = SeqState::kOffered;
  s.path = choose_kv_path(m.endpoint, endpoint_);
  s.n_prompt = static_cast<int32_t>(m.prompt.size());
  s.tokens = std::move(m.prompt);
  s.params = m.sampling;
  s.arrived = channel_->arrival().value_or(env_->now());  // taken off the network by the communication side
  s.order = next_order_++;
  s.handoff = HandoffReceiver(source, header_.n_layers, kv_segments(blocks_for_tokens(s.n_prompt)));
  offers_.push_back(id);
}

void DecodeWorker::on_prompt(proto::PrefillRequest m) {
  const proto::RequestId id = m.id;
  auto fail_now = [&](const std::string& reason, proto::FailureKind kind) {
    channel_->send(roles_.router, proto::RequestFailed{id, reason, kind});
  };
  if (was_cancelled(id)) return;
  if (seqs_.count(id)) return fail_now("duplicate request id " + std::to_string(id), proto::FailureKind::kInternal);
  if (Status st = m.sampling.validate(); !st.is_ok()) return fail_now(st.message(), proto::FailureKind::kInvalid);
  const int64_t need = blocks_for_tokens(static_cast<int64_t>(m.prompt.size()) + m.sampling.max_tokens);
  if (m.prompt.empty() || need > engine_->blocks->num_blocks())
    return fail_now("request needs " + std::to_string(need) + " KV blocks at its longest; this rank has " +
                        std::to_string(engine_->blocks->num_blocks()) + " (raise kv.decode_budget_mb)",
                    proto::FailureKind::kInvalid);
  Seq& s = seqs_[id];
  s.id = id;
  s.state = SeqState::kReady;
  s.n_prompt = static_cast<int32_t>(m.prompt.size());
  s.tokens = std::move(m.prompt);
  s.params = m.sampling;
  s.needs_compute = true;
  s.arrived = s.received = channel_->arrival().value_or(env_->now());
  s.order = next_order_++;
  waiting_.push_back(id);
}

void DecodeWorker::on_cancel(proto::RequestId id, bool from_prefill, const std::string& reason) {
  (void)reason;  // an aborting prefill rank told the router why itself
  Seq* found = find_seq(id);
  if (found == nullptr) {
    // The router's cancel can overtake the prefill rank's offer: remember it.
    if (!from_prefill) remember_cancelled(id);
    return;
  }
  Seq& s = *found;
  switch (s.state) {
    case SeqState::kOffered:
      if (!from_prefill) channel_->send(s.source, proto::HandoffReject{id, "cancelled", true, epoch_});
      return erase(s);
    case SeqState::kReceiving:
      // An aborting prefill rank will never send: cancel the receives now. A
      // router cancel waits for the prefill rank's abort or its data (a
      // receive cancelled under a live sender costs the tag a reclaim).
      if (from_prefill) return cancel_receives(s);
      return set_state(s, SeqState::kCancelling);
    case SeqState::kReady:
    case SeqState::kRunning:
    case SeqState::kPreempted:
    case SeqState::kPrefilling:
      return erase(s);
    case SeqState::kCancelling:
      if (from_prefill) s.handoff.cancel(*transport_);
      return;
  }
}

bool DecodeWorker::accept_offers() {
  bool any = false;
  KvBlockManager& blocks = *engine_->blocks;
  // Preempted sequences have first call on freed blocks: no new handoffs until they are back.
  for (proto::RequestId w : waiting_)
    if (const Seq* s = find_seq(w); s != nullptr && s->state == SeqState::kPreempted) return false;
  if (offers_.empty()) return false;
  // Keep room for the running batch's next tokens and for received-but-not-yet-
  // running sequences, so accepting a handoff does not force a preemption.
  // (Accepted handoffs join neither list, so this holds for the whole loop.)
  int64_t reserved = 0;
  for (proto::RequestId r : running_) reserved += blocks.blocks_needed_to_append(seq_of(r), 1);
  for (proto::RequestId r : prefilling_) reserved += blocks.blocks_needed_to_append(seq_of(r), 1);
  for (proto::RequestId w : waiting_)
    if (const Seq* s = find_seq(w); s != nullptr && s->has_blocks) reserved += blocks.blocks_needed_to_append(seq_of(w), 1);
  while (!offers_.empty()) {
    Seq* offered = find_seq(offers_.front());
    if (offered == nullptr || offered->state != SeqState::kOffered) {  // ended while it waited
      offers_.pop_front();
      continue;
    }
    Seq& s = *offered;
    // The whole prompt's KV arrives into fresh blocks, registered for reuse once it has.
    const AllocateOptions received{.reuse = false, .publish = false};
    const int64_t need = blocks.blocks_needed_for_prompt(s.tokens, received);
    if (need + reserved > blocks.num_free_blocks()) break;
    KvTagPool& pool = tags_of(s.source);
    std::optional<int> tag = pool.acquire();
    // A tag comes back when a handoff under one ends or a reclaim takes its
    // seal: wait for it (in order, as for blocks; the offer's deadline holds).
    if (!tag && pool.held() + pool.reclaiming() > 0) break;
    if (!tag) {  // every tag of this peer retired: refuse this handoff
      channel_->send(s.source, proto::HandoffReject{s.id, "decode rank has no free KV transfer tag for this prefill rank",
                                                    false, epoch_});
      offers_.pop_front();
      erase(s);
      continue;
    }
    auto alloc = blocks.allocate(seq_of(s.id), s.tokens, received);
    if (!alloc.is_ok()) {
      pool.release(*tag);  // nothing was posted under it
      break;
    }
    s.has_blocks = true;
    s.kv_complete = false;
    offers_.pop_front();
    s.tag = *tag;
    std::vector<int32_t> table;
    for (BlockId b : blocks.block_table(seq_of(s.id))) table.push_back(b.value);
    s.accepted = env_->now();
    Status st = transport_->select_path(s.source, s.path);
    if (st.is_ok())
      st = s.handoff.post(*transport_, s.tag, [&](int l, int segment) {
        return kv_layer_region(engine_->cache.buffer->data(), engine_->cache.layout, l, kv_segment(table, segment));
      }, s.accepted);
    else
      s.handoff.mark_foreign();  // nothing was posted; the tag ends as a failed handoff's (end_tag)
    set_state(s, SeqState::kReceiving);
    if (!st.is_ok()) {
      channel_->send(s.source, proto::HandoffReject{s.id, "decode rank could not post receives: " + st.message(), false,
                                                    epoch_});
      cancel_receives(s);
      continue;
    }
    channel_->send(s.source, proto::HandoffAccept{s.id, s.tag, epoch_, endpoint_});
    any = true;
  }
  return any;
}

bool DecodeWorker::progress_transfers() {
  bool any = false;
  std::vector<proto::RequestId> done;
  const auto now = env_->now();
  for (auto& [id, s] : seqs_) {
    if (s.handoff.all_ended()) continue;
    const size_t before = s.handoff.pending();
    s.handoff.poll(*transport_, now);
    any |= s.handoff.pending() != before;
    if (s.handoff.all_ended()) done.push_back(id);
  }
  for (proto::RequestId id : done) {
    Seq* found = find_seq(id);
    if (found == nullptr) continue;
    Seq& s = *found;
    if (s.state == SeqState::kCancelling) erase(s);
    else if (s.state == SeqState::kReceiving && !s.handoff.clean())
      fail(s, "KV transfer from prefill rank " + std::to_string(s.source) + " failed", proto::FailureKind::kTransfer);
    else if (s.state == SeqState::kReceiving) finish_transfer(s);
  }
  any |= poll_tags();
  return any;
}

void DecodeWorker::finish_transfer(Seq& s) {
  s.received = env_->now();
  auto trailer = s.handoff.trailer();
  if (!trailer.is_ok()) return fail(s, trailer.status().message(), proto::FailureKind::kTransfer);
  if (trailer->request_id != s.id || trailer->epoch != peers_.epoch(s.source)) {
    // Another handoff's data under this tag: this one's own sends may still be
    // pending (fail() retires the tag). Never decoded.
    s.handoff.mark_foreign();
    return fail(s, "KV transfer from prefill rank " + std::to_string(s.source) + " carried request " +
                       std::to_string(trailer->request_id) + " (epoch " + std::to_string(trailer->epoch) +
                       "), expected " + std::to_string(s.id) + " (epoch " + std::to_string(peers_.epoch(s.source)) +
                       "): a stale transfer, dropped",
                proto::FailureKind::kTransfer);
  }
  std::vector<int32_t> table;
  for (BlockId b : engine_->blocks->block_table(seq_of(s.id))) table.push_back(b.value);
  for (int l = 0; l < header_.n_layers; ++l) {
    if (trailer->checksums[l] == 0) continue;  // the sender does not checksum
    const Result<uint64_t> got = kv_region_checksum(
        *engine_->backend, *engine_->cache.buffer, kv_layer_region(engine_->cache.buffer->data(), engine_->cache.layout, l, table));
    if (!got.is_ok())
      return fail(s, "KV checksum of layer " + std::to_string(l) + " failed: " + got.status().message(),
                  proto::FailureKind::kTransfer);
    if (*got != trailer->checksums[l])
      return fail(s, "KV checksum mismatch at layer " + std::to_string(l) + " (transfer from prefill rank " +
                         std::to_string(s.source) + " corrupted)",
                  proto::FailureKind::kTransfer);
  }
  // Every message under the tag arrived: the peer has no send pending on it.
  end_tag(s);
  kv_written(s);
  if (trailer->finished) return erase(s);  // ended at its first token; the prefill rank told the router
  s.sampler.emplace(s.params);
  s.sampler->resume(s.tokens);  // the prompt
  s.sampler->replay(trailer->first_token);
  s.tokens.push_back(trailer->first_token);
  s.n_generated = 1;
  set_state(s, SeqState::kReady);
  waiting_.push_back(s.id);
}

void DecodeWorker::check_deadlines() {
  const auto now = env_->now();
  const auto handoff = std::chrono::milliseconds(cfg_.timeouts.handoff_ms);
  const auto transfer = std::chrono::milliseconds(cfg_.timeouts.transfer_ms);
  std::vector<proto::RequestId> expired_offers;
  for (proto::RequestId id : offers_) {
    const Seq* s = find_seq(id);
    if (s != nullptr && s->state == SeqState::kOffered && now - s->arrived > handoff) expired_offers.push_back(id);
  }
  for (proto::RequestId id : expired_offers) {
    Seq& s = seqs_.at(id);
    channel_->send(s.source, proto::HandoffReject{s.id, "no KV room on decode rank " + std::to_string(roles_.self) +
                                                           " within " + std::to_string(cfg_.timeouts.handoff_ms) + " ms",
                                                 false, epoch_});
    erase(s);
  }
  // The prefill rank enforces timeouts.transfer_ms: it knows whether it is
  // computing the next layers or stalled, and aborts the handoff (HandoffAbort)
  // when its sends stop moving or its prompt waited prefill_queue_ms in its
  // queue. This side only guards against a prefill rank that went silent: no
  // layer landing for prefill_queue_ms + transfer_ms. Time spent queued or
  // computing between layers is never taken for a stall. (A prefill rank that
  // stops altogether is declared down by the router after heartbeat_ms.)
  const int backstop_ms = cfg_.timeouts.prefill_queue_ms + cfg_.timeouts.transfer_ms;
  const auto backstop = std::chrono::milliseconds(backstop_ms);
  std::vector<proto::RequestId> stalled, gone;
  for (auto& [id, s] : seqs_) {
    if (s.state == SeqState::kReceiving && now - s.handoff.last_progress() > backstop) {
      stalled.push_back(id);
    } else if (s.state == SeqState::kCancelling && !s.handoff.all_ended()) {
      if (peers_.is_down(s.source) && peer_gone(s.source)) gone.push_back(id);
      else if (now - s.handoff.last_progress() > backstop)
        s.handoff.cancel(*transport_);  // a cancelled handoff whose data never came
    }
  }
  for (proto::RequestId id : stalled) {  // fail() may erase: not while iterating seqs_
    Seq* s = find_seq(id);
    if (s == nullptr) continue;
    fail(*s, "KV transfer from prefill rank " + std::to_string(s->source) + " did not complete: nothing arrived for " +
                 std::to_string(backstop_ms) + " ms (timeouts.prefill_queue_ms + timeouts.transfer_ms)",
         proto::FailureKind::kTimeout);
  }
  for (proto::RequestId id : gone) {
    // The sender's process has ended: nothing can write into these blocks any
    // more (what it sent before dying was consumed by the progress calls since
    // it was declared down). Abandon the receives MPI cannot cancel; free the blocks.
    Seq* s = find_seq(id);
    if (s == nullptr) continue;
    spdlog::info("decode rank {}: prefill rank {} is gone; releasing request {}'s quarantined blocks", roles_.self,
                 s->source, id);
    erase(*s);
  }
  const auto keep = std::max(handoff, transfer) * 2;
  for (auto it = cancelled_.begin(); it != cancelled_.end();)
    it = now - it->second > keep ? cancelled_.erase(it) : std::next(it);
}

void DecodeWorker::kv_written(Seq& s) {
  s.kv_complete = true;
  if (Status st = engine_->blocks->publish(seq_of(s.id)); !st.is_ok())
    spdlog::error("decode rank {}: request {}: {}", roles_.self, s.id, st.to_string());
}

void DecodeWorker::fail(Seq& s, const std::string& reason, proto::FailureKind kind) {
  spdlog::warn("decode rank {}: request {} failed: {}", roles_.self, s.id, reason);
  channel_->send(roles_.router, proto::RequestFailed{s.id, reason, kind});
  std::erase(running_, s.id);
  std::erase(prefilling_, s.id);
  std::erase(waiting_, s.id);
  std::erase(offers_, s.id);
  if (s.state == SeqState::kReceiving) return cancel_receives(s);  // receives posted: blocks freed when they end
  if (s.state == SeqState::kCancelling) return;
  erase(s);
}

bool DecodeWorker::chunked() const { return cfg_.prefill.chunk_tokens > 0; }

int64_t DecodeWorker::compute_target(const Seq& s) const {
  // A new prompt computes all its tokens (logits for token 1); a preempted
  // sequence recomputes all but its last token, which its next step feeds.
  return static_cast<int64_t>(s.tokens.size()) - (s.n_generated == 0 ? 0 : 1);
}

// The scheduler's view of this iteration. Admission order: sequences whose KV
// arrived (they hold blocks and need at most one more), then preempted ones
// (oldest first), then prompts this rank prefills itself (colocated). Chunked
// (prefill.chunk_tokens > 0): `chunks` gets this step's prompt chunks
// (serving/prefill_chunks.h) over the sequences being prefilled and the
// waiting ones to compute, under the step's token budget; only waiting
// sequences given a chunk are offered for admission. Sequences being
// prefilled count as running (they hold their blocks and may be preempted).
// Whole prompts: they count against prefill.token_budget instead.
SchedulerInput DecodeWorker::plan_input(std::vector<PrefillChunk>& chunks) {
  KvBlockManager& blocks = *engine_->blocks;
  auto held = [&](proto::RequestId id) { return static_cast<int64_t>(blocks.block_table(seq_of(id)).size()); };
  SchedulerInput in;
  in.free_blocks = blocks.num_free_blocks();
  in.max_running = cfg_.decode.max_running;
  for (proto::RequestId id : running_)
    in.running.push_back({id, blocks.blocks_needed_to_append(seq_of(id), 1), held(id), seqs_.at(id).order});
  for (proto::RequestId id : prefilling_) in.running.push_back({id, 0, held(id), seqs_.at(id).order});
  auto rank_of = [&](const Seq& s) { return !s.needs_compute ? 0 : s.state == SeqState::kPreempted ? 1 : 2; };
  std::vector<proto::RequestId> order(waiting_.begin(), waiting_.end());
  std::stable_sort(order.begin(), order.end(), [&](proto::RequestId a, proto::RequestId b) {
    const Seq &sa = seqs_.at(a), &sb = seqs_.at(b);
    if (rank_of(sa) != rank_of(sb)) return rank_of(sa) < rank_of(sb);
    return sa.order < sb.order;
  });
  std::unordered_set<proto::RequestId> given_chunk;
  if (chunked()) {
    std::vector<PrefillCandidate> candidates;
    for (proto::RequestId id : prefilling_) {
      const Seq& s = seqs_.at(id);
      candidates.push_back({id, compute_target(s) - s.computed, s.computed});
    }
    for (proto::RequestId id : order) {
      const Seq& s = seqs_.at(id);
      if (!s.needs_compute) continue;
      const auto toks = std::span<const int32_t>(s.tokens).first(static_cast<size_t>(compute_target(s)));
      const int64_t cached = reuses_cache(s) ? blocks.cached_prefix_tokens(toks) : 0;
      candidates.push_back({id, compute_target(s) - cached, cached});
    }
    const ChunkPolicy policy{colocated_prompt_budget(cfg_.decode.step_tokens, static_cast<int64_t>(running_.size())),
                             cfg_.prefill.chunk_tokens, cfg_.decode.max_running, cfg_.prefill.context_cost_tokens};
    chunks = plan_prefill_chunks(candidates, policy);
    for (const PrefillChunk& c : chunks) given_chunk.insert(c.id);
  }
  int64_t compute_tokens = 0;
  for (proto::RequestId id : order) {
    const Seq& s = seqs_.at(id);
    int64_t need;
    if (s.needs_compute) {
      const int64_t n = static_cast<int64_t>(s.tokens.size());
      if (chunked()) {
        if (!given_chunk.count(id)) continue;
      } else {
        if (compute_tokens > 0 && compute_tokens + n > cfg_.prefill.token_budget) break;
        compute_tokens += n;
      }
      need = blocks_for_tokens(s.n_generated == 0 ? n + 1 : n);
    } else {
      need = blocks.blocks_needed_to_append(seq_of(id), 1);
    }
    in.waiting.push_back({id, need, s.has_blocks ? held(id) : 0});
  }
  return in;
}

// Applies the scheduler's plan: preemptions and evictions free blocks (the
// sequence is recomputed later); admitted sequences join the batch, or start
// computing their KV — chunk by chunk (kPrefilling), or whole (returned).
std::vector<proto::RequestId> DecodeWorker::commit(const SchedulerPlan& plan) {
  for (uint64_t id : plan.preempt) {
    Seq& s = seqs_.at(id);
    release(s);
    s.needs_compute = true;
    s.computed = 0;
    s.prompt_logprobs.clear();
    set_state(s, SeqState::kPreempted);
    std::erase(running_, id);
    std::erase(prefilling_, id);
    waiting_.push_front(id);
    ++preemptions_;
    spdlog::debug("decode rank {}: preempted request {} ({} tokens)", roles_.self, id, s.tokens.size());
  }
  for (uint64_t id : plan.evict) {  // stalled holders: recompute later
    Seq& s = seqs_.at(id);
    release(s);
    s.needs_compute = true;
    set_state(s, SeqState::kPreempted);
    ++preemptions_;
  }
  std::vector<proto::RequestId> whole;
  for (uint64_t id : plan.admit) {
    Seq& s = seqs_.at(id);
    std::erase(waiting_, id);
    if (!s.needs_compute) {
      set_state(s, SeqState::kRunning);
      running_.push_back(id);
    } else if (!chunked()) {
      whole.push_back(id);
    } else if (Status st = start_prefill(s); !st.is_ok()) {
      fail(s, "prefill on decode rank failed: " + st.message(), proto::FailureKind::kInternal);
    }
  }
  return whole;
}

Status DecodeWorker::allocate_local(Seq& s) {
  const auto toks = std::span<const int32_t>(s.tokens).first(static_cast<size_t>(compute_target(s)));
  PD_ASSIGN_OR_RETURN(s.cached,
                      engine_->blocks->allocate(seq_of(s.id), toks, {.reuse = reuses_cache(s), .publish = false}));
  s.has_blocks = true;
  s.kv_complete = false;  // until the pass that computes the rest has written it
  return Status::ok();
}

Status DecodeWorker::start_prefill(Seq& s) {
  PD_RETURN_IF_ERROR(allocate_local(s));
  s.computed = s.cached;
  s.prefill_started = env_->now();
  set_state(s, SeqState::kPrefilling);
  prefilling_.push_back(s.id);
  return Status::ok();
}

bool DecodeWorker::step() {
  // Every id in these lists has its Seq (cancel and fail remove both); drop any
  // that does not rather than trust it, so a missed erase cannot end the rank.
  for (auto* list : {&running_, &prefilling_})
    std::erase_if(*list, [&](proto::RequestId id) { return !seqs_.count(id); });
  std::erase_if(waiting_, [&](proto::RequestId id) { return !seqs_.count(id); });
  if (running_.empty() && waiting_.empty() && prefilling_.empty()) return false;

  std::vector<PrefillChunk> chunks;
  const SchedulerPlan plan = schedule_iteration(plan_input(chunks));
  const std::vector<proto::RequestId> whole = commit(plan);
  const bool progressed = !plan.admit.empty() || !running_.empty() || !prefilling_.empty() || !plan.evict.empty();
  proto::TokenEvents events;
  if (!whole.empty()) {
    if (Status st = compute_local(whole, events); !st.is_ok()) {
      for (proto::RequestId id : whole)
        if (seqs_.count(id)) fail(seqs_.at(id), "prefill on decode rank failed: " + st.message(), proto::FailureKind::kInternal);
    }
  }
  // Chunks of sequences still being prefilled (a preempted one dropped out);
  // none past its sequence's end (its cached prefix can only have shrunk
  // since the plan: then it is simply not the last chunk).
  std::erase_if(chunks, [&](const PrefillChunk& c) {
    const Seq* s = find_seq(c.id);
    return s == nullptr || s->state != SeqState::kPrefilling;
  });
  for (PrefillChunk& c : chunks) {
    const Seq& s = seqs_.at(c.id);
    c.tokens = std::min(c.tokens, compute_target(s) - s.computed);
  }
  if (!running_.empty() || !chunks.empty()) run_step(chunks, events);
  if (!events.events.empty()) channel_->send(roles_.router, events);
  return progressed;
}

// One forward pass: a decode token for every running sequence, then this
// step's prompt chunks (chunked prefill: the decodes ride along a chunk's pass
// instead of waiting for the whole prompt).
void DecodeWorker::run_step(const std::vector<PrefillChunk>& chunks, proto::TokenEvents& events) {
  KvBlockManager& blocks = *engine_->blocks;
  const auto step_start = env_->now();
  const size_t n_seqs = running_.size() + chunks.size();
  if (step_tables_.size() < n_seqs) step_tables_.resize(n_seqs);
  step_batch_.resize(n_seqs);
  stepped_.clear();
  size_t used = 0;
  for (size_t i = 0; i < running_.size(); ++i) {
    Seq& s = seqs_.at(running_[i]);
    const SeqId sid = seq_of(s.id);
    if (Status st = blocks.append(sid, std::span<const int32_t>(&s.tokens.back(), 1), nullptr); !st.is_ok()) {
      spdlog::error("decode rank {}: request {}: {}", roles_.self, s.id, st.to_string());
      continue;  // the scheduler planned room; should not happen — retried next iteration
    }
    std::vector<int32_t>& table = step_tables_[used];
    table.clear();
    for (BlockId b : blocks.block_table(sid)) table.push_back(b.value);
    step_batch_[used++] = SequenceBatch{std::span<const int32_t>(&s.tokens.back(), 1),
                                        static_cast<int32_t>(s.tokens.size()) - 1, table, true, false};
    stepped_.push_back(s.id);
  }
  for (const PrefillChunk& c : chunks) {
    Seq& s = seqs_.at(c.id);
    std::vector<int32_t>& table = step_tables_[used];
    table.clear();
    for (BlockId b : blocks.block_table(seq_of(s.id))) table.push_back(b.value);
    const bool fresh = s.n_generated == 0;
    const bool last = s.computed + c.tokens == compute_target(s);
    step_batch_[used++] = SequenceBatch{
        std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(s.computed), static_cast<size_t>(c.tokens)),
        static_cast<int32_t>(s.computed), table, fresh && last, fresh && s.params.prompt_logprobs};
  }
  step_batch_.resize(used);
  Status st = engine_->model->forward(step_batch_, engine_->cache, &logits_);
  if (!st.is_ok()) {
    check_device();
    for (proto::RequestId id : stepped_) fail(seqs_.at(id), "decode step failed: " + st.message(), proto::FailureKind::kInternal);
    for (const PrefillChunk& c : chunks)
      if (Seq* s = find_seq(c.id)) fail(*s, "prefill on decode rank failed: " + st.message(), proto::FailureKind::kInternal);
    return;
  }
  const int64_t vocab = engine_->config().vocab;
  auto rows = [&](size_t first, size_t n) {
    return std::span<float>(logits_).subspan(first * vocab, n * static_cast<size_t>(vocab));
  };
  for (size_t i = 0; i < stepped_.size(); ++i) {
    Seq& s = seqs_.at(stepped_[i]);
    proto::TokenEvent ev = next_token_event(s, rows(i, 1));
    if (!s.timing_sent) {
      ev.queue_s = seconds(step_start - s.received);
      s.timing_sent = true;
    }
    const bool stop = ev.finish != proto::Finish::kNone;
    events.events.push_back(std::move(ev));
    if (stop) erase(s);
  }
  size_t row = stepped_.size();
  for (size_t i = 0; i < chunks.size(); ++i) {
    const SequenceBatch& sb = step_batch_[stepped_.size() + i];
    const size_t n_rows = sb.all_logits ? sb.tokens.size() : sb.want_logits ? 1 : 0;
    finish_local_chunk(seqs_.at(chunks[i].id), chunks[i].tokens, rows(row, n_rows), events);
    row += n_rows;
  }
}

// A sequence's chunk is in the cache. With its whole KV computed it joins the
// running batch — a new prompt first samples token 1 from `rows`' last row.
void DecodeWorker::finish_local_chunk(Seq& s, int64_t n, std::span<float> rows, proto::TokenEvents& events) {
  const int64_t vocab = engine_->config().vocab;
  if (s.n_generated == 0 && s.params.prompt_logprobs)
    append_prompt_logprobs(s.tokens, s.computed, s.computed + n, rows, vocab, s.params.logprobs, s.prompt_logprobs);
  s.computed += n;
  if (s.computed < compute_target(s)) return;
  std::erase(prefilling_, s.id);
  s.needs_compute = false;
  kv_written(s);
  if (s.n_generated > 0) {  // resumed after preemption
    set_state(s, SeqState::kRunning);
    running_.push_back(s.id);
    return;
  }
  s.sampler.emplace(s.params);
  s.sampler->resume(s.tokens);  // the prompt (n_generated is 0)
  count_prompt(s.cached, static_cast<int64_t>(s.tokens.size()) - s.cached);
  proto::TokenEvent ev = next_token_event(s, rows.subspan(rows.size() - static_cast<size_t>(vocab)));
  ev.prompt_logprobs = std::move(s.prompt_logprobs);
  ev.cached_tokens = static_cast<int32_t>(s.cached);
  ev.queue_s = seconds(s.prefill_started - s.arrived);
  ev.prefill_s = seconds(env_->now() - s.prefill_started);
  s.timing_sent = true;
  const bool stop = ev.finish != proto::Finish::kNone;
  events.events.push_back(std::move(ev));
  if (stop) return erase(s);
  set_state(s, SeqState::kRunning);
  running_.push_back(s.id);
}

// Samples the sequence's next token from its logits row (its sampler set up),
// appends it, and returns its event (no timings).
proto::TokenEvent DecodeWorker::next_token_event(Seq& s, std::span<float> row) {
  proto::TokenEvent ev = sample_token_event(*s.sampler, s.id, s.n_generated + 1, row, engine_->eos_id, raw_row_);
  s.tokens.push_back(ev.tokens[0]);
  ++s.n_generated;
  return ev;
}

// Whole prompts (prefill.chunk_tokens = 0): one pass computes the KV of every
// admitted sequence; new prompts sample token 1; all join the running batch.
Status DecodeWorker::compute_local(const std::vector<proto::RequestId>& ids, proto::TokenEvents& events) {
  KvBlockManager& blocks = *engine_->blocks;
  std::vector<std::vector<int32_t>> tables(ids.size());
  std::vector<SequenceBatch> batch(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    Seq& s = seqs_.at(ids[i]);
    const bool fresh = s.n_generated == 0;
    const std::span<const int32_t> toks(s.tokens.data(), static_cast<size_t>(compute_target(s)));
    PD_RETURN_IF_ERROR(allocate_local(s));
    for (BlockId b : blocks.block_table(seq_of(s.id))) tables[i].push_back(b.value);
    batch[i] = SequenceBatch{toks.subspan(static_cast<size_t>(s.cached)), static_cast<int32_t>(s.cached), tables[i],
                             fresh, fresh && s.params.prompt_logprobs};
  }
  const auto t0 = env_->now();
  std::vector<float> logits;
  Status st = engine_->model->prefill(batch, engine_->cache, &logits);
  if (!st.is_ok()) check_device();
  if (!st.is_ok()) return st;
  for (proto::RequestId id : ids) kv_written(seqs_.at(id));
  const double prefill_s = seconds(env_->now() - t0);
  const int64_t vocab = engine_->config().vocab;
  size_t row = 0;  // the next logits row: one per fresh prompt, one per token of an all_logits one
  auto row_at = [&](size_t r) { return std::span<float>(logits.data() + r * vocab, static_cast<size_t>(vocab)); };
  for (size_t i = 0; i < ids.size(); ++i) {
    const proto::RequestId id = ids[i];
    Seq& s = seqs_.at(id);
    s.needs_compute = false;
    if (s.n_generated > 0) {  // resumed after preemption
      set_state(s, SeqState::kRunning);
      running_.push_back(id);
      continue;
    }
    std::vector<LogprobEntry> prompt_logprobs;
    if (batch[i].all_logits) {
      const int64_t n = static_cast<int64_t>(batch[i].tokens.size());
      append_prompt_logprobs(s.tokens, 0, n, std::span<const float>(logits).subspan(row * vocab), vocab,
                             s.params.logprobs, prompt_logprobs);
      row += static_cast<size_t>(n) - 1;
    }
    s.sampler.emplace(s.params);
    s.sampler->resume(s.tokens);  // the prompt (n_generated is 0)
    count_prompt(s.cached, static_cast<int64_t>(s.tokens.size()) - s.cached);
    proto::TokenEvent ev = next_token_event(s, row_at(row++));
    ev.prompt_logprobs = std::move(prompt_logprobs);
    ev.cached_tokens = static_cast<int32_t>(s.cached);
    ev.queue_s = seconds(t0 - s.arrived);
    ev.prefill_s = prefill_s;
    s.timing_sent = true;
    const bool stop = ev.finish != proto::Finish::kNone;
    events.events.push_back(std::move(ev));
    if (stop) {
      erase(s);
    } else {
      set_state(s, SeqState::kRunning);
      running_.push_back(id);
    }
  }
  return Status::ok();
}

void DecodeWorker::fill_load(proto::LoadReport& r) const {
  r.waiting = static_cast<int32_t>(offers_.size() + waiting_.size());
  r.running = static_cast<int32_t>(running_.size() + prefilling_.size());
  r.preemptions = preemptions_;
  for (const auto& [rank, pool] : tags_) {
    r.kv_tags_retired += static_cast<int64_t>(pool.retired());
    r.kv_tags_reclaiming += static_cast<int64_t>(pool.reclaiming());
  }
  if (peers_.any_down())  // runs every iteration: walk the sequences only when a quarantine can exist
    for (const auto& [id, s] : seqs_)
      if (s.state == SeqState::kCancelling && peers_.is_down(s.source) && s.has_blocks)
        r.quarantined_blocks += static_cast<int64_t>(engine_->blocks->block_table(seq_of(id)).size());
}

}  // namespace pd
