// pd-bench-engine: the engine's speed against the machine's limits: on the CPU
// against limits measured in the same run, on a GPU against a hardware preset.
//
//   pd-bench-engine [-m MODEL] [--threads 1,2] [--batches 1,8,32] [--sweep] [--fp32-activations]
//                   [--backend cpu|cuda [--device N] [--peak-preset h200] [--tf32]]
//                   [--prefill-tokens 512,2048,4096] [--prompt 128] [--gen 128] [--reps 3]
//                   [--llamacpp DIR]
//                   [--kv-dtype f16] [--kv-compare f32,f16,q8_0 [--kv-contexts 2048,8192] [--kv-batches 1,8]]
//                   [--json FILE] [--profile FILE [--profile-prefill 64,512,4096] [--profile-contexts 128,2048]]
//
// Prints, per thread count: the machine probes (STREAM triad and read GB/s,
// FMA GFLOP/s, 8-bit multiply-add GMAC/s), prefill tok/s for one prompt of
// each --prefill-tokens length and the fraction of the FMA and int8 peaks it
// reaches (the first length is the figure of the profile and of JSON's
// "prefill"), aggregate decode tok/s for each batch (every sequence with a
// --prompt-token prompt generating --gen tokens, so contexts grow
// prompt -> prompt + gen) with the fraction of the memory bandwidth the step
// streams (weights + KV read), then peak RSS and KV bytes per token.
// --kv-dtype picks the KV cache's elements for those runs (f16, the serving
// default). --kv-compare adds decode at long contexts for each listed KV type
// (tok/s, KV GB/s read, ratio to the first type, all in this run; then the
// decode attention alone over the same cache: microseconds per layer, one
// layer's paged_attention for the batch's tokens, and its GFLOP/s): the cache
// is filled by kv_write with random K/V rather than by prefilling every
// sequence (attention's cost does not depend on the values).
// --llamacpp DIR also runs llama.cpp's llama-bench and llama-batched-bench
// from that build (tools/llamacpp_bench.h) after each thread count's runs, on
// the same file and threads, and prints the same rows with the ratio.
// --json writes everything; --profile writes the per-phase cost profile
// (prefill time vs tokens, decode step time vs batch and context) that
// pd-plan's simulator reads (common/plan/engine_profile.h); --profile-prefill
// and --profile-contexts spread its points over the prompt lengths and
// contexts a workload will reach (the planner interpolates between points and
// extrapolates beyond the last segment, so points bunched near one length
// predict long prompts and contexts badly). Random token ids:
// the speed does not depend on the text. A bad flag or model: one line naming
// it, exit status 2.
//
// --backend cuda runs the same measurements once on CUDA device --device
// (--threads and the CPU probes do not apply) and compares them with the
// --peak-preset hardware preset (common/plan/hardware.h; default h200): prefill
// FLOP/s (2 x parameters x tokens + attention, forward_flops below) as a
// fraction of the preset's dense peak, decode bytes per step (weights + the KV
// read at the step's context) per second as a fraction of its memory
// bandwidth. Decode batches default to 1,8,32,128 there. --tf32 runs the
// backend's GEMMs on TF32 tensor cores (else fp32 cuBLAS SGEMM, no tensor
// cores: expect a small fraction of a bf16 peak). Without --backend the
// CPU behaviour and output are as they always were.
#include <CLI/CLI.hpp>
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "backend/backend.h"
#include "backend/cpu/q8_kernels.h"
#include "llamacpp_bench.h"
#include "gguf/gguf_reader.h"
#include "model/kv_cache.h"
#include "model/llama_model.h"
#include "plan/engine_profile.h"
#include "plan/hardware.h"
#include "tool_common.h"

namespace {

using pd::tools::Clock;
using pd::tools::median;
using pd::tools::seconds;
int fail(const std::string& msg, int code = 1) { return pd::tools::report_error("pd-bench-engine", msg, code); }

// ---- machine probes ------------------------------------------------------

// STREAM triad a = b + s*c over arrays far larger than the caches; GB/s
// counted as STREAM does (3 arrays x 4 bytes per element), best of 5.
double stream_triad_gbs(int threads, size_t n) {
  std::vector<float> a(n), b(n, 1.0f), c(n, 2.0f);
  const float s = 3.0f;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
    best = std::max(best, 3.0 * 4.0 * static_cast<double>(n) / seconds(Clock::now() - t0) / 1e9);
  }
  if (a[n / 2] != 7.0f) std::fprintf(stderr, "triad check failed\n");
  return best;
}

// A pure read: sum of an array (vector loads, independent accumulators); GB/s, best of 5.
double read_gbs(int threads, size_t n) {
  std::vector<float> a(n, 1.0f);
  double best = 0, sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      const size_t nt = static_cast<size_t>(omp_get_num_threads()), me = static_cast<size_t>(omp_get_thread_num());
      const size_t chunk = (n / nt) & ~size_t{31}, lo = me * chunk, hi = me + 1 == nt ? n : lo + chunk;
#if defined(__AVX2__)
      __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      size_t i = lo;
      for (; i + 32 <= hi; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(&a[i]));
        s1 = _mm256_add_ps(s1, _mm256_loadu_ps(&a[i + 8]));
        s2 = _mm256_add_ps(s2, _mm256_loadu_ps(&a[i + 16]));
        s3 = _mm256_add_ps(s3, _mm256_loadu_ps(&a[i + 24]));
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
      for (float v : lanes) total += v;
      for (; i < hi; ++i) total += a[i];
#else
      float acc[16] = {};
      size_t i = lo;
      for (; i + 16 <= hi; i += 16)
        for (int k = 0; k < 16; ++k) acc[k] += a[i + k];
      for (float v : acc) total += v;
      for (; i < hi; ++i) total += a[i];
#endif
    }
    best = std::max(best, 4.0 * static_cast<double>(n) / seconds(Clock::now() - t0) / 1e9);
    sink += total;
  }
  if (sink <= 0) std::fprintf(stderr, "read check failed\n");
  return best;
}

// FMA throughput: independent vector FMA chains per thread (enough to cover
// the FMA latency), GFLOP/s (an FMA = 2 flops), best of 3.
double fma_gflops(int threads) {
  constexpr int64_t kIters = 20'000'000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double flops = 0;
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
    {
#if defined(__AVX2__) && defined(__FMA__)
      __m256 acc[10];
      for (auto& v : acc) v = _mm256_set1_ps(0.0f);
      const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
      for (int64_t i = 0; i < kIters; ++i)
        for (auto& v : acc) v = _mm256_fmadd_ps(v, x, y);
      float out[8];
      __m256 s = acc[0];
      for (int k = 1; k < 10; ++k) s = _mm256_add_ps(s, acc[k]);
      _mm256_storeu_ps(out, s);
      flops = 2.0 * 8 * 10 * static_cast<double>(kIters) + (out[0] > 1e30f ? 1 : 0);
#else
      float acc[80] = {};
      for (int64_t i = 0; i < kIters; ++i)
#pragma omp simd
        for (int k = 0; k < 80; ++k) acc[k] = acc[k] * 0.999999f + 1e-7f;
      flops = 2.0 * 80 * static_cast<double>(kIters) + (acc[0] > 1e30f ? 1 : 0);
#endif
    }
    best = std::max(best, flops / seconds(Clock::now() - t0) / 1e9);
  }
  return best;
}

// 8-bit multiply-add throughput through vpmaddubsw, the instruction the
// integer matmul kernels are built on (backend/cpu/q8_kernels.h):
// independent chains per thread, G multiply-adds/s (one = 2 ops), best of 3.
// 0 where this build has no AVX2 (the kernels then run the scalar path).
double int8_gmacs(int threads) {
#if defined(__AVX2__)
  constexpr int64_t kIters = 20'000'000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double macs = 0;
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : macs)
    {
      __m256i acc[10];
      for (int k = 0; k < 10; ++k) acc[k] = _mm256_set1_epi8(static_cast<char>(k + 1));
      const __m256i y = _mm256_set1_epi8(3);
      for (int64_t i = 0; i < kIters; ++i)
        for (auto& v : acc) v = _mm256_maddubs_epi16(v, y);
      __m256i s = acc[0];
      for (int k = 1; k < 10; ++k) s = _mm256_add_epi16(s, acc[k]);
      macs = 32.0 * 10 * static_cast<double>(kIters) + (_mm256_extract_epi16(s, 0) == 12345 ? 1 : 0);
    }
    best = std::max(best, macs / seconds(Clock::now() - t0) / 1e9);
  }
  return best;
#else
  (void)threads;
  return 0.0;
#endif
}

// "model name" from /proc/cpuinfo, with the family/model numbers that tell
// microarchitectures apart (e.g. family 23 model 1 = Zen 1).
std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, name = "unknown", family, model;
  auto value = [](const std::string& l) { return l.substr(l.find(':') + 2); };
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0 && name == "unknown") name = value(line);
    if (line.rfind("cpu family", 0) == 0 && family.empty()) family = value(line);
    if (line.rfind("model\t", 0) == 0 && model.empty()) model = value(line);
  }
  return family.empty() ? name : name + " (family " + family + " model " + model + ")";
}

// ---- engine runs ---------------------------------------------------------

struct Engine {
  std::unique_ptr<pd::Backend> backend;
  std::unique_ptr<pd::LlamaModel> model;
  pd::KvCache cache;
  int block_size = 16;
};

// Decode at a long context: the median step, and the median of the decode
// attention alone (one layer's paged_attention for the batch's tokens,
// every layer in turn) over the same cache; -1 on failure.
struct LongContextTimes {
  double step_s = -1, attention_layer_s = -1;
};

// One layer's attention for `tokens` (one per sequence, at the cache's end),
// `reps` times round the layers; the median seconds of a call.
double time_attention(pd::Backend& be, const pd::KvCache& cache, const pd::LlamaConfig& c,
                      std::span<const pd::AttentionToken> tokens, std::span<const std::span<const int32_t>> tables,
                      int reps) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  std::vector<float> host(static_cast<size_t>(c.head_dim * c.n_heads * n));
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (float& x : host) x = normal(rng);
  auto qb = be.alloc(host.size() * sizeof(float)), ob = be.alloc(host.size() * sizeof(float));
  if (!qb.is_ok() || !ob.is_ok()) return -1;
  pd::Tensor q, out;
  q.ne = out.ne = {c.head_dim, c.n_heads, n, 1};
  q.data = (*qb)->data(), out.data = (*ob)->data();
  if (!be.copy_from_host(host.data(), q, host.size() * sizeof(float)).is_ok()) return -1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  std::vector<double> call_s;
  for (int i = -c.n_layers; i < reps; ++i) {  // one warm round over the layers first
    const int layer = (i + c.n_layers) % c.n_layers;
    const auto t0 = Clock::now();
    if (!be.paged_attention(q, *cache.buffer, cache.layout, layer, tokens, tables, scale, out).is_ok() ||
        !be.synchronize().is_ok())
      return -1;
    if (i >= 0) call_s.push_back(seconds(Clock::now() - t0));
  }
  return median(call_s);
}

// The cache is filled with random K/V through kv_write (the same conversion a
// prefill does). attention_reps 0: the step only.
LongContextTimes time_long_context_decode(pd::Backend& be, pd::LlamaModel& model, pd::GgmlType dtype, int batch,
                                          int context, int steps, int block_size, int attention_reps = 0) {
  const auto& c = model.config();
  const int per_seq_blocks = (context + steps + block_size - 1) / block_size;
  auto cache = pd::KvCache::create(be, c, block_size, static_cast<int64_t>(batch) * per_seq_blocks, dtype);
  LongContextTimes fail_times;
  if (!cache.is_ok()) return fail_times;
  // One chunk of random K and V, written to every position of every layer.
  constexpr int kChunk = 1024;
  const int64_t row = static_cast<int64_t>(c.n_kv_heads) * c.head_dim;
  std::vector<float> host(static_cast<size_t>(row * kChunk));
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : host) x = normal(rng);
  auto buf = be.alloc(host.size() * sizeof(float));
  if (!buf.is_ok()) return fail_times;
  pd::Tensor kv;
  kv.ne = {c.head_dim, c.n_kv_heads, kChunk, 1};
  kv.data = (*buf)->data();
  if (!be.copy_from_host(host.data(), kv, host.size() * sizeof(float)).is_ok()) return fail_times;
  std::vector<std::vector<int32_t>> tables(batch);
  std::vector<int32_t> slots;
  for (int s = 0; s < batch; ++s) {
    tables[s].resize(per_seq_blocks);
    std::iota(tables[s].begin(), tables[s].end(), s * per_seq_blocks);
    for (int p0 = 0; p0 < context; p0 += kChunk) {
      slots.clear();
      for (int p = p0; p < std::min(context, p0 + kChunk); ++p)
        slots.push_back(tables[s][p / block_size] * block_size + p % block_size);
      kv.ne[2] = static_cast<int64_t>(slots.size());
      for (int l = 0; l < c.n_layers; ++l)
        if (!be.kv_write(*cache->buffer, cache->layout, l, kv, kv, slots).is_ok()) return fail_times;
    }
  }
  std::vector<int32_t> next(batch, 5);
  std::vector<pd::SequenceBatch> b(batch);
  std::vector<float> logits;
  std::vector<double> step_s;
  for (int i = 0; i < steps; ++i) {
    for (int s = 0; s < batch; ++s) b[s] = {std::span<const int32_t>(&next[s], 1), context + i, tables[s], true};
    const auto t0 = Clock::now();
    if (!model.decode(b, *cache, &logits).is_ok()) return fail_times;
    step_s.push_back(seconds(Clock::now() - t0));
  }
  std::vector<pd::AttentionToken> tokens;
  for (int s = 0; s < batch; ++s) tokens.push_back({context + steps - 1, s});
  const std::vector<std::span<const int32_t>> spans(tables.begin(), tables.end());
  return {median(step_s), attention_reps > 0 ? time_attention(be, *cache, c, tokens, spans, attention_reps) : 0.0};
}

std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(3 + rng() % static_cast<uint64_t>(vocab - 3));
  return t;
}

// Matmul FLOPs of a forward pass over n tokens of one sequence starting at
// position 0 (weights: 2 per multiply-add; attention: QK^T and PV over the
// causal prefix), with the LM head for one row.
double forward_flops(const pd::LlamaConfig& c, double n) {
  const double d = c.hidden, q = static_cast<double>(c.n_heads) * c.head_dim,
               kv = static_cast<double>(c.n_kv_heads) * c.head_dim;
  const double per_token = 2.0 * (d * q + 2 * d * kv + q * d + 3 * d * c.ffn);
  const double attention = 2.0 * 2.0 * q * (n * (n + 1) / 2.0);
  return c.n_layers * (per_token * n + attention) + 2.0 * d * c.vocab;
}

// One prefill pass of `n` tokens (one sequence); seconds.
double time_prefill(Engine& e, int n, uint64_t seed) {
  const auto& c = e.model->config();
  const auto toks = random_tokens(n, c.vocab, seed);
  std::vector<int32_t> table((n + e.block_size - 1) / e.block_size);
  std::iota(table.begin(), table.end(), 0);
  std::vector<pd::SequenceBatch> b{{toks, 0, table, true}};
  std::vector<float> logits;
  const auto t0 = Clock::now();
  if (!e.model->prefill(b, e.cache, &logits).is_ok()) return -1;
  return seconds(Clock::now() - t0);
}

struct DecodeRun {
  int batch = 0;
  double tokens_per_s = 0;
  std::vector<double> step_seconds;  // per step; step i runs at context prompt + i + 1
};

// `batch` sequences with `prompt`-token prompts (prefilled, not timed), then
// `gen` decode steps of the whole batch, each feeding the argmax token.
DecodeRun time_decode(Engine& e, int batch, int prompt, int gen) {
  const auto& c = e.model->config();
  const int per_seq_blocks = (prompt + gen + e.block_size - 1) / e.block_size;
  std::vector<std::vector<int32_t>> toks(batch), tables(batch);
  for (int s = 0; s < batch; ++s) {
    toks[s] = random_tokens(prompt, c.vocab, 1000 + s);
    tables[s].resize(per_seq_blocks);
    std::iota(tables[s].begin(), tables[s].end(), s * per_seq_blocks);
  }
  std::vector<float> logits;
  for (int s0 = 0; s0 < batch; s0 += 8) {  // prefill in groups (bounded scratch)
    std::vector<pd::SequenceBatch> b;
    for (int s = s0; s < std::min(batch, s0 + 8); ++s) b.push_back({toks[s], 0, tables[s], false});
    if (!e.model->prefill(b, e.cache, nullptr).is_ok()) return {};
  }
  if (!e.backend->synchronize().is_ok()) return {};  // an asynchronous backend: not into the first step's time
  DecodeRun r;
  r.batch = batch;
  std::vector<int32_t> next(batch, 5);
  std::vector<pd::SequenceBatch> steps(batch);
  const auto t_all = Clock::now();
  for (int i = 0; i < gen; ++i) {
    for (int s = 0; s < batch; ++s)
      steps[s] = {std::span<const int32_t>(&next[s], 1), prompt + i, tables[s], true};
    const auto t0 = Clock::now();
    if (!e.model->decode(steps, e.cache, &logits).is_ok()) return {};
    r.step_seconds.push_back(seconds(Clock::now() - t0));
    for (int s = 0; s < batch; ++s)
      next[s] = static_cast<int32_t>(std::max_element(logits.begin() + s * c.vocab, logits.begin() + (s + 1) * c.vocab) -
                                     (logits.begin() + s * c.vocab));
  }
  r.tokens_per_s = static_cast<double>(batch) * gen / seconds(Clock::now() - t_all);
  return r;
}

// Speculative decoding's verification step: one sequence with a `prompt`-token
// prompt (prefilled, not timed), then `steps` forward passes of `m` new tokens
// at positions prompt .. prompt + m - 1 with logits for every one of them (a
// step's last token and m - 1 drafted ones); each pass rewrites the same
// positions. Median seconds per pass (< 0: failed).
double time_verify(Engine& e, int m, int prompt, int steps) {
  const auto& c = e.model->config();
  const auto toks = random_tokens(prompt + m, c.vocab, 77);
  std::vector<int32_t> table((prompt + m + e.block_size - 1) / e.block_size);
  std::iota(table.begin(), table.end(), 0);
  const std::span<const int32_t> all(toks);
  std::vector<pd::SequenceBatch> b{{all.first(prompt), 0, table, false}};
  if (!e.model->prefill(b, e.cache, nullptr).is_ok()) return -1;
  std::vector<pd::SequenceBatch> step{{all.subspan(prompt, m), prompt, table, true, m > 1}};
  std::vector<float> logits;
  std::vector<double> s;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = Clock::now();
    if (!e.model->forward(step, e.cache, &logits).is_ok()) return -1;
    s.push_back(seconds(Clock::now() - t0));
  }
  return median(s);
}

// Peak resident memory (VmHWM), MB. reset_peak_rss() restarts it (Linux
// clear_refs "5"), so the engine's peak is measured without the probes'
// STREAM arrays; where that is refused the figure stays the process peak.
double peak_rss_mb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}
bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

std::vector<int> parse_list(const std::string& s, const char* flag, bool* ok) {
  std::vector<int> out;
  size_t pos = 0;
  *ok = true;
  while (pos <= s.size()) {
    const size_t comma = s.find(',', pos);
    const std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    try {
      size_t used = 0;
      const int v = std::stoi(item, &used);
      if (used != item.size() || v < 1) throw std::invalid_argument(item);
      out.push_back(v);
    } catch (const std::exception&) {
      std::fprintf(stderr, "pd-bench-engine: error: %s: '%s' is not a positive integer\n", flag, item.c_str());
      *ok = false;
      return {};
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

// ---- flags

// The command line as given, before the lists are parsed.
struct RawFlags {
  std::string threads = "1,2", batches = "1,8,32", prefill_tokens = "512", kv_dtype = "f16", kv_compare,
              kv_contexts = "2048,8192",
              kv_batches = "1,8", profile_prefill, profile_contexts, backend, peak_preset, verify;
  bool sweep = false, batches_given = false, device_given = false;
};

// The flags, checked and parsed.
struct BenchFlags {
  std::string model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf", json_path, profile_path, llamacpp_dir;
  int prefill_tokens = 512, prompt = 128, gen = 128, reps = 3;  // prefill_tokens: the first of prefill_lengths
  std::vector<int> prefill_lengths{512};
  bool gpu = false, fp32_activations = false, tf32 = false;
  int device = 0;
  pd::plan::HardwareSpec peak;  // --backend cuda: the --peak-preset figures
  pd::GgmlType kv_dtype{};
  std::vector<int> thread_counts, batches, kv_contexts, kv_batches, verify;
  std::vector<pd::GgmlType> kv_compare;
  std::vector<int> profile_prefill, profile_contexts;  // sorted, distinct

  // The backend of a run with `threads` CPU threads (the device with --backend cuda).
  pd::BackendConfig backend(int threads) const {
    return pd::tools::backend_config({gpu ? "cuda" : "cpu", threads, fp32_activations, device, tf32});
  }
};

void add_options(CLI::App* app, BenchFlags* f, RawFlags* raw) {
  app->add_option("-m,--model", f->model_path, "GGUF model (default: the default model)");
  app->add_option("--threads", raw->threads, "comma-separated thread counts");
  app->add_option("--batches", raw->batches, "comma-separated decode batch sizes (cuda: 1,8,32,128)");
  app->add_option("--backend", raw->backend, "compute backend: cpu (default) or cuda");
  app->add_option("--device", f->device, "CUDA device ordinal (--backend cuda)")->check(CLI::Range(0, 1023));
  app->add_option("--peak-preset", raw->peak_preset,
                  "hardware preset the cuda figures are fractions of (default h200; see pd-plan --help)");
  app->add_flag("--tf32", f->tf32, "cuda: GEMMs on TF32 tensor cores (the backend's default is fp32 SGEMM)");
  app->add_flag("--sweep", raw->sweep, "also decode batches 16, 64 and 128");
  app->add_flag("--fp32-activations", f->fp32_activations,
                "measure the CPU reference path (fp32 activations, weights as stored) instead of the default "
                "8-bit activations with integer dot products");
  app->add_option("--prefill-tokens", raw->prefill_tokens,
                  "comma-separated prompt lengths of the prefill figures (each <= 8192; the first is the profile's "
                  "and JSON's \"prefill\")");
  app->add_option("--llamacpp", f->llamacpp_dir,
                  "a llama.cpp build (its llama-bench and llama-batched-bench, in DIR or DIR/bin): the same rows "
                  "from llama.cpp after each thread count's runs, with the ratio");
  app->add_option("--prompt", f->prompt, "prompt tokens per decode sequence")->check(CLI::Range(1, 8192));
  app->add_option("--gen", f->gen, "decode steps per batch")->check(CLI::Range(1, 8192));
  app->add_option("--reps", f->reps, "prefill repetitions (median); prompts past 1,024 tokens run once")->check(CLI::Range(1, 100));
  app->add_option("--kv-dtype", raw->kv_dtype, "KV cache elements of the runs above: f16 (default), q8_0 or f32");
  app->add_option("--kv-compare", raw->kv_compare,
                  "comma-separated KV types (e.g. f32,f16,q8_0): decode at long contexts for each, ratios to the first");
  app->add_option("--kv-contexts", raw->kv_contexts, "cached tokens per sequence for --kv-compare");
  app->add_option("--kv-batches", raw->kv_batches, "decode batch sizes for --kv-compare");
  app->add_option("--verify", raw->verify,
                  "comma-separated token counts of a speculative verification step (one sequence at --prompt "
                  "tokens, logits for every position; 1 is plain decode): median step time and ratio to one token");
  app->add_option("--json", f->json_path, "write all results as JSON to this file")
      ->check(pd::tools::writable_file());
  app->add_option("--profile", f->profile_path, "write the engine cost profile (pd-plan --profile) to this file")
      ->check(pd::tools::writable_file());
  app->add_option("--profile-prefill", raw->profile_prefill,
                  "prompt lengths of the profile's prefill points (default 64,128,256 and --prefill-tokens)");
  app->add_option("--profile-contexts", raw->profile_contexts,
                  "cached tokens per sequence of the profile's decode grid (default: three points of the decode "
                  "runs, --prompt+1 to --prompt+--gen); the cache is filled with random K/V as for --kv-compare");
}

// --backend, --peak-preset, --device and --tf32: cuda-only flags refused on the CPU.
int resolve_backend(const RawFlags& raw, BenchFlags* f) {
  f->gpu = raw.backend == "cuda";
  if (!raw.backend.empty() && raw.backend != "cpu" && !f->gpu)
    return fail("--backend: unknown backend '" + raw.backend + "' (expected cpu or cuda)", 2);
  if (!f->gpu && !raw.peak_preset.empty()) return fail("--peak-preset applies to --backend cuda only", 2);
  if (!f->gpu && raw.device_given) return fail("--device applies to --backend cuda only", 2);
  if (!f->gpu && f->tf32) return fail("--tf32 applies to --backend cuda only", 2);
  if (f->gpu) {
    auto hw = pd::plan::hardware_preset(raw.peak_preset.empty() ? "h200" : raw.peak_preset);
    if (!hw.is_ok()) return fail(hw.status().message() + " (--peak-preset)", 2);
    f->peak = *hw;
  }
  return 0;
}

// --prefill-tokens (each <= 8192) and --llamacpp (CPU only, its programs present).
int resolve_prefill_lengths(const RawFlags& raw, BenchFlags* f) {
  bool ok = true;
  f->prefill_lengths = parse_list(raw.prefill_tokens, "--prefill-tokens", &ok);
  if (!ok) return 2;
  for (int n : f->prefill_lengths)
    if (n > 8192) return fail("--prefill-tokens: " + std::to_string(n) + " is more than 8192", 2);
  f->prefill_tokens = f->prefill_lengths.front();
  if (f->llamacpp_dir.empty()) return 0;
  if (f->gpu) return fail("--llamacpp applies to the CPU backend only", 2);
  if (pd::tools::llamacpp_program(f->llamacpp_dir, "llama-bench").empty() ||
      pd::tools::llamacpp_program(f->llamacpp_dir, "llama-batched-bench").empty())
    return fail("--llamacpp: no llama-bench and llama-batched-bench in '" + f->llamacpp_dir + "' (or its bin/)", 2);
  return 0;
}

// The comma-separated lists; the profile's points sorted and distinct, --sweep's batches added.
int resolve_lists(RawFlags raw, BenchFlags* f) {
  if (f->gpu && !raw.batches_given) raw.batches = "1,8,32,128";
  bool ok1 = false, ok2 = false;
  f->thread_counts = parse_list(raw.threads, "--threads", &ok1);
  f->batches = parse_list(raw.batches, "--batches", &ok2);
  if (!ok1 || !ok2) return 2;
  if (int rc = resolve_prefill_lengths(raw, f)) return rc;
  if (f->gpu) f->thread_counts = {1};  // one run on the device; the thread count is the CPU backend's
  const auto kv_dtype = pd::parse_kv_dtype(raw.kv_dtype, "--kv-dtype");
  if (!kv_dtype.is_ok()) return fail(kv_dtype.status().message(), 2);
  f->kv_dtype = *kv_dtype;
  for (size_t pos = 0; !raw.kv_compare.empty() && pos <= raw.kv_compare.size();) {
    const size_t comma = raw.kv_compare.find(',', pos);
    const auto t = pd::parse_kv_dtype(raw.kv_compare.substr(pos, comma == std::string::npos ? comma : comma - pos),
                                      "--kv-compare");
    if (!t.is_ok()) return fail(t.status().message(), 2);
    f->kv_compare.push_back(*t);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  bool ok3 = true, ok4 = true;
  f->kv_contexts = parse_list(raw.kv_contexts, "--kv-contexts", &ok3);
  f->kv_batches = parse_list(raw.kv_batches, "--kv-batches", &ok4);
  if (!ok3 || !ok4) return 2;
  bool ok5 = true, ok6 = true, ok7 = true;
  if (!raw.verify.empty()) f->verify = parse_list(raw.verify, "--verify", &ok7);
  if (!ok7) return 2;
  for (int m : f->verify)
    if (m > 64) return fail("--verify: " + std::to_string(m) + " tokens is more than 64", 2);
  if (!raw.profile_prefill.empty()) f->profile_prefill = parse_list(raw.profile_prefill, "--profile-prefill", &ok5);
  if (!raw.profile_contexts.empty())
    f->profile_contexts = parse_list(raw.profile_contexts, "--profile-contexts", &ok6);
  if (!ok5 || !ok6) return 2;
  for (std::vector<int>* v : {&f->profile_prefill, &f->profile_contexts}) {  // the profile's points: sorted, distinct
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  if (raw.sweep)
    for (int b : {16, 64, 128})
      if (std::find(f->batches.begin(), f->batches.end(), b) == f->batches.end()) f->batches.push_back(b);
  std::sort(f->batches.begin(), f->batches.end());
  return 0;
}

// Parses and checks the command line into *f. Returns the exit status when
// the tool stops here (--help, a bad flag), nothing when it goes on.
std::optional<int> parse_flags(int argc, char** argv, BenchFlags* f) {
  CLI::App app{"pd-bench-engine: engine speed vs the machine's limits (CPU: measured in the same run)"};
  RawFlags raw;
  add_options(&app, f, &raw);
  if (auto code = pd::tools::parse_command_line(app, argc, argv, "pd-bench-engine")) return code;
  raw.batches_given = app.get_option("--batches")->count() > 0;
  raw.device_given = app.get_option("--device")->count() > 0;
  if (int rc = resolve_backend(raw, f)) return rc;
  if (int rc = resolve_lists(raw, f)) return rc;
  return std::nullopt;
}

// ---- one run per thread count

// What the runs add up to, across thread counts.
struct BenchTotals {
  nlohmann::json out;
  pd::plan::EngineProfile best_profile;
  double best_decode = -1;
  double kv_pool_mb = 0, engine_peak_mb = 0;
  bool peak_reset = true;
};

// The machine's limits with one thread count (the CPU's; a GPU's come from the preset).
struct MachineLimits {
  double triad = 0, read = 0, fma = 0, int8 = 0;
};

MachineLimits measure_machine(int threads) {
  const size_t n = 32u << 20;  // 128 MiB per array
  MachineLimits m;
  m.triad = stream_triad_gbs(threads, n), m.read = read_gbs(threads, n), m.fma = fma_gflops(threads),
  m.int8 = int8_gmacs(threads);
  return m;
}

struct PrefillFigure {
  int tokens = 0;
  double seconds = 0, tokens_per_s = 0, gflops = 0;
};

// Creates the backend for `threads` and loads the model on it into *e.
int load_engine(const BenchFlags& f, const std::shared_ptr<const pd::GgufFile>& gguf, int threads, Engine* e) {
  auto be = pd::create_backend(f.backend(threads));
  if (!be.is_ok()) return fail(be.status().to_string() + (f.gpu ? " (--backend)" : ""), f.gpu ? 2 : 1);
  e->backend = std::move(be).value();
  auto m = pd::LlamaModel::load(gguf, *e->backend);
  if (!m.is_ok()) return fail(m.status().to_string());
  e->model = std::move(m).value();
  return 0;
}

// The "# backend" line (and the device's with --backend cuda), once.
void print_backend(const BenchFlags& f, const Engine& e, nlohmann::json* out) {
  std::printf("# backend %s | CPU: %s\n", e.backend->name().c_str(), cpu_model().c_str());
  if (!f.gpu && pd::cpu::isa_built_with_avx512(pd::cpu::best_isa())) std::printf("%s", pd::tools::kWideNarrowIsaNote);
  (*out)["backend"] = e.backend->name();
  (*out)["cpu"] = cpu_model();
  if (f.gpu) {
    std::printf("# device %d %s | peak (preset %s): %.0f TFLOP/s %s, %.2f TB/s memory\n", f.device,
                e.backend->device_id().c_str(), f.peak.name.c_str(), f.peak.peak_flops / 1e12,
                f.peak.peak_note.c_str(), f.peak.mem_bandwidth / 1e12);
    (*out)["device"] = f.device;
    (*out)["device_id"] = e.backend->device_id();
  }
}

// The KV cache of the runs: room for the prefill figure and the largest decode batch.
int create_run_cache(const BenchFlags& f, Engine* e, BenchTotals* totals) {
  const auto& c = e->model->config();
  for (int ctx : f.profile_contexts)
    if (ctx + 16 > c.context)
      return fail("--profile-contexts: " + std::to_string(ctx) + " + 16 steps exceeds the model's context " +
                      std::to_string(c.context),
                  2);
  const int max_batch = f.batches.back();
  const int longest = *std::max_element(f.prefill_lengths.begin(), f.prefill_lengths.end());
  const int widest_verify = f.verify.empty() ? 0 : *std::max_element(f.verify.begin(), f.verify.end());
  if (f.prompt + widest_verify > c.context)
    return fail("--verify: --prompt + " + std::to_string(widest_verify) + " tokens exceeds the model's context " +
                    std::to_string(c.context),
                2);
  if (f.prompt + f.gen > c.context)
    return fail("--prompt " + std::to_string(f.prompt) + " + --gen " + std::to_string(f.gen) +
                    " exceeds the model's context " + std::to_string(c.context),
                2);
  const int64_t blocks = std::max<int64_t>({(std::max(longest, 256) + 15) / 16,
                                            static_cast<int64_t>(max_batch) * ((f.prompt + f.gen + 15) / 16),
                                            (f.prompt + widest_verify + 15) / 16});
  auto cache = pd::KvCache::create(*e->backend, c, e->block_size, blocks, f.kv_dtype);
  if (!cache.is_ok()) return fail(cache.status().to_string());
  e->cache = std::move(cache).value();
  totals->kv_pool_mb = std::max(totals->kv_pool_mb, static_cast<double>(e->cache.layout.total_bytes()) / 1e6);
  return 0;
}

// A prefill figure: median of --reps passes of `n` tokens (one pass past
// 1,024: its time is seconds, its spread small against it).
PrefillFigure measure_prefill(const BenchFlags& f, Engine& e, int n) {
  std::vector<double> pre;
  for (int r = 0; r < (n > 1024 ? 1 : f.reps); ++r) pre.push_back(time_prefill(e, n, 7 + r));
  PrefillFigure p;
  p.tokens = n;
  p.seconds = median(pre);
  if (p.seconds <= 0) return p;
  p.tokens_per_s = n / p.seconds;
  p.gflops = forward_flops(e.model->config(), n) / p.seconds / 1e9;
  return p;
}

// Every --prefill-tokens length in order, after a warm-up; empty if one failed.
std::vector<PrefillFigure> measure_prefills(const BenchFlags& f, Engine& e) {
  time_prefill(e, std::min(f.prefill_tokens, 32), 1);  // warm-up
  std::vector<PrefillFigure> out;
  for (int n : f.prefill_lengths) {
    out.push_back(measure_prefill(f, e, n));
    if (out.back().seconds <= 0) return {};
  }
  return out;
}

// The prefill lines of a CPU run after the first, and their JSON rows.
void print_more_prefills(const std::vector<PrefillFigure>& pre, const MachineLimits& m, nlohmann::json* run) {
  (*run)["prefill_lengths"] = nlohmann::json::array();
  for (size_t i = 0; i < pre.size(); ++i) {
    const PrefillFigure& p = pre[i];
    if (i > 0)
      std::printf("prefill %d tokens: %.1f tok/s (%.3f s, %.1f GOP/s = %.1f%% of FMA peak, %.1f%% of int8 peak)\n",
                  p.tokens, p.tokens_per_s, p.seconds, p.gflops, 100.0 * p.gflops / m.fma,
                  m.int8 > 0 ? 100.0 * p.gflops / (2 * m.int8) : 0.0);
    (*run)["prefill_lengths"].push_back(
        {{"tokens", p.tokens}, {"seconds", p.seconds}, {"tokens_per_s", p.tokens_per_s}, {"gflops", p.gflops}});
  }
}

// Prints the run's header and prefill line; returns the run's JSON, its decode rows to come.
nlohmann::json start_run(const BenchFlags& f, const Engine& e, int t, const MachineLimits& m, const PrefillFigure& p) {
  const pd::plan::HardwareSpec& peak = f.peak;
  if (f.gpu) {
    // Fractions of the preset's peaks: the dense tensor-core FLOP/s and the memory bandwidth.
    const double frac = p.gflops * 1e9 / peak.peak_flops;
    std::printf("\n== cuda device %d, GEMMs %s | preset %s: %.0f TFLOP/s (%s), %.2f TB/s\n", f.device,
                f.tf32 ? "on TF32 tensor cores" : "fp32 SGEMM", peak.name.c_str(), peak.peak_flops / 1e12,
                peak.peak_note.c_str(), peak.mem_bandwidth / 1e12);
    std::printf("prefill %d tokens: %.1f tok/s (%.4f s, %.2f TFLOP/s = %.2f%% of the %s peak)\n", f.prefill_tokens,
                p.tokens_per_s, p.seconds, p.gflops / 1e3, 100.0 * frac, peak.peak_note.c_str());
    std::printf("%-8s %-14s %-14s %-16s %-10s\n", "batch", "decode tok/s", "step ms", "streamed GB/s", "of HBM");
    return {{"backend", "cuda"},
            {"device", f.device},
            {"tf32", f.tf32},
            {"machine", {{"preset", peak.name}, {"peak_note", peak.peak_note}, {"peak_flops", peak.peak_flops},
                         {"mem_bandwidth_bytes_per_s", peak.mem_bandwidth}}},
            {"weight_bytes", static_cast<double>(e.model->weight_bytes())},
            {"prefill", {{"tokens", f.prefill_tokens}, {"seconds", p.seconds}, {"tokens_per_s", p.tokens_per_s},
                         {"gflops", p.gflops}, {"flops", forward_flops(e.model->config(), f.prefill_tokens)},
                         {"fraction_of_peak", frac}}},
            {"decode", nlohmann::json::array()}};
  }
  std::printf("\n== %d thread%s | machine: triad %.1f GB/s, read %.1f GB/s, FMA %.1f GFLOP/s, int8 %.1f GMAC/s\n", t,
              t > 1 ? "s" : "", m.triad, m.read, m.fma, m.int8);
  // The matmuls run as 8-bit multiply-adds (int8 peak); attention in fp32.
  std::printf("prefill %d tokens: %.1f tok/s (%.3f s, %.1f GOP/s = %.1f%% of FMA peak, %.1f%% of int8 peak)\n",
              f.prefill_tokens, p.tokens_per_s, p.seconds, p.gflops, 100.0 * p.gflops / m.fma,
              m.int8 > 0 ? 100.0 * p.gflops / (2 * m.int8) : 0.0);
  return {{"threads", t},
          {"machine", {{"triad_gbs", m.triad}, {"read_gbs", m.read}, {"fma_gflops", m.fma}, {"int8_gmacs", m.int8}}},
          {"prefill", {{"tokens", f.prefill_tokens}, {"seconds", p.seconds}, {"tokens_per_s", p.tokens_per_s},
                       {"gflops", p.gflops}, {"fraction_of_fma", p.gflops / m.fma},
                       {"fraction_of_int8", m.int8 > 0 ? p.gflops / (2 * m.int8) : 0.0}}},
          {"decode", nlohmann::json::array()}};
}

// Sorts the profile's prefill points by tokens.
void sort_prefill_points(pd::plan::EngineProfile* prof) {
  std::vector<size_t> idx(prof->prefill_tokens.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(),
            [&](size_t a, size_t b) { return prof->prefill_tokens[a] < prof->prefill_tokens[b]; });
  std::vector<double> pt2, ps2;
  for (size_t i : idx) pt2.push_back(prof->prefill_tokens[i]), ps2.push_back(prof->prefill_seconds[i]);
  prof->prefill_tokens = pt2;
  prof->prefill_seconds = ps2;
}

// The profile's prefill points (--profile-prefill, or 64,128,256 and
// --prefill-tokens, whose figure is reused), past the model's context skipped.
int profile_prefill(const BenchFlags& f, Engine& e, double prefill_s, pd::plan::EngineProfile* prof,
                    BenchTotals* totals) {
  const auto& c = e.model->config();
  std::vector<int> prefill_points = f.profile_prefill;
  if (prefill_points.empty()) prefill_points = {64, 128, 256, f.prefill_tokens};
  for (int pt : prefill_points) {
    if (pt > c.context) {
      std::printf("profile: prefill point %d skipped (the model's context is %d)\n", pt, c.context);
      continue;
    }
    if (std::find(prof->prefill_tokens.begin(), prof->prefill_tokens.end(), pt) != prof->prefill_tokens.end())
      continue;
    std::vector<double> v;
    // Long prompts once: their time is seconds, its spread small against it.
    const int point_reps = pt > 1024 ? 1 : f.reps;
    if (pt > e.cache.layout.num_blocks * e.cache.layout.block_size) {
      auto bigger = pd::KvCache::create(*e.backend, c, e.block_size, (pt + e.block_size - 1) / e.block_size,
                                        f.kv_dtype);
      if (!bigger.is_ok()) return fail(bigger.status().to_string());
      std::swap(e.cache, *bigger);
      totals->kv_pool_mb = std::max(totals->kv_pool_mb, static_cast<double>(e.cache.layout.total_bytes()) / 1e6);
    }
    for (int r = 0; r < point_reps; ++r) v.push_back(time_prefill(e, pt, 100 + r));
    prof->prefill_tokens.push_back(pt);
    prof->prefill_seconds.push_back(pt == f.prefill_tokens ? prefill_s : median(v));
  }
  sort_prefill_points(prof);
  return 0;
}

// The profile's decode times at batch b: at --profile-contexts (a cache filled
// with random K/V), else around three steps of the decode run d.
int profile_decode(const BenchFlags& f, Engine& e, int b, const DecodeRun& d, pd::plan::EngineProfile* prof) {
  prof->decode_batches.push_back(b);
  if (!f.profile_contexts.empty()) {
    for (double ctx : prof->decode_contexts) {
      const double st =
          time_long_context_decode(*e.backend, *e.model, f.kv_dtype, b, static_cast<int>(ctx), 12, e.block_size).step_s;
      if (st <= 0) return fail("profile decode failed at batch " + std::to_string(b));
      prof->decode_seconds.push_back(st);
    }
    return 0;
  }
  for (int ci : {0, f.gen / 2, f.gen - 1}) {
    // A few steps around each context point, for a steadier figure.
    std::vector<double> w;
    for (int k = std::max(0, ci - 2); k <= std::min(f.gen - 1, ci + 2); ++k) w.push_back(d.step_seconds[k]);
    prof->decode_seconds.push_back(median(w));
  }
  return 0;
}

// Decode at every --batches size: a table row and a JSON row each, and the
// profile's decode grid. *decode8 is batch 8's tok/s (0 where not run).
int decode_batches(const BenchFlags& f, Engine& e, const MachineLimits& m, nlohmann::json* run,
                   pd::plan::EngineProfile* prof, double* decode8) {
  const double kv_per_token = static_cast<double>(e.model->config().kv_geometry(f.kv_dtype).bytes_per_token());
  const double weight_bytes = static_cast<double>(e.model->weight_bytes());
  if (!f.gpu)
    std::printf("%-8s %-14s %-14s %-16s %-10s\n", "batch", "decode tok/s", "step ms", "streamed GB/s", "of triad");
  for (int b : f.batches) {
    const DecodeRun d = time_decode(e, b, f.prompt, f.gen);
    if (d.step_seconds.empty()) return fail("decode failed at batch " + std::to_string(b));
    const double step = median(d.step_seconds);
    const double mean_ctx = f.prompt + (f.gen + 1) / 2.0;
    // Bytes a step must read: every weight once, and each sequence's KV at its context.
    const double step_bytes = weight_bytes + b * mean_ctx * kv_per_token;
    const double streamed = step_bytes / step / 1e9;
    const double limit_gbs = f.gpu ? f.peak.mem_bandwidth / 1e9 : m.triad;
    std::printf("%-8d %-14.1f %-14.2f %-16.1f %.1f%%\n", b, d.tokens_per_s, step * 1e3, streamed,
                100.0 * streamed / limit_gbs);
    if (f.gpu) {
      (*run)["decode"].push_back({{"batch", b}, {"tokens_per_s", d.tokens_per_s}, {"median_step_s", step},
                                  {"mean_context", mean_ctx}, {"bytes_per_step", step_bytes},
                                  {"streamed_gbs", streamed}, {"fraction_of_bandwidth", streamed / limit_gbs}});
    } else {
      (*run)["decode"].push_back({{"batch", b}, {"tokens_per_s", d.tokens_per_s}, {"median_step_s", step},
                                  {"streamed_gbs", streamed}, {"fraction_of_triad", streamed / m.triad}});
    }
    if (int rc = profile_decode(f, e, b, d, prof)) return rc;
    if (b == 8) *decode8 = d.tokens_per_s;
  }
  return 0;
}

// --verify: one sequence's step of m tokens (its last and m - 1 drafted),
// every position's logits, each m in turn; the ratio is to one token's step
// measured here too (the first row).
int verify_steps(const BenchFlags& f, Engine& e, nlohmann::json* run) {
  if (f.verify.empty()) return 0;
  const double one = time_verify(e, 1, f.prompt, f.gen);
  if (one <= 0) return fail("verification step failed at 1 token");
  std::printf("\n%-8s %-14s %-16s %-16s\n", "verify", "step ms", "vs one token", "tok/s if all kept");
  (*run)["verify"] = nlohmann::json::array();
  for (int m : f.verify) {
    const double s = m == 1 ? one : time_verify(e, m, f.prompt, f.gen);
    if (s <= 0) return fail("verification step failed at " + std::to_string(m) + " tokens");
    std::printf("%-8d %-14.2f x%-15.2f %-16.1f\n", m, s * 1e3, s / one, m / s);
    (*run)["verify"].push_back({{"tokens", m}, {"median_step_s", s}, {"ratio_to_one", s / one}});
  }
  return 0;
}

// The profile of one run, before its measurements: what it describes and its decode contexts.
pd::plan::EngineProfile start_profile(const BenchFlags& f, const Engine& e, int t, const MachineLimits& m) {
  pd::plan::EngineProfile prof;
  prof.model = f.model_path;
  prof.hardware = f.gpu ? "cuda device " + std::to_string(f.device) + " " + e.backend->device_id()
                        : std::to_string(t) + " thread(s), triad " + std::to_string(static_cast<int>(m.triad)) +
                              " GB/s";
  prof.kv_bytes_per_token = e.model->config().kv_geometry(f.kv_dtype).bytes_per_token();
  if (f.profile_contexts.empty()) {
    for (int ci : {0, f.gen / 2, f.gen - 1}) prof.decode_contexts.push_back(f.prompt + ci + 1);  // step indices
  } else {
    prof.decode_contexts.assign(f.profile_contexts.begin(), f.profile_contexts.end());  // sorted, distinct, checked
  }
  return prof;
}

// --llamacpp: llama.cpp's rows at `t` threads beside this run's, with the ratio.
int compare_llamacpp(const BenchFlags& f, int t, nlohmann::json* run) {
  const pd::tools::LlamaCppFigures l =
      pd::tools::run_llamacpp(f.llamacpp_dir, f.model_path, t, f.prefill_lengths, f.prompt, f.gen, f.batches, f.reps);
  if (!l.error.empty()) return fail("--llamacpp: " + l.error);
  std::printf("\n== llama.cpp (%s, build %s), %d thread%s, same file: best of flash attention off/on\n",
              f.llamacpp_dir.c_str(), l.build.c_str(), t, t > 1 ? "s" : "");
  std::printf("%-20s %-16s %-16s %-8s\n", "", "pdcluster tok/s", "llama.cpp tok/s", "ratio");
  nlohmann::json rows = nlohmann::json::array();
  auto row = [&](const std::string& what, double ours, double theirs, int fa) {
    std::printf("%-20s %-16.1f %-16.1f %.2fx%s\n", what.c_str(), ours, theirs, theirs > 0 ? ours / theirs : 0.0,
                fa ? "  (llama.cpp -fa)" : "");
    rows.push_back({{"what", what}, {"pdcluster_tokens_per_s", ours}, {"llamacpp_tokens_per_s", theirs},
                    {"llamacpp_flash_attn", fa != 0}, {"ratio", theirs > 0 ? ours / theirs : 0.0}});
  };
  for (const auto& p : (*run)["prefill_lengths"]) {
    const int n = p["tokens"].get<int>();
    row("prefill " + std::to_string(n), p["tokens_per_s"].get<double>(), l.prefill_tps.count(n) ? l.prefill_tps.at(n) : 0,
        l.prefill_fa.count(n) ? l.prefill_fa.at(n) : 0);
  }
  for (const auto& d : (*run)["decode"]) {
    const int b = d["batch"].get<int>();
    row("decode batch " + std::to_string(b), d["tokens_per_s"].get<double>(),
        l.decode_tps.count(b) ? l.decode_tps.at(b) : 0, l.decode_fa.count(b) ? l.decode_fa.at(b) : 0);
  }
  (*run)["llamacpp"] = {{"dir", f.llamacpp_dir}, {"build", l.build}, {"rows", rows}};
  return 0;
}

// One run at `t` threads: machine limits, prefill, decode at every batch, the
// profile; the run's JSON into totals, its profile kept if it is the best so far.
int run_thread_count(const BenchFlags& f, const std::shared_ptr<const pd::GgufFile>& gguf, int t,
                     BenchTotals* totals) {
  Engine e;
  if (int rc = load_engine(f, gguf, t, &e)) return rc;
  if (t == f.thread_counts.front()) print_backend(f, e, &totals->out);
  if (int rc = create_run_cache(f, &e, totals)) return rc;
  MachineLimits m;
  if (!f.gpu) m = measure_machine(t);
  totals->peak_reset = reset_peak_rss() && totals->peak_reset;  // the engine's peak from here on
  const std::vector<PrefillFigure> prefills = measure_prefills(f, e);
  if (prefills.empty()) return fail("prefill failed");
  const PrefillFigure& pre = prefills.front();
  nlohmann::json run = start_run(f, e, t, m, pre);
  if (!f.gpu) print_more_prefills(prefills, m, &run);
  pd::plan::EngineProfile prof = start_profile(f, e, t, m);
  if (int rc = profile_prefill(f, e, pre.seconds, &prof, totals)) return rc;
  double decode8 = 0;
  if (int rc = decode_batches(f, e, m, &run, &prof, &decode8)) return rc;
  if (int rc = verify_steps(f, e, &run)) return rc;
  run["peak_rss_mb"] = peak_rss_mb();
  totals->engine_peak_mb = std::max(totals->engine_peak_mb, peak_rss_mb());
  if (!f.llamacpp_dir.empty())
    if (int rc = compare_llamacpp(f, t, &run)) return rc;
  totals->out["runs"].push_back(run);
  const double score = decode8 > 0 ? decode8 : pre.tokens_per_s;
  if (score > totals->best_decode) {
    totals->best_decode = score;
    totals->best_profile = prof;
  }
  return 0;
}

// The engine's memory bound: model file + KV pool + 150 MB (the peak also
// covers the probes' STREAM arrays, freed before the engine runs).
void report_memory(const BenchFlags& f, BenchTotals* totals) {
  const double file_mb = std::filesystem::file_size(f.model_path) / 1e6;
  const double bound_mb = file_mb + totals->kv_pool_mb + 150.0;
  std::printf("\npeak RSS of the engine runs %.0f MB%s (bound: model file %.1f + KV pool %.0f + 150 = %.0f MB: %s) | "
              "KV %lld bytes/token (%s)\n",
              totals->engine_peak_mb, totals->peak_reset ? "" : " (with the probes: peak reset refused)", file_mb,
              totals->kv_pool_mb, bound_mb, totals->engine_peak_mb <= bound_mb ? "within" : "OVER",
              static_cast<long long>(totals->best_profile.kv_bytes_per_token), pd::kv_dtype_name(f.kv_dtype));
  nlohmann::json& out = totals->out;
  out["engine_peak_rss_mb"] = totals->engine_peak_mb;
  out["kv_pool_mb"] = totals->kv_pool_mb;
  out["rss_bound_mb"] = bound_mb;
  out["peak_rss_mb"] = peak_rss_mb();
  out["kv_bytes_per_token"] = totals->best_profile.kv_bytes_per_token;
  out["kv_dtype"] = pd::kv_dtype_name(f.kv_dtype);
}

// ---- --kv-compare

// The rows of one context and batch: each --kv-compare type in turn, ratios to the first.
int compare_kv_types(const BenchFlags& f, Engine& e, int ctx, int b, nlohmann::json* rows) {
  const auto& c = e.model->config();
  double base_tps = 0;
  for (pd::GgmlType dt : f.kv_compare) {
    const LongContextTimes lt = time_long_context_decode(*e.backend, *e.model, dt, b, ctx, 16, 16, 4 * c.n_layers);
    if (lt.step_s <= 0 || lt.attention_layer_s <= 0)
      return fail(std::string("long-context decode failed (") + pd::kv_dtype_name(dt) + ")");
    const double per_token = static_cast<double>(c.kv_geometry(dt).bytes_per_token());
    const double tps = b / lt.step_s, kv_gbs = b * (ctx + 8.0) * per_token / lt.step_s / 1e9;
    // The attention alone: QK^T and PV, 4 FLOPs per head, cached token and head element.
    const double attn_flops = 4.0 * b * c.n_heads * (ctx + 16.0) * c.head_dim;
    if (base_tps == 0) base_tps = tps;
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "x%.2f", tps / base_tps);
    std::printf("%-8d %-8d %-6s %-12.0f %-14.1f %-12.1f %-10s %-12.1f %-10.1f\n", ctx, b, pd::kv_dtype_name(dt),
                per_token, tps, kv_gbs, ratio, lt.attention_layer_s * 1e6, attn_flops / lt.attention_layer_s / 1e9);
    rows->push_back({{"context", ctx}, {"batch", b}, {"kv_dtype", pd::kv_dtype_name(dt)},
                     {"kv_bytes_per_token", per_token}, {"tokens_per_s", tps},
                     {"kv_gbs", kv_gbs}, {"ratio_to_first", tps / base_tps},
                     {"attention_us_per_layer", lt.attention_layer_s * 1e6},
                     {"attention_gflops", attn_flops / lt.attention_layer_s / 1e9}});
  }
  return 0;
}

// Long contexts, where decode attention reads the cache: one model, the
// largest thread count, each KV type in turn.
int run_kv_compare(const BenchFlags& f, const std::shared_ptr<const pd::GgufFile>& gguf, nlohmann::json* out) {
  const int t = *std::max_element(f.thread_counts.begin(), f.thread_counts.end());
  Engine e;
  auto be = pd::create_backend(f.backend(t));
  if (!be.is_ok()) return fail(be.status().to_string());
  e.backend = std::move(be).value();
  auto m = pd::LlamaModel::load(gguf, *e.backend);
  if (!m.is_ok()) return fail(m.status().to_string());
  e.model = std::move(m).value();
  const auto& c = e.model->config();
  const std::string where =
      f.gpu ? "cuda device " + std::to_string(f.device) : std::to_string(t) + (t > 1 ? " threads" : " thread");
  std::printf("\n== KV cache types at long contexts (%s; ratios to %s, this run)\n", where.c_str(),
              pd::kv_dtype_name(f.kv_compare.front()));
  std::printf("%-8s %-8s %-6s %-12s %-14s %-12s %-10s %-12s %-10s\n", "context", "batch", "kv", "bytes/tok",
              "decode tok/s", "KV GB/s", "vs first", "attn us/lyr", "attn GF/s");
  (*out)["kv_compare"] = nlohmann::json::array();
  for (int ctx : f.kv_contexts) {
    if (ctx + 16 > c.context) {
      std::printf("%-8d (skipped: the model's context is %d)\n", ctx, c.context);
      continue;
    }
    for (int b : f.kv_batches)
      if (int rc = compare_kv_types(f, e, ctx, b, &(*out)["kv_compare"])) return rc;
  }
  return 0;
}

// --json and --profile.
int write_outputs(const BenchFlags& f, const BenchTotals& totals) {
  if (!f.json_path.empty() && !pd::tools::write_json_file(f.json_path, totals.out))
    return fail("cannot write --json file '" + f.json_path + "'", 2);
  if (!f.profile_path.empty()) {
    std::ofstream out(f.profile_path);
    out << pd::plan::engine_profile_to_json(totals.best_profile) << "\n";
    if (!out) return fail("cannot write --profile file '" + f.profile_path + "'", 2);
    std::printf("profile (%s) written to %s\n", f.gpu ? "cuda" : "best thread count by batch-8 decode",
                f.profile_path.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  BenchFlags flags;
  if (auto code = parse_flags(argc, argv, &flags)) return *code;
  pd::tools::ToolError err;
  const auto gguf = pd::tools::open_model_file(flags.model_path, /*refusal_is_usage=*/true, &err);
  if (!gguf) return fail(err.message, err.exit_code);

  std::string cmd;
  for (int i = 0; i < argc; ++i) cmd += std::string(i ? " " : "") + argv[i];
  std::printf("# %s\n", cmd.c_str());
  BenchTotals totals;
  totals.out = {{"command", cmd}, {"model", flags.model_path}, {"runs", nlohmann::json::array()}};
  for (int t : flags.thread_counts)
    if (int rc = run_thread_count(flags, gguf, t, &totals)) return rc;
  report_memory(flags, &totals);
  if (!flags.kv_compare.empty())
    if (int rc = run_kv_compare(flags, gguf, &totals.out)) return rc;
  return write_outputs(flags, totals);
}
