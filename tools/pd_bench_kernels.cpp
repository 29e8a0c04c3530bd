// pd-bench-kernels: the CPU backend's integer matmul kernels alone, on one
// thread, over a model's own weights: each matrix of the first layer and the
// LM head, packed as the backend packs them, against quantized random
// activations of 1 to 32 tokens. Two variants run alternately in one process
// on the same bytes: the 8-row kernels (a gemm_group call per packed group)
// and the 16-row path (gemm_group_pair over consecutive groups, as the
// backend runs them; where the ISA has no 16-row kernel it is the same two
// calls). Each row gives the median time per call over the whole matrix, the
// rate in multiply-adds per second, and 16-row ÷ 8-row; the two outputs must
// be the same bits (exit status 1 otherwise).
//
//   pd-bench-kernels [-m MODEL] [--tokens 1,4,8,32] [--reps 7] [--cold]
//
// PD_CPU_ISA=avx2|scalar runs another ISA's kernels (q8_kernels.h).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/q8_kernels.h"
#include "gguf/ggml_types.h"
#include "gguf/gguf_reader.h"
#include "tool_common.h"

namespace {

using pd::cpu::BlockQ8A;
using pd::tools::Clock;

struct Flags {
  std::string model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::vector<int> tokens = {1, 4, 8, 32};
  int reps = 7;
  bool cold = false;
};

// Evicts the caches (writes and reads a buffer of 3x a large L3), so that the
// next call reads its weights from memory, as a decode step of a model larger
// than the caches does.
void evict_caches() {
  static std::vector<uint8_t> junk(96u << 20);
  static uint8_t round = 0;
  ++round;
  for (size_t i = 0; i < junk.size(); i += 64) junk[i] = static_cast<uint8_t>(junk[i] + round);
}

// One matrix packed as the backend packs it.
struct Packed {
  std::string name;
  pd::GgmlType type;
  pd::cpu::PackedFormat format;
  int64_t k, n;
  std::vector<uint8_t> bytes;
};

// The first layer's matrices and the LM head (the output matrix, else the
// tied embedding), where their type packs.
std::vector<Packed> pack_model(const pd::GgufFile& file) {
  std::vector<Packed> out;
  const bool tied = file.find_tensor("output.weight") == nullptr;
  for (const pd::GgufTensorInfo& t : file.tensors()) {
    const bool head = t.name == (tied ? "token_embd.weight" : "output.weight");
    if ((t.name.rfind("blk.0.", 0) != 0 && !head) || t.ne.size() != 2) continue;
    const pd::cpu::PackedFormat f = pd::cpu::packed_format_for(t.type);
    if (f == pd::cpu::PackedFormat::kNone) continue;
    Packed p{t.name, t.type, f, t.ne[0], t.ne[1], {}};
    p.bytes.resize(pd::cpu::packed_bytes(f, p.n, p.k));
    if (!pd::cpu::pack_rows(t.type, t.data, p.n, p.k, p.bytes.data())) continue;
    out.push_back(std::move(p));
  }
  return out;
}

// One call over the whole matrix: groups one at a time, or in pairs.
void run_matrix(const pd::cpu::Kernels& kern, const Packed& w, const BlockQ8A* x, const BlockQ8A* xo, int m,
                bool pairs, float* out) {
  const int64_t nb = w.k / pd::cpu::kQBlock, groups = (w.n + 7) / 8, ld = groups * 8;
  const size_t gb = pd::cpu::packed_group_bytes(w.format, w.k);
  for (int64_t g = 0; g < groups;) {
    const uint8_t* group = w.bytes.data() + g * gb;
    if (pairs && g + 1 < groups) {
      pd::cpu::gemm_group_pair(kern, w.format, group, nb, x, m, out + g * 8, ld, xo);
      g += 2;
    } else {
      pd::cpu::gemm_group(kern, w.format, group, nb, x, m, out + g * 8, ld, xo);
      g += 1;
    }
  }
}

// Returns false when the two variants' outputs differ.
bool bench_matrix(const pd::cpu::Kernels& kern, const Packed& w, int m, int reps, bool cold) {
  const int64_t nb = w.k / pd::cpu::kQBlock, ld = (w.n + 7) / 8 * 8;
  std::mt19937 rng(static_cast<uint32_t>(m * 7919 + w.k));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(m * w.k);
  for (float& v : x) v = normal(rng);
  std::vector<BlockQ8A> xq(m * nb), xo;
  kern.quantize_rows(x.data(), w.k, w.k, m, xq.data());
  if (pd::cpu::uses_offset_activations(kern, w.format)) {
    xo.resize(xq.size());
    pd::cpu::offset_activations(xq.data(), static_cast<int64_t>(xq.size()), xo.data());
  }
  std::vector<float> out8(m * ld), out16(m * ld);
  std::vector<double> t8, t16;
  for (int r = 0; r < reps + 1; ++r) {  // the first of each is a warm-up
    for (bool pairs : {false, true}) {
      if (cold) evict_caches();
      const auto t0 = Clock::now();
      run_matrix(kern, w, xq.data(), xo.empty() ? nullptr : xo.data(), m, pairs, pairs ? out16.data() : out8.data());
      if (r > 0) (pairs ? t16 : t8).push_back(pd::tools::seconds(Clock::now() - t0));
    }
  }
  const double s8 = pd::tools::median(t8), s16 = pd::tools::median(t16);
  const double macs = static_cast<double>(w.k) * static_cast<double>(w.n) * m;
  const bool same = std::memcmp(out8.data(), out16.data(), out8.size() * sizeof(float)) == 0;
  std::printf("%-24s %-5s %6lld x %-6lld %4d  %9.1f %7.1f  %9.1f %7.1f   %5.2f  %s\n", w.name.c_str(),
              pd::ggml_type_name(w.type), static_cast<long long>(w.n), static_cast<long long>(w.k), m, s8 * 1e6,
              macs / s8 / 1e9, s16 * 1e6, macs / s16 / 1e9, s8 / s16, same ? "same bits" : "DIFFERENT");
  return same;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"pd-bench-kernels: the integer matmul kernels alone, 8-row against 16-row, one thread"};
  app.add_option("-m,--model", f.model_path, "GGUF model (default: the default model)");
  app.add_option("--tokens", f.tokens, "comma-separated activation rows per call (1-64)")
      ->delimiter(',')
      ->check(CLI::Range(1, 64));
  app.add_option("--reps", f.reps, "timed calls per variant (median)")->check(CLI::Range(1, 1000));
  app.add_flag("--cold", f.cold, "evict the caches before every call (weights read from memory)");
  if (auto code = pd::tools::parse_command_line(app, argc, argv, "pd-bench-kernels")) return *code;
  pd::tools::ToolError err;
  const auto file = pd::tools::open_model_file(f.model_path, /*refusal_is_usage=*/true, &err);
  if (file == nullptr) return pd::tools::report_error("pd-bench-kernels", err.message, err.exit_code);
  const std::vector<Packed> ws = pack_model(*file);
  if (ws.empty())
    return pd::tools::report_error("pd-bench-kernels", "no matrix of blk.0 or the LM head packs in " + f.model_path,
                                   pd::tools::kExitUsage);
  const pd::cpu::Isa isa = pd::cpu::best_isa();
  const pd::cpu::Kernels& kern = pd::cpu::kernels(isa);
  std::printf("# %s | kernels %s | 1 thread | median of %d calls per variant, alternated\n", f.model_path.c_str(),
              pd::cpu::isa_name(isa), f.reps);
  if (pd::cpu::isa_built_with_avx512(isa)) std::printf("%s", pd::tools::kWideNarrowIsaNote);
  std::printf("%-24s %-5s %15s %4s  %17s  %17s   %5s\n", "matrix", "type", "rows x k", "tok", "8-row us  GMAC/s",
              "16-row us  GMAC/s", "ratio");
  bool same = true;
  for (int m : f.tokens)
    for (const Packed& w : ws) same = bench_matrix(kern, w, m, f.reps, f.cold) && same;
  return same ? 0 : 1;
}
