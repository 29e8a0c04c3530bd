#include "plan/pool_simulator.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <queue>
#include <string>
#include <vector>

namespace pd::plan {

Status validate_cluster(const ClusterConfig& c) {
  auto pos = [](const char* name, int64_t v) -> Status {
    if (v <= 0) return Status::invalid_argument(std::string(name) + ": must be positive, got " + std::to_string(v));
    return Status::ok();
  };
  if (!c.colocated) PD_RETURN_IF_ERROR(pos("prefill_ranks", c.prefill_ranks));
  PD_RETURN_IF_ERROR(pos(c.colocated ? "ranks" : "decode_ranks", c.decode_ranks));
  PD_RETURN_IF_ERROR(pos("prefill_token_budget", c.prefill_token_budget));
  if (c.chunk_tokens < 0) {
    return Status::invalid_argument("chunk_tokens: must not be negative, got " + std::to_string(c.chunk_tokens));
  }
  PD_RETURN_IF_ERROR(pos("step_tokens", c.step_tokens));
  PD_RETURN_IF_ERROR(pos("max_prefill_batch", c.max_prefill_batch));
  PD_RETURN_IF_ERROR(pos("max_decode_batch", c.max_decode_batch));
  PD_RETURN_IF_ERROR(pos("block_size", c.block_size));
  PD_RETURN_IF_ERROR(pos("decode_kv_blocks", c.decode_kv_blocks));
  if (c.prefill_kv_blocks < 0) {
    return Status::invalid_argument("prefill_kv_blocks: must not be negative, got " +
                                    std::to_string(c.prefill_kv_blocks));
  }
  if (c.prefill_ranks > 1'000'000 || c.decode_ranks > 1'000'000) {
    return Status::invalid_argument("ranks: at most 1,000,000 per pool");
  }
  if (!(c.warmup_fraction >= 0 && c.cooldown_fraction >= 0 && c.warmup_fraction + c.cooldown_fraction < 1)) {
    return Status::invalid_argument("warmup_fraction, cooldown_fraction: must be >= 0 and sum below 1");
  }
  return Status::ok();
}

// ---- Simulation -----------------------------------------------------------------

namespace {

struct Req {
  double arrival = 0;
  double t_first = -1;        // token 1 (end of the first prefill pass)
  double t_done = -1;
  double t_prefill_start = -1;  // first prefill pass starts
  double last_token = -1;       // latest token
  double max_gap = 0;           // longest gap between two of its tokens
  double prefill_end = 0;       // latest prefill pass, for the transfer overlap
  double prefill_dur = 0;
  int32_t prompt = 0;
  int32_t output = 0;
  int32_t generated = 0;      // tokens sampled so far
  int32_t ctx = 0;            // tokens whose KV is in the cache
  int32_t blocks = 0;         // KV blocks held on the decode (or colocated) rank
  int32_t prefill_tokens = 0; // tokens of the pending/last prefill (prompt, or all known tokens on recompute)
  int32_t computed = 0;       // of those, computed by earlier chunks
  int32_t chunk = 0;          // of those, in the current pass
  bool in_prefill = false;    // partly computed on a rank (in its `active`)
  int32_t prefill_rank = -1;
  int32_t decode_rank = -1;   // reserved by the handoff
  bool failed = false;
};

enum EvType : int32_t { kPrefillDone, kTransferDone, kDecodeDone, kColocDone };

struct Event {
  double t;
  uint64_t seq;  // tie-breaker: FIFO among equal times (determinism)
  int32_t type;
  int32_t idx;
  bool operator>(const Event& o) const { return t != o.t ? t > o.t : seq > o.seq; }
};

struct PrefillRank {
  bool busy = false;
  std::vector<int32_t> active;  // prompts taken from the router, not yet fully computed (arrival order)
  std::vector<int32_t> batch;   // the current pass (each with Req::chunk tokens)
  int64_t held_blocks = 0;  // KV awaiting handoff
  double batch_start = 0;
  double egress_free = 0;
  double busy_time = 0;
};

struct DecodeRank {
  bool busy = false;
  bool prefill_phase = false;  // colocated: current pass is a prefill
  std::vector<int32_t> running;  // admission order (newest last)
  std::vector<int32_t> ready;    // KV arrived, joins at the next step
  std::vector<int32_t> batch;    // colocated: prompts of the current prefill pass (chunked: its chunks)
  std::vector<int32_t> active;   // colocated, chunked: prompts partly computed here (arrival order)
  double step_decode = 0;        // colocated, chunked: the current step's decode part (seconds)
  double step_prefill = 0;       //   and its prompt chunks' part
  int64_t free_blocks = 0;
  int64_t ctx_sum = 0;           // sum of ctx over running
  int incoming = 0;              // handoffs reserved, KV in flight
  double step_start = 0;
  double ingress_free = 0;
  double decode_busy = 0;
};

// The router's FIFO queue, kept as two queues, short prompts (<= C tokens)
// and long ones, each ordered by a key that gives every prompt its place in
// the one queue (push_back: larger than all, push_front: smaller than all).
// A pass walks them merged, in queue order, and once its long prompt is taken
// walks the short ones only: the long ones a pass skips cost nothing, however
// many wait. Unchunked, every prompt is "long" and this is a plain deque.
class RouterQueue {
 public:
  struct Item {
    int64_t key;
    int32_t idx;
  };
  void push(int32_t j, bool is_short, bool front) {
    std::deque<Item>& q = is_short ? shorts_ : longs_;
    if (front) {
      q.push_front({--front_key_, j});
    } else {
      q.push_back({back_key_++, j});
    }
  }
  size_t size() const { return shorts_.size() + longs_.size(); }
  bool empty() const { return shorts_.empty() && longs_.empty(); }
  // The first prompt in queue order, and taking it.
  int32_t front() const { return front_is_short() ? shorts_.front().idx : longs_.front().idx; }
  void pop_front() {
    if (front_is_short()) {
      shorts_.pop_front();
    } else {
      longs_.pop_front();
    }
  }
  std::deque<Item>& shorts() { return shorts_; }
  const std::deque<Item>& shorts() const { return shorts_; }
  std::deque<Item>& longs() { return longs_; }

 private:
  bool front_is_short() const {
    return longs_.empty() || (!shorts_.empty() && shorts_.front().key < longs_.front().key);
  }
  std::deque<Item> shorts_, longs_;
  int64_t front_key_ = 0;
  int64_t back_key_ = 0;
};

class Simulator {
 public:
  Simulator(const Workload& w, const ClusterConfig& c, const PhaseCostModel& cost)
      : w_(w), c_(c), cost_(cost) {}

  Result<SimResult> run(const Slo& slo);

 private:
  int64_t blocks_for(int64_t tokens) const { return (tokens + c_.block_size - 1) / c_.block_size; }
  void push(double t, EvType type, int32_t idx) {
    heap_.push(Event{t, next_seq_++, type, idx});
  }
  void generate();
  void on_arrival(int32_t i);
  bool fits_ever(const Req& r) const {
    return blocks_for(static_cast<int64_t>(r.prompt) + r.output) + watermark_ <= c_.decode_kv_blocks;
  }
  void fail(int32_t i);
  void complete(int32_t i);
  void token(Req& r);  // a token of r at now_ (the first, or one after a gap)
  bool is_short(int64_t tokens) const {
    return c_.chunk_tokens > 0 && chunk_cost(0, tokens, c_.context_cost_tokens) <= static_cast<double>(c_.chunk_tokens);
  }
  void router_push(int32_t j, bool front);
  // Offers the router's waiting prompts to `pl` in queue order; `admit(j,
  // tokens)` puts one in the pass or returns false to end it. The admitted
  // leave the router queue.
  template <typename Admit>
  void take_from_router(ChunkPlanner& pl, Admit admit);
  // The engine's rule leaves short prompts their room beside a long chunk:
  // what the started shorts and the router's short queue need (up to the budget).
  void set_short_demand(ChunkPlanner& pl, const std::vector<int32_t>& active, double budget) const;
  void add_chunk(std::vector<int32_t>* batch, PrefillPass* pass, int32_t j, int64_t tokens);
  // Offers a rank's partly computed prompts to `pl` in order; false once the pass is full.
  bool offer_started(ChunkPlanner& pl, const std::vector<int32_t>& active, std::vector<int32_t>* batch,
                     PrefillPass* pass);
  // Disaggregated.
  void try_start_prefill(int r);
  void try_start_prefill_all();
  void on_prefill_done(int r);
  void dispatch_handoffs();
  void on_transfer_done(int32_t i);
  // Decode ranks (both modes).
  bool make_room(int d);
  bool start_decode_step(int d);
  void advance_decodes(int d);
  void on_decode_done(int d);
  // Colocated.
  void coloc_next(int d);
  void coloc_whole(int d);
  void coloc_step(int d);
  void coloc_kick_idle();
  void coloc_prompt_done(DecodeRank& dr, int32_t j);
  void on_coloc_done(int d);

  const Workload& w_;
  const ClusterConfig& c_;
  const PhaseCostModel& cost_;
  double now_ = 0;
  int64_t watermark_ = 1;
  std::vector<Req> reqs_;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> heap_;
  uint64_t next_seq_ = 0;
  RouterQueue router_;
  std::vector<size_t> taken_short_, taken_long_;  // scratch: positions a pass takes
  ChunkPolicy prefill_rule_;
  std::deque<int32_t> handoffs_;
  std::vector<PrefillRank> prefill_;
  std::vector<DecodeRank> decode_;
  int64_t preemptions_ = 0;
  int64_t completed_ = 0;
  int64_t failed_ = 0;
  int64_t decode_steps_ = 0;
  double decode_batch_sum_ = 0;
  int64_t max_router_ = 0;
  double prefill_busy_ = 0;
};

void Simulator::generate() {
  const std::vector<DrawnRequest> drawn = draw_workload(w_);
  reqs_.resize(drawn.size());
  for (size_t i = 0; i < drawn.size(); ++i) {
    reqs_[i].arrival = drawn[i].arrival;
    reqs_[i].prompt = drawn[i].prompt;
    reqs_[i].output = drawn[i].output;
  }
}

void Simulator::fail(int32_t i) {
  reqs_[i].failed = true;
  reqs_[i].t_done = now_;
  ++failed_;
}

void Simulator::complete(int32_t i) {
  reqs_[i].t_done = now_;
  ++completed_;
}

void Simulator::token(Req& r) {
  if (r.t_first < 0) {
    r.t_first = now_;
  } else {
    r.max_gap = std::max(r.max_gap, now_ - r.last_token);
  }
  r.last_token = now_;
}

void Simulator::router_push(int32_t j, bool front) {
  router_.push(j, is_short(reqs_[j].prefill_tokens), front);
}

void Simulator::set_short_demand(ChunkPlanner& pl, const std::vector<int32_t>& active, double budget) const {
  double cost = 0;
  for (int32_t j : active) {
    const int64_t rem = reqs_[j].prefill_tokens - reqs_[j].computed;
    if (rem > 0 && !pl.is_long(rem, reqs_[j].computed)) cost += pl.cost_of(rem, reqs_[j].computed);
  }
  for (const RouterQueue::Item& it : router_.shorts()) {
    if (cost >= budget) break;
    cost += pl.cost_of(reqs_[it.idx].prefill_tokens, 0);
  }
  pl.set_short_demand(cost);
}

template <typename Admit>
void Simulator::take_from_router(ChunkPlanner& pl, Admit admit) {
  std::deque<RouterQueue::Item>& shorts = router_.shorts();
  std::deque<RouterQueue::Item>& longs = router_.longs();
  taken_short_.clear();
  taken_long_.clear();
  size_t s = 0, l = 0;  // next of each, merged in queue order
  while (true) {
    // Once the pass has its long prompt, every later long one is skipped.
    const bool long_ok = l < longs.size() && !pl.long_taken();
    const bool short_ok = s < shorts.size();
    if (!long_ok && !short_ok) break;
    const bool take_short = short_ok && (!long_ok || shorts[s].key < longs[l].key);
    const int32_t j = take_short ? shorts[s].idx : longs[l].idx;
    const int64_t rem = reqs_[j].prefill_tokens;
    const int64_t g = pl.grant(rem, 0);
    if (g < 0) break;
    if (g > 0) {
      if (!admit(j, g)) break;
      pl.take(rem, 0, g);
      (take_short ? taken_short_ : taken_long_).push_back(take_short ? s : l);
    }
    ++(take_short ? s : l);
  }
  for (auto it = taken_short_.rbegin(); it != taken_short_.rend(); ++it) {
    shorts.erase(shorts.begin() + static_cast<std::ptrdiff_t>(*it));
  }
  for (auto it = taken_long_.rbegin(); it != taken_long_.rend(); ++it) {
    longs.erase(longs.begin() + static_cast<std::ptrdiff_t>(*it));
  }
}

void Simulator::add_chunk(std::vector<int32_t>* batch, PrefillPass* pass, int32_t j, int64_t tokens) {
  Req& r = reqs_[j];
  r.chunk = static_cast<int32_t>(tokens);
  batch->push_back(j);
  pass->add(static_cast<double>(tokens), static_cast<double>(r.computed));
  if (r.t_prefill_start < 0) r.t_prefill_start = now_;
}

bool Simulator::offer_started(ChunkPlanner& pl, const std::vector<int32_t>& active, std::vector<int32_t>* batch,
                              PrefillPass* pass) {
  for (int32_t j : active) {
    const Req& r = reqs_[j];
    const int64_t rem = r.prefill_tokens - r.computed;
    const int64_t g = pl.grant(rem, r.computed);
    if (g < 0) return false;
    if (g == 0) continue;
    pl.take(rem, r.computed, g);
    add_chunk(batch, pass, j, g);
  }
  return true;
}

void Simulator::on_arrival(int32_t i) {
  Req& r = reqs_[i];
  if (!fits_ever(r)) {
    fail(i);
    return;
  }
  r.prefill_tokens = r.prompt;
  router_push(i, false);
  max_router_ = std::max<int64_t>(max_router_, static_cast<int64_t>(router_.size()));
  if (c_.colocated) {
    coloc_kick_idle();
  } else {
    try_start_prefill_all();
  }
}

void Simulator::try_start_prefill_all() {
  for (int r = 0; r < static_cast<int>(prefill_.size()) && !router_.empty(); ++r) try_start_prefill(r);
}

void Simulator::try_start_prefill(int rank) {
  PrefillRank& p = prefill_[rank];
  if (p.busy || (p.active.empty() && router_.empty())) return;
  ChunkPlanner pl(prefill_rule_);
  set_short_demand(pl, p.active, static_cast<double>(prefill_rule_.budget));
  PrefillPass pass;
  // Prompts this rank has started first (they came out of the router earlier).
  if (offer_started(pl, p.active, &p.batch, &pass)) {
    int64_t held = p.held_blocks;
    take_from_router(pl, [&](int32_t j, int64_t g) {
      Req& r = reqs_[j];
      const int64_t b = blocks_for(r.prefill_tokens);
      // Backpressure: the rank keeps each prompt's KV until its handoff completes.
      if (c_.prefill_kv_blocks > 0 && held + b > c_.prefill_kv_blocks && held > 0) return false;
      held += b;
      r.in_prefill = true;
      p.active.push_back(j);
      add_chunk(&p.batch, &pass, j, g);
      return true;
    });
    p.held_blocks = held;
  }
  if (p.batch.empty()) return;
  p.busy = true;
  p.batch_start = now_;
  const double t = std::max(1e-12, cost_.prefill_pass_seconds(pass));
  push(now_ + t, kPrefillDone, rank);
}

void Simulator::on_prefill_done(int rank) {
  PrefillRank& p = prefill_[rank];
  const double dur = now_ - p.batch_start;
  p.busy_time += dur;
  for (int32_t j : p.batch) {
    Req& r = reqs_[j];
    r.computed += r.chunk;
    r.chunk = 0;
    if (r.computed < r.prefill_tokens) continue;  // more chunks to come
    r.computed = 0;
    r.in_prefill = false;
    r.ctx = r.prefill_tokens;
    r.generated += 1;
    token(r);
    // The KV goes out layer by layer during the last chunk's pass only.
    r.prefill_end = now_;
    r.prefill_dur = dur;
    r.prefill_rank = rank;
    if (r.generated >= r.output) {
      p.held_blocks -= blocks_for(r.ctx);
      complete(j);
    } else {
      handoffs_.push_back(j);
    }
  }
  p.active.erase(std::remove_if(p.active.begin(), p.active.end(), [&](int32_t j) { return !reqs_[j].in_prefill; }),
                 p.active.end());
  p.batch.clear();
  p.busy = false;
  dispatch_handoffs();
  try_start_prefill(rank);
}

void Simulator::dispatch_handoffs() {
  while (!handoffs_.empty()) {
    const int32_t j = handoffs_.front();
    Req& r = reqs_[j];
    const int64_t hold = blocks_for(r.ctx);
    const int64_t need = blocks_for(static_cast<int64_t>(r.ctx) + 1);
    int best = -1;
    for (int d = 0; d < static_cast<int>(decode_.size()); ++d) {
      const DecodeRank& dr = decode_[d];
      const int64_t seqs = static_cast<int64_t>(dr.running.size() + dr.ready.size()) + dr.incoming;
      if (seqs >= c_.max_decode_batch || dr.free_blocks - need < watermark_) continue;
      if (best < 0 || dr.free_blocks > decode_[best].free_blocks) best = d;
    }
    if (best < 0) return;  // pull: wait until a decode rank frees blocks (FIFO, head of line)
    handoffs_.pop_front();
    DecodeRank& dr = decode_[best];
    dr.free_blocks -= hold;
    dr.incoming += 1;
    r.blocks = static_cast<int32_t>(hold);
    r.decode_rank = best;
    PrefillRank& p = prefill_[r.prefill_rank];
    const double wire = cost_.kv_transfer_seconds(static_cast<double>(r.ctx));
    double exposed = wire;
    // Sent layer by layer while the pass ran, if the decode rank took it at once.
    if (c_.overlap_transfer && now_ <= r.prefill_end) {
      exposed = std::max(wire - r.prefill_dur, wire / cost_.transfer_chunks());
    }
    const double start = std::max({now_, p.egress_free, dr.ingress_free});
    const double end = start + exposed;
    p.egress_free = end;
    dr.ingress_free = end;
    push(end + cost_.kv_transfer_latency(), kTransferDone, j);
  }
}

void Simulator::on_transfer_done(int32_t j) {
  Req& r = reqs_[j];
  const int rank = r.prefill_rank;
  prefill_[rank].held_blocks -= blocks_for(r.ctx);
  const int d = r.decode_rank;
  DecodeRank& dr = decode_[d];
  dr.incoming -= 1;
  dr.ready.push_back(j);
  if (!dr.busy) start_decode_step(d);
  try_start_prefill(rank);
}

// Makes room for one more token of each running sequence, preempting the
// newest when blocks run out (it goes back to the front of the router queue to
// be prefilled again), and takes the blocks. True when it preempted.
bool Simulator::make_room(int d) {
  DecodeRank& dr = decode_[d];
  int64_t need = 0;
  for (int32_t j : dr.running) {
    const Req& r = reqs_[j];
    need += blocks_for(static_cast<int64_t>(r.ctx) + 1) - r.blocks;
  }
  bool preempted = false;
  while (need > dr.free_blocks && !dr.running.empty()) {
    const int32_t v = dr.running.back();
    dr.running.pop_back();
    Req& r = reqs_[v];
    need -= blocks_for(static_cast<int64_t>(r.ctx) + 1) - r.blocks;
    dr.free_blocks += r.blocks;
    dr.ctx_sum -= r.ctx;
    r.blocks = 0;
    // Recompute: prefill again over every token known so far.
    r.prefill_tokens = r.prompt + r.generated;
    router_push(v, true);
    ++preemptions_;
    preempted = true;
  }
  if (preempted) max_router_ = std::max<int64_t>(max_router_, static_cast<int64_t>(router_.size()));
  for (int32_t j : dr.running) {
    Req& r = reqs_[j];
    const int64_t extra = blocks_for(static_cast<int64_t>(r.ctx) + 1) - r.blocks;
    r.blocks += static_cast<int32_t>(extra);
    dr.free_blocks -= extra;
  }
  return preempted;
}

// Admits ready sequences, makes room for one more token each (preempting the
// newest when blocks run out) and starts a step. False when nothing runs.
bool Simulator::start_decode_step(int d) {
  DecodeRank& dr = decode_[d];
  for (int32_t j : dr.ready) {
    dr.running.push_back(j);
    dr.ctx_sum += reqs_[j].ctx;
  }
  dr.ready.clear();
  if (dr.running.empty()) {
    dr.busy = false;
    return false;
  }
  // Colocated: coloc_next offers the preempted work to idle ranks after this step starts.
  if (make_room(d) && !c_.colocated) try_start_prefill_all();
  if (dr.running.empty()) {
    dr.busy = false;
    return false;
  }
  const double batch = static_cast<double>(dr.running.size());
  const double t = std::max(1e-12, cost_.decode_step_seconds(batch, static_cast<double>(dr.ctx_sum) / batch));
  dr.busy = true;
  dr.prefill_phase = false;
  dr.step_start = now_;
  ++decode_steps_;
  decode_batch_sum_ += batch;
  push(now_ + t, c_.colocated ? kColocDone : kDecodeDone, d);
  return true;
}

// The end of a decode step: a token for every running sequence.
void Simulator::advance_decodes(int d) {
  DecodeRank& dr = decode_[d];
  size_t keep = 0;
  for (size_t k = 0; k < dr.running.size(); ++k) {
    const int32_t j = dr.running[k];
    Req& r = reqs_[j];
    r.ctx += 1;
    r.generated += 1;
    token(r);
    dr.ctx_sum += 1;
    if (r.generated >= r.output) {
      dr.free_blocks += r.blocks;
      dr.ctx_sum -= r.ctx;
      r.blocks = 0;
      complete(j);
    } else {
      dr.running[keep++] = j;
    }
  }
  dr.running.resize(keep);
}

void Simulator::on_decode_done(int d) {
  DecodeRank& dr = decode_[d];
  dr.decode_busy += now_ - dr.step_start;
  advance_decodes(d);
  dr.busy = false;
  if (!c_.colocated) {
    dispatch_handoffs();
    start_decode_step(d);
  }
}

// A colocated rank finished a prompt's KV: its token 1 now; then it decodes here, or it is done.
void Simulator::coloc_prompt_done(DecodeRank& dr, int32_t j) {
  Req& r = reqs_[j];
  r.ctx = r.prefill_tokens;
  r.generated += 1;
  token(r);
  if (r.generated >= r.output) {
    dr.free_blocks += r.blocks;
    r.blocks = 0;
    complete(j);
  } else {
    dr.running.push_back(j);
    dr.ctx_sum += r.ctx;
  }
}

void Simulator::coloc_kick_idle() {
  for (int d = 0; d < static_cast<int>(decode_.size()) && !router_.empty(); ++d) {
    if (!decode_[d].busy) coloc_next(d);
  }
}

void Simulator::coloc_next(int d) {
  if (c_.chunk_tokens > 0) {
    coloc_step(d);
  } else {
    coloc_whole(d);
  }
}

// A colocated rank's next pass, unchunked: a prefill of waiting prompts when
// any fit (prefill first), else a decode step of its running sequences.
void Simulator::coloc_whole(int d) {
  DecodeRank& dr = decode_[d];
  if (dr.busy) return;
  int64_t total = 0;
  double sum_sq = 0;
  while (!router_.empty() && static_cast<int>(dr.batch.size()) < c_.max_prefill_batch &&
         static_cast<int64_t>(dr.running.size() + dr.batch.size()) < c_.max_decode_batch) {
    const int32_t j = router_.front();
    Req& r = reqs_[j];
    const int64_t k = r.prefill_tokens;
    if (!dr.batch.empty() && total + k > c_.prefill_token_budget) break;
    if (dr.free_blocks - blocks_for(k + 1) < watermark_) break;
    router_.pop_front();
    dr.batch.push_back(j);
    dr.free_blocks -= blocks_for(k);
    r.blocks = static_cast<int32_t>(blocks_for(k));
    total += k;
    sum_sq += static_cast<double>(k) * static_cast<double>(k);
    if (r.t_prefill_start < 0) r.t_prefill_start = now_;
  }
  if (!dr.batch.empty()) {
    const double t = std::max(1e-12, cost_.prefill_seconds(static_cast<double>(total),
                                                           static_cast<double>(dr.batch.size()), sum_sq));
    dr.busy = true;
    dr.prefill_phase = true;
    dr.step_start = now_;
    push(now_ + t, kColocDone, d);
    return;
  }
  const int64_t before = preemptions_;
  start_decode_step(d);
  if (preemptions_ != before) coloc_kick_idle();  // preempted work for other idle ranks
}

// A colocated rank's next step, chunked: all its running decodes (one token
// each) plus prompt chunks under a prompt budget of max(S - running, S / 4).
void Simulator::coloc_step(int d) {
  DecodeRank& dr = decode_[d];
  if (dr.busy) return;
  const bool preempted = make_room(d);
  const int64_t running = static_cast<int64_t>(dr.running.size());
  // The engine's colocated step: decode.max_running prompts at most.
  const int64_t budget = colocated_prompt_budget(c_.step_tokens, running);
  ChunkPlanner pl(ChunkPolicy{budget, c_.chunk_tokens, c_.max_decode_batch, c_.context_cost_tokens});
  set_short_demand(pl, dr.active, static_cast<double>(budget));
  PrefillPass pass;
  if (offer_started(pl, dr.active, &dr.batch, &pass)) {
    take_from_router(pl, [&](int32_t j, int64_t g) {
      if (running + static_cast<int64_t>(dr.active.size()) >= c_.max_decode_batch) return false;
      Req& r = reqs_[j];
      const int64_t k = r.prefill_tokens;
      if (dr.free_blocks - blocks_for(k + 1) < watermark_) return false;
      dr.free_blocks -= blocks_for(k);
      r.blocks = static_cast<int32_t>(blocks_for(k));
      r.in_prefill = true;
      dr.active.push_back(j);
      add_chunk(&dr.batch, &pass, j, g);
      return true;
    });
  }
  if (dr.batch.empty() && running == 0) {
    dr.busy = false;
    if (preempted) coloc_kick_idle();
    return;
  }
  double t_decode = 0;
  if (running > 0) {
    const double batch = static_cast<double>(running);
    t_decode = cost_.decode_step_seconds(batch, static_cast<double>(dr.ctx_sum) / batch);
    ++decode_steps_;
    decode_batch_sum_ += batch;
  }
  const double t_prefill = pass.empty() ? 0 : cost_.prefill_pass_seconds(pass);
  dr.busy = true;
  dr.prefill_phase = false;
  dr.step_start = now_;
  dr.step_decode = t_decode;
  dr.step_prefill = t_prefill;
  push(now_ + std::max(1e-12, t_decode + t_prefill), kColocDone, d);
  if (preempted) coloc_kick_idle();  // preempted work for other idle ranks
}

void Simulator::on_coloc_done(int d) {
  DecodeRank& dr = decode_[d];
  if (c_.chunk_tokens > 0) {
    dr.decode_busy += dr.step_decode;
    prefill_busy_ += dr.step_prefill;
    advance_decodes(d);  // the decodes that ran (prompts finishing now join after)
    for (int32_t j : dr.batch) {
      Req& r = reqs_[j];
      r.computed += r.chunk;
      r.chunk = 0;
      if (r.computed < r.prefill_tokens) continue;
      r.computed = 0;
      r.in_prefill = false;
      coloc_prompt_done(dr, j);
    }
    dr.active.erase(
        std::remove_if(dr.active.begin(), dr.active.end(), [&](int32_t j) { return !reqs_[j].in_prefill; }),
        dr.active.end());
    dr.batch.clear();
    dr.busy = false;
    coloc_step(d);
    return;
  }
  if (dr.prefill_phase) {
    const double dur = now_ - dr.step_start;
    prefill_busy_ += dur;
    for (int32_t j : dr.batch) {
      coloc_prompt_done(dr, j);
    }
    dr.batch.clear();
    dr.busy = false;
    dr.prefill_phase = false;
  } else {
    on_decode_done(d);
  }
  coloc_next(d);
}

LatencyStats stats_of(std::vector<double>& v, double quantile) {
  LatencyStats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  auto q = [&](double p) {
    const size_t n = v.size();
    size_t idx = static_cast<size_t>(std::ceil(p * static_cast<double>(n)));
    idx = idx == 0 ? 0 : idx - 1;
    return v[std::min(idx, n - 1)];
  };
  s.mean = sum / static_cast<double>(v.size());
  s.p50 = q(0.5);
  s.p90 = q(0.9);
  s.p99 = q(0.99);
  s.max = v.back();
  s.at_quantile = q(quantile);
  return s;
}

Result<SimResult> Simulator::run(const Slo& slo) {
  generate();
  watermark_ = std::max<int64_t>(1, c_.decode_kv_blocks / 100);
  prefill_rule_ = ChunkPolicy{c_.prefill_token_budget, c_.chunk_tokens, c_.max_prefill_batch, c_.context_cost_tokens};
  if (!c_.colocated) prefill_.resize(static_cast<size_t>(c_.prefill_ranks));
  decode_.resize(static_cast<size_t>(c_.decode_ranks));
  for (DecodeRank& d : decode_) d.free_blocks = c_.decode_kv_blocks;

  // Bound on events: a runaway (e.g. endless preemption) ends as an error, not a hang.
  // Chunked prefill adds a pass per chunk: at least min(C, budget) tokens each
  // (a colocated step's prompt share is at least S / 4).
  double token_sum = 0;
  // (Priced by context, a chunk late in a long prompt holds as few as kMinChunkTokens.)
  const double chunk = c_.chunk_tokens <= 0             ? 0
                       : c_.context_cost_tokens > 0 ? static_cast<double>(kMinChunkTokens)
                       : static_cast<double>(std::max<int64_t>(
                             1, std::min(c_.chunk_tokens, c_.colocated ? c_.step_tokens / 4 : c_.prefill_token_budget)));
  for (const Req& r : reqs_) token_sum += r.output + (chunk > 0 ? r.prompt / chunk : 0);
  const double max_events = 64.0 * (token_sum + static_cast<double>(reqs_.size())) + 1e6;
  double events = 0;

  size_t next_arrival = 0;
  while (true) {
    const bool have_arrival = next_arrival < reqs_.size();
    if (!have_arrival && heap_.empty()) break;
    if (++events > max_events) {
      return Status::internal("simulation did not settle after " + std::to_string(static_cast<int64_t>(events)) +
                              " events (KV pool too small for the workload?)");
    }
    if (have_arrival && (heap_.empty() || reqs_[next_arrival].arrival <= heap_.top().t)) {
      now_ = reqs_[next_arrival].arrival;
      on_arrival(static_cast<int32_t>(next_arrival++));
      continue;
    }
    const Event e = heap_.top();
    heap_.pop();
    now_ = e.t;
    switch (e.type) {
      case kPrefillDone: on_prefill_done(e.idx); break;
      case kTransferDone: on_transfer_done(e.idx); break;
      case kDecodeDone: on_decode_done(e.idx); break;
      case kColocDone: on_coloc_done(e.idx); break;
      default: return Status::internal("unknown event type");
    }
  }

  SimResult res;
  res.requests = static_cast<int64_t>(reqs_.size());
  res.completed = completed_;
  res.failed = failed_;
  res.preemptions = preemptions_;
  res.max_router_queue = max_router_;
  for (const Req& r : reqs_) res.makespan_seconds = std::max(res.makespan_seconds, r.t_done);
  const size_t n = reqs_.size();
  size_t lo = static_cast<size_t>(std::floor(c_.warmup_fraction * static_cast<double>(n)));
  size_t hi = n - static_cast<size_t>(std::floor(c_.cooldown_fraction * static_cast<double>(n)));
  if (hi <= lo) {
    lo = 0;
    hi = n;
  }
  std::vector<double> ttft, tpot, e2e, wait, gap;
  ttft.reserve(hi - lo);
  e2e.reserve(hi - lo);
  wait.reserve(hi - lo);
  tpot.reserve(hi - lo);
  int64_t good = 0, done = 0, tokens = 0;
  double last_done = 0;
  for (size_t i = lo; i < hi; ++i) {
    const Req& r = reqs_[i];
    if (r.failed) continue;
    ++done;
    tokens += r.output;
    last_done = std::max(last_done, r.t_done);
    const double t1 = r.t_first - r.arrival;
    ttft.push_back(t1);
    e2e.push_back(r.t_done - r.arrival);
    wait.push_back(r.t_prefill_start - r.arrival);
    double per_token = 0;
    if (r.output >= 2) {
      per_token = (r.t_done - r.t_first) / (r.output - 1);
      tpot.push_back(per_token);
      gap.push_back(r.max_gap);
    }
    if (t1 <= slo.ttft_seconds && per_token <= slo.tpot_seconds) ++good;
  }
  res.measured = static_cast<int64_t>(hi - lo);
  res.ttft = stats_of(ttft, slo.quantile);
  res.tpot = stats_of(tpot, slo.quantile);
  res.e2e = stats_of(e2e, slo.quantile);
  res.queue_wait = stats_of(wait, slo.quantile);
  res.worst_gap = stats_of(gap, slo.quantile);
  const double span = reqs_[hi - 1].arrival - reqs_[lo].arrival;
  const double window = last_done - reqs_[lo].arrival;
  res.throughput_rps = window > 0 ? static_cast<double>(done) / window : 0;
  res.output_tokens_per_second = window > 0 ? static_cast<double>(tokens) / window : 0;
  res.goodput_rps = span > 0 ? static_cast<double>(good) / span : 0;
  res.slo_attainment = res.measured > 0 ? static_cast<double>(good) / static_cast<double>(res.measured) : 0;
  res.meets_slo = done == res.measured && res.ttft.at_quantile <= slo.ttft_seconds &&
                  res.tpot.at_quantile <= slo.tpot_seconds;
  if (c_.record_requests) {
    res.per_request.reserve(reqs_.size());
    for (const Req& r : reqs_) {
      RequestTiming t;
      t.arrival = r.arrival;
      t.prefill_start = r.t_prefill_start;
      t.first_token = r.t_first;
      t.done = r.t_done;
      t.worst_gap = r.max_gap;
      t.prompt = r.prompt;
      t.output = r.output;
      t.failed = r.failed;
      res.per_request.push_back(t);
    }
  }
  res.mean_decode_batch = decode_steps_ > 0 ? decode_batch_sum_ / static_cast<double>(decode_steps_) : 0;
  if (res.makespan_seconds > 0) {
    double pb = prefill_busy_, db = 0;
    for (const PrefillRank& p : prefill_) pb += p.busy_time;
    for (const DecodeRank& d : decode_) db += d.decode_busy;
    const double prefill_ranks = c_.colocated ? c_.decode_ranks : c_.prefill_ranks;
    res.prefill_utilization = pb / (prefill_ranks * res.makespan_seconds);
    res.decode_utilization = db / (c_.decode_ranks * res.makespan_seconds);
  }
  return res;
}

}  // namespace

Result<SimResult> simulate(const Workload& w, const ClusterConfig& c, const PhaseCostModel& cost, const Slo& slo) {
  PD_RETURN_IF_ERROR(validate_workload(w));
  PD_RETURN_IF_ERROR(validate_cluster(c));
  if (!(slo.ttft_seconds > 0) || !(slo.tpot_seconds > 0)) {
    return Status::invalid_argument("slo: TTFT and TPOT targets must be positive");
  }
  if (!(slo.quantile > 0 && slo.quantile <= 1)) {
    return Status::invalid_argument("slo: quantile must be in (0, 1], got " + std::to_string(slo.quantile));
  }
  Simulator sim(w, c, cost);
  return sim.run(slo);
}

}  // namespace pd::plan
