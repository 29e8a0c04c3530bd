#include "decode_node/decode_worker.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <set>
#include <unordered_set>

#include "decode_node/scheduler.h"
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

bool chunked(const ClusterConfig& cfg) { return cfg.prefill.chunk_tokens > 0; }

// `table` <- the ids of the blocks sequence `id` holds (it keeps its capacity).
void fill_table(const KvBlockManager& blocks, proto::RequestId id, std::vector<int32_t>& table) {
  table.clear();
  for (BlockId b : blocks.block_table(seq_of(id))) table.push_back(b.value);
}

// The tokens of a step, every sequence's.
int tokens_in(std::span<const SequenceBatch> batch) {
  int n = 0;
  for (const SequenceBatch& b : batch) n += static_cast<int>(b.tokens.size());
  return n;
}

// What preempting `seq` frees: the blocks it holds alone (a block it shares
// with a sibling of an n > 1 request or a sequence that reused its prefix
// stays taken).
int64_t blocks_held_alone(const KvBlockManager& blocks, SeqId seq) {
  const auto& table = blocks.block_table(seq);
  return static_cast<int64_t>(std::count_if(table.begin(), table.end(), [&](BlockId b) { return blocks.ref_count(b) == 1; }));
}

}  // namespace

const char* state_name(DecodeWorker::SeqState s) {
  using S = DecodeWorker::SeqState;
  switch (s) {
    case S::kReady: return "ready";
    case S::kQueued: return "queued";
    case S::kRunning: return "running";
    case S::kPreempted: return "preempted";
    case S::kPrefilling: return "prefilling";
  }
  return "?";
}

bool legal(DecodeWorker::SeqState from, DecodeWorker::SeqState to) {
  using S = DecodeWorker::SeqState;
  switch (from) {
    case S::kReady: return to == S::kRunning || to == S::kPreempted;
    case S::kQueued: return to == S::kRunning || to == S::kPrefilling;
    case S::kRunning: return to == S::kPreempted;
    case S::kPreempted: return to == S::kRunning || to == S::kPrefilling;
    case S::kPrefilling: return to == S::kRunning || to == S::kPreempted;
  }
  return false;
}

proto::TokenEvent DecodeWorker::Seq::next_token(std::span<float> row, int32_t eos_id, std::vector<float>& scratch) {
  proto::TokenEvent ev = sample_token_event(*sampler, id, n_generated + 1, row, eos_id, scratch);
  tokens.push_back(ev.tokens[0]);
  ++n_generated;
  return ev;
}

DecodeWorker::DecodeWorker(const ClusterConfig& cfg, const RoleTable& roles, std::shared_ptr<Engine> engine,
                           std::unique_ptr<Transport> transport, std::unique_ptr<ControlChannel> channel)
    : WorkerCore("decode", cfg, roles, std::move(engine), std::move(transport), std::move(channel)),
      intake_(HandoffIntake::Context{roles_.self, roles_.router, engine_.get(), transport_.get(), channel_.get(),
                                     &peers_, &header_, &endpoint_, &epoch_, &env_, cfg_.timeouts, cfg_.kv.tag_span}) {
  // Between layers of a long forward pass (a colocated prefill, a recompute):
  // keep sends moving and load reports flowing so /health stays truthful.
  engine_->model->set_kv_written_hook([this](int) {
    channel_->progress();
    report_load(false);
  });
}

bool DecodeWorker::work() {
  bool busy = intake_.seal_tags();
  busy |= accept_offers();
  busy |= step();
  return busy;
}

bool DecodeWorker::on_message(int source, proto::Message& msg) {
  if (auto* m = std::get_if<proto::HandoffOffer>(&msg)) {
    if (current(source, m->epoch)) {
      const proto::RequestId id = m->header.request_id;
      const bool known = seqs_.count(id) > 0 || intake_.source_of(id).has_value();
      if (intake_.on_offer(std::move(*m), source, known, next_order_)) ++next_order_;
    }
  } else if (auto* m = std::get_if<proto::PrefillRequest>(&msg)) {
    on_prompt(std::move(*m));
  } else if (auto* m = std::get_if<proto::Cancel>(&msg)) {
    // Its KV here (or to compute here): it simply ends. Else the intake's (or
    // not here yet: the intake remembers the router's cancel).
    if (Seq* s = find_in(seqs_, m->id)) erase(*s);
    else intake_.on_cancel(m->id, false);
  } else if (auto* m = std::get_if<proto::HandoffAbort>(&msg)) {
    // Only the handoff's own prefill rank may abort it (an aborting prefill
    // rank told the router why itself).
    if (!current(source, m->epoch)) return true;
    if (Seq* s = find_in(seqs_, m->id)) {
      if (s->source == source) erase(*s);
    } else if (intake_.source_of(m->id) == source) {
      intake_.on_cancel(m->id, true);
    }
  } else {
    return false;
  }
  return true;
}

void DecodeWorker::on_drain() {
  spdlog::info("decode rank {}: draining (finishing {} sequences)", roles_.self, held());
}

void DecodeWorker::drop_all() {
  intake_.drop_all();
  std::vector<proto::RequestId> ids;
  for (auto& [id, s] : seqs_) ids.push_back(id);
  for (proto::RequestId id : ids)
    if (Seq* s = find_in(seqs_, id)) erase(*s);
  running_.clear();
  prefilling_.clear();
  waiting_.clear();
}

void DecodeWorker::erase(Seq& s) {
  s.kv.release(*engine_->blocks, s.id, roles_.self);
  const proto::RequestId id = s.id;
  std::erase(running_, id);
  std::erase(prefilling_, id);
  std::erase(waiting_, id);
  seqs_.erase(id);
}

void DecodeWorker::on_prompt(proto::PrefillRequest m) {
  const proto::RequestId id = m.id;
  auto fail_now = [&](const std::string& reason, proto::FailureKind kind) {
    channel_->send(roles_.router, proto::RequestFailed{id, reason, kind});
  };
  if (intake_.was_cancelled(id)) return;
  if (seqs_.count(id) || intake_.source_of(id))
    return fail_now("duplicate request id " + std::to_string(id), proto::FailureKind::kInternal);
  if (Status st = m.sampling.validate(); !st.is_ok()) return fail_now(st.message(), proto::FailureKind::kInvalid);
  engine_->grammars->compile_in_background(m.sampling.grammar);  // for its token 1 (first_token)
  const int64_t need = blocks_for_tokens(static_cast<int64_t>(m.prompt.size()) + m.sampling.max_tokens);
  if (m.prompt.empty() || need > engine_->blocks->num_blocks())
    return fail_now("request needs " + std::to_string(need) + " KV blocks at its longest; this rank has " +
                        std::to_string(engine_->blocks->num_blocks()) + " (raise kv.decode_budget_mb)",
                    proto::FailureKind::kInvalid);
  Seq& s = seqs_[id];
  s.id = id;
  s.state = SeqState::kQueued;
  s.tokens = std::move(m.prompt);
  s.params = m.sampling;
  s.arrived = s.received = channel_->arrival().value_or(env_->now());
  s.order = next_order_++;
  waiting_.push_back(id);
}

bool DecodeWorker::accept_offers() {
  KvBlockManager& blocks = *engine_->blocks;
  // Preempted sequences have first call on freed blocks: no new handoffs until they are back.
  for (proto::RequestId w : waiting_)
    if (const Seq* s = find_in(seqs_, w); s != nullptr && s->state == SeqState::kPreempted) return false;
  if (!intake_.has_offers()) return false;
  // Keep room for the running batch's next tokens and for received-but-not-yet-
  // running sequences, so accepting a handoff does not force a preemption.
  // (Accepted handoffs join neither list, so this holds for the whole loop.)
  int64_t reserved = 0;
  for (proto::RequestId r : running_) reserved += blocks.blocks_needed_to_append(seq_of(r), 1);
  for (proto::RequestId r : prefilling_) reserved += blocks.blocks_needed_to_append(seq_of(r), 1);
  for (proto::RequestId w : waiting_)
    if (const Seq* s = find_in(seqs_, w); s != nullptr && s->kv.held()) reserved += blocks.blocks_needed_to_append(seq_of(w), 1);
  return intake_.accept_offers(reserved);
}

// A landed handoff joins the waiting sequences: its sampler replays token 1
// (sampled by the prefill rank) after the prompt.
bool DecodeWorker::progress_transfers() {
  std::vector<HandoffIntake::Landed> landed;
  const bool any = intake_.progress(landed);
  for (HandoffIntake::Landed& l : landed) {
    Seq& s = seqs_[l.id];
    s.id = l.id;
    s.source = l.source;
    s.state = SeqState::kReady;
    s.tokens = std::move(l.prompt);
    s.params = std::move(l.params);
    s.kv = l.kv;
    s.order = l.order;
    s.received = l.received;
    s.sampler.emplace(s.params);
    if (Status st = constrain(*s.sampler, engine_->grammars.get(), engine_->eos_id); !st.is_ok()) {
      fail(s, st.message(), proto::FailureKind::kInvalid);
      continue;
    }
    s.sampler->resume(s.tokens);  // the prompt
    s.sampler->replay(l.first_token);
    s.tokens.push_back(l.first_token);
    s.n_generated = 1;
    waiting_.push_back(s.id);
  }
  return any;
}

void DecodeWorker::check_deadlines() {
  // Of the down senders quarantining blocks, those whose process is known to have ended.
  std::set<int> gone;
  for (int rank : intake_.down_senders())
    if (peer_gone(rank)) gone.insert(rank);
  intake_.check_deadlines(gone);
}

void DecodeWorker::fail(Seq& s, const std::string& reason, proto::FailureKind kind) {
  spdlog::warn("decode rank {}: request {} failed: {}", roles_.self, s.id, reason);
  channel_->send(roles_.router, proto::RequestFailed{s.id, reason, kind});
  erase(s);
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
    in.running.push_back({id, blocks.blocks_needed_to_append(seq_of(id), 1), blocks_held_alone(blocks, seq_of(id)),
                          seqs_.at(id).order});
  for (proto::RequestId id : prefilling_)
    in.running.push_back({id, 0, blocks_held_alone(blocks, seq_of(id)), seqs_.at(id).order});
  auto rank_of = [&](const Seq& s) { return s.state == SeqState::kReady ? 0 : s.state == SeqState::kPreempted ? 1 : 2; };
  std::vector<proto::RequestId> order(waiting_.begin(), waiting_.end());
  std::stable_sort(order.begin(), order.end(), [&](proto::RequestId a, proto::RequestId b) {
    const Seq &sa = seqs_.at(a), &sb = seqs_.at(b);
    if (rank_of(sa) != rank_of(sb)) return rank_of(sa) < rank_of(sb);
    return sa.order < sb.order;
  });
  std::unordered_set<proto::RequestId> given_chunk;
  if (chunked(cfg_)) {
    std::vector<PrefillCandidate> candidates;
    for (proto::RequestId id : prefilling_) {
      const Seq& s = seqs_.at(id);
      candidates.push_back({id, s.prompt.target() - s.prompt.computed(), s.prompt.computed()});
    }
    for (proto::RequestId id : order) {
      const Seq& s = seqs_.at(id);
      if (s.state == SeqState::kReady) continue;  // its KV is here
      const auto toks = std::span<const int32_t>(s.tokens).first(static_cast<size_t>(s.compute_target()));
      const int64_t cached = s.reuses_cache() ? blocks.cached_prefix_tokens(toks) : 0;
      candidates.push_back({id, s.compute_target() - cached, cached});
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
    if (s.state != SeqState::kReady) {  // KV to compute here
      const int64_t n = static_cast<int64_t>(s.tokens.size());
      if (chunked(cfg_)) {
        if (!given_chunk.count(id)) continue;
      } else {
        if (compute_tokens > 0 && compute_tokens + n > cfg_.prefill.token_budget) break;
        compute_tokens += n;
      }
      need = blocks_for_tokens(s.n_generated == 0 ? n + 1 : n);
    } else {
      need = blocks.blocks_needed_to_append(seq_of(id), 1);
    }
    in.waiting.push_back({id, need, s.kv.held() ? held(id) : 0});
  }
  return in;
}

// Applies the scheduler's plan: preemptions and evictions free blocks (the
// sequence is recomputed later); admitted sequences join the batch, or start
// computing their KV — chunk by chunk (kPrefilling), or whole (returned).
std::vector<proto::RequestId> DecodeWorker::commit(const SchedulerPlan& plan) {
  for (uint64_t id : plan.preempt) {
    Seq& s = seqs_.at(id);
    s.kv.release(*engine_->blocks, s.id, roles_.self);
    s.prompt = PromptPass();  // its KV is computed again from the start
    transition(s.state, SeqState::kPreempted, s.id, "decode");
    std::erase(running_, id);
    std::erase(prefilling_, id);
    waiting_.push_front(id);
    ++preemptions_;
    spdlog::debug("decode rank {}: preempted request {} ({} tokens)", roles_.self, id, s.tokens.size());
  }
  for (uint64_t id : plan.evict) {  // stalled holders: recompute later
    Seq& s = seqs_.at(id);
    s.kv.release(*engine_->blocks, s.id, roles_.self);
    transition(s.state, SeqState::kPreempted, s.id, "decode");
    ++preemptions_;
  }
  std::vector<proto::RequestId> whole;
  for (uint64_t id : plan.admit) {
    Seq& s = seqs_.at(id);
    std::erase(waiting_, id);
    if (s.state == SeqState::kReady) {
      transition(s.state, SeqState::kRunning, s.id, "decode");
      running_.push_back(id);
    } else if (!chunked(cfg_)) {
      whole.push_back(id);
    } else if (Status st = start_prompt(s); st.is_resource_exhausted()) {
      // The plan counted on blocks that did not come free (shared after all):
      // it waits, first in line, for the next iteration's plan; so do the rest.
      s.prompt = PromptPass();
      waiting_.push_front(id);
      spdlog::debug("decode rank {}: request {} waits: {}", roles_.self, id, st.message());
      break;
    } else if (!st.is_ok()) {
      fail(s, "prefill on decode rank failed: " + st.message(), proto::FailureKind::kInternal);
    } else {  // its chunks run in the next steps
      s.prompt.start(env_->now());
      transition(s.state, SeqState::kPrefilling, s.id, "decode");
      prefilling_.push_back(s.id);
    }
  }
  return whole;
}

Status DecodeWorker::start_prompt(Seq& s) {
  const bool fresh = s.n_generated == 0;
  s.prompt = PromptPass(s.id, {.target = s.compute_target(),
                               .first_token = fresh,
                               .prompt_logprobs = fresh && s.params.prompt_logprobs,
                               .top_logprobs = s.params.logprobs,
                               .publish = false});  // registered once written (kv.written)
  PD_RETURN_IF_ERROR(s.prompt.place(*engine_->blocks, s.tokens, s.compute_target()));
  s.kv.allocated(s.id);  // written when the pass that computes the rest has run
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
    const Seq* s = find_in(seqs_, c.id);
    return s == nullptr || s->state != SeqState::kPrefilling;
  });
  for (PrefillChunk& c : chunks) {
    const Seq& s = seqs_.at(c.id);
    c.tokens = std::min(c.tokens, s.prompt.target() - s.prompt.computed());
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
  int64_t spare = 0;  // speculation: blocks the batch's next tokens leave free
  if (cfg_.decode.speculate > 0) {
    spare = blocks.num_free_blocks();
    for (proto::RequestId id : running_) spare -= blocks.blocks_needed_to_append(seq_of(id), 1);
  }
  for (proto::RequestId id : running_) {
    Seq& s = seqs_.at(id);
    plan_draft(s, spare);
    if (Status st = blocks.append(seq_of(id), s.step, nullptr); !st.is_ok()) {
      spdlog::error("decode rank {}: request {}: {}", roles_.self, s.id, st.to_string());
      continue;  // the scheduler planned room; should not happen — retried next iteration
    }
    fill_table(blocks, id, step_tables_[used]);
    step_batch_[used] = SequenceBatch{s.step, static_cast<int32_t>(s.tokens.size()) - 1, step_tables_[used], true,
                                      s.step.size() > 1};
    ++used;
    stepped_.push_back(s.id);
  }
  for (const PrefillChunk& c : chunks) {
    const Seq& s = seqs_.at(c.id);
    fill_table(blocks, c.id, step_tables_[used]);
    step_batch_[used] = s.prompt.chunk(s.tokens, s.prompt.computed() + c.tokens, step_tables_[used]);
    ++used;
  }
  step_batch_.resize(used);
  const auto forward_start = env_->now();
  Status st = engine_->model->forward(step_batch_, engine_->cache, &logits_);
  if (st.is_ok() && chunks.empty() && cfg_.decode.speculate > 0)  // a decode step alone: what its tokens cost
    step_cost_.observe(tokens_in(step_batch_), seconds(env_->now() - forward_start));
  if (!st.is_ok()) {
    check_device();
    for (proto::RequestId id : stepped_) fail(seqs_.at(id), "decode step failed: " + st.message(), proto::FailureKind::kInternal);
    for (const PrefillChunk& c : chunks)
      if (Seq* s = find_in(seqs_, c.id)) fail(*s, "prefill on decode rank failed: " + st.message(), proto::FailureKind::kInternal);
    return;
  }
  const size_t vocab = static_cast<size_t>(engine_->config().vocab);
  auto rows = [&](size_t first, size_t n) { return std::span<float>(logits_).subspan(first * vocab, n * vocab); };
  size_t row = 0;
  for (proto::RequestId id : stepped_) {
    Seq& s = seqs_.at(id);
    const size_t n_rows = s.step.size();
    verify_step(s, rows(row, n_rows), step_start, events);
    row += n_rows;
  }
  for (const PrefillChunk& c : chunks) {
    Seq& s = seqs_.at(c.id);
    const size_t n_rows = s.prompt.rows(s.prompt.computed() + c.tokens);
    finish_local_chunk(s, c.tokens, rows(row, n_rows), events);
    row += n_rows;
  }
}

void DecodeWorker::plan_draft(Seq& s, int64_t& spare) {
  s.step.assign(1, s.tokens.back());
  const int max = cfg_.decode.speculate;
  if (max <= 0 || !s.params.speculate || static_cast<int>(running_.size()) > cfg_.decode.speculate_max_batch) return;
  if (s.draft.max() != max) s.draft = DraftPolicy(max);
  KvBlockManager& blocks = *engine_->blocks;
  const int64_t n = static_cast<int64_t>(s.tokens.size());
  const int64_t k = std::min<int64_t>({s.draft.next(step_cost_.draft_costs(static_cast<int>(running_.size()))),
                                       s.params.max_tokens - s.n_generated - 1,
                                       static_cast<int64_t>(engine_->config().context) - n});
  if (k <= 0) {
    if (s.draft.wants_shadow()) s.draft.shadow(ngram_draft(s.tokens, max, 3, 2));
    return;
  }
  const std::vector<int32_t> d = ngram_draft(s.tokens, static_cast<int>(k), 3, 2);
  if (d.empty()) return;
  const int64_t extra = blocks.blocks_needed_to_append(seq_of(s.id), static_cast<int>(d.size()) + 1) -
                        blocks.blocks_needed_to_append(seq_of(s.id), 1);
  if (extra > spare) return;
  spare -= extra;
  s.step.insert(s.step.end(), d.begin(), d.end());
}

void DecodeWorker::verify_step(Seq& s, std::span<float> rows, Clock::time_point step_start,
                               proto::TokenEvents& events) {
  const size_t vocab = static_cast<size_t>(engine_->config().vocab);
  const size_t drafted = s.step.size() - 1;
  const size_t pos = s.tokens.size() - 1;  // of the step's first token
  size_t accepted = 0;
  bool stop = false;
  for (size_t j = 0; j <= drafted; ++j) {
    proto::TokenEvent ev = s.next_token(rows.subspan(j * vocab, vocab), engine_->eos_id, raw_row_);
    if (!s.timing_sent) {
      ev.queue_s = seconds(step_start - s.received);
      s.timing_sent = true;
    }
    stop = ev.finish != proto::Finish::kNone;
    const bool taken = j < drafted && ev.tokens[0] == s.step[j + 1];
    events.events.push_back(std::move(ev));
    accepted += taken ? 1 : 0;
    if (stop || !taken) break;
  }
  if (cfg_.decode.speculate > 0 && drafted > 0) {
    s.draft.verified(static_cast<int>(drafted), static_cast<int>(accepted));
    ++spec_steps_;
  } else if (cfg_.decode.speculate > 0) {
    s.draft.emitted(s.tokens.back());
  }
  drafted_ += static_cast<int64_t>(drafted);
  accepted_ += static_cast<int64_t>(accepted);
  if (accepted < drafted) {  // the rejected draft tokens' KV goes (and with it what they registered)
    const auto kept = std::span<const int32_t>(s.tokens).first(pos + 1 + accepted);
    if (Status st = engine_->blocks->truncate(seq_of(s.id), kept); !st.is_ok()) {
      return fail(s, "speculation rollback failed: " + st.message(), proto::FailureKind::kInternal);
    }
  }
  if (stop) erase(s);
}

// A sequence's chunk is in the cache. With its whole KV computed it joins the
// running batch — a new prompt first samples token 1 from `rows`' last row.
void DecodeWorker::finish_local_chunk(Seq& s, int64_t n, std::span<float> rows, proto::TokenEvents& events) {
  const int64_t vocab = engine_->config().vocab;
  s.prompt.chunk_done(s.tokens, s.prompt.computed() + n, rows, vocab);
  if (!s.prompt.done()) return;
  std::erase(prefilling_, s.id);
  s.kv.written(*engine_->blocks, s.id, roles_.self);
  if (s.n_generated > 0) {  // resumed after preemption
    transition(s.state, SeqState::kRunning, s.id, "decode");
    running_.push_back(s.id);
    return;
  }
  first_token(s, rows.subspan(rows.size() - static_cast<size_t>(vocab)), env_->now(), events);
}

void DecodeWorker::first_token(Seq& s, std::span<float> last_row, Clock::time_point now, proto::TokenEvents& events) {
  s.sampler.emplace(s.params);
  if (Status st = constrain(*s.sampler, engine_->grammars.get(), engine_->eos_id); !st.is_ok())
    return fail(s, st.message(), proto::FailureKind::kInvalid);
  count_prompt(s.prompt.cached(), static_cast<int64_t>(s.tokens.size()) - s.prompt.cached());
  proto::TokenEvent ev = s.prompt.first_token(*s.sampler, s.tokens, last_row, engine_->eos_id, raw_row_);
  s.tokens.push_back(ev.tokens[0]);
  ++s.n_generated;
  s.prompt.stamp(ev, s.arrived, now);
  s.timing_sent = true;
  const bool stop = ev.finish != proto::Finish::kNone;
  events.events.push_back(std::move(ev));
  if (stop) return erase(s);
  transition(s.state, SeqState::kRunning, s.id, "decode");
  running_.push_back(s.id);
}

// Whole prompts (prefill.chunk_tokens = 0): one pass computes the KV of every
// admitted sequence; new prompts sample token 1; all join the running batch.
Status DecodeWorker::compute_local(const std::vector<proto::RequestId>& ids, proto::TokenEvents& events) {
  std::vector<std::vector<int32_t>> tables(ids.size());
  std::vector<SequenceBatch> batch(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    Seq& s = seqs_.at(ids[i]);
    PD_RETURN_IF_ERROR(start_prompt(s));
    fill_table(*engine_->blocks, s.id, tables[i]);
    batch[i] = s.prompt.chunk(s.tokens, s.prompt.target(), tables[i]);
  }
  const auto t0 = env_->now();
  std::vector<float> logits;
  Status st = engine_->model->prefill(batch, engine_->cache, &logits);
  if (!st.is_ok()) check_device();
  if (!st.is_ok()) return st;
  for (proto::RequestId id : ids) seqs_.at(id).kv.written(*engine_->blocks, id, roles_.self);
  const auto t1 = env_->now();
  const size_t vocab = static_cast<size_t>(engine_->config().vocab);
  size_t row = 0;  // the next logits row: one per fresh prompt, one per token of an all_logits one
  for (proto::RequestId id : ids) {
    Seq& s = seqs_.at(id);
    s.prompt.start(t0);
    const size_t n_rows = s.prompt.rows(s.prompt.target());
    const auto rows = std::span<float>(logits).subspan(row * vocab, n_rows * vocab);
    s.prompt.chunk_done(s.tokens, s.prompt.target(), rows, static_cast<int64_t>(vocab));
    row += n_rows;
    if (s.n_generated > 0) {  // resumed after preemption
      transition(s.state, SeqState::kRunning, s.id, "decode");
      running_.push_back(id);
      continue;
    }
    first_token(s, rows.last(vocab), t1, events);
  }
  return Status::ok();
}

void DecodeWorker::fill_load(proto::LoadReport& r) const {
  r.waiting = static_cast<int32_t>(waiting_.size());
  r.running = static_cast<int32_t>(running_.size() + prefilling_.size());
  r.preemptions = preemptions_;
  r.spec_drafted = drafted_;
  r.spec_accepted = accepted_;
  r.spec_steps = spec_steps_;
  intake_.fill_load(r);  // its offers wait too
}

}  // namespace pd
