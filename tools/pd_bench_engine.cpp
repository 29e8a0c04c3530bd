// pd-bench-engine: the engine's speed against the machine's limits: on the CPU
// against limits measured in the same run, on a GPU against a hardware preset.
//
//   pd-bench-engine [-m MODEL] [--threads 1,2] [--batches 1,8,32] [--sweep] [--fp32-activations]
//                   [--backend cpu|cuda [--device N] [--peak-preset h200] [--tf32]]
//                   [--prefill-tokens 512] [--prompt 128] [--gen 128] [--reps 3]
//                   [--kv-dtype f16] [--kv-compare f32,f16,q8_0 [--kv-contexts 2048,8192] [--kv-batches 1,8]]
//                   [--json FILE] [--profile FILE [--profile-prefill 64,512,4096] [--profile-contexts 128,2048]]
//
// Prints, per thread count: the machine probes (STREAM triad and read GB/s,
// FMA GFLOP/s, 8-bit multiply-add GMAC/s), prefill tok/s for one prompt and
// the fraction of the FMA and int8 peaks it reaches, aggregate decode tok/s for each batch (every sequence with a
// --prompt-token prompt generating --gen tokens, so contexts grow
// prompt -> prompt + gen) with the fraction of the memory bandwidth the step
// streams (weights + KV read), then peak RSS and KV bytes per token.
// --kv-dtype picks the KV cache's elements for those runs (f16, the serving
// default). --kv-compare adds decode at long contexts for each listed KV type
// (tok/s, KV GB/s read, ratio to the first type, all in this run): the cache
// is filled by kv_write with random K/V rather than by prefilling every
// sequence (attention's cost does not depend on the values).
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
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "backend/backend.h"
#include "gguf/gguf_reader.h"
#include "model/kv_cache.h"
#include "model/llama_model.h"
#include "plan/engine_profile.h"
#include "plan/hardware.h"

namespace {

using Clock = std::chrono::steady_clock;
double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}
int fail(const std::string& msg, int code = 1) {
  std::fprintf(stderr, "pd-bench-engine: error: %s\n", msg.c_str());
  return code;
}

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
    best = std::max(best, 3.0 * 4.0 * static_cast<double>(n) / secs(Clock::now() - t0) / 1e9);
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
    best = std::max(best, 4.0 * static_cast<double>(n) / secs(Clock::now() - t0) / 1e9);
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
    best = std::max(best, flops / secs(Clock::now() - t0) / 1e9);
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
    best = std::max(best, macs / secs(Clock::now() - t0) / 1e9);
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

// Median seconds of a decode step of `batch` sequences at `context` cached
// tokens, KV elements of `dtype`; -1 on failure. The cache is filled with
// random K/V through kv_write (the same conversion a prefill does).
double time_long_context_decode(pd::Backend& be, pd::LlamaModel& model, pd::GgmlType dtype, int batch, int context,
                                int steps, int block_size) {
  const auto& c = model.config();
  const int per_seq_blocks = (context + steps + block_size - 1) / block_size;
  auto cache = pd::KvCache::create(be, c, block_size, static_cast<int64_t>(batch) * per_seq_blocks, dtype);
  if (!cache.is_ok()) return -1;
  // One chunk of random K and V, written to every position of every layer.
  constexpr int kChunk = 1024;
  const int64_t row = static_cast<int64_t>(c.n_kv_heads) * c.head_dim;
  std::vector<float> host(static_cast<size_t>(row * kChunk));
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : host) x = normal(rng);
  auto buf = be.alloc(host.size() * sizeof(float));
  if (!buf.is_ok()) return -1;
  pd::Tensor kv;
  kv.ne = {c.head_dim, c.n_kv_heads, kChunk, 1};
  kv.data = (*buf)->data();
  if (!be.copy_from_host(host.data(), kv, host.size() * sizeof(float)).is_ok()) return -1;
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
        if (!be.kv_write(*cache->buffer, cache->layout, l, kv, kv, slots).is_ok()) return -1;
    }
  }
  std::vector<int32_t> next(batch, 5);
  std::vector<pd::SequenceBatch> b(batch);
  std::vector<float> logits;
  std::vector<double> step_s;
  for (int i = 0; i < steps; ++i) {
    for (int s = 0; s < batch; ++s) b[s] = {std::span<const int32_t>(&next[s], 1), context + i, tables[s], true};
    const auto t0 = Clock::now();
    if (!model.decode(b, *cache, &logits).is_ok()) return -1;
    step_s.push_back(secs(Clock::now() - t0));
  }
  return median(step_s);
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
  return secs(Clock::now() - t0);
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
    r.step_seconds.push_back(secs(Clock::now() - t0));
    for (int s = 0; s < batch; ++s)
      next[s] = static_cast<int32_t>(std::max_element(logits.begin() + s * c.vocab, logits.begin() + (s + 1) * c.vocab) -
                                     (logits.begin() + s * c.vocab));
  }
  r.tokens_per_s = static_cast<double>(batch) * gen / secs(Clock::now() - t_all);
  return r;
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

}  // namespace

int main(int argc, char** argv) {
  std::string model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf", threads_s = "1,2", batches_s = "1,8,32";
  std::string json_path, profile_path, kv_dtype_flag = "f16", kv_compare_s, kv_contexts_s = "2048,8192",
                                      kv_batches_s = "1,8", profile_prefill_s, profile_contexts_s;
  int prefill_tokens = 512, prompt = 128, gen = 128, reps = 3;
  bool sweep = false, fp32_activations = false, tf32 = false;
  std::string backend_kind, peak_preset_s;
  int device = 0;
  CLI::App app{"pd-bench-engine: engine speed vs the machine's limits (CPU: measured in the same run)"};
  app.add_option("-m,--model", model_path, "GGUF model (default: the default model)");
  app.add_option("--threads", threads_s, "comma-separated thread counts");
  auto* batches_opt = app.add_option("--batches", batches_s, "comma-separated decode batch sizes (cuda: 1,8,32,128)");
  app.add_option("--backend", backend_kind, "compute backend: cpu (default) or cuda");
  auto* device_opt =
      app.add_option("--device", device, "CUDA device ordinal (--backend cuda)")->check(CLI::NonNegativeNumber);
  app.add_option("--peak-preset", peak_preset_s,
                 "hardware preset the cuda figures are fractions of (default h200; see pd-plan --help)");
  app.add_flag("--tf32", tf32, "cuda: GEMMs on TF32 tensor cores (the backend's default is fp32 SGEMM)");
  app.add_flag("--sweep", sweep, "also decode batches 16, 64 and 128");
  app.add_flag("--fp32-activations", fp32_activations,
               "measure the CPU reference path (fp32 activations, weights as stored) instead of the default "
               "8-bit activations with integer dot products");
  app.add_option("--prefill-tokens", prefill_tokens, "prompt tokens for the prefill figure")->check(CLI::Range(1, 8192));
  app.add_option("--prompt", prompt, "prompt tokens per decode sequence")->check(CLI::Range(1, 8192));
  app.add_option("--gen", gen, "decode steps per batch")->check(CLI::Range(1, 8192));
  app.add_option("--reps", reps, "prefill repetitions (median)")->check(CLI::Range(1, 100));
  app.add_option("--kv-dtype", kv_dtype_flag, "KV cache elements of the runs above: f16 (default), q8_0 or f32");
  app.add_option("--kv-compare", kv_compare_s,
                 "comma-separated KV types (e.g. f32,f16,q8_0): decode at long contexts for each, ratios to the first");
  app.add_option("--kv-contexts", kv_contexts_s, "cached tokens per sequence for --kv-compare");
  app.add_option("--kv-batches", kv_batches_s, "decode batch sizes for --kv-compare");
  app.add_option("--json", json_path, "write all results as JSON to this file");
  app.add_option("--profile", profile_path, "write the engine cost profile (pd-plan --profile) to this file");
  app.add_option("--profile-prefill", profile_prefill_s,
                 "prompt lengths of the profile's prefill points (default 64,128,256 and --prefill-tokens)");
  app.add_option("--profile-contexts", profile_contexts_s,
                 "cached tokens per sequence of the profile's decode grid (default: three points of the decode runs, "
                 "--prompt+1 to --prompt+--gen); the cache is filled with random K/V as for --kv-compare");
  CLI11_PARSE(app, argc, argv);
  const bool gpu = backend_kind == "cuda";
  if (!backend_kind.empty() && backend_kind != "cpu" && !gpu)
    return fail("--backend: unknown backend '" + backend_kind + "' (expected cpu or cuda)", 2);
  if (!gpu && !peak_preset_s.empty()) return fail("--peak-preset applies to --backend cuda only", 2);
  if (!gpu && device_opt->count() > 0) return fail("--device applies to --backend cuda only", 2);
  if (!gpu && tf32) return fail("--tf32 applies to --backend cuda only", 2);
  pd::plan::HardwareSpec peak;
  if (gpu) {
    auto hw = pd::plan::hardware_preset(peak_preset_s.empty() ? "h200" : peak_preset_s);
    if (!hw.is_ok()) return fail(hw.status().message() + " (--peak-preset)", 2);
    peak = *hw;
    if (batches_opt->count() == 0) batches_s = "1,8,32,128";
  }
  bool ok1 = false, ok2 = false;
  std::vector<int> thread_counts = parse_list(threads_s, "--threads", &ok1);
  std::vector<int> batches = parse_list(batches_s, "--batches", &ok2);
  if (!ok1 || !ok2) return 2;
  if (gpu) thread_counts = {1};  // one run on the device; the thread count is the CPU backend's
  const auto kv_dtype = pd::parse_kv_dtype(kv_dtype_flag, "--kv-dtype");
  if (!kv_dtype.is_ok()) return fail(kv_dtype.status().message(), 2);
  std::vector<pd::GgmlType> kv_compare;
  for (size_t pos = 0; !kv_compare_s.empty() && pos <= kv_compare_s.size();) {
    const size_t comma = kv_compare_s.find(',', pos);
    const auto t = pd::parse_kv_dtype(kv_compare_s.substr(pos, comma == std::string::npos ? comma : comma - pos),
                                      "--kv-compare");
    if (!t.is_ok()) return fail(t.status().message(), 2);
    kv_compare.push_back(*t);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  bool ok3 = true, ok4 = true;
  const std::vector<int> kv_contexts = parse_list(kv_contexts_s, "--kv-contexts", &ok3);
  const std::vector<int> kv_batches = parse_list(kv_batches_s, "--kv-batches", &ok4);
  if (!ok3 || !ok4) return 2;
  bool ok5 = true, ok6 = true;
  std::vector<int> profile_prefill =
      profile_prefill_s.empty() ? std::vector<int>{} : parse_list(profile_prefill_s, "--profile-prefill", &ok5);
  std::vector<int> profile_contexts =
      profile_contexts_s.empty() ? std::vector<int>{} : parse_list(profile_contexts_s, "--profile-contexts", &ok6);
  if (!ok5 || !ok6) return 2;
  for (std::vector<int>* v : {&profile_prefill, &profile_contexts}) {  // the profile's points: sorted, distinct
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  if (sweep)
    for (int b : {16, 64, 128})
      if (std::find(batches.begin(), batches.end(), b) == batches.end()) batches.push_back(b);
  std::sort(batches.begin(), batches.end());
  if (!std::filesystem::exists(model_path)) return fail("model file not found: " + model_path + " (--model)", 2);
  auto file = pd::GgufFile::open(model_path);
  if (!file.is_ok()) return fail(file.status().to_string() + " (--model)", 2);
  std::shared_ptr<const pd::GgufFile> gguf(std::move(file).value());

  std::string cmd;
  for (int i = 0; i < argc; ++i) cmd += std::string(i ? " " : "") + argv[i];
  std::printf("# %s\n", cmd.c_str());

  nlohmann::json out{{"command", cmd}, {"model", model_path}, {"runs", nlohmann::json::array()}};
  pd::plan::EngineProfile best_profile;
  double best_decode = -1;
  double kv_pool_mb = 0, engine_peak_mb = 0;
  bool peak_reset = true;
  for (int t : thread_counts) {
    Engine e;
    pd::BackendConfig bc;
    bc.kind = gpu ? "cuda" : "cpu";
    bc.device = device;
    bc.cuda_tf32 = tf32;
    bc.n_threads = t;
    bc.int8_activations = !fp32_activations;
    auto be = pd::create_backend(bc);
    if (!be.is_ok()) return fail(be.status().to_string() + (gpu ? " (--backend)" : ""), gpu ? 2 : 1);
    e.backend = std::move(be).value();
    auto m = pd::LlamaModel::load(gguf, *e.backend);
    if (!m.is_ok()) return fail(m.status().to_string());
    e.model = std::move(m).value();
    if (t == thread_counts.front()) {
      std::printf("# backend %s | CPU: %s\n", e.backend->name().c_str(), cpu_model().c_str());
      out["backend"] = e.backend->name();
      out["cpu"] = cpu_model();
      if (gpu) {
        std::printf("# device %d %s | peak (preset %s): %.0f TFLOP/s %s, %.2f TB/s memory\n", device,
                    e.backend->device_id().c_str(), peak.name.c_str(), peak.peak_flops / 1e12, peak.peak_note.c_str(),
                    peak.mem_bandwidth / 1e12);
        out["device"] = device;
        out["device_id"] = e.backend->device_id();
      }
    }
    const auto& c = e.model->config();
    for (int ctx : profile_contexts)
      if (ctx + 16 > c.context)
        return fail("--profile-contexts: " + std::to_string(ctx) + " + 16 steps exceeds the model's context " +
                        std::to_string(c.context),
                    2);
    const int max_batch = batches.back();
    const int64_t blocks = std::max<int64_t>((std::max(prefill_tokens, 256) + 15) / 16,
                                             static_cast<int64_t>(max_batch) * ((prompt + gen + 15) / 16));
    auto cache = pd::KvCache::create(*e.backend, c, e.block_size, blocks, *kv_dtype);
    if (!cache.is_ok()) return fail(cache.status().to_string());
    e.cache = std::move(cache).value();
    kv_pool_mb = std::max(kv_pool_mb, static_cast<double>(e.cache.layout.total_bytes()) / 1e6);
    const double kv_per_token = static_cast<double>(c.kv_geometry(*kv_dtype).bytes_per_token());
    const double weight_bytes = static_cast<double>(e.model->weight_bytes());

    // Machine limits with this thread count (the CPU's; a GPU's come from the preset).
    const size_t n = 32u << 20;  // 128 MiB per array
    double triad = 0, rd = 0, fma = 0, i8 = 0;
    if (!gpu) triad = stream_triad_gbs(t, n), rd = read_gbs(t, n), fma = fma_gflops(t), i8 = int8_gmacs(t);
    peak_reset = reset_peak_rss() && peak_reset;  // the engine's peak from here on

    // Prefill.
    time_prefill(e, std::min(prefill_tokens, 32), 1);  // warm-up
    std::vector<double> pre;
    for (int r = 0; r < reps; ++r) pre.push_back(time_prefill(e, prefill_tokens, 7 + r));
    const double pre_s = median(pre);
    if (pre_s <= 0) return fail("prefill failed");
    const double pre_tps = prefill_tokens / pre_s;
    const double pre_gflops = forward_flops(c, prefill_tokens) / pre_s / 1e9;

    nlohmann::json run;
    if (gpu) {
      // Fractions of the preset's peaks: the dense tensor-core FLOP/s and the memory bandwidth.
      const double frac = pre_gflops * 1e9 / peak.peak_flops;
      std::printf("\n== cuda device %d, GEMMs %s | preset %s: %.0f TFLOP/s (%s), %.2f TB/s\n", device,
                  tf32 ? "on TF32 tensor cores" : "fp32 SGEMM", peak.name.c_str(), peak.peak_flops / 1e12,
                  peak.peak_note.c_str(), peak.mem_bandwidth / 1e12);
      std::printf("prefill %d tokens: %.1f tok/s (%.4f s, %.2f TFLOP/s = %.2f%% of the %s peak)\n", prefill_tokens,
                  pre_tps, pre_s, pre_gflops / 1e3, 100.0 * frac, peak.peak_note.c_str());
      std::printf("%-8s %-14s %-14s %-16s %-10s\n", "batch", "decode tok/s", "step ms", "streamed GB/s", "of HBM");
      run = {{"backend", "cuda"},
             {"device", device},
             {"tf32", tf32},
             {"machine", {{"preset", peak.name}, {"peak_note", peak.peak_note}, {"peak_flops", peak.peak_flops},
                          {"mem_bandwidth_bytes_per_s", peak.mem_bandwidth}}},
             {"weight_bytes", weight_bytes},
             {"prefill", {{"tokens", prefill_tokens}, {"seconds", pre_s}, {"tokens_per_s", pre_tps},
                          {"gflops", pre_gflops}, {"flops", forward_flops(c, prefill_tokens)},
                          {"fraction_of_peak", frac}}},
             {"decode", nlohmann::json::array()}};
    } else {
      std::printf("\n== %d thread%s | machine: triad %.1f GB/s, read %.1f GB/s, FMA %.1f GFLOP/s, int8 %.1f GMAC/s\n",
                  t, t > 1 ? "s" : "", triad, rd, fma, i8);
      // The matmuls run as 8-bit multiply-adds (int8 peak); attention in fp32.
      std::printf("prefill %d tokens: %.1f tok/s (%.3f s, %.1f GOP/s = %.1f%% of FMA peak, %.1f%% of int8 peak)\n",
                  prefill_tokens, pre_tps, pre_s, pre_gflops, 100.0 * pre_gflops / fma,
                  i8 > 0 ? 100.0 * pre_gflops / (2 * i8) : 0.0);
      std::printf("%-8s %-14s %-14s %-16s %-10s\n", "batch", "decode tok/s", "step ms", "streamed GB/s", "of triad");
      run = {{"threads", t},
             {"machine", {{"triad_gbs", triad}, {"read_gbs", rd}, {"fma_gflops", fma}, {"int8_gmacs", i8}}},
             {"prefill", {{"tokens", prefill_tokens}, {"seconds", pre_s}, {"tokens_per_s", pre_tps},
                          {"gflops", pre_gflops}, {"fraction_of_fma", pre_gflops / fma},
                          {"fraction_of_int8", i8 > 0 ? pre_gflops / (2 * i8) : 0.0}}},
             {"decode", nlohmann::json::array()}};
    }

    pd::plan::EngineProfile prof;
    prof.model = model_path;
    prof.hardware = gpu ? "cuda device " + std::to_string(device) + " " + e.backend->device_id()
                        : std::to_string(t) + " thread(s), triad " + std::to_string(static_cast<int>(triad)) + " GB/s";
    prof.kv_bytes_per_token = static_cast<int64_t>(kv_per_token);
    std::vector<int> prefill_points = profile_prefill;
    if (prefill_points.empty()) prefill_points = {64, 128, 256, prefill_tokens};
    for (int pt : prefill_points) {
      if (pt > c.context) {
        std::printf("profile: prefill point %d skipped (the model's context is %d)\n", pt, c.context);
        continue;
      }
      if (std::find(prof.prefill_tokens.begin(), prof.prefill_tokens.end(), pt) != prof.prefill_tokens.end()) continue;
      std::vector<double> v;
      // Long prompts once: their time is seconds, its spread small against it.
      const int point_reps = pt > 1024 ? 1 : reps;
      if (pt > e.cache.layout.num_blocks * e.cache.layout.block_size) {
        auto bigger =
            pd::KvCache::create(*e.backend, c, e.block_size, (pt + e.block_size - 1) / e.block_size, *kv_dtype);
        if (!bigger.is_ok()) return fail(bigger.status().to_string());
        std::swap(e.cache, *bigger);
        kv_pool_mb = std::max(kv_pool_mb, static_cast<double>(e.cache.layout.total_bytes()) / 1e6);
      }
      for (int r = 0; r < point_reps; ++r) v.push_back(time_prefill(e, pt, 100 + r));
      prof.prefill_tokens.push_back(pt);
      prof.prefill_seconds.push_back(pt == prefill_tokens ? pre_s : median(v));
    }
    // Keep the prefill points sorted.
    std::vector<size_t> idx(prof.prefill_tokens.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return prof.prefill_tokens[a] < prof.prefill_tokens[b]; });
    std::vector<double> pt2, ps2;
    for (size_t i : idx) pt2.push_back(prof.prefill_tokens[i]), ps2.push_back(prof.prefill_seconds[i]);
    prof.prefill_tokens = pt2;
    prof.prefill_seconds = ps2;
    const std::vector<int> ctx_points{0, gen / 2, gen - 1};  // step indices: contexts prompt+1, +gen/2, +gen
    if (profile_contexts.empty()) {
      for (int ci : ctx_points) prof.decode_contexts.push_back(prompt + ci + 1);
    } else {
      prof.decode_contexts.assign(profile_contexts.begin(), profile_contexts.end());  // sorted, distinct, checked
    }
    double decode8 = 0;
    for (int b : batches) {
      const DecodeRun d = time_decode(e, b, prompt, gen);
      if (d.step_seconds.empty()) return fail("decode failed at batch " + std::to_string(b));
      const double step = median(d.step_seconds);
      const double mean_ctx = prompt + (gen + 1) / 2.0;
      // Bytes a step must read: every weight once, and each sequence's KV at its context.
      const double step_bytes = weight_bytes + b * mean_ctx * kv_per_token;
      const double streamed = step_bytes / step / 1e9;
      const double limit_gbs = gpu ? peak.mem_bandwidth / 1e9 : triad;
      std::printf("%-8d %-14.1f %-14.2f %-16.1f %.1f%%\n", b, d.tokens_per_s, step * 1e3, streamed,
                  100.0 * streamed / limit_gbs);
      if (gpu) {
        run["decode"].push_back({{"batch", b}, {"tokens_per_s", d.tokens_per_s}, {"median_step_s", step},
                                 {"mean_context", mean_ctx}, {"bytes_per_step", step_bytes},
                                 {"streamed_gbs", streamed}, {"fraction_of_bandwidth", streamed / limit_gbs}});
      } else {
        run["decode"].push_back({{"batch", b}, {"tokens_per_s", d.tokens_per_s}, {"median_step_s", step},
                                 {"streamed_gbs", streamed}, {"fraction_of_triad", streamed / triad}});
      }
      prof.decode_batches.push_back(b);
      if (!profile_contexts.empty()) {
        for (double ctx : prof.decode_contexts) {
          const double st = time_long_context_decode(*e.backend, *e.model, *kv_dtype, b, static_cast<int>(ctx), 12,
                                                     e.block_size);
          if (st <= 0) return fail("profile decode failed at batch " + std::to_string(b));
          prof.decode_seconds.push_back(st);
        }
      } else {
        for (int ci : ctx_points) {
          // A few steps around each context point, for a steadier figure.
          std::vector<double> w;
          for (int k = std::max(0, ci - 2); k <= std::min(gen - 1, ci + 2); ++k) w.push_back(d.step_seconds[k]);
          prof.decode_seconds.push_back(median(w));
        }
      }
      if (b == 8) decode8 = d.tokens_per_s;
    }
    run["peak_rss_mb"] = peak_rss_mb();
    engine_peak_mb = std::max(engine_peak_mb, peak_rss_mb());
    out["runs"].push_back(run);
    const double score = decode8 > 0 ? decode8 : pre_tps;
    if (score > best_decode) {
      best_decode = score;
      best_profile = prof;
    }
  }
  // The engine's memory bound: model file + KV pool + 150 MB (the peak also
  // covers the probes' STREAM arrays, freed before the engine runs).
  const double file_mb = std::filesystem::file_size(model_path) / 1e6;
  const double bound_mb = file_mb + kv_pool_mb + 150.0;
  std::printf("\npeak RSS of the engine runs %.0f MB%s (bound: model file %.1f + KV pool %.0f + 150 = %.0f MB: %s) | "
              "KV %lld bytes/token (%s)\n",
              engine_peak_mb, peak_reset ? "" : " (with the probes: peak reset refused)", file_mb, kv_pool_mb,
              bound_mb, engine_peak_mb <= bound_mb ? "within" : "OVER",
              static_cast<long long>(best_profile.kv_bytes_per_token), pd::kv_dtype_name(*kv_dtype));
  out["engine_peak_rss_mb"] = engine_peak_mb;
  out["kv_pool_mb"] = kv_pool_mb;
  out["rss_bound_mb"] = bound_mb;
  out["peak_rss_mb"] = peak_rss_mb();
  out["kv_bytes_per_token"] = best_profile.kv_bytes_per_token;
  out["kv_dtype"] = pd::kv_dtype_name(*kv_dtype);
  if (!kv_compare.empty()) {
    // Long contexts, where decode attention reads the cache: one model, the
    // largest thread count, each KV type in turn.
    const int t = *std::max_element(thread_counts.begin(), thread_counts.end());
    pd::BackendConfig bc;
    bc.kind = gpu ? "cuda" : "cpu";
    bc.device = device;
    bc.cuda_tf32 = tf32;
    bc.n_threads = t;
    bc.int8_activations = !fp32_activations;
    auto be = pd::create_backend(bc);
    if (!be.is_ok()) return fail(be.status().to_string());
    auto m = pd::LlamaModel::load(gguf, **be);
    if (!m.is_ok()) return fail(m.status().to_string());
    const auto& c = (*m)->config();
    const std::string where = gpu ? "cuda device " + std::to_string(device)
                                  : std::to_string(t) + (t > 1 ? " threads" : " thread");
    std::printf("\n== KV cache types at long contexts (%s; ratios to %s, this run)\n", where.c_str(),
                pd::kv_dtype_name(kv_compare.front()));
    std::printf("%-8s %-8s %-6s %-12s %-14s %-12s %-10s\n", "context", "batch", "kv", "bytes/tok", "decode tok/s",
                "KV GB/s", "vs first");
    out["kv_compare"] = nlohmann::json::array();
    for (int ctx : kv_contexts) {
      if (ctx + 16 > c.context) {
        std::printf("%-8d (skipped: the model's context is %d)\n", ctx, c.context);
        continue;
      }
      for (int b : kv_batches) {
        double base_tps = 0;
        for (pd::GgmlType dt : kv_compare) {
          const double step = time_long_context_decode(**be, **m, dt, b, ctx, 16, 16);
          if (step <= 0) return fail(std::string("long-context decode failed (") + pd::kv_dtype_name(dt) + ")");
          const double per_token = static_cast<double>(c.kv_geometry(dt).bytes_per_token());
          const double tps = b / step, kv_gbs = b * (ctx + 8.0) * per_token / step / 1e9;
          if (base_tps == 0) base_tps = tps;
          std::printf("%-8d %-8d %-6s %-12.0f %-14.1f %-12.1f x%.2f\n", ctx, b, pd::kv_dtype_name(dt), per_token, tps,
                      kv_gbs, tps / base_tps);
          out["kv_compare"].push_back({{"context", ctx}, {"batch", b}, {"kv_dtype", pd::kv_dtype_name(dt)},
                                       {"kv_bytes_per_token", per_token}, {"tokens_per_s", tps},
                                       {"kv_gbs", kv_gbs}, {"ratio_to_first", tps / base_tps}});
        }
      }
    }
  }
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << out.dump(2) << "\n";
    if (!f) return fail("cannot write --json file '" + json_path + "'", 2);
  }
  if (!profile_path.empty()) {
    std::ofstream f(profile_path);
    f << pd::plan::engine_profile_to_json(best_profile) << "\n";
    if (!f) return fail("cannot write --profile file '" + profile_path + "'", 2);
    std::printf("profile (%s) written to %s\n", gpu ? "cuda" : "best thread count by batch-8 decode",
                profile_path.c_str());
  }
  return 0;
}
