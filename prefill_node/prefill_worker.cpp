#include "prefill_node/prefill_worker.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <thread>

#include "serving/prefill_chunks.h"
#include "serving/token_events.h"
#include "util/env.h"
#include "util/lifecycle.h"

namespace pd {
namespace {

// The sequence under `id` in `seqs`, or null.
template <typename Map>
auto* find_in(Map& seqs, proto::RequestId id) {
  auto it = seqs.find(id);
  return it == seqs.end() ? nullptr : &it->second;
}

// The region of one layer of one segment of a sequence's KV (blocks `table`) in `engine`'s cache.
HandoffSender::RegionOf region_of(const Engine& engine, const std::vector<int32_t>& table) {
  return [&engine, &table](int layer, int segment) {
    return kv_layer_region(engine.cache.buffer->data(), engine.cache.layout, layer, kv_segment(table, segment));
  };
}

// Remaining tokens of a prompt that has not started: what the prefix cache does
// not hold (prompt logprobs need every position: such a prompt reuses nothing).
int64_t uncached_tokens(const KvBlockManager& blocks, const proto::PrefillRequest& req) {
  const int64_t n = static_cast<int64_t>(req.prompt.size());
  return req.sampling.prompt_logprobs ? n : n - blocks.cached_prefix_tokens(req.prompt);
}

}  // namespace

const char* state_name(PrefillWorker::SeqState s) {
  using S = PrefillWorker::SeqState;
  switch (s) {
    case S::kQueued: return "queued";
    case S::kComputing: return "computing";
    case S::kPrefilling: return "prefilling";
    case S::kHandingOff: return "handing-off";
    case S::kAborted: return "aborted";
  }
  return "?";
}

bool legal(PrefillWorker::SeqState from, PrefillWorker::SeqState to) {
  using S = PrefillWorker::SeqState;
  switch (from) {
    case S::kQueued: return to == S::kComputing;
    case S::kComputing: return to == S::kHandingOff || to == S::kAborted || to == S::kPrefilling;
    case S::kPrefilling: return to == S::kComputing;
    case S::kHandingOff:
    case S::kAborted: return false;  // only ended (erased) from here
  }
  return false;
}

PrefillWorker::PrefillWorker(const ClusterConfig& cfg, const RoleTable& roles, std::shared_ptr<Engine> engine,
                             std::unique_ptr<Transport> transport, std::unique_ptr<ControlChannel> channel)
    : WorkerCore("prefill", cfg, roles, std::move(engine), std::move(transport), std::move(channel)) {
  // Layer hook: runs on this thread inside forward(), right after a layer's KV
  // is in the cache. Checksums are taken for every request of the batch (a
  // held request sends later); the control messages that arrived meanwhile
  // are acted on (mid_pass_message); every layer written so far of an
  // accepted handoff is handed to the communication side, which sends it
  // while the next layers compute. Nothing here ends a sequence under forward():
  // a sequence ended mid-pass becomes kAborted and run_batch ends it after the pass.
  engine_->model->set_kv_written_hook([this](int layer) {
    for (proto::RequestId id : batch_) {
      auto it = seqs_.find(id);
      if (it == seqs_.end()) continue;
      Seq& seq = it->second;
      // A layer of the prompt is complete when its last chunk writes it.
      if (seq.state != SeqState::kComputing || !seq.last_chunk()) continue;
      if (engine_->kv_checksum) {
        Result<uint64_t> sum = kv_region_checksum(
            *engine_->backend, *engine_->cache.buffer,
            kv_layer_region(engine_->cache.buffer->data(), engine_->cache.layout, layer, seq.table));
        if (sum.is_ok()) seq.handoff.layer_written(layer, *sum);
        else seq.handoff.fail("KV checksum failed: " + sum.status().message());
      } else {
        seq.handoff.layer_written(layer, 0);
      }
    }
    handle_messages(/*in_pass=*/true);
    for (proto::RequestId id : batch_) {
      Seq* seq = find_in(seqs_, id);
      if (seq != nullptr && seq->state == SeqState::kComputing && seq->last_chunk()) post_written(*seq);
    }
    progress_transfers();  // what went out during the pass counts as hidden
    report_load(false);
  });
}

// What the layer hook may act on in the middle of a pass: a new prompt (it is
// offered and queued), a cancel or a handoff answer (an accept starts the sends
// of the layers already written), a tag to seal, a peer going down or up. Anything else —
// Rejoin, Drain, PeerLeft, Shutdown — waits for the pass to end, and so does
// every message behind it (order per source holds).
bool PrefillWorker::mid_pass_message(const proto::Message& m) const {
  return std::holds_alternative<proto::PrefillRequest>(m) || std::holds_alternative<proto::Cancel>(m) ||
         std::holds_alternative<proto::HandoffAccept>(m) || std::holds_alternative<proto::HandoffReject>(m) ||
         std::holds_alternative<proto::PeerDown>(m) || std::holds_alternative<proto::PeerUp>(m) ||
         std::holds_alternative<proto::Hello>(m) || std::holds_alternative<proto::KvTagSeal>(m);
}

bool PrefillWorker::on_message(int source, proto::Message& msg) {
  if (auto* m = std::get_if<proto::PrefillRequest>(&msg)) on_request(std::move(*m));
  else if (auto* m = std::get_if<proto::Cancel>(&msg)) on_cancel(m->id);
  else if (auto* m = std::get_if<proto::HandoffAccept>(&msg)) {
    if (current(source, m->epoch)) on_accept(*m, source);
  } else if (auto* m = std::get_if<proto::HandoffReject>(&msg)) {
    if (current(source, m->epoch)) on_reject(*m, source);
  } else if (auto* m = std::get_if<proto::KvTagSeal>(&msg)) {
    if (current(source, m->epoch)) on_seal(*m, source);
  } else {
    return false;
  }
  return true;
}

void PrefillWorker::on_peer_down(int rank) {
  std::vector<proto::RequestId> ids;
  for (auto& [id, seq] : seqs_)
    if (seq.req.decode_rank == rank) ids.push_back(id);
  for (proto::RequestId id : ids) {
    Seq* seq = find_in(seqs_, id);
    if (seq == nullptr) continue;
    // The router decides what happens to the request (re-run or error); an
    // id it already re-dispatched is stale to it and ignored.
    fail(*seq, "decode rank " + std::to_string(rank) + " is down", proto::FailureKind::kPeerDown, false);
  }
  if (!ids.empty())
    spdlog::warn("prefill rank {}: decode rank {} is down; ended {} handoffs to it", roles_.self, rank, ids.size());
  // Its seals need not arrive: it retires the tags it was reclaiming from us.
  std::erase_if(seals_, [&](const Seal& s) {
    if (s.peer == rank) transport_->abandon(s.op);
    return s.peer == rank;
  });
}

void PrefillWorker::forget_peer(int rank) {
  std::erase_if(seals_, [&](const Seal& s) {
    if (s.peer == rank) transport_->abandon(s.op);
    return s.peer == rank;
  });
  std::erase_if(sealed_, [&](const auto& kv) { return kv.first.first == rank; });
}

void PrefillWorker::on_drain() {
  // Hand back what has not started: the router runs it on another rank.
  std::vector<proto::RequestId> queued(queue_.begin(), queue_.end());
  for (proto::RequestId id : queued)
    if (Seq* seq = find_in(seqs_, id); seq != nullptr && seq->state == SeqState::kQueued)
      fail(*seq, "prefill rank " + std::to_string(roles_.self) + " is leaving the cluster",
           proto::FailureKind::kLeaving, true);
  spdlog::info("prefill rank {}: draining (handed back {} queued, finishing {})", roles_.self, queued.size(),
               seqs_.size());
}

void PrefillWorker::drop_all() {
  std::vector<proto::RequestId> ids;
  for (auto& [id, seq] : seqs_) ids.push_back(id);
  for (proto::RequestId id : ids) end(id);
  queue_.clear();
}

void PrefillWorker::on_request(proto::PrefillRequest req) {
  const proto::RequestId id = req.id;
  if (seqs_.count(id)) {
    spdlog::error("prefill rank {}: duplicate request {}", roles_.self, id);
    return;
  }
  if (req.decode_rank >= 0 && peers_.is_down(req.decode_rank)) {  // the router sent it before it learned; it will hear it failed
    channel_->send(roles_.router, proto::RequestFailed{id, "decode rank " + std::to_string(req.decode_rank) + " is down",
                                                       proto::FailureKind::kPeerDown});
    return;
  }
  // Bounds checked before anything acts on them (a grammar's size among them),
  // as the decode rank checks what reaches it.
  if (Status st = req.sampling.validate(); !st.is_ok()) {
    channel_->send(roles_.router, proto::RequestFailed{id, st.message(), proto::FailureKind::kInvalid});
    return;
  }
  // A grammar compiles in the background while the prompt is computed (a
  // no-op once cached); token 1 makes a matcher from it (finish_chunk).
  engine_->grammars->compile_in_background(req.sampling.grammar);
  Seq& seq = seqs_[id];
  seq.req = std::move(req);
  // Its queue wait counts from when the communication side took it off the
  // network, not from when this loop got to it.
  seq.arrived = channel_->arrival().value_or(env_->now());
  seq.offered = env_->now();
  const SamplingParams& sp = seq.req.sampling;
  seq.prompt = PromptPass(id, {.target = static_cast<int64_t>(seq.req.prompt.size()),
                               .first_token = true,
                               .prompt_logprobs = sp.prompt_logprobs,
                               .top_logprobs = sp.logprobs,
                               .publish = true});
  if (seq.warm()) {  // no handoff: the prompt only goes into the prefix cache
    queue_.push_back(id);
    return;
  }
  const int64_t bs = engine_->blocks->block_size();
  seq.handoff = HandoffSender(seq.req.decode_rank, id, epoch_, header_.n_layers,
                              kv_segments((static_cast<int64_t>(seq.req.prompt.size()) + bs - 1) / bs));
  // Offer the handoff now: the decode rank reserves blocks while we compute.
  proto::HandoffOffer offer;
  offer.header = header_;
  offer.header.request_id = id;
  offer.header.n_tokens = static_cast<int32_t>(seq.req.prompt.size());
  offer.prompt = seq.req.prompt;
  offer.sampling = seq.req.sampling;
  offer.epoch = epoch_;
  offer.endpoint = endpoint_;
  channel_->send(seq.req.decode_rank, offer);
  queue_.push_back(id);
}

void PrefillWorker::on_cancel(proto::RequestId id) {
  Seq* seq = find_in(seqs_, id);
  if (seq == nullptr) return;  // already handed off or finished
  switch (seq->state) {
    case SeqState::kQueued:
    case SeqState::kComputing:
    case SeqState::kPrefilling:
      if (!seq->warm()) channel_->send(seq->req.decode_rank, proto::HandoffAbort{id, "cancelled", epoch_});
      end(id);
      break;
    case SeqState::kHandingOff:
      // Sending: the decode rank was cancelled too; the transfer completes, then we free.
      if (seq->handoff.accepted()) break;
      channel_->send(seq->req.decode_rank, proto::HandoffAbort{id, "cancelled", epoch_});  // held here
      end(id);
      break;
    case SeqState::kAborted: break;
  }
}

void PrefillWorker::on_accept(const proto::HandoffAccept& m, int source) {
  Seq* seq = find_in(seqs_, m.id);
  if (seq == nullptr) {
    // Ended here without telling that rank (it was declared down, or the abort
    // crossed this accept): say so, or its blocks wait for timeouts.transfer_ms.
    channel_->send(source, proto::HandoffAbort{m.id, "the handoff ended on prefill rank " +
                                                         std::to_string(roles_.self), epoch_});
    return;
  }
  if (seq->state == SeqState::kAborted) return;  // aborted in the running pass; its abort tells it
  if (source != seq->req.decode_rank) {
    spdlog::error("prefill rank {}: accept for request {} from rank {}, offered to {}", roles_.self, m.id, source,
                  seq->req.decode_rank);
    return;
  }
  if (!proto::is_kv_tag(m.tag)) {
    // KV bytes under any other tag would land among control messages (or another path's).
    spdlog::error("prefill rank {}: accept for request {} from rank {} under tag {}, not a KV tag; ignored",
                  roles_.self, m.id, source, m.tag);
    count_refused();
    return;
  }
  if (!seq->handoff.accept(m.tag)) return;  // a duplicate
  sealed_.erase({source, m.tag});  // the tag came back to us: a new handoff under it
  // The decode rank chose the same path from the same two endpoints.
  if (Status st = transport_->select_path(source, choose_kv_path(endpoint_, m.endpoint)); !st.is_ok())
    seq->handoff.fail("KV path: " + st.message());
  // Held (its handoff now kFinishing): everything goes now. Prefilling: the
  // segments its earlier chunks completed. A sequence in the running pass
  // posts its written KV from the layer hook.
  if (seq->state == SeqState::kHandingOff || seq->state == SeqState::kPrefilling) post_written(*seq);
}

void PrefillWorker::on_reject(const proto::HandoffReject& m, int source) {
  Seq* seq = find_in(seqs_, m.id);
  if (seq == nullptr || source != seq->req.decode_rank) return;
  if (seq->handoff.accepted() || seq->state == SeqState::kAborted) return;
  if (!m.cancelled)
    channel_->send(roles_.router,
                   proto::RequestFailed{m.id, "decode rank " + std::to_string(seq->req.decode_rank) +
                                                  " refused the KV handoff: " + m.reason,
                                        proto::FailureKind::kOverloaded});
  end(m.id);
}

// The decode rank ended handoff `m.id` early and reclaims its tag: the
// handoff ends here too (if it still is; the decode rank told the router, or
// the router told it), then the seal goes out under the tag, behind all this
// rank sent there. A request for a tag another handoff holds now, or for a
// tag already sealed for this handoff, is stale (a seal then would meet a
// later receive of the decode rank): ignored.
void PrefillWorker::on_seal(const proto::KvTagSeal& m, int source) {
  if (!proto::is_kv_tag(m.tag)) {  // a seal under any other tag would land among control messages
    spdlog::error("prefill rank {}: decode rank {} asked to seal tag {}, not a KV tag; ignored", roles_.self, source,
                  m.tag);
    count_refused();
    return;
  }
  const std::pair<int, int> key{source, m.tag};
  if (auto it = sealed_.find(key); it != sealed_.end() && it->second == m.id) return;
  for (const auto& [id, seq] : seqs_)
    if (id != m.id && seq.req.decode_rank == source && seq.handoff.accepted() && seq.handoff.tag() == m.tag &&
        seq.state != SeqState::kAborted) {
      spdlog::warn("prefill rank {}: decode rank {} asked to seal tag {} for request {}, but request {} holds it",
                   roles_.self, source, m.tag, m.id, id);
      return;
    }
  // An aborted sequence (ended in the running pass) posts nothing more and is erased after the pass.
  if (Seq* seq = find_in(seqs_, m.id); seq != nullptr && seq->req.decode_rank == source && seq->state != SeqState::kAborted)
    end(m.id);
  Result<TransferOp> op = transport_->post_send_bytes(source, m.tag, nullptr, 0);
  if (!op.is_ok()) {  // the decode rank retires the tag once its reclaim passes its limit
    spdlog::warn("prefill rank {}: sealing tag {} for decode rank {}: {}", roles_.self, m.tag, source,
                 op.status().to_string());
    return;
  }
  seals_.push_back({source, *op});
  sealed_[key] = m.id;
}

void PrefillWorker::post_written(Seq& seq) {
  // Sends to one peer go out in posting order; how many are in flight at once
  // is the communication side's business (kvtransfer/send_budget.h).
  seq.handoff.post_written(*transport_, region_of(*engine_, seq.table), env_->now());
}

// Blocks the started prompts will still take for their later chunks: set
// aside, so a prompt once started always finishes (no two half-computed
// prompts can wait on each other's blocks).
int64_t PrefillWorker::reserved_blocks() const {
  int64_t reserved = 0;
  for (const auto& [id, seq] : seqs_)
    if (seq.state == SeqState::kPrefilling)
      reserved += engine_->blocks->blocks_needed_to_append(
          seq_of(id), static_cast<int>(static_cast<int64_t>(seq.req.prompt.size()) - seq.prompt.computed()));
  return reserved;
}

// The first chunk creates the sequence (reusing cached prefix blocks unless
// prompt logprobs need every position; prompt.computed() becomes what the
// cache held); a block is registered for reuse only when the pass that
// writes it is next.
Status PrefillWorker::place_chunk(Seq& seq, int64_t end) {
  KvBlockManager& blocks = *engine_->blocks;
  PD_RETURN_IF_ERROR(seq.prompt.place(blocks, seq.req.prompt, end));
  seq.table.clear();
  for (BlockId b : blocks.block_table(seq_of(seq.req.id))) seq.table.push_back(b.value);
  return Status::ok();
}

// Chooses the next pass: chunks of waiting and started prompts under the
// token budget (serving/prefill_chunks.h), a prompt that has not started only
// if its whole prompt's blocks are free beside what started ones will take.
// Fills batch_ (the sequences become kComputing).
void PrefillWorker::plan_pass() {
  std::erase_if(queue_, [&](proto::RequestId id) { return find_in(seqs_, id) == nullptr; });
  std::vector<PrefillCandidate> candidates;
  for (proto::RequestId id : queue_) {
    const Seq& seq = seqs_.at(id);
    const int64_t n = static_cast<int64_t>(seq.req.prompt.size());
    if (seq.state == SeqState::kQueued) {
      const int64_t uncached = uncached_tokens(*engine_->blocks, seq.req);
      candidates.push_back({id, uncached, n - uncached});
    } else if (seq.state == SeqState::kPrefilling) {
      candidates.push_back({id, n - seq.prompt.computed(), seq.prompt.computed()});
    }
  }
  const ChunkPolicy policy{cfg_.prefill.token_budget, cfg_.prefill.chunk_tokens, cfg_.prefill.max_batch,
                           cfg_.prefill.context_cost_tokens};
  KvBlockManager& blocks = *engine_->blocks;
  int64_t free = blocks.num_free_blocks() - reserved_blocks();
  bool may_start = true;  // no overtaking among prompts that have not started
  for (const PrefillChunk& chunk : plan_prefill_chunks(candidates, policy)) {
    Seq& seq = seqs_.at(chunk.id);
    const int64_t n = static_cast<int64_t>(seq.req.prompt.size());
    int64_t end = seq.prompt.computed() + chunk.tokens;
    if (seq.state == SeqState::kQueued) {
      if (!may_start) continue;
      const int64_t needed = seq.req.sampling.prompt_logprobs
                                 ? blocks.blocks_needed_to_append(seq_of(seq.req.id), static_cast<int>(n))
                                 : blocks.blocks_needed_for_prompt(seq.req.prompt);
      if (needed > free) {
        // Held KV (offers not yet accepted) and sends in flight free blocks
        // later. A prompt that cannot fit even in an empty pool fails now.
        if (batch_.empty() && blocks.num_free_blocks() == blocks.num_blocks() && reserved_blocks() == 0)
          fail(seq, "prompt of " + std::to_string(n) + " tokens does not fit this prefill rank's KV pool (" +
                        std::to_string(blocks.num_blocks() * blocks.block_size()) +
                        " tokens; raise kv.prefill_budget_mb)",
               proto::FailureKind::kInvalid, true);
        may_start = false;
        continue;
      }
      free -= needed;
      end = n - uncached_tokens(blocks, seq.req) + chunk.tokens;  // what the cache holds, then the chunk
    }
    if (Status st = place_chunk(seq, std::min(end, n)); !st.is_ok()) {
      spdlog::error("prefill rank {}: request {}: placing its chunk: {}", roles_.self, seq.req.id, st.to_string());
      if (seq.state == SeqState::kQueued) may_start = false;
      continue;
    }
    if (seq.state == SeqState::kQueued) seq.prompt.start(env_->now());
    transition(seq.state, SeqState::kComputing, seq.req.id, "prefill");
    batch_.push_back(seq.req.id);
  }
}

bool PrefillWorker::run_batch() {
  batch_.clear();
  plan_pass();
  if (batch_.empty()) return false;

  // Sequence views (spans into the sequences, which do not move during the
  // pass: nothing erases a kComputing one; it becomes kAborted instead).
  std::vector<SequenceBatch> chunks;
  std::vector<size_t> n_rows;  // logits rows of each chunk
  chunks.reserve(batch_.size());
  for (proto::RequestId id : batch_) {
    const Seq& seq = seqs_.at(id);
    chunks.push_back(seq.prompt.chunk(seq.req.prompt, seq.prompt.placed_end(), seq.table));
    n_rows.push_back(seq.prompt.rows(seq.prompt.placed_end()));
  }
  std::vector<float> logits;
  in_pass_ = true;
  Status st = engine_->model->prefill(chunks, engine_->cache, &logits);
  in_pass_ = false;
  // What the communication side sent during the pass counts as hidden: take
  // the completions now, before the pass's end is stamped.
  progress_transfers();
  std::vector<proto::RequestId> ran;
  ran.swap(batch_);
  if (!st.is_ok()) {
    spdlog::error("prefill rank {}: batch of {} failed: {}", roles_.self, ran.size(), st.to_string());
    check_device();
    for (proto::RequestId id : ran)
      if (Seq* seq = find_in(seqs_, id)) fail(*seq, "prefill failed: " + st.message(), proto::FailureKind::kInternal, true);
  }
  const int64_t vocab = engine_->config().vocab;
  proto::TokenEvents events;
  size_t next_row = 0;  // the first logits row of ran[i]
  for (size_t i = 0; i < ran.size(); ++i) {
    const size_t first_row = next_row;
    next_row += n_rows[i];
    Seq* found = find_in(seqs_, ran[i]);
    if (found == nullptr) continue;
    Seq& seq = *found;
    if (seq.state == SeqState::kAborted) {  // ended during the pass: forward() is done with its blocks now
      end(seq.req.id);
      continue;
    }
    if (seq.handoff.phase() == HandoffSender::Phase::kFailed) {  // a checksum or a send from the layer hook failed
      fail(seq, seq.handoff.error(), proto::FailureKind::kTransfer, true);
      continue;
    }
    const auto rows = std::span<float>(logits).subspan(first_row * vocab, (next_row - first_row) * vocab);
    if (std::optional<proto::TokenEvent> ev = finish_chunk(seq, rows)) events.events.push_back(std::move(*ev));
  }
  if (!events.events.empty()) channel_->send(roles_.router, events);
  return true;
}

// After a pass: the sequence's chunk is in the cache. A prompt with chunks
// left waits for the next pass (kPrefilling); a finished one samples token 1,
// returns its event, and hands off the rest of its KV (now if the decode rank
// accepted; else when it does, on_accept).
std::optional<proto::TokenEvent> PrefillWorker::finish_chunk(Seq& seq, std::span<float> rows) {
  const int64_t vocab = engine_->config().vocab;
  const int64_t n = static_cast<int64_t>(seq.req.prompt.size());
  seq.prompt.chunk_done(seq.req.prompt, seq.prompt.placed_end(), rows, vocab);
  if (seq.warm() && seq.last_chunk()) {  // in the cache now (its blocks stay there as the sequence ends)
    // Not in the rank's prompt-token counts: those add up to the prompts the router dispatched.
    channel_->send(roles_.router, proto::Warmed{seq.req.id, n - seq.prompt.cached()});
    end(seq.req.id);
    return std::nullopt;
  }
  if (!seq.prompt.done()) {
    transition(seq.state, SeqState::kPrefilling, seq.req.id, "prefill");
    if (seq.warm()) return std::nullopt;
    // The KV segments every layer of which is now written go behind the next passes.
    seq.handoff.segments_done(
        static_cast<int>(seq.prompt.computed() / (int64_t{kKvSegmentBlocks} * engine_->blocks->block_size())));
    post_written(seq);
    return std::nullopt;
  }
  std::erase(queue_, seq.req.id);
  count_prompt(seq.prompt.cached(), n - seq.prompt.cached());
  Sampler sampler(seq.req.sampling);  // the decode rank's own sampler replays this token (Sampler::replay)
  if (Status st = constrain(sampler, engine_->grammars.get(), engine_->eos_id); !st.is_ok()) {
    fail(seq, st.message(), proto::FailureKind::kInvalid, /*tell_decode=*/true);
    return std::nullopt;
  }
  std::vector<float> scratch;
  proto::TokenEvent ev =
      seq.prompt.first_token(sampler, seq.req.prompt, rows.last(static_cast<size_t>(vocab)), engine_->eos_id, scratch);
  const int32_t first_token = ev.tokens[0];
  const bool stop = ev.finish != proto::Finish::kNone;
  seq.computed = env_->now();
  seq.hidden_bytes = seq.handoff.bytes_sent();
  seq.prompt.stamp(ev, seq.arrived, seq.computed);
  seq.handoff.finish(first_token, stop, *transport_, region_of(*engine_, seq.table), env_->now());
  // Held until the accept, or sending: its handoff's phase says which.
  transition(seq.state, SeqState::kHandingOff, seq.req.id, "prefill");
  return ev;
}

bool PrefillWorker::progress_transfers() {
  bool any = false;
  std::vector<proto::RequestId> sent, broken;
  const auto now = env_->now();
  for (auto& [id, seq] : seqs_) {
    const size_t before = seq.handoff.in_flight();
    const HandoffSender::Phase phase = seq.handoff.poll(*transport_, now);
    any |= seq.handoff.in_flight() != before;
    // A sequence of the running batch (kComputing) keeps its blocks until the pass
    // ends (the layer hook runs this function mid-pass).
    if (seq.state == SeqState::kComputing || seq.state == SeqState::kAborted) continue;
    if (phase == HandoffSender::Phase::kFailed) broken.push_back(id);
    else if (seq.state == SeqState::kHandingOff && phase == HandoffSender::Phase::kSent) sent.push_back(id);
  }
  for (proto::RequestId id : sent) {
    Seq& seq = seqs_.at(id);
    // Every byte is out: the blocks may be reused.
    channel_->send(roles_.router,
                   proto::TransferStats{seq.req.id, seq.handoff.bytes_posted(), seconds(now - seq.computed),
                                        seconds(now - seq.handoff.send_started()), seq.hidden_bytes});
    end(id);
  }
  for (proto::RequestId id : broken)
    if (Seq* seq = find_in(seqs_, id)) fail(*seq, seq->handoff.error(), proto::FailureKind::kTransfer, true);
  const size_t seals = seals_.size();
  std::erase_if(seals_, [&](const Seal& s) {
    const Result<OpState> r = transport_->test(s.op);
    if (!r.is_ok()) spdlog::warn("prefill rank {}: a seal to decode rank {} failed: {}", roles_.self, s.peer,
                                 r.status().to_string());
    return !r.is_ok() || *r != OpState::kPending;
  });
  any |= seals_.size() != seals;
  return any;
}

void PrefillWorker::check_deadlines() {
  const auto now = env_->now();
  const auto handoff = std::chrono::milliseconds(cfg_.timeouts.handoff_ms);
  const auto transfer = std::chrono::milliseconds(cfg_.timeouts.transfer_ms);
  const auto queue_bound = std::chrono::milliseconds(cfg_.timeouts.prefill_queue_ms);
  std::vector<std::pair<proto::RequestId, std::pair<std::string, proto::FailureKind>>> expired;
  for (auto& [id, seq] : seqs_) {
    if (seq.state == SeqState::kQueued && now - seq.arrived > queue_bound) {
      // Each deadline measures what it names: this one the wait for a batch.
      expired.push_back({id, {"waited " + std::to_string(cfg_.timeouts.prefill_queue_ms) + " ms in prefill rank " +
                                  std::to_string(roles_.self) + "'s queue without starting (timeouts.prefill_queue_ms)",
                              proto::FailureKind::kOverloaded}});
    } else if (!seq.warm() && !seq.handoff.accepted() && seq.state != SeqState::kAborted &&
               now - seq.offered > handoff) {
      expired.push_back({id, {"decode rank " + std::to_string(seq.req.decode_rank) +
                                  " did not accept the KV handoff within " + std::to_string(cfg_.timeouts.handoff_ms) +
                                  " ms",
                              proto::FailureKind::kOverloaded}});
    } else if (seq.state == SeqState::kHandingOff && seq.handoff.accepted() &&
               now - seq.handoff.last_progress() > transfer) {
      expired.push_back({id, {"KV transfer to decode rank " + std::to_string(seq.req.decode_rank) +
                                  " did not complete: no progress for " + std::to_string(cfg_.timeouts.transfer_ms) +
                                  " ms (timeouts.transfer_ms)",
                              proto::FailureKind::kTimeout}});
    }
  }
  for (auto& [id, why] : expired)  // fail() erases: not while iterating seqs_
    if (Seq* seq = find_in(seqs_, id)) fail(*seq, why.first, why.second, true);
}

void PrefillWorker::fail(Seq& seq, const std::string& reason, proto::FailureKind kind, bool tell_decode) {
  if (seq.state == SeqState::kAborted) return;
  spdlog::warn("prefill rank {}: request {} failed: {}", roles_.self, seq.req.id, reason);
  channel_->send(roles_.router, proto::RequestFailed{seq.req.id, reason, kind});
  if (tell_decode && !seq.warm()) channel_->send(seq.req.decode_rank, proto::HandoffAbort{seq.req.id, reason, epoch_});
  end(seq.req.id);
}

void PrefillWorker::end(proto::RequestId id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  Seq& seq = it->second;
  // Sends still in flight cannot be cancelled (ob1): the handoff abandons
  // them (HandoffSender::abandon), and nothing more of it goes out.
  seq.handoff.abandon(*transport_, graveyard_);
  if (seq.state == SeqState::kComputing && in_pass_) {
    // forward() is reading this sequence's block table: run_batch ends it after the pass.
    transition(seq.state, SeqState::kAborted, seq.req.id, "prefill");
    return;
  }
  // Blocks whose KV was computed stay in the prefix cache (free); others are discarded.
  const bool computed = seq.state == SeqState::kHandingOff || (seq.warm() && seq.prompt.done());
  bool placed = seq.prompt.placed();
  release_blocks(id, placed, computed);
  // A prompt stays in queue_ until its last chunk is computed, in any of
  // kQueued, kComputing and kPrefilling: leave nothing of it there.
  std::erase(queue_, id);
  seqs_.erase(it);
}

void PrefillWorker::fill_load(proto::LoadReport& r) const {
  r.waiting = static_cast<int32_t>(
      std::count_if(seqs_.begin(), seqs_.end(), [](const auto& kv) { return kv.second.state == SeqState::kQueued; }));
  r.running = static_cast<int32_t>(seqs_.size()) - r.waiting;
}

// Shutdown: the sends in flight get a bounded chance to complete.
std::chrono::milliseconds PrefillWorker::exit_grace() const {
  return std::chrono::milliseconds(std::min(cfg_.timeouts.transfer_ms, 5000));
}

}  // namespace pd
