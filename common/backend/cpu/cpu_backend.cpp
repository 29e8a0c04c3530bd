#include "backend/cpu/cpu_backend.h"

#include <cblas.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "backend/cpu/cpu_kernels.h"
#include "backend/cpu/q8_kernels.h"
#include "gguf/gguf_reader.h"

namespace pd {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// Host memory, 64-byte aligned. Allocations of a huge page or more are
// huge-page aligned and marked MADV_HUGEPAGE: weights and the KV pool are
// streamed every step, and with 4 KiB pages (worse under a hypervisor's
// nested paging) TLB misses cost more than the arithmetic.
class HostBuffer final : public BackendBuffer {
 public:
  explicit HostBuffer(size_t bytes) : size_(bytes) {
    if (bytes >= kHugePage) {
      const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
      data_ = std::aligned_alloc(kHugePage, rounded);
      if (data_) madvise(data_, rounded, MADV_HUGEPAGE);  // a hint: fails harmlessly without THP
    } else {
      const size_t rounded = (bytes + 63) / 64 * 64;
      data_ = rounded ? std::aligned_alloc(64, rounded) : nullptr;
    }
  }
  ~HostBuffer() override { std::free(data_); }
  void* data() override { return data_; }
  size_t size() const override { return size_; }
  bool ok() const { return data_ != nullptr || size_ == 0; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// Repacked weights live in shared huge-page arenas (most matrices are well
// under 2 MiB, so one allocation each would defeat the huge pages); each
// weight's buffer keeps its arena alive.
class ArenaSlice final : public BackendBuffer {
 public:
  ArenaSlice(std::shared_ptr<HostBuffer> arena, size_t offset, size_t bytes)
      : arena_(std::move(arena)), offset_(offset), size_(bytes) {}
  void* data() override { return static_cast<uint8_t*>(arena_->data()) + offset_; }
  size_t size() const override { return size_; }

 private:
  std::shared_ptr<HostBuffer> arena_;
  size_t offset_, size_;
};

// Asks the kernel to drop the resident pages of [p, p + bytes) — the GGUF
// mapping of a weight that now lives repacked — so they stop counting in RSS.
// MADV_PAGEOUT never changes contents (pages are read back on access), so it
// is safe on a file mapping and on GgufFile::from_bytes memory alike; where
// the kernel lacks it, the call fails and nothing happens.
void release_pages(const void* p, size_t bytes) {
#ifdef MADV_PAGEOUT
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_PAGEOUT);
#else
  (void)p, (void)bytes;
#endif
}

const float* f32(const Tensor& t) { return static_cast<const float*>(t.data); }
float* f32(Tensor& t) { return static_cast<float*>(t.data); }

Status expect_f32(const Tensor& t, const char* op, const char* arg) {
  if (t.type != GgmlType::kF32)
    return Status::invalid_argument(std::string(op) + ": " + arg + " must be F32, got " + ggml_type_name(t.type));
  return Status::ok();
}

// ---- KV cache rows of f16 / q8_0 elements, read back as fp32.
// Both conversions are exact (an fp16 widens exactly; a q8_0 element is an
// fp16 scale times an int8, a product of 11 and 8 significant bits), so the
// F16C path and the scalar one give the same floats and attention results do
// not depend on the instruction set.

void kv_rows_to_f32_scalar(GgmlType dtype, const uint8_t* src, int n, int64_t hd, float* dst) {
  const size_t row = ggml_row_bytes(dtype, hd);
  for (int r = 0; r < n; ++r) dequantize_row(dtype, src + r * row, dst + r * hd, hd);
}

#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) void kv_rows_to_f32_f16c(GgmlType dtype, const uint8_t* src, int n, int64_t hd,
                                                               float* dst) {
  const int64_t count = n * hd;  // rows are contiguous in both layouts
  if (dtype == GgmlType::kF16) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
    for (; i < count; ++i) dst[i] = fp16_to_fp32(h[i]);
    return;
  }
  // Q8_0: count / 32 blocks of {fp16 d, int8 qs[32]}.
  const BlockQ8_0* b = reinterpret_cast<const BlockQ8_0*>(src);
  for (int64_t blk = 0; blk < count / 32; ++blk, dst += 32) {
    const __m256 d = _mm256_set1_ps(fp16_to_fp32(b[blk].d));
    for (int j = 0; j < 32; j += 8) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b[blk].qs + j));
      _mm256_storeu_ps(dst + j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8))));
    }
  }
}
#endif

// dst = n rows of hd elements of `dtype` at src, as floats.
void kv_rows_to_f32(GgmlType dtype, bool f16c, const uint8_t* src, int n, int64_t hd, float* dst) {
#if defined(__x86_64__)
  if (f16c) return kv_rows_to_f32_f16c(dtype, src, n, hd, dst);
#endif
  (void)f16c;
  kv_rows_to_f32_scalar(dtype, src, n, hd, dst);
}

// The reverse for f16 rows (kv_write): n floats to fp16, rounded to nearest
// even as fp32_to_fp16 (ggml's reference) does, with F16C where `f16c`; a NaN
// lane goes through fp32_to_fp16 too (its quiet NaN, where F16C would keep
// the payload), so the bytes are the same on every path.
#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) void f32_to_f16_row_f16c(const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0)
      for (int64_t j = i; j < i + 8; ++j) dst[j] = fp32_to_fp16(src[j]);
  }
  for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}
#endif

// One K or V row of hd floats into the cache's element type.
void kv_row_from_f32(GgmlType dtype, bool f16c, const float* src, int64_t hd, uint8_t* dst) {
  if (dtype == GgmlType::kF32) {
    std::memcpy(dst, src, static_cast<size_t>(hd) * sizeof(float));
    return;
  }
#if defined(__x86_64__)
  if (f16c && dtype == GgmlType::kF16) return f32_to_f16_row_f16c(src, hd, reinterpret_cast<uint16_t*>(dst));
#endif
  (void)f16c;
  quantize_row(dtype, src, dst, hd);  // ggml's reference rounding: the same bytes on every CPU
}

Status check_kv_layout(const KvCacheLayout& L) {
  if (L.dtype != GgmlType::kF32 && L.dtype != GgmlType::kF16 && L.dtype != GgmlType::kQ8_0)
    return Status::unsupported(std::string("cpu: KV cache type ") + ggml_type_name(L.dtype) + " (f32, f16 or q8_0)");
  if (L.dtype == GgmlType::kQ8_0 && L.head_dim % 32 != 0)
    return Status::invalid_argument("cpu: a q8_0 KV cache needs head_dim a multiple of 32");
  return Status::ok();
}

// Blocked causal attention over the paged cache ("flash" attention: no score
// matrix, an online softmax). A work item is a tile of query rows — up to
// kTileRows (token, head) pairs of consecutive tokens of one sequence whose
// heads share one kv head — and walks the keys in fixed windows of
// kKeyWindow positions ([0, 64), [64, 128), ...). Each window's K and V rows
// are found in their blocks (read in place by small tiles, widened to fp32
// once by large ones: kInPlaceKvRows), then every row's scores, softmax step
// and value sums run through the kernels' row-blocked loops.
//
// Batch invariance: the windows are the same for every row whatever tile it
// is in (a decode token alone, a prefill chunk, a long prompt), a row stops at
// its own position, and the kernels give each row the same operations
// whatever the other rows are; so a token's output does not depend on what
// it is computed with.
//
// Sliding-window attention (AttentionTile::window > 0): a row's keys start at
// its own first position lo = position - window + 1. Windows wholly before a
// row's lo count as empty for it (the softmax and sums are left unchanged:
// c = 1); in the window holding its lo it runs alone, on the scores and value
// rows from lo on; later windows as above. Scores do not depend on which keys
// are scored with them, so this is still per-row arithmetic that no other row
// changes; the tile's walk starts at the window holding the smallest lo of
// its rows, so blocks before every row's window are never read.
constexpr int64_t kKeyWindow = 64;
constexpr int kTileRows = 48;
// Tiles of up to this many query rows (a decode token's heads) read f16 and
// q8_0 K/V rows where they lie in the cache: the kernels widen each row in
// registers, once per pass of kQkRows / kPvRows rows. Larger tiles (prefill)
// widen each window once into scratch and pass the fp32 copies. The widening
// is exact, so both give the same bits.
constexpr int kInPlaceKvRows = 8;

struct AttentionTile {
  const float* q;         // row (token u, head h) at q + u * tok_stride + h * hd
  float* out;             // the same layout
  int64_t tok_stride;
  std::span<const AttentionToken> tokens;  // consecutive tokens of one sequence
  int nq;                 // heads per token in this tile (sharing kv_head)
  int64_t hd;
  const uint8_t* base;
  const KvCacheLayout* L;
  int layer;
  int64_t kv_head;
  std::span<const int32_t> table;
  float scale;
  bool f16c;              // convert f16/q8_0 rows with F16C/AVX2
  int window;             // > 0: each row attends to its last `window` positions only
};

// One thread's scratch for attend_tile: grow-only, sized by reserve() for the
// largest tile of a call before its parallel loop, so what a thread allocates
// does not depend on which tiles the dynamic schedule hands it.
struct AttentionScratch {
  std::vector<float> q, acc, s, k, v, m, l, c;  // k, v: a window's rows widened (large tiles)
  std::vector<const void*> k_rows, v_rows;      // a window's row pointers
  std::vector<int> n_ctx, n_valid, lo;

  void reserve(int64_t rows, int64_t hd) {
    const auto fit = [](auto& v, int64_t n) {
      if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
    };
    fit(q, rows * hd), fit(acc, rows * hd), fit(s, rows * kKeyWindow);
    fit(k, kKeyWindow * hd), fit(v, kKeyWindow * hd), fit(k_rows, kKeyWindow), fit(v_rows, kKeyWindow);
    fit(m, rows), fit(l, rows), fit(c, rows), fit(n_ctx, rows), fit(n_valid, rows), fit(lo, rows);
  }
};

// fn(src, i, seg) for each run of rows [p0, p0 + n) of one kv head's K (kind
// 0) or V (kind 1) that lies in one block: rows p0 + i ... p0 + i + seg - 1,
// contiguous at src.
template <typename Fn>
void for_each_run(const AttentionTile& a, int kind, int64_t p0, int64_t n, Fn&& fn) {
  const KvCacheLayout& L = *a.L;
  const int64_t bs = L.block_size;
  for (int64_t p = p0; p < p0 + n;) {
    const int64_t off = p % bs, seg = std::min(bs - off, p0 + n - p);
    fn(a.base + L.offset(a.layer, kind, a.table[p / bs]) + (a.kv_head * bs + off) * L.row_bytes(), p - p0, seg);
    p += seg;
  }
}

// Rows [p0, p0 + n) of K (kind 0) or V (kind 1) as row pointers for the
// kernels: into the cache itself (its own element type), or, given `widened`
// (room for n rows), to copies converted to fp32 there.
cpu::KvRows window_rows(const AttentionTile& a, int kind, int64_t p0, int64_t n, const void** rows, float* widened) {
  const KvCacheLayout& L = *a.L;
  const size_t row = L.row_bytes();
  for_each_run(a, kind, p0, n, [&](const uint8_t* src, int64_t i0, int64_t seg) {
    if (widened) {
      float* d = widened + i0 * a.hd;
      kv_rows_to_f32(L.dtype, a.f16c, src, static_cast<int>(seg), a.hd, d);
      for (int64_t i = 0; i < seg; ++i) rows[i0 + i] = d + i * a.hd;
    } else {
      for (int64_t i = 0; i < seg; ++i) rows[i0 + i] = src + i * row;
    }
  });
  return {rows, widened ? GgmlType::kF32 : L.dtype};
}

// Asks for rows [p0, p0 + n) of the tile's K (kind 0) or V (kind 1) into L2
// (prefetcht1). A window's rows lie in runs of at most block_size rows, one
// per block, too short for the hardware prefetchers to pick up. attend_tile
// asks for the next window's K as a window starts and for its V before the
// value sums, one window ahead each. Without them, reading the rows in place
// was slower than widening them first; with them, a decode step's attention
// over a KV cache in DRAM runs 1.35-2.2x faster than the widening copy did
// (docs/BENCHMARKS.md). Asking for K and V together (one burst of twice the
// misses) gained less, into L1 (prefetcht0) nothing.
void prefetch_rows(const AttentionTile& a, int kind, int64_t p0, int64_t n) {
  const size_t row = a.L->row_bytes();
  for_each_run(a, kind, p0, n, [&](const uint8_t* src, int64_t, int64_t seg) {
    for (size_t o = 0; o < static_cast<size_t>(seg) * row; o += 64) __builtin_prefetch(src + o, 0, 2);
  });
}

// The key positions a tile reads: [first, end), first on a window boundary
// (the window holding its rows' smallest lo).
struct KeySpan {
  int64_t first, end;
};
KeySpan key_span(const AttentionTile& a) {
  int64_t end = 0, min_lo = std::numeric_limits<int64_t>::max();
  for (const AttentionToken& t : a.tokens) {
    end = std::max<int64_t>(end, t.position + 1);
    min_lo = std::min<int64_t>(min_lo, a.window > 0 ? std::max(0, t.position - a.window + 1) : 0);
  }
  return {min_lo / kKeyWindow * kKeyWindow, end};
}

// `w` holds at least the tile's rows (AttentionScratch::reserve). `next`, if
// given, is a small (decode) tile this thread most likely runs next: as this
// tile starts each window, one window of next's K and V is asked for too, so
// that next's first windows do not wait on memory. A decode tile computes a
// window in well under the time its rows take to arrive, and its own
// prefetches run only one window ahead. Measured in one process, alternating
// per call (docs/BENCHMARKS.md): next's first window asked for before the
// tile made attention 12% faster than nothing, its first four 2-4% more, and
// one window per window of this tile 3-5% more again; a burst much larger
// than the core's miss buffers mostly does not arrive.
void attend_tile(const cpu::Kernels& kern, const AttentionTile& a, AttentionScratch& w,
                 const AttentionTile* next = nullptr) {
  const int nt = static_cast<int>(a.tokens.size());
  const int nr = nt * a.nq;
  const int64_t hd = a.hd;
  for (int u = 0; u < nt; ++u) {
    std::memcpy(&w.q[u * a.nq * hd], a.q + u * a.tok_stride, static_cast<size_t>(a.nq * hd) * sizeof(float));
    const int32_t pos = a.tokens[u].position;
    const int lo = a.window > 0 ? std::max(0, pos - a.window + 1) : 0;
    for (int h = 0; h < a.nq; ++h) w.n_ctx[u * a.nq + h] = pos + 1, w.lo[u * a.nq + h] = lo;
  }
  std::fill_n(w.m.begin(), nr, -std::numeric_limits<float>::infinity());
  std::fill_n(w.l.begin(), nr, 0.0f);
  std::fill_n(w.acc.begin(), nr * hd, 0.0f);
  const bool widen = a.L->dtype != GgmlType::kF32 && nr > kInPlaceKvRows;
  const auto [first_window, max_ctx] = key_span(a);
  for (int kind = 0; kind < 2; ++kind)
    prefetch_rows(a, kind, first_window, std::min(kKeyWindow, max_ctx - first_window));
  const KeySpan next_keys = next != nullptr ? key_span(*next) : KeySpan{0, 0};
  for (int64_t p0 = first_window, next_p0 = next_keys.first; p0 < max_ctx; p0 += kKeyWindow, next_p0 += kKeyWindow) {
    const int n_in = static_cast<int>(std::min(kKeyWindow, max_ctx - p0));
    const int64_t n_next = std::min(kKeyWindow, max_ctx - p0 - kKeyWindow);  // <= 0 in the last window
    if (n_next > 0) prefetch_rows(a, 0, p0 + kKeyWindow, n_next);
    if (next_p0 < next_keys.end)
      for (int kind = 0; kind < 2; ++kind)
        prefetch_rows(*next, kind, next_p0, std::min(kKeyWindow, next_keys.end - next_p0));
    const cpu::KvRows K = window_rows(a, 0, p0, n_in, w.k_rows.data(), widen ? w.k.data() : nullptr);
    const cpu::KvRows V = window_rows(a, 1, p0, n_in, w.v_rows.data(), widen ? w.v.data() : nullptr);
    kern.qk_scores(w.q.data(), hd, nr, K, hd, n_in, a.scale, w.s.data(), kKeyWindow);
    // Rows whose keys start inside this window (lo > p0) take no part in the
    // shared pass (0 valid keys: left as they are) and run alone below.
    bool starts_inside = false;
    for (int i = 0; i < nr; ++i) {
      const bool inside = w.lo[i] > p0;
      starts_inside = starts_inside || inside;
      w.n_valid[i] = inside ? 0 : static_cast<int>(std::clamp<int64_t>(w.n_ctx[i] - p0, 0, n_in));
    }
    kern.softmax_step(w.s.data(), kKeyWindow, nr, w.n_valid.data(), w.m.data(), w.l.data(), w.c.data());
    if (n_next > 0) prefetch_rows(a, 1, p0 + kKeyWindow, n_next);
    kern.pv_accumulate(w.s.data(), kKeyWindow, nr, w.n_valid.data(), w.c.data(), V, hd, w.acc.data(), hd);
    if (!starts_inside) continue;
    for (int i = 0; i < nr; ++i) {
      const int64_t first = w.lo[i] - p0;
      if (first <= 0 || first >= n_in) continue;  // shared above, or starts in a later window
      int n = static_cast<int>(std::clamp<int64_t>(w.n_ctx[i] - p0, 0, n_in) - first);
      if (n <= 0) continue;
      float* si = w.s.data() + i * kKeyWindow + first;
      kern.softmax_step(si, kKeyWindow, 1, &n, &w.m[i], &w.l[i], &w.c[i]);
      const cpu::KvRows tail{V.rows + first, V.type};
      kern.pv_accumulate(si, kKeyWindow, 1, &n, &w.c[i], tail, hd, w.acc.data() + i * hd, hd);
    }
  }
  for (int u = 0; u < nt; ++u) {
    for (int h = 0; h < a.nq; ++h) {
      const int i = u * a.nq + h;
      const float inv_l = 1.0f / w.l[i];
      float* o = a.out + u * a.tok_stride + h * hd;
      for (int64_t j = 0; j < hd; ++j) o[j] = w.acc[i * hd + j] * inv_l;
    }
  }
}

// The largest of v[0, n) (SSE where the target has it: the LM head's rows are
// scanned once per token).
float largest_of(const float* v, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(__SSE2__)
  __m128 a = _mm_set1_ps(best), b = a;
  for (; j + 8 <= n; j += 8) a = _mm_max_ps(a, _mm_loadu_ps(v + j)), b = _mm_max_ps(b, _mm_loadu_ps(v + j + 4));
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(a, b));
  best = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
#endif
  for (; j < n; ++j) best = std::max(best, v[j]);
  return best;
}

// PD_CPU_LM_HEAD_MARGIN, a comparison knob (like PD_CPU_INT8X2): a number
// >= 0 replaces `margin`; anything else is reported on stderr and ignored.
float lm_head_margin_from_env(float margin) {
  const char* env = std::getenv("PD_CPU_LM_HEAD_MARGIN");
  if (env == nullptr) return margin;
  char* end = nullptr;
  const float v = std::strtof(env, &end);
  if (end != env && *end == '\0' && v >= 0.0f) return v;
  std::fprintf(stderr, "cpu backend: PD_CPU_LM_HEAD_MARGIN='%s' is not a number >= 0; keeping %g\n", env,
               static_cast<double>(margin));
  return margin;
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuBackendConfig& cfg) : cfg_(cfg) {
    n_threads_ = cfg.n_threads > 0 ? cfg.n_threads : omp_get_num_procs();
    isa_ = cpu::best_isa();
    for (cpu::Isa isa : cpu::kAllIsas)
      if (cfg.isa == cpu::isa_name(isa) && cpu::isa_supported(isa)) isa_ = isa;
    // PD_CPU_INT8X2=none|KIND+KIND overrides the two-pass kinds (for
    // comparisons, like PD_CPU_ISA; kinds qkv, attn_out, gate_up, down, lm_head, all).
    if (const char* env = std::getenv("PD_CPU_INT8X2")) {
      cfg_.int8x2_matmul_kinds = 0;
      std::string list(env);
      for (size_t at = 0; at <= list.size();) {
        const size_t end = std::min(list.find('+', at), list.size());
        const std::string k = list.substr(at, end - at);
        if (k == "qkv") cfg_.int8x2_matmul_kinds |= kMatmulQkv;
        if (k == "attn_out") cfg_.int8x2_matmul_kinds |= kMatmulAttnOut;
        if (k == "gate_up") cfg_.int8x2_matmul_kinds |= kMatmulGateUp;
        if (k == "down") cfg_.int8x2_matmul_kinds |= kMatmulDown;
        if (k == "lm_head") cfg_.int8x2_matmul_kinds |= kMatmulLmHead;
        if (k == "all") cfg_.int8x2_matmul_kinds |= 0x1f;
        at = end + 1;
      }
    }
    cfg_.lm_head_two_pass_margin = lm_head_margin_from_env(cfg_.lm_head_two_pass_margin);
    // We split GEMMs across our own threads; each sgemm call runs on one.
    openblas_set_num_threads(1);
  }

  std::string name() const override { return std::string("cpu-") + cpu::isa_name(isa_); }

  Result<std::unique_ptr<BackendBuffer>> alloc(size_t bytes) override {
    auto buf = std::make_unique<HostBuffer>(bytes);
    if (!buf->ok()) return Status::resource_exhausted("cpu: cannot allocate " + std::to_string(bytes) + " bytes");
    return std::unique_ptr<BackendBuffer>(std::move(buf));
  }

  Result<Tensor> load_weight(const GgufTensorInfo& info, std::unique_ptr<BackendBuffer>* storage) override {
    if (info.ne.empty() || info.ne.size() > 4)
      return Status::invalid_argument("cpu: tensor '" + info.name + "' has unsupported rank");
    Tensor t;
    t.type = info.type;
    for (size_t i = 0; i < info.ne.size(); ++i) t.ne[i] = info.ne[i];
    t.data = const_cast<uint8_t*>(info.data);  // read-only use; the mapping is PROT_READ
    if (storage) storage->reset();
    // Quantized matrices are repacked for the integer kernels (q8_kernels.h);
    // the file's pages are then released, so memory holds one copy.
    const cpu::PackedFormat f = cpu::packed_format_for(info.type);
    if (!cfg_.int8_activations || f == cpu::PackedFormat::kNone || !storage || t.ne[2] != 1 || t.ne[3] != 1 ||
        t.ne[0] % cpu::kQBlock != 0)
      return t;
    const size_t bytes = (cpu::packed_bytes(f, t.ne[1], t.ne[0]) + 63) / 64 * 64;
    if (!arena_ || arena_used_ + bytes > arena_->size()) {
      arena_ = std::make_shared<HostBuffer>(std::max(bytes, kArenaBytes));
      arena_used_ = 0;
      if (!arena_->ok()) {
        arena_.reset();
        return Status::resource_exhausted("cpu: cannot allocate " + std::to_string(bytes) + " bytes");
      }
    }
    auto buf = std::make_unique<ArenaSlice>(arena_, arena_used_, bytes);
    if (!cpu::pack_rows(info.type, info.data, t.ne[1], t.ne[0], buf->data())) return t;  // kept as in the file
    arena_used_ += bytes;
    release_pages(info.data, info.nbytes);
    t.data = buf->data();
    packed_weights_.push_back(PackedWeight{t.data, mode_for(info.name)});
    t.layout = static_cast<uint8_t>(f);
    *storage = std::move(buf);
    return t;
  }

  Status copy_to_host(const Tensor& src, void* dst, size_t bytes) override {
    if (src.layout != 0) return Status::unsupported("cpu: copy_to_host of a repacked weight");
    if (bytes > src.n_bytes()) return Status::invalid_argument("cpu: copy_to_host past end of tensor");
    std::memcpy(dst, src.data, bytes);
    return Status::ok();
  }
  Status copy_from_host(const void* src, Tensor& dst, size_t bytes) override {
    if (bytes > dst.n_bytes()) return Status::invalid_argument("cpu: copy_from_host past end of tensor");
    std::memcpy(dst.data, src, bytes);
    return Status::ok();
  }
  Status synchronize() override { return Status::ok(); }

  Status get_rows(const Tensor& table, std::span<const int32_t> ids, Tensor& out) override {
    PD_RETURN_IF_ERROR(expect_f32(out, "get_rows", "out"));
    const int64_t d = table.ne[0];
    if (out.ne[0] != d || out.n_rows() < static_cast<int64_t>(ids.size()))
      return Status::invalid_argument("get_rows: out shape mismatch");
    const size_t row_bytes = table.row_bytes();
    const uint8_t* base = static_cast<const uint8_t*>(table.data);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= table.n_rows())
        return Status::invalid_argument("get_rows: row id " + std::to_string(ids[i]) + " out of range [0, " +
                                        std::to_string(table.n_rows()) + ")");
    }
    const int64_t n = static_cast<int64_t>(ids.size());
    const auto packed = static_cast<cpu::PackedFormat>(table.layout);
    for_each(n > 4, n, [&](int64_t i) {
      if (packed != cpu::PackedFormat::kNone)
        cpu::unpack_row(packed, table.data, d, ids[i], f32(out) + i * d);
      else
        cpu::dequant_row(table.type, base + static_cast<size_t>(ids[i]) * row_bytes, d, f32(out) + i * d);
    });
    return Status::ok();
  }

  // fn(i) for i in [0, n): split over the threads when `parallel`, else on
  // the calling thread without entering OpenMP at all. A parallel region whose
  // `if` clause is false still builds a team: 0.5-0.9 us a call, about 4% of
  // a batch-1 decode step with its eight small ops a layer (docs/BENCHMARKS.md).
  template <typename Fn>
  void for_each(bool parallel, int64_t n, Fn&& fn) {
    if (!parallel) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
#pragma omp parallel for num_threads(n_threads_) schedule(static)
    for (int64_t i = 0; i < n; ++i) fn(i);
  }

  Status rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override {
    PD_RETURN_IF_ERROR(expect_f32(x, "rms_norm", "x"));
    PD_RETURN_IF_ERROR(expect_f32(w, "rms_norm", "w"));
    const int64_t d = x.ne[0], n = x.n_rows();
    if (w.ne[0] != d || out.ne[0] != d || out.n_rows() < n) return Status::invalid_argument("rms_norm: shape mismatch");
    const float* xs = f32(x);
    const float* ws = f32(w);
    float* os = f32(out);
    for_each(n > 8, n, [&](int64_t i) {
      const float* xi = xs + i * d;
      float* oi = os + i * d;
      // Eight sums of squares (element j into sum j % 8), added in a fixed
      // tree: the same bits on every ISA and batch, and eight independent
      // chains where one serial chain of d double adds was 2% of a batch-32
      // decode step.
      double part[8] = {};
      int64_t j = 0;
      for (; j + 8 <= d; j += 8)
        for (int r = 0; r < 8; ++r) part[r] += static_cast<double>(xi[j + r]) * xi[j + r];
      for (; j < d; ++j) part[j % 8] += static_cast<double>(xi[j]) * xi[j];
      const double ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
      for (int64_t j = 0; j < d; ++j) oi[j] = xi[j] * scale * ws[j];
    });
    return Status::ok();
  }

  static Status check_matmul(const Tensor& x, const Tensor& w, const Tensor& out) {
    PD_RETURN_IF_ERROR(expect_f32(x, "matmul", "x"));
    PD_RETURN_IF_ERROR(expect_f32(out, "matmul", "out"));
    const int64_t k = w.ne[0], n = w.n_rows(), m = x.n_rows();
    if (x.ne[0] != k || out.ne[0] != n || out.n_rows() < m)
      return Status::invalid_argument("matmul: shape mismatch (x [" + std::to_string(x.ne[0]) + ", " +
                                      std::to_string(m) + "], w [" + std::to_string(k) + ", " +
                                      std::to_string(n) + "], out [" + std::to_string(out.ne[0]) + "])");
    if (k % cpu::block_elems(w.type) != 0) return Status::invalid_argument("matmul: k not a multiple of the block size");
    return Status::ok();
  }

  Status matmul_multi(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> outs) override {
    if (ws.size() != outs.size() || ws.size() > kMaxMulti)
      return Status::invalid_argument("matmul_multi: weight and output counts differ or exceed " +
                                      std::to_string(kMaxMulti));
    bool all_packed = true;
    for (size_t i = 0; i < ws.size(); ++i) {
      PD_RETURN_IF_ERROR(check_matmul(x, *ws[i], *outs[i]));
      all_packed = all_packed && ws[i]->layout != 0;
    }
    if (!all_packed) return Backend::matmul_multi(x, ws, outs);
    return matmul_packed(x, ws, outs);
  }

  Status matmul(const Tensor& x, const Tensor& w, Tensor& out) override {
    PD_RETURN_IF_ERROR(check_matmul(x, w, out));
    if (w.layout != 0) {
      const Tensor* wp = &w;
      Tensor* op = &out;
      return matmul_packed(x, std::span<const Tensor* const>(&wp, 1), std::span<Tensor* const>(&op, 1));
    }
    const int64_t k = w.ne[0], n = w.n_rows(), m = x.n_rows();
    const float* xs = f32(x);
    float* os = f32(out);
    const uint8_t* wb = static_cast<const uint8_t*>(w.data);
    const size_t w_row_bytes = w.row_bytes();

    if (!cfg_.batch_invariant && m >= cfg_.gemm_min_rows) {
      // Panels of kPanel weight rows: dequantize once, then one sgemm per panel.
      constexpr int64_t kPanel = 64;
      const int64_t n_panels = (n + kPanel - 1) / kPanel;
      if (static_cast<int>(panel_bufs_.size()) < n_threads_) panel_bufs_.resize(n_threads_);
#pragma omp parallel num_threads(n_threads_)
      {
        std::vector<float>& panel = panel_bufs_[omp_get_thread_num()];
        if (panel.size() < static_cast<size_t>(kPanel * k)) panel.resize(kPanel * k);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < n_panels; ++p) {
          const int64_t j0 = p * kPanel;
          const int64_t rows = std::min(kPanel, n - j0);
          for (int64_t r = 0; r < rows; ++r)
            cpu::dequant_row(w.type, wb + (j0 + r) * w_row_bytes, k, panel.data() + r * k);
          // out[i, j0 + r] = sum_k x[i, k] * panel[r, k]   (row-major, out row stride n)
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(rows),
                      static_cast<int>(k), 1.0f, xs, static_cast<int>(k), panel.data(), static_cast<int>(k), 0.0f,
                      os + j0, static_cast<int>(n));
        }
      }
      return Status::ok();
    }

    // Row-dot kernels: weight rows in groups of kDotGroupRows, each group's
    // blocks unpacked once per tile of inputs and dotted with each of them;
    // inputs in chunks of kChunk rows so the chunk stays in cache while the
    // weights stream past it. A row's result does not depend on m.
    constexpr int64_t kChunk = 64;
    constexpr int kG = cpu::kDotGroupRows;
    const int64_t n_groups = (n + kG - 1) / kG;
#pragma omp parallel num_threads(n_threads_)
    for (int64_t i0 = 0; i0 < m; i0 += kChunk) {
      const int mt = static_cast<int>(std::min(kChunk, m - i0));
#pragma omp for schedule(static)
      for (int64_t g = 0; g < n_groups; ++g) {
        const int64_t j0 = g * kG;
        const int nr = static_cast<int>(std::min<int64_t>(kG, n - j0));
        float acc[kG * kChunk];
        const void* rows[kG];
        for (int r = 0; r < nr; ++r) {
          rows[r] = wb + (j0 + r) * w_row_bytes;
          for (int i = 0; i < mt; ++i) acc[r * kChunk + i] = 0.0f;
        }
        cpu::dot_rows_grouped(w.type, rows, nr, k, xs + i0 * k, k, mt, acc, kChunk);
        for (int r = 0; r < nr; ++r)
          for (int i = 0; i < mt; ++i) os[(i0 + i) * n + j0 + r] = acc[r * kChunk + i];
      }
    }
    return Status::ok();
  }

  // Integer path: x quantized to 8 bits per 32-block once per call, then
  // one parallel pass over the 8-row groups of every weight (so Q/K/V or
  // gate/up share the input and a single fork/join): each thread takes whole
  // groups and runs them against a chunk of tokens (kInt8Chunk rows stay in
  // cache while the weights stream past).
  static constexpr size_t kMaxMulti = 4;
  static constexpr int64_t kInt8Chunk = 64;  // tokens per pass over the weights
  // kInt8x2Top: in chunks of up to this many tokens the second pass runs in
  // the first sweep, while a group is in cache, for the tokens whose logits
  // there come within the margin of the largest the thread has seen so far for
  // them (a superset of those picked in the end: the final largest can only be
  // larger); beyond, the picked groups are read again for the tokens that
  // picked them. Measured alternated (docs/BENCHMARKS.md): sweeping at 8-16
  // tokens too was the same on the AVX-512 path and 8-10% slower at batch 8 on
  // the AVX2 one (its Q8_0 head kernel costs twice the VNNI one's).
  static constexpr int kTopSweepMaxTokens = 7;
  // Splits the weights by how their activations are taken (CpuBackendConfig::
  // int8x2_matmul_kinds, fp32_matmul_kinds): each group shares one input
  // preparation and one parallel pass.
  Status matmul_packed(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> outs) {
    // 0: int8, 1: two-pass int8, 2: two-pass near the top (the LM head), 3: fp32 (diagnostics)
    const Tensor* sel_ws[4][kMaxMulti];
    Tensor* sel_outs[4][kMaxMulti];
    size_t n_sel[4] = {0, 0, 0, 0};
    for (size_t j = 0; j < ws.size(); ++j) {
      const auto c = static_cast<int>(activation_mode(ws[j]->data));
      sel_ws[c][n_sel[c]] = ws[j];
      sel_outs[c][n_sel[c]++] = outs[j];
    }
    for (size_t j = 0; j < n_sel[3]; ++j) matmul_unpacked_fp32(x, *sel_ws[3][j], *sel_outs[3][j]);
    for (int c = 0; c < 3; ++c) {
      const auto mode = static_cast<ActivationMode>(c);
      // kInt8x2Top selects per weight: one call each.
      const size_t per_call = mode == ActivationMode::kInt8x2Top ? 1 : kMaxMulti;
      for (size_t j = 0; j < n_sel[c]; j += per_call) {
        const size_t count = std::min(per_call, n_sel[c] - j);
        PD_RETURN_IF_ERROR(matmul_int8(x, std::span<const Tensor* const>(sel_ws[c] + j, count),
                                       std::span<Tensor* const>(sel_outs[c] + j, count), mode));
      }
    }
    return Status::ok();
  }

  // How one repacked weight's activations are taken, fixed at load from its
  // GGUF name (the matmul kind and layer) and the config.
  // kInt8x2Top: the second pass only where the first pass's logit is within
  // CpuBackendConfig::lm_head_two_pass_margin of its row's largest.
  enum class ActivationMode : uint8_t { kInt8, kInt8x2, kInt8x2Top, kFp32 };
  struct PackedWeight {
    const void* data;
    ActivationMode mode;
  };
  ActivationMode mode_for(const std::string& name) const {
    uint32_t kind = 0;
    int layer = -1;
    if (name == "output.weight" || name == "token_embd.weight") kind = kMatmulLmHead;
    if (name.rfind("blk.", 0) == 0) {
      layer = std::atoi(name.c_str() + 4);
      if (name.find(".attn_q.") != std::string::npos || name.find(".attn_k.") != std::string::npos ||
          name.find(".attn_v.") != std::string::npos)
        kind = kMatmulQkv;
      else if (name.find(".attn_output.") != std::string::npos)
        kind = kMatmulAttnOut;
      else if (name.find(".ffn_gate.") != std::string::npos || name.find(".ffn_up.") != std::string::npos)
        kind = kMatmulGateUp;
      else if (name.find(".ffn_down.") != std::string::npos)
        kind = kMatmulDown;
    }
    auto in_layers = [&](uint64_t mask) { return layer < 0 || (layer < 64 && ((mask >> layer) & 1) != 0); };
    if ((cfg_.fp32_matmul_kinds & kind) != 0 && in_layers(cfg_.fp32_matmul_layers)) return ActivationMode::kFp32;
    if ((cfg_.int8x2_matmul_kinds & kind) != 0 && in_layers(cfg_.int8x2_matmul_layers))
      return kind == kMatmulLmHead && cfg_.lm_head_two_pass_margin > 0.0f ? ActivationMode::kInt8x2Top
                                                                          : ActivationMode::kInt8x2;
    return ActivationMode::kInt8;
  }
  // Newest first: a model loaded after another was freed may reuse its addresses.
  ActivationMode activation_mode(const void* data) const {
    for (auto it = packed_weights_.rbegin(); it != packed_weights_.rend(); ++it)
      if (it->data == data) return it->mode;
    return ActivationMode::kInt8;
  }
  // out = x * dequant(w) in fp32 for a repacked weight: panels of rows
  // unpacked exactly (unpack_row), one sgemm each. Diagnostics only.
  void matmul_unpacked_fp32(const Tensor& x, const Tensor& w, Tensor& out) {
    const int64_t k = w.ne[0], n = w.n_rows(), m = x.n_rows();
    const auto f = static_cast<cpu::PackedFormat>(w.layout);
    constexpr int64_t kPanel = 64;
    const int64_t n_panels = (n + kPanel - 1) / kPanel;
    if (static_cast<int>(panel_bufs_.size()) < n_threads_) panel_bufs_.resize(n_threads_);
    const float* xs = f32(x);
    float* os = f32(out);
#pragma omp parallel num_threads(n_threads_)
    {
      std::vector<float>& panel = panel_bufs_[omp_get_thread_num()];
      if (panel.size() < static_cast<size_t>(kPanel * k)) panel.resize(kPanel * k);
#pragma omp for schedule(static)
      for (int64_t p = 0; p < n_panels; ++p) {
        const int64_t j0 = p * kPanel, rows = std::min(kPanel, n - j0);
        for (int64_t r = 0; r < rows; ++r) cpu::unpack_row(f, w.data, k, j0 + r, panel.data() + r * k);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(rows),
                    static_cast<int>(k), 1.0f, xs, static_cast<int>(k), panel.data(), static_cast<int>(k), 0.0f,
                    os + j0, static_cast<int>(n));
      }
    }
  }

  // two_pass: x ~ d1*q1 + d2*q2 with q2 the quantized residual x - d1*q1;
  // each group runs against q1 and q2 and the two results are added.
  // kInt8x2Top (one weight: the LM head): every group runs against q1; then
  // for each token, the groups with a first-pass logit within the margin of
  // that token's largest run against q2 too, and only those logits get the
  // second result added: those are the same bits as kInt8x2's, the others
  // are the one-pass values. The selection depends on the token's own logits
  // alone (batch invariant).
  Status matmul_int8(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> outs,
                     ActivationMode mode) {
    const cpu::Kernels& kern = cpu::kernels(isa_);
    const int64_t k = x.ne[0], m = x.n_rows(), nb = k / cpu::kQBlock;
    const bool two_pass = mode != ActivationMode::kInt8, top = mode == ActivationMode::kInt8x2Top;
    const int64_t groups_padded = (ws[0]->n_rows() + cpu::kPackRows - 1) / cpu::kPackRows * cpu::kPackRows;
    // Activations offset by 128 too (after the plain ones in the same
    // buffers) where a weight's kernel takes them.
    const bool offset = std::any_of(ws.begin(), ws.end(), [&](const Tensor* w) {
      return cpu::uses_offset_activations(kern, static_cast<cpu::PackedFormat>(w->layout));
    });
    reserve_int8_buffers(mode, k, m, groups_padded, offset);
    cpu::BlockQ8A* xq = xq_.data();
    cpu::BlockQ8A* xq2 = two_pass ? xq2_.data() : nullptr;
    cpu::BlockQ8A* xqo = offset ? xq + m * nb : nullptr;
    cpu::BlockQ8A* xq2o = offset && two_pass ? xq2 + m * nb : nullptr;
    const float* xs = f32(x);
    // Work items are pairs of consecutive groups of one weight (the last
    // item of a weight with an odd group count is a single group): the
    // kernels run a pair in one pass (gemm_group_pair).
    int64_t first_item[kMaxMulti + 1] = {0};
    for (size_t j = 0; j < ws.size(); ++j)
      first_item[j + 1] = first_item[j] + (ws[j]->n_rows() + 2 * cpu::kPackRows - 1) / (2 * cpu::kPackRows);
    const int64_t total_items = first_item[ws.size()];
#pragma omp parallel num_threads(n_threads_)
    {
      quantize_inputs(kern, xs, k, m, xq, xqo, xq2, xq2o);
      for (int64_t i0 = 0; i0 < m; i0 += kInt8Chunk) {
        Int8Chunk c{kern, k, i0, static_cast<int>(std::min(kInt8Chunk, m - i0)), two_pass, top, groups_padded,
                    xq + i0 * nb, two_pass ? xq2 + i0 * nb : nullptr, offset ? xqo + i0 * nb : nullptr,
                    offset && two_pass ? xq2o + i0 * nb : nullptr};
        if (top)
          std::fill_n(top_running_.data() + omp_get_thread_num() * kInt8Chunk, c.mt,
                      -std::numeric_limits<float>::infinity());
#pragma omp for schedule(static)
        for (int64_t item = 0; item < total_items; ++item) {
          size_t j = 0;
          while (item >= first_item[j + 1]) ++j;
          int8_item(c, *ws[j], *outs[j], 2 * (item - first_item[j]));
        }
        if (top)
          second_pass_near_top(kern, *ws[0], *outs[0], i0, c.mt, c.x2, c.x2o, nb,
                               c.mt <= kTopSweepMaxTokens ? top_second_.data() : nullptr, groups_padded);
      }
    }
    return Status::ok();
  }

  // One chunk of matmul_int8's tokens: [i0, i0 + mt), quantized (x, and the
  // second pass's x2), with their offset copies where the kernels take them.
  struct Int8Chunk {
    const cpu::Kernels& kern;
    int64_t k, i0;
    int mt;
    bool two_pass, top;
    int64_t groups_padded;
    const cpu::BlockQ8A *x, *x2, *xo, *x2o;
  };
  // matmul_int8's work item: the chunk's tokens against groups g and g + 1 of
  // w (g alone where it is w's last group), into out.
  void int8_item(const Int8Chunk& c, const Tensor& w, Tensor& out, int64_t g) {
    constexpr int kR = cpu::kPackRows, kPair = 2 * kR;
    const int64_t n = w.n_rows(), groups = (n + kR - 1) / kR, nb = c.k / cpu::kQBlock;
    const bool pair = g + 1 < groups;
    const int cols = pair ? kPair : kR;
    const auto f = static_cast<cpu::PackedFormat>(w.layout);
    const size_t group_bytes = cpu::packed_group_bytes(f, c.k);
    const uint8_t* wb = static_cast<const uint8_t*>(w.data);
    float* os = f32(out);
    // The SIMD kernels prefetch the weights themselves as they stream them
    // (the one-group kernels 8 KB ahead, the two-group ones the next pair, a
    // block at a time), which covers the next item too: a burst for the next
    // item here on top of that stalled the core (AVX2 batch-8 decode 10%
    // slower, the Zen 4 two-group kernels' 6.7%: docs/BENCHMARKS.md). The
    // portable kernels do not prefetch: with several token tiles, which read
    // these groups many times from L1, the next item's reads start now.
    const int64_t next = g + cols / kR;
    if (isa_ == cpu::Isa::kScalar && c.mt > 4)
      prefetch_bytes(wb + next * group_bytes, (std::min(next + 2, groups) - next) * group_bytes);
    const void* group = wb + g * group_bytes;
    const bool whole = g * kR + cols <= n;
    float tail[kInt8Chunk * kPair];  // the last group of a matrix whose rows are not a multiple of 8
    float* dst = whole ? os + c.i0 * n + g * kR : tail;
    const int64_t stride = whole ? n : cols;
    auto gemm = [&](const cpu::BlockQ8A* xa, const cpu::BlockQ8A* xao, float* o, int64_t o_stride) {
      if (pair)
        cpu::gemm_group_pair(c.kern, f, group, nb, xa, c.mt, o, o_stride, xao);
      else
        cpu::gemm_group(c.kern, f, group, nb, xa, c.mt, o, o_stride, xao);
    };
    gemm(c.x, c.xo, dst, stride);
    if (c.two_pass && !c.top) {
      float second[kInt8Chunk * kPair];
      gemm(c.x2, c.x2o, second, cols);
      add_rows(second, cols, c.mt, cols, dst, stride);
    } else if (c.top && c.mt <= kTopSweepMaxTokens) {
      // kept for second_pass_near_top, which adds it where it picks the group
      sweep_near_top(c, g, cols, std::min<int64_t>(cols, n - g * kR), dst, stride, gemm);
    }
    if (!whole) copy_rows(tail, cols, c.mt, n - g * kR, os + c.i0 * n + g * kR, n);
  }
  // kInt8x2Top, up to kTopSweepMaxTokens tokens: the second pass of groups g
  // (and g + 1: `cols` rows) for the tokens whose first-pass logits here (dst)
  // come within the margin of the largest the thread has seen for them, while
  // the groups are in cache (only those tokens, gathered where not all); kept
  // in top_second_ for second_pass_near_top, which adds it where it picks the
  // group.
  template <typename Gemm>
  void sweep_near_top(const Int8Chunk& c, int64_t g, int cols, int64_t valid, const float* dst, int64_t stride,
                      Gemm&& gemm) {
    static_assert(kTopSweepMaxTokens <= 32, "top_swept_ holds a bit per token");
    constexpr int kR = cpu::kPackRows;
    const int thread = omp_get_thread_num();
    float* running = top_running_.data() + thread * kInt8Chunk;
    const int64_t ld = c.groups_padded, nb = c.k / cpu::kQBlock;
    int near[kTopSweepMaxTokens], n_near = 0;
    uint32_t mask = 0;
    for (int i = 0; i < c.mt; ++i) {
      const float largest = largest_of(dst + i * stride, valid);
      running[i] = std::max(running[i], largest);
      if (largest >= running[i] - cfg_.lm_head_two_pass_margin) near[n_near++] = i, mask |= uint32_t{1} << i;
    }
    std::fill_n(top_swept_.begin() + g, cols / kR, mask);
    if (n_near == c.mt) return gemm(c.x2, c.x2o, top_second_.data() + g * kR, ld);
    if (n_near == 0) return;
    // The picked tokens' second-pass inputs, as the kernel takes them (the
    // offset copies where this weight uses them), into this thread's buffer.
    const cpu::BlockQ8A* src = c.x2o != nullptr ? c.x2o : c.x2;
    cpu::BlockQ8A* pick = xq2_pick_.data() + thread * kInt8Chunk * nb;
    for (int p = 0; p < n_near; ++p) std::copy_n(src + near[p] * nb, nb, pick + p * nb);
    float second[kTopSweepMaxTokens * 2 * kR];
    gemm(pick, c.x2o != nullptr ? pick : nullptr, second, cols);
    for (int p = 0; p < n_near; ++p) std::copy_n(second + p * cols, cols, top_second_.data() + near[p] * ld + g * kR);
  }
  static void prefetch_bytes(const uint8_t* p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
  }
  // dst[i * dst_stride + r] += src[i * src_stride + r], or = for copy_rows, for i < rows, r < cols.
  static void add_rows(const float* src, int64_t src_stride, int rows, int64_t cols, float* dst, int64_t dst_stride) {
    for (int i = 0; i < rows; ++i)
      for (int64_t r = 0; r < cols; ++r) dst[i * dst_stride + r] += src[i * src_stride + r];
  }
  static void copy_rows(const float* src, int64_t src_stride, int rows, int64_t cols, float* dst, int64_t dst_stride) {
    for (int i = 0; i < rows; ++i) std::copy_n(src + i * src_stride, cols, dst + i * dst_stride);
  }

  // matmul_int8's inputs, inside its parallel region: m rows of k floats to
  // 8-bit blocks xq; with xq2 the second pass's (the residual's); with xqo /
  // xq2o their offset copies.
  void quantize_inputs(const cpu::Kernels& kern, const float* xs, int64_t k, int64_t m, cpu::BlockQ8A* xq,
                       cpu::BlockQ8A* xqo, cpu::BlockQ8A* xq2, cpu::BlockQ8A* xq2o) {
    const int64_t nb = k / cpu::kQBlock;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m; ++i) {
      kern.quantize_rows(xs + i * k, k, k, 1, xq + i * nb);
      if (xqo != nullptr) cpu::offset_activations(xq + i * nb, nb, xqo + i * nb);
      if (xq2 == nullptr) continue;
      float* res = xres_.data() + omp_get_thread_num() * k;
      cpu::quantization_residual(xs + i * k, xq + i * nb, k, res);
      kern.quantize_rows(res, k, k, 1, xq2 + i * nb);
      if (xq2o != nullptr) cpu::offset_activations(xq2 + i * nb, nb, xq2o + i * nb);
    }
  }

  // matmul_int8's grow-only buffers for m rows of k inputs (twice as many
  // blocks with the offset copies; for kInt8x2Top, an output of
  // groups_padded columns).
  void reserve_int8_buffers(ActivationMode mode, int64_t k, int64_t m, int64_t groups_padded, bool offset) {
    const int64_t nb = k / cpu::kQBlock, copies = offset ? 2 : 1;
    auto fit = [](auto& v, int64_t n) {
      if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
    };
    fit(xq_, copies * m * nb);
    if (mode == ActivationMode::kInt8) return;
    fit(xq2_, copies * m * nb), fit(xres_, n_threads_ * k);
    if (mode != ActivationMode::kInt8x2Top) return;
    fit(xq2_pick_, n_threads_ * kInt8Chunk * nb), fit(top_threshold_, kInt8Chunk);
    // Any chunk of up to kTopSweepMaxTokens tokens (the whole call, or its last chunk).
    fit(top_second_, std::min<int64_t>(m, kTopSweepMaxTokens) * groups_padded);
    fit(top_running_, n_threads_ * kInt8Chunk), fit(top_swept_, groups_padded / cpu::kPackRows);
  }

  // kInt8x2Top's second phase, inside matmul_int8's parallel region, for the
  // tokens [i0, i0 + mt) whose first-pass logits are in `out`. With
  // `second_all` (up to kTopSweepMaxTokens tokens) the first sweep already
  // ran the second pass for the groups near each token's running largest
  // (top_swept_; token i, row j at second_all[i * stride + j]), and it is
  // only added where picked; a picked group the sweep did not run (it cannot
  // happen with finite logits) and, without second_all, every picked group is
  // read again for the tokens that picked it. The same bits either way: the
  // choice depends on the batch, the values do not.
  void second_pass_near_top(const cpu::Kernels& kern, const Tensor& w, Tensor& out, int64_t i0, int mt,
                            const cpu::BlockQ8A* xc2, const cpu::BlockQ8A* xc2o, int64_t nb, const float* second_all,
                            int64_t stride) {
    constexpr int kR = cpu::kPackRows;
    const int64_t n = w.n_rows(), groups = (n + kR - 1) / kR, k = nb * cpu::kQBlock;
    const auto f = static_cast<cpu::PackedFormat>(w.layout);
    const size_t group_bytes = cpu::packed_group_bytes(f, k);
    float* os = f32(out);
    float* threshold = top_threshold_.data();
#pragma omp for schedule(static)
    for (int i = 0; i < mt; ++i) threshold[i] = largest_of(os + (i0 + i) * n, n) - cfg_.lm_head_two_pass_margin;
    // The second pass's input as the kernel takes it (the offset copies where
    // this weight's layout uses them); picked tokens not in one run are
    // gathered into this thread's buffer.
    const cpu::BlockQ8A* src = xc2o != nullptr ? xc2o : xc2;
    cpu::BlockQ8A* pick = xq2_pick_.data() + omp_get_thread_num() * kInt8Chunk * nb;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int rows = static_cast<int>(std::min<int64_t>(kR, n - g * kR));
      int tokens[kInt8Chunk], picked = 0;
      for (int i = 0; i < mt; ++i) {
        if (largest_of(os + (i0 + i) * n + g * kR, rows) < threshold[i]) continue;
        if (second_all != nullptr && ((top_swept_[g] >> i) & 1) != 0) {
          for (int r = 0; r < rows; ++r) os[(i0 + i) * n + g * kR + r] += second_all[i * stride + g * kR + r];
          continue;
        }
        tokens[picked++] = i;
      }
      if (picked == 0) continue;
      const cpu::BlockQ8A* in = src + tokens[0] * nb;
      if (tokens[picked - 1] - tokens[0] != picked - 1) {
        for (int p = 0; p < picked; ++p) std::copy_n(src + tokens[p] * nb, nb, pick + p * nb);
        in = pick;
      }
      float second[kInt8Chunk * kR];
      cpu::gemm_group(kern, f, static_cast<const uint8_t*>(w.data) + g * group_bytes, nb, in, picked, second, kR,
                      xc2o != nullptr ? in : nullptr);
      for (int p = 0; p < picked; ++p)
        for (int r = 0; r < rows; ++r) os[(i0 + tokens[p]) * n + g * kR + r] += second[p * kR + r];
    }
  }

  using Backend::rope;
  Status rope(Tensor& x, std::span<const int32_t> positions, const RopeSpec& spec) override {
    PD_RETURN_IF_ERROR(expect_f32(x, "rope", "x"));
    const int64_t hd = x.ne[0], nh = x.ne[1], nt = x.ne[2];
    if (hd % 2 != 0 || hd > 512 || static_cast<int64_t>(positions.size()) < nt)
      return Status::invalid_argument("rope: odd head_dim (or over 512) or too few positions");
    if (!spec.freq_factors.empty() && static_cast<int64_t>(spec.freq_factors.size()) != hd / 2)
      return Status::invalid_argument("rope: " + std::to_string(spec.freq_factors.size()) +
                                      " frequency factors for head_dim " + std::to_string(hd) + " (need head_dim / 2)");
    const RopeTable& table = rope_table(spec, hd / 2, positions.first(static_cast<size_t>(nt)));
    // Pair i is (x[2i], x[2i+1]) or, NEOX, (x[i], x[i + hd/2]).
    const int64_t stride = spec.neox ? 1 : 2, second = spec.neox ? hd / 2 : 1;
    float* xs = f32(x);
    for_each(nt > 4, nt, [&](int64_t t) {
      const float* cs = table.cs.data() + t * (hd / 2);
      const float* sn = table.sn.data() + t * (hd / 2);
      for (int64_t h = 0; h < nh; ++h) {
        float* v = xs + (t * nh + h) * hd;
        for (int64_t i = 0; i < hd / 2; ++i) {
          float* p = v + stride * i;
          const float a = p[0], b = p[second];
          p[0] = a * cs[i] - b * sn[i];
          p[second] = a * sn[i] + b * cs[i];
        }
      }
    });
    return Status::ok();
  }

  // rope's angles: per spec, the angle per unit of position of each pair
  // (inv_freq), and the cos and sin of every pair at the positions of the
  // spec's last call. A forward pass ropes q and k of every layer at the same
  // positions, so the sines are computed once a pass rather than twice a
  // layer (2% of a batch-32 decode step on the default model); two tables,
  // as a model alternates between at most two specs (local and global layers).
  struct RopeTable {
    float base = 0.0f, scale = 0.0f;
    std::vector<float> factors;
    std::vector<double> inv_freq;
    std::vector<int32_t> positions;
    std::vector<float> cs, sn;  // position t, pair i at [t * pairs + i]
  };
  const RopeTable& rope_table(const RopeSpec& spec, int64_t pairs, std::span<const int32_t> positions) {
    auto matches = [&](const RopeTable& r) {
      return static_cast<int64_t>(r.inv_freq.size()) == pairs && r.base == spec.freq_base && r.scale == spec.freq_scale &&
             std::ranges::equal(spec.freq_factors, r.factors);
    };
    RopeTable* r = matches(rope_tables_[0]) ? &rope_tables_[0] : matches(rope_tables_[1]) ? &rope_tables_[1] : nullptr;
    if (r == nullptr) {
      r = &rope_tables_[rope_table_next_];
      rope_table_next_ ^= 1;
      r->inv_freq.resize(pairs);
      for (int64_t i = 0; i < pairs; ++i) {
        double f = std::pow(static_cast<double>(spec.freq_base), -2.0 * static_cast<double>(i) / static_cast<double>(2 * pairs));
        if (spec.freq_scale != 1.0f) f *= spec.freq_scale;
        if (!spec.freq_factors.empty()) f /= spec.freq_factors[i];
        r->inv_freq[i] = f;
      }
      r->base = spec.freq_base, r->scale = spec.freq_scale;
      r->factors.assign(spec.freq_factors.begin(), spec.freq_factors.end());
      r->positions.clear();
    }
    if (std::ranges::equal(positions, r->positions)) return *r;
    const int64_t nt = static_cast<int64_t>(positions.size());
    r->positions.assign(positions.begin(), positions.end());
    r->cs.resize(nt * pairs), r->sn.resize(nt * pairs);
    for_each(nt > 4, nt, [&](int64_t t) {
      const double pos = positions[t];
      for (int64_t i = 0; i < pairs; ++i) {
        const double theta = pos * r->inv_freq[i];
        r->cs[t * pairs + i] = static_cast<float>(std::cos(theta));
        r->sn[t * pairs + i] = static_cast<float>(std::sin(theta));
      }
    });
    return *r;
  }

  Status swiglu(const Tensor& gate, const Tensor& up, Tensor& out) override {
    const int64_t n = gate.n_elements();
    if (up.n_elements() != n || out.n_elements() < n) return Status::invalid_argument("swiglu: shape mismatch");
    const float* g = f32(gate);
    const float* u = f32(up);
    float* o = f32(out);
    const cpu::Kernels& kern = cpu::kernels(isa_);
    constexpr int64_t kSlice = 4096;
    const int64_t slices = (n + kSlice - 1) / kSlice;
    for_each(slices > 1, slices, [&](int64_t i) {
      kern.silu_mul(g + i * kSlice, u + i * kSlice, std::min(kSlice, n - i * kSlice), o + i * kSlice);
    });
    return Status::ok();
  }

  Status geglu(const Tensor& gate, const Tensor& up, Tensor& out) override {
    const int64_t n = gate.n_elements();
    if (up.n_elements() != n || out.n_elements() < n) return Status::invalid_argument("geglu: shape mismatch");
    PD_RETURN_IF_ERROR(expect_f32(gate, "geglu", "gate"));
    PD_RETURN_IF_ERROR(expect_f32(up, "geglu", "up"));
    PD_RETURN_IF_ERROR(expect_f32(out, "geglu", "out"));
    const float* g = f32(gate);
    const float* u = f32(up);
    float* o = f32(out);
    for_each(n > 4096, n, [&](int64_t i) { o[i] = cpu::gelu_tanh(g[i]) * u[i]; });
    return Status::ok();
  }

  Status add(const Tensor& a, const Tensor& b, Tensor& out) override {
    const int64_t n = a.n_elements();
    if (out.n_elements() < n) return Status::invalid_argument("add: shape mismatch");
    const float* as = f32(a);
    const float* bs = f32(b);
    float* o = f32(out);
    if (b.n_elements() != n) {  // one row added to every row (a bias)
      const int64_t d = a.ne[0];
      if (b.n_elements() != d) return Status::invalid_argument("add: shape mismatch");
      for_each(n > 4096, a.n_rows(), [&](int64_t r) {
        for (int64_t j = 0; j < d; ++j) o[r * d + j] = as[r * d + j] + bs[j];
      });
      return Status::ok();
    }
    for_each(n > 4096, n, [&](int64_t i) { o[i] = as[i] + bs[i]; });
    return Status::ok();
  }

  Status scale(const Tensor& x, float s, Tensor& out) override {
    const int64_t n = x.n_elements();
    if (out.n_elements() < n) return Status::invalid_argument("scale: shape mismatch");
    PD_RETURN_IF_ERROR(expect_f32(x, "scale", "x"));
    PD_RETURN_IF_ERROR(expect_f32(out, "scale", "out"));
    const float* xs = f32(x);
    float* o = f32(out);
    for_each(n > 4096, n, [&](int64_t i) { o[i] = xs[i] * s; });
    return Status::ok();
  }

  Status kv_write(BackendBuffer& cache, const KvCacheLayout& L, int layer, const Tensor& k, const Tensor& v,
                  std::span<const int32_t> slots) override {
    PD_RETURN_IF_ERROR(check_kv_layout(L));
    const int64_t hd = L.head_dim, nkv = L.n_kv_heads;
    if (k.ne[0] != hd || k.ne[1] != nkv || v.ne[0] != hd || v.ne[1] != nkv)
      return Status::invalid_argument("kv_write: k/v shape does not match the cache layout");
    const int64_t n = static_cast<int64_t>(slots.size());
    for (int64_t i = 0; i < n; ++i)
      if (slots[i] < 0 || slots[i] / L.block_size >= L.num_blocks)
        return Status::invalid_argument("kv_write: slot out of range");
    const size_t row = L.row_bytes();
    uint8_t* base = static_cast<uint8_t*>(cache.data());
    const bool f16c = isa_ != cpu::Isa::kScalar;
    for_each(n >= 8, n, [&](int64_t i) {
      const int64_t block = slots[i] / L.block_size, off = slots[i] % L.block_size;
      uint8_t* kb = base + L.offset(layer, 0, block);
      uint8_t* vb = base + L.offset(layer, 1, block);
      for (int64_t g = 0; g < nkv; ++g) {
        const size_t at = (g * L.block_size + off) * row;
        kv_row_from_f32(L.dtype, f16c, f32(k) + (i * nkv + g) * hd, hd, kb + at);
        kv_row_from_f32(L.dtype, f16c, f32(v) + (i * nkv + g) * hd, hd, vb + at);
      }
    });
    return Status::ok();
  }

  using Backend::paged_attention;
  Status paged_attention(const Tensor& q, const BackendBuffer& cache, const KvCacheLayout& L, int layer,
                         std::span<const AttentionToken> tokens,
                         std::span<const std::span<const int32_t>> block_tables, float scale, int window,
                         Tensor& out) override {
    PD_RETURN_IF_ERROR(check_kv_layout(L));
    if (window < 0) return Status::invalid_argument("paged_attention: negative window");
    const int64_t hd = q.ne[0], nh = q.ne[1], nt = static_cast<int64_t>(tokens.size());
    const int64_t nkv = L.n_kv_heads, bs = L.block_size;
    if (hd != L.head_dim || nh % nkv != 0 || q.ne[2] < nt || hd > 256)
      return Status::invalid_argument("paged_attention: q shape does not match the cache layout");
    for (const AttentionToken& t : tokens) {
      if (t.seq < 0 || t.seq >= static_cast<int32_t>(block_tables.size()) || t.position < 0 ||
          static_cast<int64_t>(block_tables[t.seq].size()) * bs <= t.position)
        return Status::invalid_argument("paged_attention: token position not covered by its block table");
    }
    const int64_t group = nh / nkv;
    const uint8_t* base = static_cast<const uint8_t*>(const_cast<BackendBuffer&>(cache).data());
    const float* qs = f32(q);
    float* os = f32(out);
    // The SIMD attention kernels take rows of a multiple of 8 floats.
    const cpu::Kernels& kern = cpu::kernels(hd % 8 == 0 ? isa_ : cpu::Isa::kScalar);
    // Work items: (tile of tokens, kv head, run of that kv head's query
    // heads). A kv head's query heads stay together (they share every K/V
    // row) unless there are too few items to keep the threads busy (small
    // decode batches); a tile holds up to kTileRows rows.
    int64_t sequences = 0;
    for (int64_t t = 0; t < nt; ++t) sequences += t == 0 || tokens[t].seq != tokens[t - 1].seq;
    const int64_t per_item = sequences * nkv >= n_threads_ ? std::min<int64_t>(group, kTileRows) : 1;
    const int64_t runs = (group + per_item - 1) / per_item;
    const std::vector<std::pair<int64_t, int64_t>>& tiles =
        balanced_attention_tiles(tokens, std::max<int64_t>(1, kTileRows / per_item), nkv * runs);
    const int64_t n_tiles = static_cast<int64_t>(tiles.size());
    int64_t most_tokens = 0;
    for (const auto& [t0, count] : tiles) most_tokens = std::max(most_tokens, count);
    if (static_cast<int>(attention_scratch_.size()) < n_threads_) attention_scratch_.resize(n_threads_);
#pragma omp parallel num_threads(n_threads_)
    {
      // Each thread sizes its own scratch, before any tile: what it allocates does
      // not depend on the schedule, and its buffers come from its own malloc arena
      // rather than next to another thread's, whose boundary cache lines both
      // would write (as the thread_local scratch before it; docs/BENCHMARKS.md).
      AttentionScratch& w = attention_scratch_[omp_get_thread_num()];
      w.reserve(most_tokens * per_item, hd);
      const int64_t n_items = n_tiles * nkv * runs;
      auto tile = [&](int64_t item) {
        const int64_t run = item % runs, g = item / runs % nkv;
        const auto [t0, count] = tiles[item / runs / nkv];
        const int64_t h0 = g * group + run * per_item;
        const int nq = static_cast<int>(std::min(per_item, (g + 1) * group - h0));
        return AttentionTile{qs + (t0 * nh + h0) * hd,
                             os + (t0 * nh + h0) * hd,
                             nh * hd,
                             tokens.subspan(t0, count),
                             nq,
                             hd,
                             base,
                             &L,
                             layer,
                             g,
                             block_tables[tokens[t0].seq],
                             scale,
                             isa_ != cpu::Isa::kScalar,
                             window};
      };
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < n_items; ++item) {
        const AttentionTile next = tile(std::min(item + n_threads_, n_items - 1));
        const bool prefetch_next = item + n_threads_ < n_items &&
                                   static_cast<int64_t>(next.tokens.size()) * next.nq <= kInPlaceKvRows;
        attend_tile(kern, tile(item), w, prefetch_next ? &next : nullptr);
      }
    }
    return Status::ok();
  }

  // attention_tiles() of at most `most` tokens, fewer where a few tiles would
  // leave a thread idle for a tile's time (a verification step's tokens of one
  // sequence: 3 kv heads' tiles on 2 threads ran 2 and 1; in halves, 3 and
  // 3). Each tile reads its keys again; a tile's rows give the same bits in
  // any tile.
  const std::vector<std::pair<int64_t, int64_t>>& balanced_attention_tiles(std::span<const AttentionToken> tokens,
                                                                           int64_t most, int64_t items_per_tile) {
    const auto idle_share = [&](int64_t tile_tokens) {
      const int64_t items = static_cast<int64_t>(attention_tiles(tokens, tile_tokens).size()) * items_per_tile;
      const int64_t rounds = (items + n_threads_ - 1) / n_threads_;
      return static_cast<double>(rounds * n_threads_ - items) / static_cast<double>(rounds * n_threads_);
    };
    int64_t best = most, last = most;
    double best_idle = idle_share(most);
    for (int64_t t = most / 2; t >= 1 && best_idle > 0.1; t /= 2) {
      const double idle = idle_share(last = t);
      if (idle < best_idle) best = t, best_idle = idle;
    }
    return last == best ? attention_tiles_ : attention_tiles(tokens, best);  // the common case cuts once
  }

  // The tokens cut into tiles ([first, count)): runs of consecutive tokens of
  // one sequence, at most tile_tokens long. Kept in a member (no allocation
  // once warm).
  const std::vector<std::pair<int64_t, int64_t>>& attention_tiles(std::span<const AttentionToken> tokens,
                                                                   int64_t tile_tokens) {
    attention_tiles_.clear();
    const int64_t nt = static_cast<int64_t>(tokens.size());
    for (int64_t t = 0; t < nt;) {
      int64_t end = t + 1;
      while (end < nt && end - t < tile_tokens && tokens[end].seq == tokens[t].seq) ++end;
      attention_tiles_.emplace_back(t, end - t);
      t = end;
    }
    return attention_tiles_;
  }

  Status kv_copy_block(BackendBuffer& cache, const KvCacheLayout& L, int64_t src, int64_t dst) override {
    if (src < 0 || dst < 0 || src >= L.num_blocks || dst >= L.num_blocks)
      return Status::invalid_argument("kv_copy_block: block out of range");
    uint8_t* base = static_cast<uint8_t*>(cache.data());
    for (int layer = 0; layer < L.n_layers; ++layer)
      for (int kind = 0; kind < 2; ++kind)
        std::memcpy(base + L.offset(layer, kind, dst), base + L.offset(layer, kind, src), L.block_bytes());
    return Status::ok();
  }

 private:
  CpuBackendConfig cfg_;
  int n_threads_ = 1;
  cpu::Isa isa_ = cpu::Isa::kScalar;
  std::vector<cpu::BlockQ8A> xq_;  // quantized activations of the current matmul (grow-only)
  static constexpr size_t kArenaBytes = size_t{16} << 20;
  std::shared_ptr<HostBuffer> arena_;  // where the next repacked weight goes
  size_t arena_used_ = 0;
  std::vector<std::vector<float>> panel_bufs_;  // per-thread dequantized weight panels
  std::vector<AttentionScratch> attention_scratch_;  // per-thread (paged_attention)
  std::vector<PackedWeight> packed_weights_;    // every repacked weight and how its activations are taken
  std::vector<cpu::BlockQ8A> xq2_;              // two-pass: the quantized residuals (grow-only)
  std::vector<float> xres_;                     // two-pass: residual rows, one per thread (grow-only)
  std::vector<cpu::BlockQ8A> xq2_pick_;         // kInt8x2Top: the picked tokens' q2, one chunk per thread
  std::vector<float> top_threshold_;            // kInt8x2Top: per token of a chunk, the logit a group needs
  std::vector<float> top_second_;               // kInt8x2Top, small batches: the swept second-pass results
  std::vector<float> top_running_;              // kInt8x2Top sweep: per thread and token, the largest logit so far
  std::vector<uint32_t> top_swept_;             // kInt8x2Top sweep: per group, the tokens top_second_ holds it for
  RopeTable rope_tables_[2];                    // rope's angles for the last two specs
  int rope_table_next_ = 0;                     // the table a new spec replaces
  std::vector<std::pair<int64_t, int64_t>> attention_tiles_;  // paged_attention's work (grow-only)
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const CpuBackendConfig& cfg) { return std::make_unique<CpuBackend>(cfg); }

}  // namespace pd
