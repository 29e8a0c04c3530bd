// pd-bench-textbook: three textbook claims a disaggregated serving design rests
// on, measured on this engine. Every figure is a ratio of two variants run in
// the same process, on the same model, with the same engine calls.
//
//   pd-bench-textbook [-m MODEL] [--threads N] [--seed S] [--json FILE]
//                     [--only kv-cache,batching,paged] [--block-size 16]
//                     [--kv-prompt 32] [--kv-steps 128]
//                     [--batching-requests 24] [--batching-max-batch 8]
//                     [--batching-prompt 16,128] [--batching-output 8,256]
//                     [--paged-requests 48] [--paged-budget 4096] [--paged-max-len 1024]
//                     [--paged-prompt 32,192] [--paged-output 32,192] [--paged-max-batch 64]
//
// kv-cache  Generating N tokens after a P-token prompt with the KV cache (one
//           prefill, then N decode steps of one token each) against
//           recomputing the whole prefix at every step (step t is a prefill of
//           all P + t tokens from position 0: what generating without a cache
//           costs). Every step of both is timed, so the totals are measured,
//           not extrapolated. The table gives per-step times at a few t (the
//           median of steps t-2..t+2), the totals, and beside each measured
//           ratio the FLOP ratio the planner predicts for this model's shape
//           (generation_step_flops / generation_total_flops, plan/roofline.h).
//           Recompute feeds the tokens the cached run produced, so both compute
//           the same next token; how many argmaxes agree is printed.
// batching  R requests, all present at t=0, random prompt and output lengths,
//           at most B running. Static: groups of B in arrival order; a group's
//           finished sequences leave its decode steps (static batching's best
//           case), but nothing joins until the whole group is done.
//           Continuous (iteration-level, as in Orca): a finished sequence's
//           place goes to the next waiting request before the next step.
// paged     The continuous loop (batch cap B) over one KV pool of M tokens,
//           differing only in admission. Contiguous: a sequence reserves the
//           blocks of the maximum length L when admitted, as a server with
//           context L must (so M / L run at once). Paged: admitted when its
//           prompt's blocks + 1 are free, given blocks as it grows; when a step
//           needs blocks the pool lacks, the newest running sequence is
//           preempted: its blocks are freed, it goes back to the head of the
//           queue, and on readmission its prompt + generated tokens are
//           prefilled again (vLLM's recompute policy).
//
// In batching and paged every admitted request is prefilled in its own pass
// (which yields its first output token) between decode steps; a request's
// completion time runs from t=0 to its last token. All runs use the engine's
// real structures: LlamaModel::prefill/decode over a KvCache whose blocks come
// from a KvBlockManager (prefix sharing off: random prompts share nothing, and
// a readmitted sequence must recompute its KV). Token ids are random; each step
// feeds the argmax of the previous logits (no sampling); lengths are drawn from
// --seed. A bad flag or model: one line naming it, exit status 2.
#include <CLI/CLI.hpp>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf_reader.h"
#include "kv/kv_block_manager.h"
#include "model/kv_cache.h"
#include "model/llama_model.h"
#include "plan/model_spec.h"
#include "plan/roofline.h"
#include "tool_common.h"

namespace {

using nlohmann::json;
using pd::Status;
using pd::tools::Clock;
using pd::tools::median;
using pd::tools::seconds;

double mean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}
// Nearest-rank quantile q in (0, 1].
double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}
int fail(const std::string& msg, int code = 1) { return pd::tools::report_error("pd-bench-textbook", msg, code); }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::vector<int32_t> random_tokens(int n, int vocab, std::mt19937_64& rng) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(3 + rng() % static_cast<uint64_t>(vocab - 3));
  return t;
}
int32_t argmax_row(const std::vector<float>& logits, size_t row, int vocab) {
  const auto first = logits.begin() + static_cast<std::ptrdiff_t>(row * vocab);
  return static_cast<int32_t>(std::max_element(first, first + vocab) - first);
}

struct Range {
  int min = 0, max = 0;
};
// "MIN,MAX" with 1 <= MIN <= MAX; nullopt (and one line naming `flag`) otherwise.
std::optional<Range> parse_range(const std::string& s, const char* flag) {
  const size_t comma = s.find(',');
  try {
    size_t used_a = 0, used_b = 0;
    if (comma == std::string::npos) throw std::invalid_argument(s);
    const std::string a = s.substr(0, comma), b = s.substr(comma + 1);
    const Range r{std::stoi(a, &used_a), std::stoi(b, &used_b)};
    if (used_a != a.size() || used_b != b.size() || r.min < 1 || r.min > r.max) throw std::invalid_argument(s);
    return r;
  } catch (const std::exception&) {
    fail(std::string(flag) + ": '" + s + "' is not MIN,MAX with 1 <= MIN <= MAX", 2);
    return std::nullopt;
  }
}

struct Engine {
  std::unique_ptr<pd::Backend> backend;
  std::unique_ptr<pd::LlamaModel> model;
  int block_size = 16;
  int vocab() const { return model->config().vocab; }
  pd::Result<pd::KvCache> make_cache(int64_t blocks) {
    return pd::KvCache::create(*backend, model->config(), block_size, blocks, pd::kDefaultKvDtype);
  }
};

// One prefill of `prefill_tokens` tokens and one decode step of `batch`
// sequences, untimed, so the model's scratch has grown before anything is
// timed. The cache needs max(ceil(prefill_tokens / block), batch) blocks.
Status warm_up(Engine& e, pd::KvCache& cache, int prefill_tokens, int batch) {
  std::mt19937_64 rng(7);
  const auto toks = random_tokens(prefill_tokens, e.vocab(), rng);
  std::vector<int32_t> table(static_cast<size_t>(ceil_div(prefill_tokens, e.block_size)));
  std::iota(table.begin(), table.end(), 0);
  std::vector<float> logits;
  const std::vector<pd::SequenceBatch> pre{{toks, 0, table, true}};
  if (Status s = e.model->prefill(pre, cache, &logits); !s.is_ok()) return s;
  std::vector<int32_t> ids(static_cast<size_t>(batch));
  std::iota(ids.begin(), ids.end(), 0);
  std::vector<pd::SequenceBatch> step(static_cast<size_t>(batch));
  for (size_t s = 0; s < step.size(); ++s) step[s] = {std::span<const int32_t>(&toks[0], 1), 0, {&ids[s], 1}, true};
  return e.model->decode(step, cache, &logits);
}

// ---- kv-cache: generating with the cache vs recomputing the prefix --------

// FLOPs of recompute over cached, from the planner's formulas.
double flop_ratio(const pd::plan::GenerationCost& g) {
  return (g.naive_model.attention + g.naive_model.projections) /
         (g.cached_model.attention + g.cached_model.projections);
}

// The measurements of both ways of generating `steps` tokens after a `prompt`-token prompt.
struct KvCacheRuns {
  int prompt = 0, steps = 0;
  double prefill_s = 0;                      // the prompt's prefill (not counted)
  std::vector<double> cached_s, recompute_s;  // per step t = 1..steps
  int agree = 0;                              // steps whose next tokens agree
};

// Cached: the prompt's prefill gives token 1; step t feeds token t at
// position P + t - 1 and gives token t + 1 (context P + t). *seq ends as the
// prompt and tokens 1..steps; *next holds token t + 1 of each step t.
Status time_cached(Engine& e, pd::KvCache& cache, const std::vector<int32_t>& table, std::vector<int32_t>* seq,
                   KvCacheRuns* r, std::vector<int32_t>* next) {
  std::vector<float> logits;
  auto t0 = Clock::now();
  const std::vector<pd::SequenceBatch> pre{{*seq, 0, table, true}};
  if (Status s = e.model->prefill(pre, cache, &logits); !s.is_ok()) return s;
  r->prefill_s = seconds(Clock::now() - t0);
  seq->push_back(argmax_row(logits, 0, e.vocab()));
  for (int t = 1; t <= r->steps; ++t) {
    const std::vector<pd::SequenceBatch> step{{{&seq->back(), 1}, r->prompt + t - 1, table, true}};
    t0 = Clock::now();
    if (Status s = e.model->decode(step, cache, &logits); !s.is_ok()) return s;
    r->cached_s.push_back(seconds(Clock::now() - t0));
    next->push_back(argmax_row(logits, 0, e.vocab()));
    if (t < r->steps) seq->push_back(next->back());
  }
  return Status::ok();
}

// Recompute: step t is a fresh prefill of prompt + tokens 1..t from position
// 0 (overwriting the same slots, so nothing cached is read).
Status time_recompute(Engine& e, pd::KvCache& cache, const std::vector<int32_t>& table,
                      const std::vector<int32_t>& seq, const std::vector<int32_t>& cached_next, KvCacheRuns* r) {
  std::vector<float> logits;
  for (int t = 1; t <= r->steps; ++t) {
    const std::vector<pd::SequenceBatch> all{{{seq.data(), static_cast<size_t>(r->prompt + t)}, 0, table, true}};
    const auto t0 = Clock::now();
    if (Status s = e.model->prefill(all, cache, &logits); !s.is_ok()) return s;
    r->recompute_s.push_back(seconds(Clock::now() - t0));
    r->agree += argmax_row(logits, 0, e.vocab()) == cached_next[static_cast<size_t>(t - 1)];
  }
  return Status::ok();
}

// Median of steps t-2..t+2 (1-based, within 1..steps) of per-step times v.
double step_window(const std::vector<double>& v, int t, int steps) {
  const int lo = std::max(1, t - 2), hi = std::min(steps, t + 2);
  return median(std::vector<double>(v.begin() + lo - 1, v.begin() + hi));
}

// The per-step table (steps 1, 8, 16, ... up to --kv-steps) beside the FLOP ratios; its JSON rows.
json print_kv_cache_rows(const pd::plan::ModelSpec& spec, const KvCacheRuns& r) {
  std::printf("\n== kv-cache: %d-token prompt, %d generated tokens (per step: median of steps t-2..t+2)\n", r.prompt,
              r.steps);
  std::printf("%-8s %-8s %-11s %-14s %-10s %-12s\n", "step t", "context", "cached ms", "recompute ms", "measured",
              "FLOP ratio");
  json rows = json::array();
  for (int t : {1, 8, 16, 32, 64, 128, 256, 512, 1024}) {
    if (t > r.steps) break;
    const double c = step_window(r.cached_s, t, r.steps), rc = step_window(r.recompute_s, t, r.steps);
    const double predicted = flop_ratio(pd::plan::generation_step_flops(spec, r.prompt + t));
    std::printf("%-8d %-8d %-11.2f %-14.2f x%-9.1f x%.1f\n", t, r.prompt + t, c * 1e3, rc * 1e3, rc / c, predicted);
    rows.push_back({{"step", t}, {"context", r.prompt + t}, {"cached_s", c}, {"recompute_s", rc},
                    {"measured_ratio", rc / c}, {"flop_ratio", predicted}});
  }
  return rows;
}

// Growth with N: the first N/2 steps against all N (from an empty prompt
// x2 is linear, x4 quadratic), beside the planner's FLOPs for the same. Null below 2 steps.
json print_kv_cache_growth(const pd::plan::ModelSpec& spec, const KvCacheRuns& r, double cached_total,
                           double recompute_total) {
  if (r.steps < 2) return json();
  const int steps = r.steps, prompt = r.prompt, half = steps / 2;
  const double c_half = std::accumulate(r.cached_s.begin(), r.cached_s.begin() + half, 0.0);
  const double r_half = std::accumulate(r.recompute_s.begin(), r.recompute_s.begin() + half, 0.0);
  const auto f_all = pd::plan::generation_total_flops(spec, steps, prompt);
  const auto f_half = pd::plan::generation_total_flops(spec, half, prompt);
  auto flops = [](const pd::plan::GenerationFlops& f) { return f.attention + f.projections; };
  const double c_pred = flops(f_all.cached_model) / flops(f_half.cached_model);
  const double r_pred = flops(f_all.naive_model) / flops(f_half.naive_model);
  std::printf("cumulative from %d to %d steps: cached x%.2f (FLOPs x%.2f), recompute x%.2f (FLOPs x%.2f); "
              "recompute step %d / step 1: x%.1f (context x%.1f)\n",
              half, steps, cached_total / c_half, c_pred, recompute_total / r_half, r_pred, steps,
              step_window(r.recompute_s, steps, steps) / step_window(r.recompute_s, 1, steps),
              static_cast<double>(prompt + steps) / (prompt + 1));
  return {{"half_steps", half},         {"cached_growth", cached_total / c_half}, {"cached_flop_growth", c_pred},
          {"recompute_growth", recompute_total / r_half}, {"recompute_flop_growth", r_pred}};
}

Status run_kv_cache(Engine& e, const pd::plan::ModelSpec& spec, int prompt, int steps, uint64_t seed, json* out) {
  const int total = prompt + steps;
  std::vector<int32_t> table(static_cast<size_t>(ceil_div(total, e.block_size)));
  std::iota(table.begin(), table.end(), 0);
  auto cache = e.make_cache(static_cast<int64_t>(table.size()));
  if (!cache.is_ok()) return cache.status();
  if (Status s = warm_up(e, *cache, total, 1); !s.is_ok()) return s;
  std::mt19937_64 rng(seed);
  std::vector<int32_t> seq = random_tokens(prompt, e.vocab(), rng);
  KvCacheRuns r;
  r.prompt = prompt;
  r.steps = steps;
  std::vector<int32_t> cached_next;  // token t + 1, from step t
  if (Status s = time_cached(e, *cache, table, &seq, &r, &cached_next); !s.is_ok()) return s;
  if (Status s = time_recompute(e, *cache, table, seq, cached_next, &r); !s.is_ok()) return s;

  const json rows = print_kv_cache_rows(spec, r);
  const double cached_total = std::accumulate(r.cached_s.begin(), r.cached_s.end(), 0.0);
  const double recompute_total = std::accumulate(r.recompute_s.begin(), r.recompute_s.end(), 0.0);
  const double total_predicted = flop_ratio(pd::plan::generation_total_flops(spec, steps, prompt));
  std::printf("all %d steps: cached %.3f s, recompute %.3f s: x%.1f measured, x%.1f FLOPs (prompt prefill %.1f ms, "
              "not counted)\n",
              steps, cached_total, recompute_total, recompute_total / cached_total, total_predicted,
              r.prefill_s * 1e3);
  const json growth = print_kv_cache_growth(spec, r, cached_total, recompute_total);
  std::printf("recompute's next token equals the cached run's at %d of %d steps\n", r.agree, steps);
  *out = {{"prompt", prompt},           {"steps", steps},
          {"prompt_prefill_s", r.prefill_s}, {"cached_step_s", r.cached_s},
          {"recompute_step_s", r.recompute_s}, {"rows", rows},
          {"cached_total_s", cached_total}, {"recompute_total_s", recompute_total},
          {"measured_total_ratio", recompute_total / cached_total}, {"flop_total_ratio", total_predicted},
          {"growth", growth},              {"agreeing_next_tokens", r.agree}};
  return Status::ok();
}

// ---- one offline serving loop for batching and paged ----------------------

struct Request {
  std::vector<int32_t> prompt;
  int output_len = 0;
};

std::vector<Request> draw_requests(int n, Range prompt, Range output, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> p(prompt.min, prompt.max), o(output.min, output.max);
  std::vector<Request> reqs(static_cast<size_t>(n));
  for (Request& r : reqs) {
    const int len = p(rng);
    r.output_len = o(rng);
    r.prompt = random_tokens(len, vocab, rng);
  }
  return reqs;
}

struct ServeConfig {
  int max_batch = 8;
  // Static batching: admission opens only when the running batch is empty,
  // and then takes up to max_batch requests.
  bool static_groups = false;
  // > 0: each sequence reserves this many tokens of KV when admitted
  // (contiguous); 0: paged, blocks on demand with preemption.
  int reserve_tokens = 0;
};

struct ServeResult {
  double wall_s = 0;
  int64_t output_tokens = 0, prefill_passes = 0, prefill_tokens = 0, recomputed_tokens = 0;
  int64_t decode_steps = 0, preemptions = 0;
  double prefill_s = 0, decode_s = 0;  // inside the engine's prefill / decode calls
  int max_running = 0;
  double mean_running = 0;    // mean decode batch = mean concurrent sequences
  double mean_kv_held = 0;    // mean fraction of the pool's blocks held, over decode steps
  double mean_kv_filled = 0;  // mean fraction of held block slots that hold a token
  std::vector<double> completion_s;  // per request, from t=0 to its last token

  double tokens_per_s() const { return wall_s > 0 ? static_cast<double>(output_tokens) / wall_s : 0.0; }
  double mean_step_s() const { return decode_steps > 0 ? decode_s / static_cast<double>(decode_steps) : 0.0; }
  json to_json() const {
    return {{"wall_s", wall_s},
            {"output_tokens", output_tokens},
            {"tokens_per_s", tokens_per_s()},
            {"mean_completion_s", mean(completion_s)},
            {"p90_completion_s", quantile(completion_s, 0.9)},
            {"prefill_passes", prefill_passes},
            {"prefill_tokens", prefill_tokens},
            {"recomputed_tokens", recomputed_tokens},
            {"decode_steps", decode_steps},
            {"prefill_s", prefill_s},
            {"decode_s", decode_s},
            {"mean_step_s", mean_step_s()},
            {"preemptions", preemptions},
            {"max_running", max_running},
            {"mean_running", mean_running},
            {"mean_kv_blocks_held", mean_kv_held},
            {"mean_kv_slots_filled", mean_kv_filled},
            {"completion_s", completion_s}};
  }
};

// The offline serving loop: every request to completion over one KvCache,
// whose blocks a fresh KvBlockManager hands out. Each iteration: (1) paged
// growth of the running batch (plan, preempting the newest until it fits, then
// commit), (2) admission, one prefill pass per admitted request (none in an
// iteration that preempted, as in vLLM's scheduler), (3) one decode step of
// the whole running batch. Single use: construct, then run().
class ServeLoop {
 public:
  ServeLoop(Engine& e, pd::KvCache& cache, const std::vector<Request>& reqs, const ServeConfig& cfg)
      : e_(e), cache_(cache), reqs_(reqs), cfg_(cfg),
        blocks_({e.block_size, cache.layout.num_blocks, /*enable_prefix_sharing=*/false}), generated_(reqs.size()) {
    waiting_.resize(reqs.size());
    std::iota(waiting_.begin(), waiting_.end(), size_t{0});
    res_.completion_s.assign(reqs.size(), 0.0);
  }

  // ResourceExhausted naming the request when the pool cannot hold a request
  // on its own; Internal if blocks are still held at the end.
  pd::Result<ServeResult> run() {
    t0_ = Clock::now();
    while (!waiting_.empty() || !running_.empty()) {
      bool preempted = false;
      if (cfg_.reserve_tokens == 0 && !running_.empty())
        if (Status s = grow_running(&preempted); !s.is_ok()) return s;
      int admitted = 0;
      if (Status s = admit(!preempted && (!cfg_.static_groups || running_.empty()), &admitted); !s.is_ok()) return s;
      if (running_.empty()) {
        if (admitted == 0 && !waiting_.empty())
          return Status::resource_exhausted("request " + std::to_string(waiting_.front()) + " does not fit an empty " +
                                            std::to_string(blocks_.num_blocks()) + "-block KV pool");
        continue;
      }
      if (Status s = decode_step(); !s.is_ok()) return s;
    }
    res_.wall_s = seconds(Clock::now() - t0_);
    if (Status s = blocks_.check_invariants(); !s.is_ok()) return s;
    if (blocks_.num_free_blocks() != blocks_.num_blocks())
      return Status::internal("KV blocks still held after every request finished");
    if (res_.decode_steps > 0) {
      const double n = static_cast<double>(res_.decode_steps);
      res_.mean_running = running_sum_ / n;
      res_.mean_kv_held = held_sum_ / n;
      res_.mean_kv_filled = filled_sum_ / n;
    }
    return res_;
  }

 private:
  struct Running {
    size_t request;
    pd::SeqId seq;
    std::vector<int32_t> table;  // block ids, as the model takes them
  };

  void refresh_table(Running& r) {
    r.table.clear();
    for (pd::BlockId b : blocks_.block_table(r.seq)) r.table.push_back(b.value);
  }
  // Records request i's new token; true when that was its last.
  bool emit(size_t i, int32_t token) {
    generated_[i].push_back(token);
    ++res_.output_tokens;
    if (static_cast<int>(generated_[i].size()) < reqs_[i].output_len) return false;
    res_.completion_s[i] = seconds(Clock::now() - t0_);
    return true;
  }

  // Paged: a slot for each running sequence's next token. Plan: the blocks
  // the step needs; while the pool lacks them, preempt the newest running
  // sequence (blocks freed, back at the head of the queue, its tokens kept for
  // a recompute). Commit: append the tokens.
  Status grow_running(bool* preempted) {
    for (;;) {
      int64_t need = 0;
      for (const Running& r : running_) need += blocks_.blocks_needed_to_append(r.seq, 1);
      if (need <= blocks_.num_free_blocks()) break;
      if (running_.size() == 1)
        return Status::resource_exhausted("request " + std::to_string(running_[0].request) +
                                          " outgrows the KV pool alone");
      if (Status s = blocks_.free(running_.back().seq); !s.is_ok()) return s;
      waiting_.push_front(running_.back().request);
      running_.pop_back();
      ++res_.preemptions;
      *preempted = true;
    }
    for (Running& r : running_) {
      if (Status s = blocks_.append(r.seq, {&generated_[r.request].back(), 1}, nullptr); !s.is_ok()) return s;
      refresh_table(r);
    }
    return Status::ok();
  }

  // While `open` and a place is free (static: up to max_batch per group),
  // admits the head of the queue if the pool allows: contiguous, blocks for
  // reserve_tokens; paged, blocks for its tokens + 1 (the slot of the token
  // its prefill gives). Each is prefilled in its own pass over its prompt and
  // whatever it generated before a preemption.
  Status admit(bool open, int* admitted) {
    while (open && !waiting_.empty() &&
           (cfg_.static_groups ? *admitted : static_cast<int>(running_.size())) < cfg_.max_batch) {
      const size_t i = waiting_.front();
      std::vector<int32_t> tokens = reqs_[i].prompt;
      tokens.insert(tokens.end(), generated_[i].begin(), generated_[i].end());
      const bool contiguous = cfg_.reserve_tokens > 0;
      const int64_t need = contiguous ? ceil_div(cfg_.reserve_tokens, e_.block_size)
                                      : blocks_.blocks_needed_for_prompt(tokens) + 1;
      if (need > blocks_.num_free_blocks()) break;
      Running r{i, pd::SeqId{next_seq_++}, {}};
      const auto placed = contiguous
                              ? blocks_.allocate(r.seq, std::vector<int32_t>(static_cast<size_t>(cfg_.reserve_tokens), 0))
                              : blocks_.allocate(r.seq, tokens);
      if (!placed.is_ok()) return placed.status();
      refresh_table(r);
      const std::vector<pd::SequenceBatch> pre{{tokens, 0, r.table, true}};
      const auto t_pass = Clock::now();
      if (Status s = e_.model->prefill(pre, cache_, &logits_); !s.is_ok()) return s;
      res_.prefill_s += seconds(Clock::now() - t_pass);
      waiting_.pop_front();
      ++*admitted;
      ++res_.prefill_passes;
      res_.prefill_tokens += static_cast<int64_t>(tokens.size());
      if (!generated_[i].empty()) res_.recomputed_tokens += static_cast<int64_t>(tokens.size());
      if (emit(i, argmax_row(logits_, 0, e_.vocab()))) {
        if (Status s = blocks_.free(r.seq); !s.is_ok()) return s;
        continue;
      }
      if (!contiguous) {
        if (Status s = blocks_.append(r.seq, {&generated_[i].back(), 1}, nullptr); !s.is_ok()) return s;
        refresh_table(r);
      }
      running_.push_back(std::move(r));
    }
    return Status::ok();
  }

  // One decode step of the whole running batch; finished sequences leave it.
  Status decode_step() {
    std::vector<pd::SequenceBatch> step(running_.size());
    int64_t held_tokens = 0, held_blocks = 0;
    for (size_t k = 0; k < running_.size(); ++k) {
      const Running& r = running_[k];
      const auto& g = generated_[r.request];
      const int32_t pos = static_cast<int32_t>(reqs_[r.request].prompt.size() + g.size() - 1);
      step[k] = {{&g.back(), 1}, pos, r.table, true};
      held_tokens += pos + 1;
      held_blocks += static_cast<int64_t>(r.table.size());
    }
    const auto t_pass = Clock::now();
    if (Status s = e_.model->decode(step, cache_, &logits_); !s.is_ok()) return s;
    res_.decode_s += seconds(Clock::now() - t_pass);
    ++res_.decode_steps;
    res_.max_running = std::max(res_.max_running, static_cast<int>(running_.size()));
    running_sum_ += static_cast<double>(running_.size());
    held_sum_ += static_cast<double>(blocks_.num_blocks() - blocks_.num_free_blocks()) / blocks_.num_blocks();
    filled_sum_ += static_cast<double>(held_tokens) / static_cast<double>(held_blocks * e_.block_size);
    std::vector<Running> still;
    for (size_t k = 0; k < running_.size(); ++k) {
      if (emit(running_[k].request, argmax_row(logits_, k, e_.vocab()))) {
        if (Status s = blocks_.free(running_[k].seq); !s.is_ok()) return s;
      } else {
        still.push_back(std::move(running_[k]));
      }
    }
    running_ = std::move(still);
    return Status::ok();
  }

  Engine& e_;
  pd::KvCache& cache_;
  const std::vector<Request>& reqs_;
  const ServeConfig cfg_;
  pd::KvBlockManager blocks_;
  std::deque<size_t> waiting_;                   // request indices; head = next admitted
  std::vector<Running> running_;                 // in admission order: back = newest
  std::vector<std::vector<int32_t>> generated_;  // per request, kept across preemptions
  std::vector<float> logits_;
  ServeResult res_;
  int64_t next_seq_ = 0;
  double running_sum_ = 0, held_sum_ = 0, filled_sum_ = 0;
  Clock::time_point t0_;
};

pd::Result<ServeResult> serve(Engine& e, pd::KvCache& cache, const std::vector<Request>& reqs, const ServeConfig& cfg) {
  return ServeLoop(e, cache, reqs, cfg).run();
}

json ratios(const ServeResult& a, const ServeResult& b) {  // a over b
  auto r = [](double x, double y) { return y > 0 ? x / y : 0.0; };
  return {{"wall_s", r(a.wall_s, b.wall_s)},
          {"tokens_per_s", r(a.tokens_per_s(), b.tokens_per_s())},
          {"mean_completion_s", r(mean(a.completion_s), mean(b.completion_s))},
          {"p90_completion_s", r(quantile(a.completion_s, 0.9), quantile(b.completion_s, 0.9))},
          {"mean_running", r(a.mean_running, b.mean_running)}};
}

// ---- batching: continuous vs static ---------------------------------------

struct BatchingFlags {
  int requests = 24, max_batch = 8;
  Range prompt{16, 128}, output{8, 256};
};

Status run_batching(Engine& e, const BatchingFlags& f, uint64_t seed, json* out) {
  const auto reqs = draw_requests(f.requests, f.prompt, f.output, e.vocab(), seed);
  // Enough blocks that no sequence ever waits for KV: both variants differ in
  // batching alone.
  const int64_t per_seq = ceil_div(f.prompt.max + f.output.max, e.block_size) + 1;
  auto cache = e.make_cache(std::max<int64_t>(f.max_batch * per_seq, f.max_batch));
  if (!cache.is_ok()) return cache.status();
  if (Status s = warm_up(e, *cache, f.prompt.max, f.max_batch); !s.is_ok()) return s;
  ServeConfig static_cfg{f.max_batch, /*static_groups=*/true, 0}, continuous_cfg{f.max_batch, false, 0};
  auto stat = serve(e, *cache, reqs, static_cfg);
  if (!stat.is_ok()) return stat.status();
  auto cont = serve(e, *cache, reqs, continuous_cfg);
  if (!cont.is_ok()) return cont.status();

  std::printf("\n== batching: %d requests at t=0, prompts %d-%d, outputs %d-%d tokens, max batch %d\n", f.requests,
              f.prompt.min, f.prompt.max, f.output.min, f.output.max, f.max_batch);
  std::printf("%-20s %-8s %-10s %-12s %-12s %-11s %-8s\n", "variant", "wall s", "out tok/s", "mean done s",
              "p90 done s", "mean batch", "steps");
  for (auto [name, r] : {std::pair{"static (best case)", &*stat}, std::pair{"continuous", &*cont}})
    std::printf("%-20s %-8.2f %-10.1f %-12.2f %-12.2f %-11.2f %-8lld\n", name, r->wall_s, r->tokens_per_s(),
                mean(r->completion_s), quantile(r->completion_s, 0.9), r->mean_running,
                static_cast<long long>(r->decode_steps));
  const json q = ratios(*cont, *stat);
  std::printf("%-20s x%-7.2f x%-9.2f x%-11.2f x%-11.2f x%-10.2f\n", "continuous/static", q["wall_s"].get<double>(),
              q["tokens_per_s"].get<double>(), q["mean_completion_s"].get<double>(),
              q["p90_completion_s"].get<double>(), q["mean_running"].get<double>());
  std::printf("(static's best case: a group's finished sequences leave its steps; none joins until the group ends)\n");
  std::printf("continuous: x%.2f the output tok/s, mean completion x%.2f, in %lld decode steps against %lld (mean "
              "step %.1f ms at %.2f sequences vs %.1f ms at %.2f)\n",
              q["tokens_per_s"].get<double>(), q["mean_completion_s"].get<double>(),
              static_cast<long long>(cont->decode_steps), static_cast<long long>(stat->decode_steps),
              1e3 * cont->mean_step_s(), cont->mean_running, 1e3 * stat->mean_step_s(),
              stat->mean_running);
  *out = {{"requests", f.requests},
          {"max_batch", f.max_batch},
          {"prompt", {f.prompt.min, f.prompt.max}},
          {"output", {f.output.min, f.output.max}},
          {"static", stat->to_json()},
          {"continuous", cont->to_json()},
          {"continuous_over_static", q}};
  return Status::ok();
}

// ---- paged: paged blocks vs contiguous max-length reservations ------------

struct PagedFlags {
  int requests = 48, budget = 4096, max_len = 1024, max_batch = 64;
  Range prompt{32, 192}, output{32, 192};
};

Status run_paged(Engine& e, const PagedFlags& f, uint64_t seed, json* out) {
  const auto reqs = draw_requests(f.requests, f.prompt, f.output, e.vocab(), seed);
  const int64_t pool_blocks = f.budget / e.block_size;
  auto cache = e.make_cache(pool_blocks);
  if (!cache.is_ok()) return cache.status();
  if (Status s = warm_up(e, *cache, f.prompt.max + f.output.max, std::min<int64_t>(f.max_batch, pool_blocks));
      !s.is_ok())
    return s;
  ServeConfig contiguous_cfg{f.max_batch, false, f.max_len}, paged_cfg{f.max_batch, false, 0};
  auto contig = serve(e, *cache, reqs, contiguous_cfg);
  if (!contig.is_ok()) return contig.status();
  auto paged = serve(e, *cache, reqs, paged_cfg);
  if (!paged.is_ok()) return paged.status();

  std::printf("\n== paged: KV pool %d tokens (%lld blocks of %d), max length %d, %d requests at t=0, prompts %d-%d, "
              "outputs %d-%d, batch cap %d\n",
              f.budget, static_cast<long long>(pool_blocks), e.block_size, f.max_len, f.requests, f.prompt.min,
              f.prompt.max, f.output.min, f.output.max, f.max_batch);
  std::printf("%-18s %-8s %-10s %-9s %-10s %-9s %-11s %-10s %-10s %-10s\n", "variant", "wall s", "out tok/s",
              "max seqs", "mean seqs", "preempt", "recomputed", "KV held", "KV filled", "mean done s");
  for (auto [name, r] : {std::pair{"contiguous", &*contig}, std::pair{"paged", &*paged}})
    std::printf("%-18s %-8.2f %-10.1f %-9d %-10.2f %-9lld %-11lld %-10.0f %-10.0f %-10.2f\n", name, r->wall_s,
                r->tokens_per_s(), r->max_running, r->mean_running, static_cast<long long>(r->preemptions),
                static_cast<long long>(r->recomputed_tokens), 100.0 * r->mean_kv_held, 100.0 * r->mean_kv_filled,
                mean(r->completion_s));
  const json q = ratios(*paged, *contig);
  std::printf("%-18s x%-7.2f x%-9.2f %-9s x%-9.2f %-9s %-11s %-10s %-10s x%.2f\n", "paged/contiguous",
              q["wall_s"].get<double>(), q["tokens_per_s"].get<double>(), "", q["mean_running"].get<double>(), "", "",
              "", "", q["mean_completion_s"].get<double>());
  std::printf("(KV held: %% of the pool's blocks taken; KV filled: %% of taken slots holding a token; both averaged "
              "over decode steps)\n");
  std::printf("paged runs x%.2f the sequences at once for x%.2f the output tok/s (mean decode step %.1f ms at %.1f "
              "sequences vs %.1f ms at %.1f); the PagedAttention paper reports 2-4x throughput (GPUs)\n",
              q["mean_running"].get<double>(), q["tokens_per_s"].get<double>(), 1e3 * paged->mean_step_s(),
              paged->mean_running, 1e3 * contig->mean_step_s(), contig->mean_running);
  *out = {{"requests", f.requests},
          {"kv_budget_tokens", f.budget},
          {"kv_blocks", pool_blocks},
          {"max_len", f.max_len},
          {"max_batch", f.max_batch},
          {"prompt", {f.prompt.min, f.prompt.max}},
          {"output", {f.output.min, f.output.max}},
          {"contiguous", contig->to_json()},
          {"paged", paged->to_json()},
          {"paged_over_contiguous", q}};
  return Status::ok();
}

// ---- flags and set-up -------------------------------------------------------

struct TextbookFlags {
  std::string model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf", json_path, only = "kv-cache,batching,paged";
  int threads = 0, block_size = pd::KvBlockManagerConfig{}.block_size, kv_prompt = 32, kv_steps = 128;
  uint64_t seed = 1;
  BatchingFlags batching;
  PagedFlags paged;
  bool run_kv = false, run_batching = false, run_paged = false;  // from --only
};

// The MIN,MAX flags as given.
struct RangeFlags {
  std::string batching_prompt = "16,128", batching_output = "8,256", paged_prompt = "32,192",
              paged_output = "32,192";
};

void add_options(CLI::App* app, TextbookFlags* f, RangeFlags* r) {
  app->add_option("-m,--model", f->model_path, "GGUF model (default: the default model)");
  app->add_option("--threads", f->threads, "CPU threads (0 = all cores)")->check(CLI::Range(0, 1024));
  app->add_option("--seed", f->seed, "seed of the token ids and lengths");
  app->add_option("--json", f->json_path, "write all results as JSON to this file")
      ->check(pd::tools::writable_file());
  app->add_option("--only", f->only, "comma-separated experiments: kv-cache, batching, paged");
  app->add_option("--block-size", f->block_size, "KV block size in tokens")->check(CLI::Range(1, 1024));
  app->add_option("--kv-prompt", f->kv_prompt, "kv-cache: prompt tokens")->check(CLI::Range(1, 1 << 20));
  app->add_option("--kv-steps", f->kv_steps, "kv-cache: generated tokens")->check(CLI::Range(1, 1 << 20));
  app->add_option("--batching-requests", f->batching.requests, "batching: requests")->check(CLI::Range(1, 1 << 20));
  app->add_option("--batching-max-batch", f->batching.max_batch, "batching: max running")
      ->check(CLI::Range(1, 1024));
  app->add_option("--batching-prompt", r->batching_prompt, "batching: prompt tokens MIN,MAX (uniform)");
  app->add_option("--batching-output", r->batching_output, "batching: output tokens MIN,MAX (uniform)");
  app->add_option("--paged-requests", f->paged.requests, "paged: requests")->check(CLI::Range(1, 1 << 20));
  app->add_option("--paged-budget", f->paged.budget, "paged: KV pool in tokens")->check(CLI::Range(1, 1 << 24));
  app->add_option("--paged-max-len", f->paged.max_len, "paged: max sequence length (contiguous reservation)")
      ->check(CLI::Range(1, 1 << 24));
  app->add_option("--paged-max-batch", f->paged.max_batch, "paged: max running")->check(CLI::Range(1, 1024));
  app->add_option("--paged-prompt", r->paged_prompt, "paged: prompt tokens MIN,MAX (uniform)");
  app->add_option("--paged-output", r->paged_output, "paged: output tokens MIN,MAX (uniform)");
}

// --only: which experiments run.
int parse_only(TextbookFlags* f) {
  const std::string& only = f->only;
  for (size_t pos = 0; pos <= only.size();) {
    const size_t comma = only.find(',', pos);
    const std::string name = only.substr(pos, comma == std::string::npos ? comma : comma - pos);
    if (name == "kv-cache") f->run_kv = true;
    else if (name == "batching") f->run_batching = true;
    else if (name == "paged") f->run_paged = true;
    else return fail("--only: unknown experiment '" + name + "' (kv-cache, batching, paged)", 2);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return 0;
}

// Parses and checks the command line into *f. Returns the exit status when
// the tool stops here (--help, a bad flag), nothing when it goes on.
std::optional<int> parse_flags(int argc, char** argv, TextbookFlags* f) {
  CLI::App app{"pd-bench-textbook: KV cache, continuous batching and paged KV, each against its alternative"};
  RangeFlags r;
  add_options(&app, f, &r);
  if (auto code = pd::tools::parse_command_line(app, argc, argv, "pd-bench-textbook")) return code;
  const auto bp = parse_range(r.batching_prompt, "--batching-prompt");
  const auto bo = parse_range(r.batching_output, "--batching-output");
  const auto pp = parse_range(r.paged_prompt, "--paged-prompt"), po = parse_range(r.paged_output, "--paged-output");
  if (!bp || !bo || !pp || !po) return 2;
  f->batching.prompt = *bp, f->batching.output = *bo, f->paged.prompt = *pp, f->paged.output = *po;
  if (int rc = parse_only(f)) return rc;
  const PagedFlags& paged = f->paged;
  if (paged.max_len < paged.prompt.max + paged.output.max)
    return fail("--paged-max-len: " + std::to_string(paged.max_len) + " is below the longest sequence (" +
                    std::to_string(paged.prompt.max + paged.output.max) + " tokens: --paged-prompt + --paged-output)",
                2);
  if (paged.budget / f->block_size < ceil_div(paged.max_len, f->block_size))
    return fail("--paged-budget: " + std::to_string(paged.budget) + " tokens (blocks of " +
                    std::to_string(f->block_size) + ") cannot hold one --paged-max-len sequence",
                2);
  return std::nullopt;
}

// Opens --model, reads its shape for the planner's formulas, loads it on the CPU backend.
int load_engine(const TextbookFlags& f, Engine* e, pd::plan::ModelSpec* spec) {
  pd::tools::ToolError err;
  const auto gguf = pd::tools::open_model_file(f.model_path, /*refusal_is_usage=*/true, &err);
  if (!gguf) return fail(err.message, err.exit_code);
  auto s = pd::plan::model_from_gguf(*gguf);
  if (!s.is_ok()) return fail(s.status().to_string() + " (--model)", 2);
  *spec = *s;
  e->block_size = f.block_size;
  pd::tools::BackendFlags bf;
  bf.threads = f.threads;
  auto be = pd::create_backend(pd::tools::backend_config(bf));
  if (!be.is_ok()) return fail(be.status().to_string());
  e->backend = std::move(be).value();
  auto m = pd::LlamaModel::load(gguf, *e->backend);
  if (!m.is_ok()) return fail(m.status().to_string() + " (--model)", 2);
  e->model = std::move(m).value();
  return 0;
}

// Refuses an experiment whose longest sequence exceeds the model's context.
int check_lengths(const TextbookFlags& f, const Engine& e) {
  const int context = e.model->config().context;
  auto too_long = [&](bool on, int tokens, const char* flags) {
    if (on && tokens > context)
      return fail(std::string(flags) + ": sequences of " + std::to_string(tokens) + " tokens exceed the model's " +
                      std::to_string(context) + "-token context",
                  2);
    return 0;
  };
  if (int rc = too_long(f.run_kv, f.kv_prompt + f.kv_steps, "--kv-prompt + --kv-steps")) return rc;
  if (int rc = too_long(f.run_batching, f.batching.prompt.max + f.batching.output.max,
                        "--batching-prompt/--batching-output"))
    return rc;
  return too_long(f.run_paged, f.paged.prompt.max + f.paged.output.max, "--paged-prompt/--paged-output");
}

// The command line and set-up as "#" lines; the JSON's header.
json print_header(const TextbookFlags& f, const Engine& e, int argc, char** argv) {
  std::string cmd;
  for (int i = 0; i < argc; ++i) cmd += std::string(i ? " " : "") + argv[i];
  std::printf("# %s\n", cmd.c_str());
  const int n_threads = f.threads > 0 ? f.threads : omp_get_num_procs();
  std::printf("# backend %s, %d thread%s, KV %s, blocks of %d tokens, seed %llu\n", e.backend->name().c_str(),
              n_threads, n_threads > 1 ? "s" : "", pd::kv_dtype_name(pd::kDefaultKvDtype), f.block_size,
              static_cast<unsigned long long>(f.seed));
  std::fflush(stdout);
  return {{"command", cmd},          {"model", f.model_path}, {"backend", e.backend->name()},
          {"threads", n_threads},    {"seed", f.seed},        {"block_size", f.block_size},
          {"kv_dtype", pd::kv_dtype_name(pd::kDefaultKvDtype)}, {"experiments", json::object()}};
}

// Runs the experiments --only names, each result into out["experiments"]; false after one fails.
bool run_experiments(const TextbookFlags& f, Engine& e, const pd::plan::ModelSpec& spec, json* out) {
  auto run = [&](bool on, const char* name, auto&& body) {
    if (!on) return true;
    json result;
    if (Status s = body(&result); !s.is_ok()) {
      fail(std::string(name) + ": " + s.to_string());
      return false;
    }
    (*out)["experiments"][name] = std::move(result);
    std::fflush(stdout);
    return true;
  };
  return run(f.run_kv, "kv-cache",
             [&](json* r) { return run_kv_cache(e, spec, f.kv_prompt, f.kv_steps, f.seed, r); }) &&
         run(f.run_batching, "batching", [&](json* r) { return run_batching(e, f.batching, f.seed + 1, r); }) &&
         run(f.run_paged, "paged", [&](json* r) { return run_paged(e, f.paged, f.seed + 2, r); });
}

}  // namespace

int main(int argc, char** argv) {
  TextbookFlags flags;
  if (auto code = parse_flags(argc, argv, &flags)) return *code;
  Engine e;
  pd::plan::ModelSpec spec;
  if (int rc = load_engine(flags, &e, &spec)) return rc;
  if (int rc = check_lengths(flags, e)) return rc;
  json out = print_header(flags, e, argc, argv);
  const auto t_all = Clock::now();
  if (!run_experiments(flags, e, spec, &out)) return 1;
  out["total_s"] = seconds(Clock::now() - t_all);
  std::printf("\ntotal %.1f s\n", out["total_s"].get<double>());
  if (!flags.json_path.empty() && !pd::tools::write_json_file(flags.json_path, out))
    return fail("cannot write --json file '" + flags.json_path + "'", 2);
  return 0;
}
