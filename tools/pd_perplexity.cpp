// pd-perplexity: how far each CPU compute path's next-token distribution is
// from the fp32 reference, measured the way llama.cpp's
// `llama-perplexity --kl-divergence` measures a quantization.
//
//   pd-perplexity [-m MODEL] -f TEXT [--ctx 512] [--chunks N] [-t THREADS]
//                 [--act int8,fp32] [--isa all|scalar,avx2,avx512vnni] [--kv-dtype f32,f16,q8_0]
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
// scalar | avx2 | avx512vnni (kernel ISA; default the widest this CPU runs),
// sgemm (fp32 matmuls through OpenBLAS as the reference's: fp32:sgemm is the
// reference configuration itself, KL exactly 0),
// f32 | f16 | q8_0 (or kv=f32, ...: the KV cache), fp32=KIND+KIND
// (diagnostics: those matmul kinds take fp32 activations in an int8 path;
// kinds qkv, attn_out, gate_up, down, lm_head, all), x2=KIND+KIND (those kinds take two-pass 8-bit activations,
// CpuBackendConfig::int8x2_matmul_kinds, in place of the backend's default
// choice; x2=none: none) and layers=A-B+C (restricts fp32= and x2= to those
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

namespace {

using Clock = std::chrono::steady_clock;

int fail(const std::string& msg, int code = 1) {
  std::fprintf(stderr, "pd-perplexity: error: %s\n", msg.c_str());
  return code;
}

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
    if (!layers_text.empty()) s += ":layers=" + layers_text;
    return s;
  }
};

const char* kIsaNames[] = {"scalar", "avx2", "avx512vnni"};

bool isa_runs_here(const std::string& name) {
  for (pd::cpu::Isa isa : {pd::cpu::Isa::kScalar, pd::cpu::Isa::kAvx2, pd::cpu::Isa::kAvx512Vnni})
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
    } else if (w == "scalar" || w == "avx2" || w == "avx512vnni") {
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
    } else if (w.rfind("layers=", 0) == 0) {
      auto bits = parse_layers(w.substr(7));
      if (!bits) return "--path '" + spec + "': bad layer list '" + w.substr(7) + "' (e.g. 0-3+7)";
      p->layers = *bits;
      p->layers_text = w.substr(7);
    } else {
      auto kv = pd::parse_kv_dtype(w.rfind("kv=", 0) == 0 ? w.substr(3) : w, "--path");
      if (!kv.is_ok())
        return "--path '" + spec + "': unknown word '" + w +
               "' (int8|fp32, scalar|avx2|avx512vnni, sgemm, f32|f16|q8_0, x2=KINDS, fp32=KINDS, layers=LIST)";
      p->kv = *kv;
    }
  }
  if ((p->fp32_kinds || p->x2_kinds >= 0) && !p->int8)
    return "--path '" + spec + "': fp32= and x2= apply to int8 paths only";
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
  e.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
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

}  // namespace

int main(int argc, char** argv) {
  std::string model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf", text_path, save_base, base_path, json_path;
  std::string act_list = "int8", isa_list = "", kv_list = "f32", ref_isa;
  std::vector<std::string> path_specs;
  int n_ctx = 512, max_chunks = -1, threads = 0;

  CLI::App app{"pd-perplexity: perplexity and KL divergence of the CPU paths against the fp32 reference"};
  app.add_option("-m,--model", model_path, "GGUF model file");
  app.add_option("-f,--file", text_path, "text file to score");
  auto* ctx_opt = app.add_option("-c,--ctx", n_ctx, "tokens per chunk (the second half is scored)")
                      ->check(CLI::Range(4, 1 << 20));
  app.add_option("--chunks", max_chunks, "score at most this many chunks (-1 = all)");
  app.add_option("-t,--threads", threads, "CPU threads (0 = all cores)")->check(CLI::NonNegativeNumber);
  app.add_option("--act", act_list, "activation paths, comma-separated: int8, fp32");
  app.add_option("--isa", isa_list,
                 "kernel ISAs, comma-separated: scalar, avx2, avx512vnni, or all (every one this CPU runs); "
                 "default: the widest");
  app.add_option("--kv-dtype", kv_list, "KV cache types, comma-separated: f32, f16, q8_0");
  app.add_option("--path", path_specs, "one path (see the header of tools/pd_perplexity.cpp); replaces --act/--isa/--kv-dtype");
  app.add_option("--ref-isa", ref_isa, "ISA of the fp32 reference (default: the widest)");
  auto* save_opt = app.add_option("--save-base", save_base, "write the reference's log-probs (llama.cpp format)");
  auto* base_opt = app.add_option("--base", base_path, "read the reference's log-probs (llama.cpp format)");
  save_opt->excludes(base_opt);
  app.add_option("--json", json_path, "write the results as JSON");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(e.what(), 2);
  }

  // ---- paths
  std::vector<PathSpec> specs;
  if (!path_specs.empty()) {
    for (const std::string& s : path_specs) {
      PathSpec p;
      if (auto err = parse_path(s, &p)) return fail(*err, 2);
      specs.push_back(p);
    }
  } else {
    std::vector<std::string> isas;
    if (isa_list == "all") {
      for (const char* n : kIsaNames)
        if (isa_runs_here(n)) isas.push_back(n);
    } else if (isa_list.empty()) {
      isas.push_back("");
    } else {
      isas = split(isa_list, ',');
    }
    for (const std::string& a : split(act_list, ',')) {
      if (a != "int8" && a != "fp32") return fail("--act: unknown activation path '" + a + "' (int8, fp32)", 2);
      for (const std::string& isa : isas) {
        if (!isa.empty() && isa != "scalar" && isa != "avx2" && isa != "avx512vnni")
          return fail("--isa: unknown ISA '" + isa + "' (scalar, avx2, avx512vnni, all)", 2);
        for (const std::string& k : split(kv_list, ',')) {
          auto kv = pd::parse_kv_dtype(k, "--kv-dtype");
          if (!kv.is_ok()) return fail(kv.status().message(), 2);
          PathSpec p;
          p.int8 = a == "int8";
          p.isa = isa;
          p.kv = *kv;
          specs.push_back(p);
        }
      }
    }
  }
  if (!ref_isa.empty() && ref_isa != "scalar" && ref_isa != "avx2" && ref_isa != "avx512vnni")
    return fail("--ref-isa: unknown ISA '" + ref_isa + "' (scalar, avx2, avx512vnni)", 2);
  if (!ref_isa.empty() && !isa_runs_here(ref_isa)) return fail("--ref-isa: this CPU cannot run " + ref_isa, 2);

  // ---- model, tokens
  if (!std::filesystem::exists(model_path)) return fail("model file not found: " + model_path + " (--model)", 2);
  if (text_path.empty() && base_path.empty()) return fail("one of --file or --base is required", 2);
  auto file = pd::GgufFile::open(model_path);
  if (!file.is_ok()) return fail(file.status().to_string());
  std::shared_ptr<const pd::GgufFile> gguf(std::move(file).value());
  auto tok = pd::Tokenizer::from_gguf(*gguf);
  if (!tok.is_ok()) return fail(tok.status().to_string());

  std::vector<pd::TokenId> tokens;
  if (!text_path.empty()) {
    std::ifstream in(text_path, std::ios::binary);
    if (!in) return fail("cannot read --file '" + text_path + "'", 2);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!text.empty() && text.back() == '\n') text.pop_back();  // as llama.cpp's -f does
    tokens = (*tok)->encode(text, /*parse_special=*/false);
    if ((*tok)->add_bos() && (*tok)->bos_id() >= 0) tokens.insert(tokens.begin(), (*tok)->bos_id());
  }
  BaseFile base;
  const bool use_base = !base_path.empty();
  if (use_base) {
    if (auto err = open_base(base_path, &base)) return fail(*err, 2);
    if (ctx_opt->count() && static_cast<uint32_t>(n_ctx) != base.n_ctx)
      return fail("--ctx " + std::to_string(n_ctx) + " differs from --base file's n_ctx " + std::to_string(base.n_ctx), 2);
    n_ctx = static_cast<int>(base.n_ctx);
    if (!tokens.empty()) {
      const size_t n = std::min(tokens.size(), base.tokens.size());
      if (tokens.size() < base.tokens.size())
        return fail("--file '" + text_path + "' has " + std::to_string(tokens.size()) + " tokens, fewer than the " +
                        std::to_string(base.tokens.size()) + " of --base '" + base_path + "'",
                    2);
      for (size_t i = 0; i < n; ++i) {
        if (tokens[i] != base.tokens[i])
          return fail("--file '" + text_path + "' tokenizes differently from --base '" + base_path +
                          "' at token " + std::to_string(i) + " (" + std::to_string(tokens[i]) + " vs " +
                          std::to_string(base.tokens[i]) + ")",
                      2);
      }
    }
    tokens = base.tokens;
  }
  const int n_chunk_max = static_cast<int>(tokens.size() / n_ctx);
  if (!use_base && static_cast<int64_t>(tokens.size()) < 2 * static_cast<int64_t>(n_ctx))
    return fail("--file '" + text_path + "' has " + std::to_string(tokens.size()) + " tokens; --ctx " +
                    std::to_string(n_ctx) + " needs at least " + std::to_string(2 * n_ctx) + " (as llama-perplexity)",
                2);
  const int n_chunk = max_chunks < 0 ? n_chunk_max : std::min(max_chunks, n_chunk_max);
  if (n_chunk <= 0) return fail("--chunks must be positive", 2);
  const int first = n_ctx / 2;
  const int n_scored = n_ctx - 1 - first;

  // ---- engines
  Engine ref;
  ref.spec.int8 = false;
  ref.spec.isa = ref_isa;
  ref.spec.sgemm = true;
  if (!use_base) {
    if (auto st = load_engine(gguf, threads, n_ctx, &ref); !st.is_ok()) return fail("reference: " + st.to_string());
  }
  std::vector<Engine> engines(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    Engine& e = engines[i];
    e.spec = specs[i];
    if (!e.spec.isa.empty() && !isa_runs_here(e.spec.isa)) {
      e.skipped = "this CPU cannot run " + e.spec.isa;
      continue;
    }
    if (auto st = load_engine(gguf, threads, n_ctx, &e); !st.is_ok()) e.skipped = st.to_string();
  }
  const int n_vocab = use_base ? base.n_vocab : (*tok)->vocab_size();
  if (!use_base) {
    if (ref.model->config().vocab != n_vocab)
      return fail("the model's vocabulary (" + std::to_string(ref.model->config().vocab) +
                  ") differs from its tokenizer's (" + std::to_string(n_vocab) + ")");
  } else {
    for (Engine& e : engines)
      if (e.model && e.model->config().vocab != n_vocab)
        return fail("--base file '" + base_path + "' has a vocabulary of " + std::to_string(n_vocab) +
                        ", the model " + std::to_string(e.model->config().vocab),
                    2);
  }

  std::ofstream save;
  const bool saving = !save_base.empty();
  if (saving) {
    save.open(save_base, std::ios::binary);
    if (!save) return fail("cannot write --save-base file '" + save_base + "'", 2);
    const uint32_t ctx32 = static_cast<uint32_t>(n_ctx);
    const int32_t nv = n_vocab, nc = n_chunk;
    save.write(kBaseMagic, 8);
    save.write(reinterpret_cast<const char*>(&ctx32), 4);
    save.write(reinterpret_cast<const char*>(&nv), 4);
    save.write(reinterpret_cast<const char*>(&nc), 4);
    save.write(reinterpret_cast<const char*>(tokens.data()), static_cast<size_t>(n_ctx) * n_chunk * sizeof(pd::TokenId));
  }

  std::fprintf(stderr, "pd-perplexity: %s, %zu tokens, %d chunks of %d (%d scored each), reference: %s\n",
               text_path.empty() ? base_path.c_str() : text_path.c_str(), tokens.size(), n_chunk, n_ctx, n_scored,
               use_base ? ("--base " + base_path).c_str() : ref.backend->name().c_str());

  // ---- chunks
  const int halves = base_row_halves(n_vocab);
  Stats ref_stats;
  std::vector<Stats> stats(engines.size());
  std::vector<double> ref_lp(static_cast<size_t>(n_scored) * (use_base ? 0 : n_vocab)), scratch;
  std::vector<int> ref_top(n_scored);
  std::vector<uint16_t> base_rows(static_cast<size_t>(n_scored) * halves);
  std::vector<float> logits;
  const bool bos_first = (*tok)->add_bos() && (*tok)->bos_id() >= 0;
  const auto t_start = Clock::now();
  for (int c = 0; c < n_chunk; ++c) {
    std::vector<pd::TokenId> chunk(tokens.begin() + static_cast<int64_t>(c) * n_ctx,
                                   tokens.begin() + static_cast<int64_t>(c + 1) * n_ctx);
    if (bos_first) chunk[0] = (*tok)->bos_id();  // as llama-perplexity does
    const pd::TokenId* next = chunk.data() + first + 1;  // next[i] is predicted by row i
    if (use_base) {
      base.in.read(reinterpret_cast<char*>(base_rows.data()), base_rows.size() * sizeof(uint16_t));
      if (!base.in) return fail("--base file '" + base_path + "': truncated at chunk " + std::to_string(c));
      for (int i = 0; i < n_scored; ++i) accumulate_base_self(n_vocab, base_rows.data() + static_cast<size_t>(i) * halves, next[i], &ref_stats);
    } else {
      if (auto st = eval_chunk(ref, chunk, first, &logits); !st.is_ok()) return fail("reference: " + st.to_string());
      for (int i = 0; i < n_scored; ++i) {
        const float* row = logits.data() + static_cast<size_t>(i) * n_vocab;
        double* lp = ref_lp.data() + static_cast<size_t>(i) * n_vocab;
        ref_top[i] = log_softmax(n_vocab, row, lp);
        const double nll = -lp[next[i]];
        ref_stats.sum_nll += nll;
        ref_stats.sum_nll2 += nll * nll;
        ref_stats.kl.push_back(0.0f);
        ++ref_stats.same_top;
        ++ref_stats.count;
        if (saving) encode_base_row(n_vocab, row, base_rows.data() + static_cast<size_t>(i) * halves);
      }
      if (saving) save.write(reinterpret_cast<const char*>(base_rows.data()), base_rows.size() * sizeof(uint16_t));
    }
    for (size_t p = 0; p < engines.size(); ++p) {
      Engine& e = engines[p];
      if (!e.skipped.empty()) continue;
      if (auto st = eval_chunk(e, chunk, first, &logits); !st.is_ok()) {
        e.skipped = st.to_string();
        std::fprintf(stderr, "pd-perplexity: path %s skipped: %s\n", e.spec.label().c_str(), e.skipped.c_str());
        continue;
      }
      for (int i = 0; i < n_scored; ++i) {
        const float* row = logits.data() + static_cast<size_t>(i) * n_vocab;
        if (use_base)
          accumulate_base(n_vocab, base_rows.data() + static_cast<size_t>(i) * halves, row, next[i], &stats[p]);
        else
          accumulate_exact(n_vocab, ref_lp.data() + static_cast<size_t>(i) * n_vocab, ref_top[i], row, next[i],
                           &stats[p], &scratch);
      }
    }
    const double el = std::chrono::duration<double>(Clock::now() - t_start).count();
    std::fprintf(stderr, "[%d/%d] ref PPL %.4f | %.1f s elapsed, ~%.0f s left\n", c + 1, n_chunk, ref_stats.ppl().first,
                 el, el / (c + 1) * (n_chunk - c - 1));
  }
  if (saving) {
    save.close();
    if (!save) return fail("writing --save-base file '" + save_base + "' failed");
  }

  // ---- report
  nlohmann::json out{{"model", model_path},
                     {"text", text_path},
                     {"base", base_path},
                     {"ctx", n_ctx},
                     {"chunks", n_chunk},
                     {"scored_tokens", ref_stats.count},
                     {"kl_mode", use_base ? "base file (llama.cpp formula)" : "exact"},
                     {"paths", nlohmann::json::array()}};
  std::printf("\n%d chunks x %d tokens, %zu scored; KL(ref || path) in nats, %s\n", n_chunk, n_ctx, ref_stats.count,
              use_base ? "reference from the --base file (llama.cpp's formula)" : "exact");
  std::printf("%-40s %-18s %-22s %-10s %-10s %-16s %s\n", "path", "PPL", "mean KL", "p99 KL", "max KL", "top-1 same",
              "tok/s");
  auto row = [&](const std::string& label, const Stats& s, double secs, const std::string& backend, bool is_ref) {
    const auto [ppl, ppl_u] = s.ppl();
    const auto [kl, kl_u] = s.mean_kl();
    const auto [top, top_u] = s.top1();
    const double tps = secs > 0 ? static_cast<double>(n_chunk) * (n_ctx - 1) / secs : 0.0;
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
    out["paths"].push_back({{"path", label},
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
  };
  row(use_base ? "reference (--base file)" : "reference fp32:kv=f32", ref_stats, ref.seconds,
      use_base ? "" : ref.backend->name(), true);
  for (size_t p = 0; p < engines.size(); ++p) {
    const Engine& e = engines[p];
    if (!e.skipped.empty()) {
      std::printf("%-40s skipped: %s\n", e.spec.label().c_str(), e.skipped.c_str());
      out["paths"].push_back({{"path", e.spec.label()}, {"skipped", e.skipped}});
      continue;
    }
    row(e.spec.label(), stats[p], e.seconds, e.backend->name(), false);
  }
  if (!json_path.empty()) {
    std::ofstream j(json_path);
    if (!j) return fail("cannot write --json file '" + json_path + "'", 2);
    j << out.dump(2) << "\n";
  }
  return 0;
}
