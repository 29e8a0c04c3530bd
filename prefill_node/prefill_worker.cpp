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

// Places `prompt` in fresh blocks, reusing no cached prefix, so that every
// position is computed (prompt logprobs need each one's logits). Returns 0
// cached tokens; on failure nothing changed.
Result<int64_t> allocate_uncached(KvBlockManager& blocks, SeqId seq, std::span<const int32_t> prompt) {
  PD_RETURN_IF_ERROR(blocks.allocate(seq, {}).status());
  if (Status st = blocks.append(seq, prompt, nullptr); !st.is_ok()) {
    (void)blocks.free(seq);
    return st;
  }
  return int64_t{0};
}

}  // namespace

const char* state_name(PrefillWorker::JobState s) {
  using S = PrefillWorker::JobState;
  switch (s) {
    case S::kQueued: return "queued";
    case S::kComputing: return "computing";
    case S::kPrefilling: return "prefilling";
    case S::kHeld: return "held";
    case S::kSending: return "sending";
    case S::kAborted: return "aborted";
  }
  return "?";
}

bool legal(PrefillWorker::JobState from, PrefillWorker::JobState to) {
  using S = PrefillWorker::JobState;
  switch (from) {
    case S::kQueued: return to == S::kComputing;
    case S::kComputing:
      return to == S::kHeld || to == S::kSending || to == S::kAborted || to == S::kPrefilling;
    case S::kPrefilling: return to == S::kComputing;
    case S::kHeld: return to == S::kSending;
    case S::kSending:
    case S::kAborted: return false;  // only ended (erased) from here
  }
  return false;
}

void PrefillWorker::set_state(Job& job, JobState to) { transition(job.state, to, job.req.id, "prefill"); }

PrefillWorker::PrefillWorker(const ClusterConfig& cfg, const RoleTable& roles, std::shared_ptr<Engine> engine,
                             std::unique_ptr<Transport> transport, std::unique_ptr<ControlChannel> channel)
    : WorkerCore("prefill", cfg, roles, std::move(engine), std::move(transport), std::move(channel)) {
  // Layer hook: runs on this thread inside forward(), right after a layer's KV
  // is in the cache. Checksums are taken for every request of the batch (a
  // held request sends later); the control messages that arrived meanwhile
  // are acted on (mid_pass_message); every layer written so far of an
  // accepted handoff is handed to the communication side, which sends it
  // while the next layers compute. Nothing here ends a job under forward():
  // a job ended mid-pass becomes kAborted and run_batch ends it after the pass.
  engine_->model->set_kv_written_hook([this](int layer) {
    for (proto::RequestId id : batch_) {
      auto it = jobs_.find(id);
      if (it == jobs_.end()) continue;
      Job& job = it->second;
      // A layer of the prompt is complete when its last chunk writes it.
      if (job.state != JobState::kComputing || !job.last_chunk()) continue;
      if (engine_->kv_checksum) {
        Result<uint64_t> sum = kv_region_checksum(
            *engine_->backend, *engine_->cache.buffer,
            kv_layer_region(engine_->cache.buffer->data(), engine_->cache.layout, layer, job.table));
        if (sum.is_ok()) job.handoff.layer_written(layer, *sum);
        else job.handoff.fail("KV checksum failed: " + sum.status().message());
      } else {
        job.handoff.layer_written(layer, 0);
      }
    }
    handle_messages(/*in_pass=*/true);
    for (proto::RequestId id : batch_) {
      Job* job = find_job(id);
      if (job != nullptr && job->state == JobState::kComputing && job->last_chunk()) post_written(*job);
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
  for (auto& [id, job] : jobs_)
    if (job.req.decode_rank == rank) ids.push_back(id);
  for (proto::RequestId id : ids) {
    Job* job = find_job(id);
    if (job == nullptr) continue;
    // The router decides what happens to the request (re-run or error); an
    // id it already re-dispatched is stale to it and ignored.
    fail(*job, "decode rank " + std::to_string(rank) + " is down", proto::FailureKind::kPeerDown, false);
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
    if (Job* job = find_job(id); job != nullptr && job->state == JobState::kQueued)
      fail(*job, "prefill rank " + std::to_string(roles_.self) + " is leaving the cluster",
           proto::FailureKind::kLeaving, true);
  spdlog::info("prefill rank {}: draining (handed back {} queued, finishing {})", roles_.self, queued.size(),
               jobs_.size());
}

void PrefillWorker::drop_all() {
  std::vector<proto::RequestId> ids;
  for (auto& [id, job] : jobs_) ids.push_back(id);
  for (proto::RequestId id : ids) end(id);
  queue_.clear();
}

PrefillWorker::Job* PrefillWorker::find_job(proto::RequestId id) {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : &it->second;
}

bool PrefillWorker::in_batch(proto::RequestId id) const {
  return std::find(batch_.begin(), batch_.end(), id) != batch_.end();
}

void PrefillWorker::on_request(proto::PrefillRequest req) {
  const proto::RequestId id = req.id;
  if (jobs_.count(id)) {
    spdlog::error("prefill rank {}: duplicate request {}", roles_.self, id);
    return;
  }
  if (req.decode_rank >= 0 && peers_.is_down(req.decode_rank)) {  // the router sent it before it learned; it will hear it failed
    channel_->send(roles_.router, proto::RequestFailed{id, "decode rank " + std::to_string(req.decode_rank) + " is down",
                                                       proto::FailureKind::kPeerDown});
    return;
  }
  Job& job = jobs_[id];
  job.req = std::move(req);
  // Its queue wait counts from when the communication side took it off the
  // network, not from when this loop got to it.
  job.arrived = channel_->arrival().value_or(env_->now());
  job.offered = env_->now();
  if (job.warm()) {  // no handoff: the prompt only goes into the prefix cache
    queue_.push_back(id);
    return;
  }
  const int64_t bs = engine_->blocks->block_size();
  job.handoff = HandoffSender(job.req.decode_rank, id, epoch_, header_.n_layers,
                              kv_segments((static_cast<int64_t>(job.req.prompt.size()) + bs - 1) / bs));
  // Offer the handoff now: the decode rank reserves blocks while we compute.
  proto::HandoffOffer offer;
  offer.header = header_;
  offer.header.request_id = id;
  offer.header.n_tokens = static_cast<int32_t>(job.req.prompt.size());
  offer.prompt = job.req.prompt;
  offer.sampling = job.req.sampling;
  offer.epoch = epoch_;
  offer.endpoint = endpoint_;
  channel_->send(job.req.decode_rank, offer);
  queue_.push_back(id);
}

void PrefillWorker::on_cancel(proto::RequestId id) {
  Job* job = find_job(id);
  if (job == nullptr) return;  // already handed off or finished
  switch (job->state) {
    case JobState::kQueued:
    case JobState::kComputing:
    case JobState::kPrefilling:
    case JobState::kHeld:
      if (!job->warm()) channel_->send(job->req.decode_rank, proto::HandoffAbort{id, "cancelled", epoch_});
      end(id);
      break;
    case JobState::kSending:  // the decode rank was cancelled too; the transfer completes, then we free
    case JobState::kAborted: break;
  }
}

void PrefillWorker::on_accept(const proto::HandoffAccept& m, int source) {
  Job* job = find_job(m.id);
  if (job == nullptr) {
    // Ended here without telling that rank (it was declared down, or the abort
    // crossed this accept): say so, or its blocks wait for timeouts.transfer_ms.
    channel_->send(source, proto::HandoffAbort{m.id, "the handoff ended on prefill rank " +
                                                         std::to_string(roles_.self), epoch_});
    return;
  }
  if (job->state == JobState::kAborted) return;  // aborted in the running pass; its abort tells it
  if (source != job->req.decode_rank) {
    spdlog::error("prefill rank {}: accept for request {} from rank {}, offered to {}", roles_.self, m.id, source,
                  job->req.decode_rank);
    return;
  }
  if (!proto::is_kv_tag(m.tag)) {
    // KV bytes under any other tag would land among control messages (or another path's).
    spdlog::error("prefill rank {}: accept for request {} from rank {} under tag {}, not a KV tag; ignored",
                  roles_.self, m.id, source, m.tag);
    count_refused();
    return;
  }
  if (!job->handoff.accept(m.tag)) return;  // a duplicate
  sealed_.erase({source, m.tag});  // the tag came back to us: a new handoff under it
  // The decode rank chose the same path from the same two endpoints.
  if (Status st = transport_->select_path(source, choose_kv_path(endpoint_, m.endpoint)); !st.is_ok())
    job->handoff.fail("KV path: " + st.message());
  if (job->state == JobState::kHeld) {
    set_state(*job, JobState::kSending);
    post_written(*job);
  } else if (job->state == JobState::kPrefilling) {
    post_written(*job);  // the segments its earlier chunks completed
  }
  // A job in the running pass posts its written KV from the layer hook.
}

void PrefillWorker::on_reject(const proto::HandoffReject& m, int source) {
  Job* job = find_job(m.id);
  if (job == nullptr || source != job->req.decode_rank) return;
  if (job->handoff.accepted() || job->state == JobState::kSending || job->state == JobState::kAborted) return;
  if (!m.cancelled)
    channel_->send(roles_.router,
                   proto::RequestFailed{m.id, "decode rank " + std::to_string(job->req.decode_rank) +
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
  for (const auto& [id, job] : jobs_)
    if (id != m.id && job.req.decode_rank == source && job.handoff.accepted() && job.handoff.tag() == m.tag &&
        job.state != JobState::kAborted) {
      spdlog::warn("prefill rank {}: decode rank {} asked to seal tag {} for request {}, but request {} holds it",
                   roles_.self, source, m.tag, m.id, id);
      return;
    }
  // An aborted job (ended in the running pass) posts nothing more and is erased after the pass.
  if (Job* job = find_job(m.id); job != nullptr && job->req.decode_rank == source && job->state != JobState::kAborted)
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

HandoffSender::RegionOf PrefillWorker::region_of(const Job& job) const {
  return [this, &job](int layer, int segment) {
    return kv_layer_region(engine_->cache.buffer->data(), engine_->cache.layout, layer, kv_segment(job.table, segment));
  };
}

void PrefillWorker::post_written(Job& job) {
  // Sends to one peer go out in posting order; how many are in flight at once
  // is the communication side's business (kvtransfer/send_budget.h).
  job.handoff.post_written(*transport_, region_of(job), env_->now());
}

// Remaining tokens of a prompt that has not started: what the prefix cache does
// not hold (prompt logprobs need every position: such a prompt reuses nothing).
int64_t PrefillWorker::uncached_tokens(const Job& job) const {
  const int64_t n = static_cast<int64_t>(job.req.prompt.size());
  return job.req.sampling.prompt_logprobs ? n : n - engine_->blocks->cached_prefix_tokens(job.req.prompt);
}

// Blocks the started prompts will still take for their later chunks: set
// aside, so a prompt once started always finishes (no two half-computed
// prompts can wait on each other's blocks).
int64_t PrefillWorker::reserved_blocks() const {
  int64_t reserved = 0;
  for (const auto& [id, job] : jobs_)
    if (job.state == JobState::kPrefilling)
      reserved += engine_->blocks->blocks_needed_to_append(
          seq_of(id), static_cast<int>(static_cast<int64_t>(job.req.prompt.size()) - job.done));
  return reserved;
}

// Places the job's next chunk, tokens [job.done, end), in its blocks. The
// first chunk creates the sequence (reusing cached prefix blocks unless prompt
// logprobs need every position; job.done becomes what the cache held); a
// block is registered for reuse only when the pass that writes it is next.
Status PrefillWorker::place_chunk(Job& job, int64_t end) {
  KvBlockManager& blocks = *engine_->blocks;
  const SeqId seq = seq_of(job.req.id);
  const std::span<const int32_t> prompt(job.req.prompt);
  if (!job.has_seq) {
    Result<int64_t> cached = job.req.sampling.prompt_logprobs
                                 ? allocate_uncached(blocks, seq, prompt.first(static_cast<size_t>(end)))
                                 : blocks.allocate(seq, prompt.first(static_cast<size_t>(end)));
    PD_RETURN_IF_ERROR(cached.status());
    job.has_seq = true;
    job.done = job.cached = *cached;
  } else {
    std::vector<BlockCopy> copies;  // a prompt's last block is its own: nothing to copy
    PD_RETURN_IF_ERROR(blocks.append(seq, prompt.subspan(static_cast<size_t>(job.done),
                                                         static_cast<size_t>(end - job.done)), &copies));
    if (!copies.empty()) return Status::internal("prefill: a prompt's block was shared while it was computed");
  }
  job.chunk_end = end;
  job.table.clear();
  for (BlockId b : blocks.block_table(seq)) job.table.push_back(b.value);
  return Status::ok();
}

// Chooses the next pass: chunks of waiting and started prompts under the
// token budget (serving/prefill_chunks.h), a prompt that has not started only
// if its whole prompt's blocks are free beside what started ones will take.
// Fills batch_ (the jobs become kComputing).
void PrefillWorker::plan_pass() {
  std::erase_if(queue_, [&](proto::RequestId id) { return find_job(id) == nullptr; });
  std::vector<PrefillCandidate> candidates;
  for (proto::RequestId id : queue_) {
    const Job& job = jobs_.at(id);
    const int64_t n = static_cast<int64_t>(job.req.prompt.size());
    if (job.state == JobState::kQueued) {
      const int64_t uncached = uncached_tokens(job);
      candidates.push_back({id, uncached, n - uncached});
    } else if (job.state == JobState::kPrefilling) {
      candidates.push_back({id, n - job.done, job.done});
    }
  }
  const ChunkPolicy policy{cfg_.prefill.token_budget, cfg_.prefill.chunk_tokens, cfg_.prefill.max_batch,
                           cfg_.prefill.context_cost_tokens};
  KvBlockManager& blocks = *engine_->blocks;
  int64_t free = blocks.num_free_blocks() - reserved_blocks();
  bool may_start = true;  // no overtaking among prompts that have not started
  for (const PrefillChunk& chunk : plan_prefill_chunks(candidates, policy)) {
    Job& job = jobs_.at(chunk.id);
    const int64_t n = static_cast<int64_t>(job.req.prompt.size());
    int64_t end = job.done + chunk.tokens;
    if (job.state == JobState::kQueued) {
      if (!may_start) continue;
      const int64_t needed = job.req.sampling.prompt_logprobs
                                 ? blocks.blocks_needed_to_append(seq_of(job.req.id), static_cast<int>(n))
                                 : blocks.blocks_needed_for_prompt(job.req.prompt);
      if (needed > free) {
        // Held KV (offers not yet accepted) and sends in flight free blocks
        // later. A prompt that cannot fit even in an empty pool fails now.
        if (batch_.empty() && blocks.num_free_blocks() == blocks.num_blocks() && reserved_blocks() == 0)
          fail(job, "prompt of " + std::to_string(n) + " tokens does not fit this prefill rank's KV pool (" +
                        std::to_string(blocks.num_blocks() * blocks.block_size()) +
                        " tokens; raise kv.prefill_budget_mb)",
               proto::FailureKind::kInvalid, true);
        may_start = false;
        continue;
      }
      free -= needed;
      end = n - uncached_tokens(job) + chunk.tokens;  // what the cache holds, then the chunk
    }
    if (Status st = place_chunk(job, std::min(end, n)); !st.is_ok()) {
      spdlog::error("prefill rank {}: request {}: placing its chunk: {}", roles_.self, job.req.id, st.to_string());
      if (job.state == JobState::kQueued) may_start = false;
      continue;
    }
    if (job.state == JobState::kQueued) {
      job.started = env_->now();
      job.queue_s = seconds(job.started - job.arrived);
    }
    set_state(job, JobState::kComputing);
    batch_.push_back(job.req.id);
  }
}

bool PrefillWorker::run_batch() {
  batch_.clear();
  plan_pass();
  if (batch_.empty()) return false;

  // Sequence views (spans into the jobs, which do not move during the pass:
  // nothing erases a kComputing job; it becomes kAborted instead).
  std::vector<SequenceBatch> seqs;
  seqs.reserve(batch_.size());
  for (proto::RequestId id : batch_) {
    const Job& job = jobs_.at(id);
    SequenceBatch sb;
    sb.tokens = std::span<const int32_t>(job.req.prompt)
                    .subspan(static_cast<size_t>(job.done), static_cast<size_t>(job.chunk_end - job.done));
    sb.start_pos = static_cast<int32_t>(job.done);
    sb.block_table = job.table;
    sb.want_logits = job.last_chunk();
    sb.all_logits = job.req.sampling.prompt_logprobs;
    seqs.push_back(sb);
  }
  std::vector<float> logits;
  in_pass_ = true;
  Status st = engine_->model->prefill(seqs, engine_->cache, &logits);
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
      if (Job* job = find_job(id)) fail(*job, "prefill failed: " + st.message(), proto::FailureKind::kInternal, true);
  }
  const int64_t vocab = engine_->config().vocab;
  proto::TokenEvents events;
  size_t next_row = 0;  // the first logits row of ran[i]
  for (size_t i = 0; i < ran.size(); ++i) {
    const size_t first_row = next_row;
    next_row += seqs[i].all_logits ? seqs[i].tokens.size() : seqs[i].want_logits ? 1 : 0;
    Job* found = find_job(ran[i]);
    if (found == nullptr) continue;
    Job& job = *found;
    if (job.state == JobState::kAborted) {  // ended during the pass: forward() is done with its blocks now
      end(job.req.id);
      continue;
    }
    if (job.handoff.phase() == HandoffSender::Phase::kFailed) {  // a checksum or a send from the layer hook failed
      fail(job, job.handoff.error(), proto::FailureKind::kTransfer, true);
      continue;
    }
    const auto rows = std::span<float>(logits).subspan(first_row * vocab, (next_row - first_row) * vocab);
    if (std::optional<proto::TokenEvent> ev = finish_chunk(job, rows)) events.events.push_back(std::move(*ev));
  }
  if (!events.events.empty()) channel_->send(roles_.router, events);
  return true;
}

// After a pass: the job's chunk is in the cache. A prompt with chunks left
// waits for the next pass (kPrefilling); a finished one samples token 1,
// returns its event, and hands off the rest of its KV (now if the decode rank
// accepted; else when it does, on_accept).
std::optional<proto::TokenEvent> PrefillWorker::finish_chunk(Job& job, std::span<float> rows) {
  const int64_t vocab = engine_->config().vocab;
  const SamplingParams& sp = job.req.sampling;
  if (sp.prompt_logprobs)
    append_prompt_logprobs(job.req.prompt, job.done, job.chunk_end, rows, vocab, sp.logprobs, job.prompt_logprobs);
  job.done = job.chunk_end;
  if (job.warm() && job.last_chunk()) {  // in the cache now (its blocks stay there as the job ends)
    // Not in the rank's prompt-token counts: those add up to the prompts the router dispatched.
    const int64_t n = static_cast<int64_t>(job.req.prompt.size());
    channel_->send(roles_.router, proto::Warmed{job.req.id, n - job.cached});
    end(job.req.id);
    return std::nullopt;
  }
  if (job.done < static_cast<int64_t>(job.req.prompt.size())) {
    set_state(job, JobState::kPrefilling);
    if (job.warm()) return std::nullopt;
    // The KV segments every layer of which is now written go behind the next passes.
    job.handoff.segments_done(static_cast<int>(job.done / (int64_t{kKvSegmentBlocks} * engine_->blocks->block_size())));
    post_written(job);
    return std::nullopt;
  }
  std::erase(queue_, job.req.id);
  count_prompt(job.cached, static_cast<int64_t>(job.req.prompt.size()) - job.cached);
  Sampler sampler(sp);  // the decode rank's own sampler replays this token (Sampler::replay)
  sampler.resume(job.req.prompt);
  std::vector<float> scratch;
  proto::TokenEvent ev = sample_token_event(sampler, job.req.id, 1, rows.last(static_cast<size_t>(vocab)),
                                            engine_->eos_id, scratch);
  ev.prompt_logprobs = std::move(job.prompt_logprobs);
  ev.cached_tokens = static_cast<int32_t>(job.cached);
  const int32_t first_token = ev.tokens[0];
  const bool stop = ev.finish != proto::Finish::kNone;
  job.computed = env_->now();
  job.hidden_bytes = job.handoff.bytes_sent();
  ev.queue_s = job.queue_s;
  // From its first chunk's pass to its last (a chunked prompt's time includes
  // the other prompts' chunks computed beside it: what chunking costs it).
  ev.prefill_s = seconds(job.computed - job.started);
  job.handoff.finish(first_token, stop, *transport_, region_of(job), env_->now());
  set_state(job, job.handoff.accepted() ? JobState::kSending : JobState::kHeld);
  return ev;
}

bool PrefillWorker::progress_transfers() {
  bool any = false;
  std::vector<proto::RequestId> sent, broken;
  const auto now = env_->now();
  for (auto& [id, job] : jobs_) {
    const size_t before = job.handoff.in_flight();
    const HandoffSender::Phase phase = job.handoff.poll(*transport_, now);
    any |= job.handoff.in_flight() != before;
    // A job of the running batch (kComputing) keeps its blocks until the pass
    // ends (the layer hook runs this function mid-pass).
    if (job.state == JobState::kComputing || job.state == JobState::kAborted) continue;
    if (phase == HandoffSender::Phase::kFailed) broken.push_back(id);
    else if (job.state == JobState::kSending && phase == HandoffSender::Phase::kSent) sent.push_back(id);
  }
  for (proto::RequestId id : sent) {
    Job& job = jobs_.at(id);
    // Every byte is out: the blocks may be reused.
    channel_->send(roles_.router,
                   proto::TransferStats{job.req.id, job.handoff.bytes_posted(), seconds(now - job.computed),
                                        seconds(now - job.handoff.send_started()), job.hidden_bytes});
    end(id);
  }
  for (proto::RequestId id : broken)
    if (Job* job = find_job(id)) fail(*job, job->handoff.error(), proto::FailureKind::kTransfer, true);
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
  for (auto& [id, job] : jobs_) {
    if (job.state == JobState::kQueued && now - job.arrived > queue_bound) {
      // Each deadline measures what it names: this one the wait for a batch.
      expired.push_back({id, {"waited " + std::to_string(cfg_.timeouts.prefill_queue_ms) + " ms in prefill rank " +
                                  std::to_string(roles_.self) + "'s queue without starting (timeouts.prefill_queue_ms)",
                              proto::FailureKind::kOverloaded}});
    } else if (!job.warm() && !job.handoff.accepted() && job.state != JobState::kAborted &&
               now - job.offered > handoff) {
      expired.push_back({id, {"decode rank " + std::to_string(job.req.decode_rank) +
                                  " did not accept the KV handoff within " + std::to_string(cfg_.timeouts.handoff_ms) +
                                  " ms",
                              proto::FailureKind::kOverloaded}});
    } else if (job.state == JobState::kSending && now - job.handoff.last_progress() > transfer) {
      expired.push_back({id, {"KV transfer to decode rank " + std::to_string(job.req.decode_rank) +
                                  " did not complete: no progress for " + std::to_string(cfg_.timeouts.transfer_ms) +
                                  " ms (timeouts.transfer_ms)",
                              proto::FailureKind::kTimeout}});
    }
  }
  for (auto& [id, why] : expired)  // fail() erases: not while iterating jobs_
    if (Job* job = find_job(id)) fail(*job, why.first, why.second, true);
}

void PrefillWorker::fail(Job& job, const std::string& reason, proto::FailureKind kind, bool tell_decode) {
  if (job.state == JobState::kAborted) return;
  spdlog::warn("prefill rank {}: request {} failed: {}", roles_.self, job.req.id, reason);
  channel_->send(roles_.router, proto::RequestFailed{job.req.id, reason, kind});
  if (tell_decode && !job.warm()) channel_->send(job.req.decode_rank, proto::HandoffAbort{job.req.id, reason, epoch_});
  end(job.req.id);
}

void PrefillWorker::end(proto::RequestId id) {
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return;
  Job& job = it->second;
  // Sends still in flight cannot be cancelled (ob1): the handoff abandons
  // them (HandoffSender::abandon), and nothing more of it goes out.
  job.handoff.abandon(*transport_, graveyard_);
  if (job.state == JobState::kComputing && in_pass_) {
    // forward() is reading this job's block table: run_batch ends it after the pass.
    set_state(job, JobState::kAborted);
    return;
  }
  // Blocks whose KV was computed stay in the prefix cache (free); others are discarded.
  const bool computed = job.state == JobState::kSending || job.state == JobState::kHeld ||
                        (job.warm() && job.done == static_cast<int64_t>(job.req.prompt.size()));
  release_blocks(id, job.has_seq, computed);
  // A prompt stays in queue_ until its last chunk is computed, in any of
  // kQueued, kComputing and kPrefilling: leave nothing of it there.
  std::erase(queue_, id);
  jobs_.erase(it);
}

void PrefillWorker::fill_load(proto::LoadReport& r) const {
  r.waiting = static_cast<int32_t>(
      std::count_if(jobs_.begin(), jobs_.end(), [](const auto& kv) { return kv.second.state == JobState::kQueued; }));
  r.running = static_cast<int32_t>(jobs_.size()) - r.waiting;
}

// Shutdown: the sends in flight get a bounded chance to complete.
std::chrono::milliseconds PrefillWorker::exit_grace() const {
  return std::chrono::milliseconds(std::min(cfg_.timeouts.transfer_ms, 5000));
}

}  // namespace pd
