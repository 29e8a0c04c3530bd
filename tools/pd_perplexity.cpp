// pd-perplexity: how far each CPU compute path's next-token distribution is
// from the fp32 reference, measured the way llama.cpp's
// `llama-perplexity --kl-divergence` measures a quantization.
//
//   pd-perplexity [-m MODEL] -f TEXT [--ctx 512] [--chunks N] [-t THREADS]
//                 [--act int8,fp32] [--isa all|scalar,avx2,avxvnni,avx512vnni] [--kv-dtype f32,f16,q8_0]
//                 [--path SPEC]... [--save-base FILE | --base FILE] [--json FILE]
//
// The text is tokenized as llama.cpp does (no special-token parsing, one
// trailing newline dropped, BOS first when the model asks for one) and cut
// into chunks of --ctx tokens; each chunk is a fresh sequence (BOS in its
// first slot when the model uses one), and the tokens of its second half are
// scored: positions ctx/2 .. ctx-2 predict the token after them, ctx/2 - 1
// scored tokens per chunk, exactly llama-perplexity's windows, so the numbers
// compare with its.
//
// The reference is the fp32 path: fp32 activations against the weights as
// stored, f32 KV cache, its matmuls through OpenBLAS sgemm on dequantized
// panels (CpuBackendConfig::batch_invariant off: the fastest fp32 path; the
// batch-invariant one differs from it only in fp32 summation order). For
// every other path asked for (the cross product of --act x --isa x
// --kv-dtype, or each --path) it reports perplexity (with
// llama.cpp's ± error), the mean (±), 99th percentile and maximum KL divergence
// KL(ref || path) of the next-token distribution in nats, and the fraction of
// positions whose top-1 token equals the reference's. All models are loaded
// once; every chunk runs through the reference and then each path, so nothing
// per position is kept but the KL values.
//
// --save-base FILE writes the reference's log-probabilities in llama.cpp's
// --kl-divergence-base format ("_logits_", uint32 n_ctx, int32 n_vocab,
// int32 n_chunk, int32 tokens[n_ctx * n_chunk], then per chunk and scored
// position: float scale, float min_log_prob, 2 pad halves, uint16 per vocab
// entry (rounded up to an even count): log p = scale * q + min_log_prob over
// [max - 16, max]), so `llama-perplexity --kl-divergence-base FILE
// --kl-divergence` measures llama.cpp against our reference on our tokens.
// --base FILE reads such a file (ours or llama.cpp's) instead of running the
// reference, and then computes KL and top-1 from the decoded log-probs with
// llama.cpp's own formula (terms below log p = -16 dropped); the text, if
// given, must tokenize to the file's tokens. Without --base, KL is exact
// (double precision over the whole vocabulary).
//
// --path SPEC: colon-separated words, any order: int8 | fp32 (activations),
// scalar | avx2 | avxvnni | avx512vnni (kernel ISA; default the widest this CPU runs),
// sgemm (fp32 matmuls through OpenBLAS as the reference's: fp32:sgemm is the
// reference configuration itself, KL exactly 0),
// f32 | f16 | q8_0 (or kv=f32, ...: the KV cache), fp32=KIND+KIND
// (diagnostics: those matmul kinds take fp32 activations in an int8 path;
// kinds qkv, attn_out, gate_up, down, lm_head, all), x2=KIND+KIND (those kinds take two-pass 8-bit activations,
// CpuBackendConfig::int8x2_matmul_kinds, in place of the backend's default
// choice; x2=none: none), top=NATS (the LM head's second pass only for logits
// within NATS of the row's largest, CpuBackendConfig::lm_head_two_pass_margin;
// top=0: for every logit) and layers=A-B+C (restricts fp32= and x2= to those
// layers). Example: --path int8:avx2:f16 --path int8:fp32=down:layers=0-3.
// PD_CPU_INT8X2 in the environment overrides x2= in every path (leave it unset).
//
// A path the backend cannot run (an ISA this CPU lacks, a KV type not
// implemented) is reported as skipped with the reason; the others go on.
// Bad flags or files: one line naming the flag or file, exit status 2.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/q8_kernels.h"
#include "gguf/gguf_reader.h"
#include "model/kv_cache.h"
#include "model/llama_model.h"
#include "tokenizer/tokenizer.h"
#include "tool_common.h"

namespace {

using pd::tools::Clock;
using pd::tools::ToolError;

int fail(const std::string& msg, int code = 1) { return pd::tools::report_error("pd-perplexity", msg, code); }
int fail(const ToolError& e) { return fail(e.message, e.exit_code); }

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream in(s);
  while (std::getline(in, cur, sep))
    if (!cur.empty()) out.push_back(cur);
  return out;
}

// ---- what a path is -------------------------------------------------------

struct PathSpec {
  bool int8 = true;
  std::string isa;  // "" = the widest supported
  pd::GgmlType kv = pd::GgmlType::kF32;
  uint32_t fp32_kinds = 0;
  int64_t x2_kinds = -1;  // -1: the backend's default
  float top = -1;         // LM head second-pass margin; -1: the backend's default
  uint64_t layers = ~uint64_t{0};
  std::string layers_text;  // as given, for the label
  bool sgemm = false;       // fp32 matmuls of many rows through OpenBLAS (the reference: faster, not batch invariant)

  std::string label() const {
    std::string s = int8 ? "int8" : "fp32";
    s += ":" + (isa.empty() ? std::string(pd::cpu::isa_name(pd::cpu::best_isa())) : isa);
    s += std::string(":kv=") + pd::kv_dtype_name(kv);
    if (sgemm) s += ":sgemm";
    auto kinds = [](uint32_t bits) {
      static const char* names[] = {"qkv", "attn_out", "gate_up", "down", "lm_head"};
      std::string k;
      for (int b = 0; b < 5; ++b)
        if (bits & (1u << b)) k += (k.empty() ? "" : "+") + std::string(names[b]);
      return k.empty() ? std::string("none") : k;
    };
    if (x2_kinds >= 0) s += ":x2=" + kinds(static_cast<uint32_t>(x2_kinds));
    if (fp32_kinds) s += ":fp32=" + kinds(fp32_kinds);
    if (top >= 0) { char b[32]; std::snprintf(b, sizeof b, ":top=%g", top); s += b; }
    if (!layers_text.empty()) s += ":layers=" + layers_text;
    return s;
  }
};

const char* kIsaNames[] = {"scalar", "avx2", "avxvnni", "avx512vnni"};

bool known_isa(const std::string& name) {
  for (const char* n : kIsaNames)
    if (name == n) return true;
  return false;
}

bool isa_runs_here(const std::string& name) {
  for (pd::cpu::Isa isa : pd::cpu::kAllIsas)
    if (name == pd::cpu::isa_name(isa)) return pd::cpu::isa_supported(isa);
  return false;
}

// "0-3+7" -> bits 0,1,2,3,7. Empty optional on a malformed list.
std::optional<uint64_t> parse_layers(const std::string& s) {
  uint64_t bits = 0;
  for (const std::string& part : split(s, '+')) {
    int a = 0, b = 0;
    char dash = 0;
    std::istringstream in(part);
    if (!(in >> a)) return std::nullopt;
    b = a;
    if (in >> dash) {
      if (dash != '-' || !(in >> b)) return std::nullopt;
    }
    if (a < 0 || b < a || b > 63) return std::nullopt;
    for (int l = a; l <= b; ++l) bits |= uint64_t{1} << l;
  }
  return bits;
}

// Parses a --path SPEC; an error message naming the bad word otherwise.
std::optional<std::string> parse_path(const std::string& spec, PathSpec* p) {
  for (const std::string& w : split(spec, ':')) {
    if (w == "int8" || w == "fp32") {
      p->int8 = w == "int8";
    } else if (w == "sgemm") {
      p->sgemm = true;
    } else if (known_isa(w)) {
      p->isa = w;
    } else if (w.rfind("fp32=", 0) == 0 || w.rfind("x2=", 0) == 0) {
      const bool fp32 = w[0] == 'f';
      uint32_t bits = 0;
      for (const std::string& k : split(w.substr(fp32 ? 5 : 3), '+')) {
        if (k == "qkv") bits |= pd::kMatmulQkv;
        else if (k == "attn_out") bits |= pd::kMatmulAttnOut;
        else if (k == "gate_up") bits |= pd::kMatmulGateUp;
        else if (k == "down") bits |= pd::kMatmulDown;
        else if (k == "lm_head") bits |= pd::kMatmulLmHead;
        else if (k == "all") bits |= 0x1f;
        else if (k == "none") bits |= 0;
        else
          return "--path '" + spec + "': unknown matmul kind '" + k + "' (qkv, attn_out, gate_up, down, lm_head, all, none)";
      }
      if (fp32) p->fp32_kinds = bits;
      else p->x2_kinds = bits;
    } else if (w.rfind("top=", 0) == 0) {
      char* end = nullptr;
      const float t = std::strtof(w.c_str() + 4, &end);
      if (end == w.c_str() + 4 || *end != '\0' || !(t >= 0.0f) || t > 1000.0f)
        return "--path '" + spec + "': bad top= margin '" + w.substr(4) + "' (nats, 0 to 1000)";
      p->top = t;
    } else if (w.rfind("layers=", 0) == 0) {
      auto bits = parse_layers(w.substr(7));
      if (!bits) return "--path '" + spec + "': bad layer list '" + w.substr(7) + "' (e.g. 0-3+7)";
      p->layers = *bits;
      p->layers_text = w.substr(7);
    } else {
      auto kv = pd::parse_kv_dtype(w.rfind("kv=", 0) == 0 ? w.substr(3) : w, "--path");
      if (!kv.is_ok())
        return "--path '" + spec + "': unknown word '" + w +
               "' (int8|fp32, scalar|avx2|avxvnni|avx512vnni, sgemm, f32|f16|q8_0, x2=KINDS, fp32=KINDS, top=NATS, layers=LIST)";
      p->kv = *kv;
    }
  }
  if ((p->fp32_kinds || p->x2_kinds >= 0 || p->top >= 0) && !p->int8)
    return "--path '" + spec + "': fp32=, x2= and top= apply to int8 paths only";
  return std::nullopt;
}

// ---- one loaded engine per path --------------------------------------------

struct Engine {
  PathSpec spec;
  std::unique_ptr<pd::Backend> backend;
  std::unique_ptr<pd::LlamaModel> model;
  std::optional<pd::KvCache> cache;
  std::string skipped;  // why this path does not run, if it does not
  double seconds = 0;
};

pd::Status load_engine(const std::shared_ptr<const pd::GgufFile>& gguf, int threads, int n_ctx, Engine* e) {
  pd::CpuBackendConfig c;
  c.n_threads = threads;
  c.int8_activations = e->spec.int8;
  c.batch_invariant = !e->spec.sgemm;
  c.isa = e->spec.isa;
  c.fp32_matmul_kinds = e->spec.fp32_kinds;
  c.fp32_matmul_layers = e->spec.layers;
  if (e->spec.x2_kinds >= 0) {
    c.int8x2_matmul_kinds = static_cast<uint32_t>(e->spec.x2_kinds);
    c.int8x2_matmul_layers = e->spec.layers;
  }
  if (e->spec.top >= 0) c.lm_head_two_pass_margin = e->spec.top;
  e->backend = pd::make_cpu_backend(c);
  PD_ASSIGN_OR_RETURN(e->model, pd::LlamaModel::load(gguf, *e->backend));
  constexpr int kBlock = 16;
  PD_ASSIGN_OR_RETURN(pd::KvCache cache, pd::KvCache::create(*e->backend, e->model->config(), kBlock,
                                                             (n_ctx + kBlock - 1) / kBlock, e->spec.kv));
  e->cache.emplace(std::move(cache));
  return pd::Status::ok();
}

// Logits of positions first .. n-2 of one chunk (n - 1 - first rows of vocab
// floats): the first half is prefilled without logits, the scored half with
// all_logits (the same arithmetic as one pass: every kernel is row-independent).
pd::Status eval_chunk(Engine& e, std::span<const pd::TokenId> chunk, int first, std::vector<float>* logits) {
  const int n = static_cast<int>(chunk.size());
  const int bs = e.cache->layout.block_size;
  std::vector<int32_t> table((n + bs - 1) / bs);
  for (size_t b = 0; b < table.size(); ++b) table[b] = static_cast<int32_t>(b);
  const auto t0 = Clock::now();
  if (first > 0) {
    pd::SequenceBatch head{chunk.subspan(0, first), 0, table, false};
    PD_RETURN_IF_ERROR(e.model->forward(std::span<const pd::SequenceBatch>(&head, 1), *e.cache, nullptr));
  }
  pd::SequenceBatch tail{chunk.subspan(first, n - 1 - first), first, table, true};
  tail.all_logits = true;
  PD_RETURN_IF_ERROR(e.model->forward(std::span<const pd::SequenceBatch>(&tail, 1), *e.cache, logits));
  e.seconds += pd::tools::seconds(Clock::now() - t0);
  return pd::Status::ok();
}

// ---- llama.cpp's --kl-divergence-base format --------------------------------

constexpr char kBaseMagic[8] = {'_', 'l', 'o', 'g', 'i', 't', 's', '_'};
int base_row_halves(int n_vocab) { return 2 * ((n_vocab + 1) / 2) + 4; }

int nearest_int(float fval) {  // llama.cpp's, bit for bit
  float val = fval + 12582912.f;
  int i;
  std::memcpy(&i, &val, sizeof(int));
  return (i & 0x007fffff) - 0x00400000;
}

// llama.cpp's log_softmax(n_vocab, logits, uint16_t* log_prob, tok): one row
// of the base file, same float/double steps.
void encode_base_row(int n_vocab, const float* logits, uint16_t* row) {
  float max_logit = logits[0], min_logit = logits[0];
  for (int i = 1; i < n_vocab; ++i) {
    max_logit = std::max(max_logit, logits[i]);
    min_logit = std::min(min_logit, logits[i]);
  }
  min_logit = std::max(min_logit, max_logit - 16);
  double sum_exp = 0.0;
  for (int i = 0; i < n_vocab; ++i) sum_exp += expf(logits[i] - max_logit);
  const float log_sum_exp = static_cast<float>(std::log(sum_exp));
  const float min_log_prob = min_logit - max_logit - log_sum_exp;
  const float scale = (max_logit - min_logit) / 65535.f;
  std::memset(row, 0, base_row_halves(n_vocab) * sizeof(uint16_t));
  std::memcpy(row, &scale, sizeof(float));
  std::memcpy(row + 2, &min_log_prob, sizeof(float));
  uint16_t* q = row + 4;
  if (scale != 0.0f) {
    const float inv_scale = 1 / scale;
    for (int i = 0; i < n_vocab; ++i)
      q[i] = logits[i] > min_logit ? static_cast<uint16_t>(nearest_int(inv_scale * (logits[i] - min_logit))) : 0;
  }
}

struct BaseFile {
  std::ifstream in;
  uint32_t n_ctx = 0;
  int32_t n_vocab = 0, n_chunk = 0;
  std::vector<pd::TokenId> tokens;
};

std::optional<std::string> open_base(const std::string& path, BaseFile* b) {
  b->in.open(path, std::ios::binary);
  if (!b->in) return "cannot read --base file '" + path + "'";
  char magic[8];
  b->in.read(magic, 8);
  if (!b->in || std::memcmp(magic, kBaseMagic, 8) != 0)
    return "--base file '" + path + "' is not a llama.cpp log-probability file (no _logits_ magic)";
  b->in.read(reinterpret_cast<char*>(&b->n_ctx), 4);
  b->in.read(reinterpret_cast<char*>(&b->n_vocab), 4);
  b->in.read(reinterpret_cast<char*>(&b->n_chunk), 4);
  if (!b->in || b->n_ctx < 4 || b->n_vocab <= 0 || b->n_chunk <= 0)
    return "--base file '" + path + "': bad header";
  b->tokens.resize(static_cast<size_t>(b->n_ctx) * b->n_chunk);
  b->in.read(reinterpret_cast<char*>(b->tokens.data()), b->tokens.size() * sizeof(pd::TokenId));
  if (!b->in) return "--base file '" + path + "': truncated token list";
  return std::nullopt;
}

// ---- statistics (llama.cpp's definitions) -----------------------------------

struct Stats {
  double sum_nll = 0, sum_nll2 = 0, sum_kl = 0, sum_kl2 = 0;
  size_t same_top = 0, count = 0;
  std::vector<float> kl;

  static std::pair<double, double> mean_unc(double sum, double sum2, size_t n) {
    if (n < 1) return {0.0, 0.0};
    const double f = sum / n;
    double df = sum2 / n - f * f;
    df = df > 0 && n > 10 ? std::sqrt(df / (n - 1)) : 0.0;
    return {f, df};
  }
  std::pair<double, double> ppl() const {
    auto [m, u] = mean_unc(sum_nll, sum_nll2, count);
    return {std::exp(m), std::exp(m) * u};
  }
  std::pair<double, double> mean_kl() const { return mean_unc(sum_kl, sum_kl2, count); }
  double kl_percentile(double fraction) const {  // llama.cpp's interpolation
    if (kl.empty()) return 0.0;
    std::vector<float> v = kl;
    std::sort(v.begin(), v.end());
    if (fraction <= 0) return v.front();
    if (fraction >= 1) return v.back();
    double p = fraction * (v.size() - 1);
    const size_t ip = static_cast<size_t>(p);
    p -= ip;
    return (1 - p) * v[ip] + p * v[std::min(ip + 1, v.size() - 1)];
  }
  std::pair<double, double> top1() const {
    const double p = count ? static_cast<double>(same_top) / count : 0.0;
    return {p, count > 1 ? std::sqrt(p * (1 - p) / (count - 1)) : 0.0};
  }
};

// log-softmax of one row in double: out[i] = logits[i] - logsumexp; returns argmax (first max).
int log_softmax(int n_vocab, const float* logits, double* out) {
  int imax = 0;
  for (int i = 1; i < n_vocab; ++i)
    if (logits[i] > logits[imax]) imax = i;
  const double mx = logits[imax];
  double sum = 0.0;
  for (int i = 0; i < n_vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  for (int i = 0; i < n_vocab; ++i) out[i] = logits[i] - lse;
  return imax;
}

// Exact KL(ref || q) against a reference row of log-probs (double, whole vocabulary).
void accumulate_exact(int n_vocab, const double* ref_lp, int ref_top, const float* logits, int tok, Stats* s,
                      std::vector<double>* scratch) {
  scratch->resize(n_vocab);
  const int top = log_softmax(n_vocab, logits, scratch->data());
  const double* lp = scratch->data();
  double kl = 0.0;
  for (int i = 0; i < n_vocab; ++i) {
    const double p = std::exp(ref_lp[i]);
    if (p > 0) kl += p * (ref_lp[i] - lp[i]);
  }
  const double nll = -lp[tok];
  s->sum_nll += nll;
  s->sum_nll2 += nll * nll;
  s->sum_kl += kl;
  s->sum_kl2 += kl * kl;
  s->kl.push_back(static_cast<float>(kl));
  s->same_top += top == ref_top;
  ++s->count;
}

// llama.cpp's log_softmax(n_vocab, logits, base_log_prob, tok, kld): KL and top-1
// against one decoded base-file row, the same float steps and the same -16 cut.
void accumulate_base(int n_vocab, const uint16_t* base_row, const float* logits, int tok, Stats* s) {
  float max_logit = logits[0];
  int imax = 0;
  for (int i = 1; i < n_vocab; ++i) {
    if (logits[i] > max_logit) {
      max_logit = logits[i];
      imax = i;
    }
  }
  double sum_exp = 0.0;
  for (int i = 0; i < n_vocab; ++i) sum_exp += expf(logits[i] - max_logit);
  const float log_sum_exp = static_cast<float>(std::log(sum_exp));
  float scale, min_log_prob;
  std::memcpy(&scale, base_row, sizeof(float));
  std::memcpy(&min_log_prob, base_row + 2, sizeof(float));
  const uint16_t* q = base_row + 4;
  const float nll = max_logit + log_sum_exp - logits[tok];
  max_logit += log_sum_exp;
  double sum = 0;
  int imax_base = -1;
  float p_log_base_max = 0;
  for (int i = 0; i < n_vocab; ++i) {
    const float p_log_base = scale * q[i] + min_log_prob;
    if (i == 0 || p_log_base > p_log_base_max) {
      p_log_base_max = p_log_base;
      imax_base = i;
    }
    if (p_log_base > -16.f) {
      const float p_base = expf(p_log_base);
      sum += p_base * (p_log_base - logits[i] + max_logit);
    }
  }
  s->sum_nll += nll;
  s->sum_nll2 += static_cast<double>(nll) * nll;
  s->sum_kl += sum;
  s->sum_kl2 += sum * sum;
  s->kl.push_back(static_cast<float>(sum));
  s->same_top += imax == imax_base;
  ++s->count;
}

// The base file's own perplexity (its stored log-prob of each next token).
void accumulate_base_self(int n_vocab, const uint16_t* base_row, int tok, Stats* s) {
  (void)n_vocab;
  float scale, min_log_prob;
  std::memcpy(&scale, base_row, sizeof(float));
  std::memcpy(&min_log_prob, base_row + 2, sizeof(float));
  const double nll = -(scale * base_row[4 + tok] + min_log_prob);
  s->sum_nll += nll;
  s->sum_nll2 += nll * nll;
  s->kl.push_back(0.0f);
  ++s->same_top;
  ++s->count;
}

// ---- flags ---------------------------------------------------------------------

struct PerplexityFlags {
  std::string model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf", text_path, save_base, base_path, json_path;
  std::string act_list = "int8", isa_list = "", kv_list = "f32", ref_isa;
  std::vector<std::string> path_specs;
  int n_ctx = 512, max_chunks = -1, threads = 0;
  bool ctx_given = false;  // --ctx on the command line (it must then match a --base file's)
};

// Parses the command line into *f. Returns the exit status when the tool
// stops here (--help, a bad flag), nothing when it goes on.
std::optional<int> parse_flags(int argc, char** argv, PerplexityFlags* f) {
  CLI::App app{"pd-perplexity: perplexity and KL divergence of the CPU paths against the fp32 reference"};
  app.add_option("-m,--model", f->model_path, "GGUF model file");
  app.add_option("-f,--file", f->text_path, "text file to score");
  auto* ctx_opt = app.add_option("-c,--ctx", f->n_ctx, "tokens per chunk (the second half is scored)")
                      ->check(CLI::Range(4, 1 << 20));
  app.add_option("--chunks", f->max_chunks, "score at most this many chunks (-1 = all)")
      ->check(CLI::Range(-1, 1 << 30));
  app.add_option("-t,--threads", f->threads, "CPU threads (0 = all cores)")->check(CLI::Range(0, 1024));
  app.add_option("--act", f->act_list, "activation paths, comma-separated: int8, fp32");
  app.add_option("--isa", f->isa_list,
                 "kernel ISAs, comma-separated: scalar, avx2, avxvnni, avx512vnni, or all (every one this CPU runs); "
                 "default: the widest");
  app.add_option("--kv-dtype", f->kv_list, "KV cache types, comma-separated: f32, f16, q8_0");
  app.add_option("--path", f->path_specs,
                 "one path (see the header of tools/pd_perplexity.cpp); replaces --act/--isa/--kv-dtype");
  app.add_option("--ref-isa", f->ref_isa, "ISA of the fp32 reference (default: the widest)");
  auto* save_opt = app.add_option("--save-base", f->save_base, "write the reference's log-probs (llama.cpp format)");
  auto* base_opt = app.add_option("--base", f->base_path, "read the reference's log-probs (llama.cpp format)");
  save_opt->excludes(base_opt);
  app.add_option("--json", f->json_path, "write the results as JSON")->check(pd::tools::writable_file());
  if (auto code = pd::tools::parse_command_line(app, argc, argv, "pd-perplexity")) return code;
  f->ctx_given = ctx_opt->count() > 0;
  return std::nullopt;
}

// The paths to compare: each --path, else the cross product --act x --isa x --kv-dtype.
std::optional<ToolError> paths_of(const PerplexityFlags& f, std::vector<PathSpec>* specs) {
  if (!f.path_specs.empty()) {
    for (const std::string& s : f.path_specs) {
      PathSpec p;
      if (auto err = parse_path(s, &p)) return ToolError{*err, 2};
      specs->push_back(p);
    }
    return std::nullopt;
  }
  std::vector<std::string> isas;
  if (f.isa_list == "all") {
    for (const char* n : kIsaNames)
      if (isa_runs_here(n)) isas.push_back(n);
  } else if (f.isa_list.empty()) {
    isas.push_back("");
  } else {
    isas = split(f.isa_list, ',');
  }
  for (const std::string& a : split(f.act_list, ',')) {
    if (a != "int8" && a != "fp32") return ToolError{"--act: unknown activation path '" + a + "' (int8, fp32)", 2};
    for (const std::string& isa : isas) {
      if (!isa.empty() && !known_isa(isa))
        return ToolError{"--isa: unknown ISA '" + isa + "' (scalar, avx2, avxvnni, avx512vnni, all)", 2};
      for (const std::string& k : split(f.kv_list, ',')) {
        auto kv = pd::parse_kv_dtype(k, "--kv-dtype");
        if (!kv.is_ok()) return ToolError{kv.status().message(), 2};
        PathSpec p;
        p.int8 = a == "int8";
        p.isa = isa;
        p.kv = *kv;
        specs->push_back(p);
      }
    }
  }
  return std::nullopt;
}

std::optional<ToolError> check_ref_isa(const std::string& ref_isa) {
  if (!ref_isa.empty() && !known_isa(ref_isa))
    return ToolError{"--ref-isa: unknown ISA '" + ref_isa + "' (scalar, avx2, avxvnni, avx512vnni)", 2};
  if (!ref_isa.empty() && !isa_runs_here(ref_isa)) return ToolError{"--ref-isa: this CPU cannot run " + ref_isa, 2};
  return std::nullopt;
}

// ---- the tokens and their chunks ---------------------------------------------

// What is scored: the tokens (of --file, or of the --base file), cut into chunks.
struct Corpus {
  std::vector<pd::TokenId> tokens;
  BaseFile base;
  bool use_base = false;
  int n_ctx = 0, n_chunk = 0;
  int first = 0, n_scored = 0;  // a chunk's scored rows: positions first .. n_ctx - 2
  int n_vocab = 0;
  pd::TokenId bos = -1;  // in each chunk's first slot, where the model uses one
};

// --file's tokens as llama.cpp makes them: one trailing newline dropped, BOS first.
std::optional<ToolError> read_text(const PerplexityFlags& f, const pd::Tokenizer& tok, Corpus* c) {
  std::string error;
  auto read = pd::tools::read_input_file(f.text_path, "--file", &error);
  if (!read) return ToolError{error, 2};
  std::string text = std::move(*read);
  if (!text.empty() && text.back() == '\n') text.pop_back();  // as llama.cpp's -f does
  c->tokens = tok.encode(text, /*parse_special=*/false);
  if (tok.add_bos() && tok.bos_id() >= 0) c->tokens.insert(c->tokens.begin(), tok.bos_id());
  return std::nullopt;
}

// Opens --base: its n_ctx and tokens replace --ctx and --file's (which must agree with them).
std::optional<ToolError> read_base(const PerplexityFlags& f, Corpus* c) {
  if (auto err = open_base(f.base_path, &c->base)) return ToolError{*err, 2};
  const BaseFile& base = c->base;
  if (f.ctx_given && static_cast<uint32_t>(c->n_ctx) != base.n_ctx)
    return ToolError{
        "--ctx " + std::to_string(c->n_ctx) + " differs from --base file's n_ctx " + std::to_string(base.n_ctx), 2};
  c->n_ctx = static_cast<int>(base.n_ctx);
  const std::vector<pd::TokenId>& tokens = c->tokens;
  if (!tokens.empty()) {
    const size_t n = std::min(tokens.size(), base.tokens.size());
    if (tokens.size() < base.tokens.size())
      return ToolError{"--file '" + f.text_path + "' has " + std::to_string(tokens.size()) +
                           " tokens, fewer than the " + std::to_string(base.tokens.size()) + " of --base '" +
                           f.base_path + "'",
                       2};
    for (size_t i = 0; i < n; ++i) {
      if (tokens[i] != base.tokens[i])
        return ToolError{"--file '" + f.text_path + "' tokenizes differently from --base '" + f.base_path +
                             "' at token " + std::to_string(i) + " (" + std::to_string(tokens[i]) + " vs " +
                             std::to_string(base.tokens[i]) + ")",
                         2};
    }
  }
  c->tokens = base.tokens;
  return std::nullopt;
}

// The tokens, cut into chunks of --ctx (at most --chunks of them).
std::optional<ToolError> read_corpus(const PerplexityFlags& f, const pd::Tokenizer& tok, Corpus* c) {
  c->n_ctx = f.n_ctx;
  c->use_base = !f.base_path.empty();
  if (!f.text_path.empty())
    if (auto err = read_text(f, tok, c)) return err;
  if (c->use_base)
    if (auto err = read_base(f, c)) return err;
  const int n_ctx = c->n_ctx;
  const int n_chunk_max = static_cast<int>(c->tokens.size() / n_ctx);
  if (!c->use_base && static_cast<int64_t>(c->tokens.size()) < 2 * static_cast<int64_t>(n_ctx))
    return ToolError{"--file '" + f.text_path + "' has " + std::to_string(c->tokens.size()) + " tokens; --ctx " +
                         std::to_string(n_ctx) + " needs at least " + std::to_string(2 * n_ctx) +
                         " (as llama-perplexity)",
                     2};
  c->n_chunk = f.max_chunks < 0 ? n_chunk_max : std::min(f.max_chunks, n_chunk_max);
  if (c->n_chunk <= 0) return ToolError{"--chunks must be positive", 2};
  c->first = n_ctx / 2;
  c->n_scored = n_ctx - 1 - c->first;
  c->n_vocab = c->use_base ? c->base.n_vocab : tok.vocab_size();
  c->bos = tok.add_bos() && tok.bos_id() >= 0 ? tok.bos_id() : -1;
  return std::nullopt;
}

// ---- engines ---------------------------------------------------------------------

// The reference (not loaded with --base) and one engine per path; a path
// that cannot load is marked skipped. Checks the vocabularies agree.
std::optional<ToolError> load_engines(const PerplexityFlags& f, const std::shared_ptr<const pd::GgufFile>& gguf,
                                      const Corpus& c, const std::vector<PathSpec>& specs, Engine* ref,
                                      std::vector<Engine>* engines) {
  ref->spec.int8 = false;
  ref->spec.isa = f.ref_isa;
  ref->spec.sgemm = true;
  if (!c.use_base) {
    if (auto st = load_engine(gguf, f.threads, c.n_ctx, ref); !st.is_ok())
      return ToolError{"reference: " + st.to_string()};
  }
  *engines = std::vector<Engine>(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    Engine& e = (*engines)[i];
    e.spec = specs[i];
    if (!e.spec.isa.empty() && !isa_runs_here(e.spec.isa)) {
      e.skipped = "this CPU cannot run " + e.spec.isa;
      continue;
    }
    if (auto st = load_engine(gguf, f.threads, c.n_ctx, &e); !st.is_ok()) e.skipped = st.to_string();
  }
  if (!c.use_base) {
    if (ref->model->config().vocab != c.n_vocab)
      return ToolError{"the model's vocabulary (" + std::to_string(ref->model->config().vocab) +
                       ") differs from its tokenizer's (" + std::to_string(c.n_vocab) + ")"};
    return std::nullopt;
  }
  for (Engine& e : *engines)
    if (e.model && e.model->config().vocab != c.n_vocab)
      return ToolError{"--base file '" + f.base_path + "' has a vocabulary of " + std::to_string(c.n_vocab) +
                           ", the model " + std::to_string(e.model->config().vocab),
                       2};
  return std::nullopt;
}

// Opens --save-base and writes its header and token list.
std::optional<ToolError> start_save_base(const PerplexityFlags& f, const Corpus& c, std::ofstream* save) {
  save->open(f.save_base, std::ios::binary);
  if (!*save) return ToolError{"cannot write --save-base file '" + f.save_base + "'", 2};
  const uint32_t ctx32 = static_cast<uint32_t>(c.n_ctx);
  const int32_t nv = c.n_vocab, nc = c.n_chunk;
  save->write(kBaseMagic, 8);
  save->write(reinterpret_cast<const char*>(&ctx32), 4);
  save->write(reinterpret_cast<const char*>(&nv), 4);
  save->write(reinterpret_cast<const char*>(&nc), 4);
  save->write(reinterpret_cast<const char*>(c.tokens.data()),
              static_cast<size_t>(c.n_ctx) * c.n_chunk * sizeof(pd::TokenId));
  return std::nullopt;
}

// ---- chunks ------------------------------------------------------------------------

// The statistics of the reference and of each path, and the rows of one chunk.
struct Scoring {
  Stats ref_stats;
  std::vector<Stats> stats;                // one per path
  std::vector<double> ref_lp, scratch;     // [n_scored, n_vocab]: the reference's log-probs (not with --base)
  std::vector<int> ref_top;                // [n_scored]: the reference's top-1 token
  std::vector<uint16_t> base_rows;         // [n_scored, base_row_halves]: --base / --save-base rows
  std::vector<float> logits;               // [n_scored, n_vocab]
  std::ofstream save;                      // --save-base, when open
};

// Scores one chunk's reference: the --base rows, else the reference engine
// (its rows also into --save-base, where asked).
std::optional<ToolError> score_reference(const PerplexityFlags& f, Corpus& c, int chunk_index,
                                         std::span<const pd::TokenId> chunk, Engine& ref, Scoring* s) {
  const int halves = base_row_halves(c.n_vocab);
  const pd::TokenId* next = chunk.data() + c.first + 1;  // next[i] is predicted by row i
  if (c.use_base) {
    c.base.in.read(reinterpret_cast<char*>(s->base_rows.data()), s->base_rows.size() * sizeof(uint16_t));
    if (!c.base.in)
      return ToolError{"--base file '" + f.base_path + "': truncated at chunk " + std::to_string(chunk_index)};
    for (int i = 0; i < c.n_scored; ++i)
      accumulate_base_self(c.n_vocab, s->base_rows.data() + static_cast<size_t>(i) * halves, next[i], &s->ref_stats);
    return std::nullopt;
  }
  if (auto st = eval_chunk(ref, chunk, c.first, &s->logits); !st.is_ok())
    return ToolError{"reference: " + st.to_string()};
  const bool saving = s->save.is_open();
  for (int i = 0; i < c.n_scored; ++i) {
    const float* row = s->logits.data() + static_cast<size_t>(i) * c.n_vocab;
    double* lp = s->ref_lp.data() + static_cast<size_t>(i) * c.n_vocab;
    s->ref_top[i] = log_softmax(c.n_vocab, row, lp);
    const double nll = -lp[next[i]];
    s->ref_stats.sum_nll += nll;
    s->ref_stats.sum_nll2 += nll * nll;
    s->ref_stats.kl.push_back(0.0f);
    ++s->ref_stats.same_top;
    ++s->ref_stats.count;
    if (saving) encode_base_row(c.n_vocab, row, s->base_rows.data() + static_cast<size_t>(i) * halves);
  }
  if (saving) s->save.write(reinterpret_cast<const char*>(s->base_rows.data()), s->base_rows.size() * sizeof(uint16_t));
  return std::nullopt;
}

// Scores one chunk through each path against the reference; a path that fails is skipped from then on.
void score_paths(const Corpus& c, std::span<const pd::TokenId> chunk, std::vector<Engine>& engines, Scoring* s) {
  const int halves = base_row_halves(c.n_vocab);
  const pd::TokenId* next = chunk.data() + c.first + 1;
  for (size_t p = 0; p < engines.size(); ++p) {
    Engine& e = engines[p];
    if (!e.skipped.empty()) continue;
    if (auto st = eval_chunk(e, chunk, c.first, &s->logits); !st.is_ok()) {
      e.skipped = st.to_string();
      std::fprintf(stderr, "pd-perplexity: path %s skipped: %s\n", e.spec.label().c_str(), e.skipped.c_str());
      continue;
    }
    for (int i = 0; i < c.n_scored; ++i) {
      const float* row = s->logits.data() + static_cast<size_t>(i) * c.n_vocab;
      if (c.use_base)
        accumulate_base(c.n_vocab, s->base_rows.data() + static_cast<size_t>(i) * halves, row, next[i], &s->stats[p]);
      else
        accumulate_exact(c.n_vocab, s->ref_lp.data() + static_cast<size_t>(i) * c.n_vocab, s->ref_top[i], row,
                         next[i], &s->stats[p], &s->scratch);
    }
  }
}

// Every chunk through the reference and each path, with a progress line per chunk.
std::optional<ToolError> score_chunks(const PerplexityFlags& f, Corpus& c, Engine& ref, std::vector<Engine>& engines,
                                      Scoring* s) {
  s->stats.resize(engines.size());
  s->ref_lp.resize(static_cast<size_t>(c.n_scored) * (c.use_base ? 0 : c.n_vocab));
  s->ref_top.resize(c.n_scored);
  s->base_rows.resize(static_cast<size_t>(c.n_scored) * base_row_halves(c.n_vocab));
  const auto t_start = Clock::now();
  for (int i = 0; i < c.n_chunk; ++i) {
    std::vector<pd::TokenId> chunk(c.tokens.begin() + static_cast<int64_t>(i) * c.n_ctx,
                                   c.tokens.begin() + static_cast<int64_t>(i + 1) * c.n_ctx);
    if (c.bos >= 0) chunk[0] = c.bos;  // as llama-perplexity does
    if (auto err = score_reference(f, c, i, chunk, ref, s)) return err;
    score_paths(c, chunk, engines, s);
    const double el = pd::tools::seconds(Clock::now() - t_start);
    std::fprintf(stderr, "[%d/%d] ref PPL %.4f | %.1f s elapsed, ~%.0f s left\n", i + 1, c.n_chunk,
                 s->ref_stats.ppl().first, el, el / (i + 1) * (c.n_chunk - i - 1));
  }
  if (s->save.is_open()) {
    s->save.close();
    if (!s->save) return ToolError{"writing --save-base file '" + f.save_base + "' failed"};
  }
  return std::nullopt;
}

// ---- report ------------------------------------------------------------------------

// One table row and one JSON entry of a path (or the reference).
void report_row(const Corpus& c, const std::string& label, const Stats& s, double secs, const std::string& backend,
                bool is_ref, nlohmann::json* out) {
  const auto [ppl, ppl_u] = s.ppl();
  const auto [kl, kl_u] = s.mean_kl();
  const auto [top, top_u] = s.top1();
  const double tps = secs > 0 ? static_cast<double>(c.n_chunk) * (c.n_ctx - 1) / secs : 0.0;
  char buf[512];
  if (is_ref) {
    std::snprintf(buf, sizeof buf, "%-40s %8.4f ± %-7.4f %-22s %-10s %-10s %-16s %.0f", label.c_str(), ppl, ppl_u,
                  "(reference)", "", "", "", tps);
  } else {
    std::snprintf(buf, sizeof buf, "%-40s %8.4f ± %-7.4f %9.6f ± %-10.6f %-10.6f %-10.6f %6.3f ± %-6.3f%% %.0f",
                  label.c_str(), ppl, ppl_u, kl, kl_u, s.kl_percentile(0.99), s.kl_percentile(1.0), 100 * top,
                  100 * top_u, tps);
  }
  std::printf("%s\n", buf);
  (*out)["paths"].push_back({{"path", label},
                             {"backend", backend},
                             {"reference", is_ref},
                             {"ppl", ppl},
                             {"ppl_err", ppl_u},
                             {"kl_mean", kl},
                             {"kl_mean_err", kl_u},
                             {"kl_p99", s.kl_percentile(0.99)},
                             {"kl_max", s.kl_percentile(1.0)},
                             {"top1", top},
                             {"top1_err", top_u},
                             {"scored", s.count},
                             {"tok_per_s", tps}});
}

// The table on stdout and its JSON: the reference, then each path (or why it was skipped).
nlohmann::json report(const PerplexityFlags& f, const Corpus& c, const Engine& ref,
                      const std::vector<Engine>& engines, const Scoring& s) {
  nlohmann::json out{{"model", f.model_path},
                     {"text", f.text_path},
                     {"base", f.base_path},
                     {"ctx", c.n_ctx},
                     {"chunks", c.n_chunk},
                     {"scored_tokens", s.ref_stats.count},
                     {"kl_mode", c.use_base ? "base file (llama.cpp formula)" : "exact"},
                     {"paths", nlohmann::json::array()}};
  std::printf("\n%d chunks x %d tokens, %zu scored; KL(ref || path) in nats, %s\n", c.n_chunk, c.n_ctx,
              s.ref_stats.count, c.use_base ? "reference from the --base file (llama.cpp's formula)" : "exact");
  std::printf("%-40s %-18s %-22s %-10s %-10s %-16s %s\n", "path", "PPL", "mean KL", "p99 KL", "max KL", "top-1 same",
              "tok/s");
  report_row(c, c.use_base ? "reference (--base file)" : "reference fp32:kv=f32", s.ref_stats, ref.seconds,
             c.use_base ? "" : ref.backend->name(), true, &out);
  for (size_t p = 0; p < engines.size(); ++p) {
    const Engine& e = engines[p];
    if (!e.skipped.empty()) {
      std::printf("%-40s skipped: %s\n", e.spec.label().c_str(), e.skipped.c_str());
      out["paths"].push_back({{"path", e.spec.label()}, {"skipped", e.skipped}});
      continue;
    }
    report_row(c, e.spec.label(), s.stats[p], e.seconds, e.backend->name(), false, &out);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  PerplexityFlags flags;
  if (auto code = parse_flags(argc, argv, &flags)) return *code;
  std::vector<PathSpec> specs;
  if (auto err = paths_of(flags, &specs)) return fail(*err);
  if (auto err = check_ref_isa(flags.ref_isa)) return fail(*err);

  pd::tools::ToolError err;
  if (!std::filesystem::exists(flags.model_path))  // reported before a missing --file
    return fail(pd::tools::ToolError{"model file not found: " + flags.model_path + " (--model)", 2});
  if (flags.text_path.empty() && flags.base_path.empty()) return fail("one of --file or --base is required", 2);
  const auto gguf = pd::tools::open_model_file(flags.model_path, /*refusal_is_usage=*/false, &err);
  if (!gguf) return fail(err);
  auto tok = pd::Tokenizer::from_gguf(*gguf);
  if (!tok.is_ok()) return fail(tok.status().to_string());
  Corpus corpus;
  if (auto e = read_corpus(flags, **tok, &corpus)) return fail(*e);

  Engine ref;
  std::vector<Engine> engines;
  if (auto e = load_engines(flags, gguf, corpus, specs, &ref, &engines)) return fail(*e);
  Scoring scoring;
  if (!flags.save_base.empty())
    if (auto e = start_save_base(flags, corpus, &scoring.save)) return fail(*e);
  std::fprintf(stderr, "pd-perplexity: %s, %zu tokens, %d chunks of %d (%d scored each), reference: %s\n",
               flags.text_path.empty() ? flags.base_path.c_str() : flags.text_path.c_str(), corpus.tokens.size(),
               corpus.n_chunk, corpus.n_ctx, corpus.n_scored,
               corpus.use_base ? ("--base " + flags.base_path).c_str() : ref.backend->name().c_str());
  if (auto e = score_chunks(flags, corpus, ref, engines, &scoring)) return fail(*e);

  const nlohmann::json out = report(flags, corpus, ref, engines, scoring);
  if (!flags.json_path.empty() && !pd::tools::write_json_file(flags.json_path, out))
    return fail("cannot write --json file '" + flags.json_path + "'", 2);
  return 0;
}
