// Backend equivalence, CUDA vs CPU (in the style of llama.cpp's test-backend-ops):
// every op of pd::Backend runs on random inputs on both backends, and the CUDA
// result must match the CPU one within a stated tolerance on the normalized max
// error  max_i |cuda_i - cpu_i| / max_i |cpu_i|.  Copies (add, kv_write,
// kv_copy_block) must match bit for bit.
//
// Without a CUDA device every test that needs one prints "SKIPPED: no CUDA
// device: ..." and exits 77 (CTest: Skipped).
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "gguf/ggml_types.h"
#include "gguf/gguf_reader.h"
#include "test_support.h"

namespace pd {
namespace {

// Tolerances (normalized max error, see the file comment).
constexpr double kTolGetRows = 1e-6;   // same decoding; Q4_1 may differ by an FMA rounding
constexpr double kTolMatmul = 1e-4;    // fp32 dot products, different summation order
constexpr double kTolRmsNorm = 1e-5;
constexpr double kTolRope = 1e-5;      // angles in double on both sides
constexpr double kTolSwiglu = 1e-5;    // expf vs std::exp
constexpr double kTolAttention = 1e-4; // online softmax over different chunkings

#define REQUIRE_OK(expr)                   \
  do {                                     \
    const ::pd::Status st_ = (expr);       \
    INFO(st_.to_string());                 \
    REQUIRE(st_.is_ok());                  \
  } while (0)

std::unique_ptr<Backend> cuda_or_skip(const CudaBackendConfig& cfg = {}) {
  Result<std::unique_ptr<Backend>> r = make_cuda_backend(cfg);
  if (!r.is_ok()) {
    if (r.status().is_unsupported()) test::skip("no CUDA device: " + r.status().message());
    FAIL("make_cuda_backend: " << r.status().to_string());
  }
  return std::move(r).value();
}

struct Backends {
  std::unique_ptr<Backend> cpu;
  std::unique_ptr<Backend> gpu;
};

Backends both_or_skip(const CudaBackendConfig& cfg = {}) {
  Backends b;
  b.gpu = cuda_or_skip(cfg);
  CpuBackendConfig cpu_cfg;
  cpu_cfg.n_threads = 2;
  cpu_cfg.int8_activations = false;  // compare against fp32 activations, as the GPU computes
  b.cpu = make_cpu_backend(cpu_cfg);
  return b;
}

std::vector<float> random_floats(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

double nmax_err(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double max_diff = 0.0, max_ref = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isfinite(want[i]) && !std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - want[i]));
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(want[i])));
  }
  return max_diff / std::max(max_ref, 1e-30);
}

// A tensor with the same contents on one backend.
struct DeviceTensor {
  std::unique_ptr<BackendBuffer> buf;
  std::vector<uint8_t> host;  // a weight's bytes (the CPU backend's view points here)
  Tensor t;
};

// An F32 activation filled with `data` (ne's elements).
DeviceTensor f32_tensor(Backend& be, std::array<int64_t, 4> ne, const std::vector<float>& data) {
  DeviceTensor d;
  d.t.type = GgmlType::kF32;
  d.t.ne = ne;
  REQUIRE(static_cast<int64_t>(data.size()) == d.t.n_elements());
  Result<std::unique_ptr<BackendBuffer>> buf = be.alloc(data.size() * sizeof(float));
  REQUIRE_OK(buf.status());
  d.buf = std::move(buf).value();
  d.t.data = d.buf->data();
  REQUIRE_OK(be.copy_from_host(data.data(), d.t, data.size() * sizeof(float)));
  return d;
}

// A weight [k, rows] of `type` quantized from `values`, loaded through load_weight.
DeviceTensor weight_tensor(Backend& be, GgmlType type, int64_t k, int64_t rows, const std::vector<float>& values) {
  DeviceTensor d;
  const size_t row_bytes = ggml_row_bytes(type, k);
  d.host.resize(row_bytes * static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) quantize_row(type, values.data() + r * k, d.host.data() + r * row_bytes, k);
  GgufTensorInfo info;
  info.name = std::string("test.weight.") + ggml_type_name(type);
  info.type = type;
  info.ne = {k, rows};
  info.data = d.host.data();
  info.nbytes = d.host.size();
  Result<Tensor> t = be.load_weight(info, &d.buf);
  REQUIRE_OK(t.status());
  d.t = t.value();
  return d;
}

std::vector<float> download(Backend& be, const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.n_elements()));
  REQUIRE_OK(be.copy_to_host(t, out.data(), out.size() * sizeof(float)));
  return out;
}

// A KV cache buffer with random contents, the same on both backends: rows of
// random floats stored as the layout's type (ggml's reference quantizers), so
// f16 and q8_0 caches hold valid numbers. Buffers are rounded up to whole
// floats (a q8_0 cache need not be).
struct CachePair {
  std::unique_ptr<BackendBuffer> cpu, gpu;
};
CachePair random_cache(Backends& b, const KvCacheLayout& L, std::mt19937& rng) {
  const size_t row = L.row_bytes(), n_rows = L.total_bytes() / row;
  const size_t n_floats = (L.total_bytes() + sizeof(float) - 1) / sizeof(float);
  std::vector<uint8_t> init(n_floats * sizeof(float), 0);
  for (size_t r = 0; r < n_rows; ++r) {
    const std::vector<float> x = random_floats(static_cast<size_t>(L.head_dim), rng);
    quantize_row(L.dtype, x.data(), init.data() + r * row, L.head_dim);
  }
  CachePair c;
  for (int side = 0; side < 2; ++side) {
    Backend& be = side == 0 ? *b.cpu : *b.gpu;
    Result<std::unique_ptr<BackendBuffer>> buf = be.alloc(init.size());
    REQUIRE_OK(buf.status());
    Tensor view;
    view.ne = {static_cast<int64_t>(n_floats), 1, 1, 1};
    view.data = buf.value()->data();
    REQUIRE_OK(be.copy_from_host(init.data(), view, init.size()));
    (side == 0 ? c.cpu : c.gpu) = std::move(buf).value();
  }
  return c;
}
std::vector<float> download_cache(Backend& be, BackendBuffer& buf) {
  Tensor view;
  view.ne = {static_cast<int64_t>(buf.size() / sizeof(float)), 1, 1, 1};
  view.data = buf.data();
  return download(be, view);
}

// Empty when the two downloads hold the same bytes; else where the first
// difference is (cache row, byte within the row) and both rows' bytes. Bytes,
// not floats: a quantized or random cache holds NaN patterns, never equal as floats.
std::string byte_difference(const std::vector<float>& cpu, const std::vector<float>& gpu, size_t row_bytes) {
  const auto* a = reinterpret_cast<const uint8_t*>(cpu.data());
  const auto* g = reinterpret_cast<const uint8_t*>(gpu.data());
  const size_t n = std::min(cpu.size(), gpu.size()) * sizeof(float);
  if (cpu.size() != gpu.size()) return "sizes differ: " + std::to_string(cpu.size()) + " vs " + std::to_string(gpu.size());
  size_t i = 0, count = 0;
  while (i < n && a[i] == g[i]) ++i;
  if (i == n) return "";
  for (size_t j = i; j < n; ++j) count += a[j] != g[j];
  const size_t row = i / row_bytes, start = row * row_bytes, end = std::min(n, start + row_bytes);
  std::ostringstream os;
  os << count << " bytes differ, the first at byte " << i << " (row " << row << ", byte " << i - start
     << " of " << row_bytes << ")\n  cpu row:";
  for (size_t j = start; j < end; ++j) os << ' ' << static_cast<int>(a[j]);
  os << "\n  gpu row:";
  for (size_t j = start; j < end; ++j) os << ' ' << static_cast<int>(g[j]);
  return os.str();
}

constexpr GgmlType kAllTypes[] = {GgmlType::kF32,  GgmlType::kF16,  GgmlType::kBF16, GgmlType::kQ8_0,
                                  GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1,
                                  GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K};
bool is_block_type(GgmlType t) { return ggml_traits(t).block_elems > 1; }
int64_t block_of(GgmlType t) { return ggml_traits(t).block_elems; }

}  // namespace

TEST_CASE("cuda: make_cuda_backend refuses a missing device or a bad ordinal", "[gpu]") {
  // Runs with or without a device: both cases are Unsupported with a message.
  for (int device : {-1, 1 << 20}) {
    Result<std::unique_ptr<Backend>> r = make_cuda_backend(device);
    INFO("device " << device << ": " << r.status().to_string());
    REQUIRE_FALSE(r.is_ok());
    CHECK(r.status().is_unsupported());
    CHECK(r.status().message().rfind("cuda: ", 0) == 0);
  }
  const std::vector<std::string> kinds = available_backends();
  CHECK(std::find(kinds.begin(), kinds.end(), "cuda") != kinds.end());
  BackendConfig cfg;
  cfg.kind = "cuda";
  Result<std::unique_ptr<Backend>> r = create_backend(cfg);
  if (r.is_ok()) {
    CHECK(r.value()->name() == "cuda");
  } else {
    INFO(r.status().to_string());
    CHECK(r.status().is_unsupported());
    CHECK(r.status().message().find("no CUDA device") != std::string::npos);
  }
}

TEST_CASE("cuda: memory copies round-trip and refuse out-of-range sizes", "[gpu]") {
  Backends b = both_or_skip();
  std::mt19937 rng(1);
  const std::vector<float> data = random_floats(1001, rng);
  DeviceTensor t = f32_tensor(*b.gpu, {1001, 1, 1, 1}, data);
  CHECK(download(*b.gpu, t.t) == data);
  std::vector<float> part(10);
  REQUIRE_OK(b.gpu->copy_to_host(t.t, part.data(), part.size() * sizeof(float)));
  CHECK(std::equal(part.begin(), part.end(), data.begin()));
  std::vector<float> big(1002);
  CHECK(b.gpu->copy_to_host(t.t, big.data(), big.size() * sizeof(float)).is_invalid_argument());
  CHECK(b.gpu->copy_from_host(big.data(), t.t, big.size() * sizeof(float)).is_invalid_argument());
  Result<std::unique_ptr<BackendBuffer>> empty = b.gpu->alloc(0);
  REQUIRE_OK(empty.status());
  CHECK(empty.value()->size() == 0);
  REQUIRE_OK(b.gpu->synchronize());
}

TEST_CASE("cuda: get_rows matches the CPU backend for every weight type", "[gpu]") {
  Backends b = both_or_skip();
  std::mt19937 rng(2);
  for (GgmlType type : kAllTypes) {
    const int64_t blk = block_of(type);
    for (int64_t d : is_block_type(type) ? std::vector<int64_t>{blk, 3 * blk} : std::vector<int64_t>{1, 37, 96}) {
      const int64_t vocab = 50;
      const std::vector<float> values = random_floats(static_cast<size_t>(d * vocab), rng, -2.0f, 2.0f);
      DeviceTensor wc = weight_tensor(*b.cpu, type, d, vocab, values);
      DeviceTensor wg = weight_tensor(*b.gpu, type, d, vocab, values);
      for (int64_t n : {1, 5, 33}) {
        std::vector<int32_t> ids(static_cast<size_t>(n));
        std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
        for (int32_t& id : ids) id = pick(rng);
        ids.front() = static_cast<int32_t>(vocab - 1);
        if (n > 2) ids[1] = ids[2];  // repeats
        const std::vector<float> init(static_cast<size_t>(d * (n + 1)), 7.0f);  // one spare row
        DeviceTensor oc = f32_tensor(*b.cpu, {d, n + 1, 1, 1}, init);
        DeviceTensor og = f32_tensor(*b.gpu, {d, n + 1, 1, 1}, init);
        REQUIRE_OK(b.cpu->get_rows(wc.t, ids, oc.t));
        REQUIRE_OK(b.gpu->get_rows(wg.t, ids, og.t));
        INFO("type " << ggml_type_name(type) << " d " << d << " n " << n);
        CHECK(nmax_err(download(*b.gpu, og.t), download(*b.cpu, oc.t)) <= kTolGetRows);
      }
    }
  }
}

TEST_CASE("cuda: matmul matches the CPU backend (types, batch sizes, both GPU paths)", "[gpu]") {
  Backends b = both_or_skip();
  // Default, all-cuBLAS, all-fused, and cuBLAS over 3-row dequantized panels.
  std::vector<std::pair<std::string, std::unique_ptr<Backend>>> gpus;
  gpus.emplace_back("default", std::move(b.gpu));
  CudaBackendConfig cfg;
  cfg.gemm_min_rows = 1;
  gpus.emplace_back("cublas", cuda_or_skip(cfg));
  cfg.gemm_min_rows = 1000;
  gpus.emplace_back("fused", cuda_or_skip(cfg));
  std::mt19937 rng(3);
  for (GgmlType type : kAllTypes) {
    const std::vector<std::pair<int64_t, int64_t>> shapes =
        block_of(type) == 256 ? std::vector<std::pair<int64_t, int64_t>>{{256, 67}, {768, 130}}
        : is_block_type(type) ? std::vector<std::pair<int64_t, int64_t>>{{96, 67}, {256, 130}}
                            : std::vector<std::pair<int64_t, int64_t>>{{33, 45}, {256, 67}};
    for (auto [k, n] : shapes) {
      cfg.gemm_min_rows = 1;
      cfg.max_panel_bytes = 3 * static_cast<size_t>(k) * sizeof(float) + 1;
      std::unique_ptr<Backend> paneled = cuda_or_skip(cfg);
      const std::vector<float> values = random_floats(static_cast<size_t>(k * n), rng);
      DeviceTensor wc = weight_tensor(*b.cpu, type, k, n, values);
      std::vector<DeviceTensor> wg;
      for (auto& g : gpus) wg.push_back(weight_tensor(*g.second, type, k, n, values));
      DeviceTensor wp = weight_tensor(*paneled, type, k, n, values);
      for (int64_t m : {1, 3, 7, 8, 17, 64}) {
        const std::vector<float> x = random_floats(static_cast<size_t>(k * m), rng);
        const std::vector<float> init(static_cast<size_t>(n * m), -3.0f);
        DeviceTensor xc = f32_tensor(*b.cpu, {k, m, 1, 1}, x);
        DeviceTensor oc = f32_tensor(*b.cpu, {n, m, 1, 1}, init);
        REQUIRE_OK(b.cpu->matmul(xc.t, wc.t, oc.t));
        const std::vector<float> want = download(*b.cpu, oc.t);
        for (size_t g = 0; g <= gpus.size(); ++g) {
          Backend& be = g < gpus.size() ? *gpus[g].second : *paneled;
          const Tensor& w = g < gpus.size() ? wg[g].t : wp.t;
          DeviceTensor xg = f32_tensor(be, {k, m, 1, 1}, x);
          DeviceTensor og = f32_tensor(be, {n, m, 1, 1}, init);
          REQUIRE_OK(be.matmul(xg.t, w, og.t));
          INFO("type " << ggml_type_name(type) << " k " << k << " n " << n << " m " << m << " gpu path "
                       << (g < gpus.size() ? gpus[g].first : std::string("3-row panels")));
          CHECK(nmax_err(download(be, og.t), want) <= kTolMatmul);
        }
      }
    }
  }
}

TEST_CASE("cuda: rms_norm matches the CPU backend", "[gpu]") {
  Backends b = both_or_skip();
  std::mt19937 rng(4);
  const std::vector<std::pair<int64_t, int64_t>> shapes{{1, 1}, {37, 7}, {576, 3}, {1000, 33}, {4096, 2}};
  for (auto [d, n] : shapes) {
    for (float eps : {1e-5f, 1e-6f}) {
      for (bool in_place : {false, true}) {
        const std::vector<float> x = random_floats(static_cast<size_t>(d * n), rng, -3.0f, 3.0f);
        const std::vector<float> w = random_floats(static_cast<size_t>(d), rng, 0.5f, 1.5f);
        std::vector<float> results[2];
        for (int side = 0; side < 2; ++side) {
          Backend& be = side == 0 ? *b.cpu : *b.gpu;
          DeviceTensor xt = f32_tensor(be, {d, n, 1, 1}, x);
          DeviceTensor wt = f32_tensor(be, {d, 1, 1, 1}, w);
          DeviceTensor ot = f32_tensor(be, {d, n, 1, 1}, std::vector<float>(x.size(), 0.0f));
          Tensor& out = in_place ? xt.t : ot.t;
          REQUIRE_OK(be.rms_norm(xt.t, wt.t, eps, out));
          results[side] = download(be, out);
        }
        INFO("d " << d << " n " << n << " eps " << eps << " in place " << in_place);
        CHECK(nmax_err(results[1], results[0]) <= kTolRmsNorm);
      }
    }
  }
}

TEST_CASE("cuda: rope matches the CPU backend", "[gpu]") {
  Backends b = both_or_skip();
  std::mt19937 rng(5);
  struct Case {
    int64_t hd, nh, nt;
    float base;
  };
  const Case cases[] = {{2, 1, 1, 10000.0f},  {64, 3, 5, 10000.0f},  {128, 9, 20, 500000.0f},
                        {80, 1, 7, 10000.0f}, {64, 9, 1, 1000000.0f}, {256, 2, 3, 10000.0f}};
  for (const Case& c : cases) {
    const std::vector<float> x = random_floats(static_cast<size_t>(c.hd * c.nh * c.nt), rng);
    std::vector<int32_t> pos(static_cast<size_t>(c.nt) + 2);  // spare positions are ignored
    std::uniform_int_distribution<int32_t> pick(0, 100000);
    for (int32_t& p : pos) p = pick(rng);
    pos[0] = 0;
    std::vector<float> factors(static_cast<size_t>(c.hd / 2));
    for (float& f : factors) f = std::uniform_real_distribution<float>(1.0f, 8.0f)(rng);
    // The plain rotation, then NEOX pairs, linear scaling and frequency factors (Llama 3.x).
    for (int variant = 0; variant < 4; ++variant) {
      RopeSpec spec;
      spec.freq_base = c.base;
      spec.neox = variant >= 1;
      spec.freq_scale = variant >= 2 ? 0.25f : 1.0f;
      if (variant == 3) spec.freq_factors = factors;
      std::vector<float> results[2];
      for (int side = 0; side < 2; ++side) {
        Backend& be = side == 0 ? *b.cpu : *b.gpu;
        DeviceTensor xt = f32_tensor(be, {c.hd, c.nh, c.nt, 1}, x);
        if (variant == 0) {
          REQUIRE_OK(be.rope(xt.t, pos, c.base));
        } else {
          REQUIRE_OK(be.rope(xt.t, pos, spec));
        }
        results[side] = download(be, xt.t);
      }
      INFO("head_dim " << c.hd << " heads " << c.nh << " tokens " << c.nt << " base " << c.base << " variant "
                       << variant);
      CHECK(nmax_err(results[1], results[0]) <= kTolRope);
    }
  }
}

TEST_CASE("cuda: swiglu, geglu, add and scale match the CPU backend", "[gpu]") {
  Backends b = both_or_skip();
  std::mt19937 rng(6);
  for (int64_t n : {1, 31, 1000, 100003}) {
    const std::vector<float> g = random_floats(static_cast<size_t>(n), rng, -10.0f, 10.0f);
    const std::vector<float> u = random_floats(static_cast<size_t>(n), rng);
    std::vector<float> sw[2], gg[2], sum[2], sum_in_place[2], bias_sum[2], scaled[2];
    for (int side = 0; side < 2; ++side) {
      Backend& be = side == 0 ? *b.cpu : *b.gpu;
      DeviceTensor gt = f32_tensor(be, {n, 1, 1, 1}, g);
      DeviceTensor ut = f32_tensor(be, {n, 1, 1, 1}, u);
      DeviceTensor ot = f32_tensor(be, {n, 1, 1, 1}, std::vector<float>(static_cast<size_t>(n), 0.0f));
      REQUIRE_OK(be.swiglu(gt.t, ut.t, ot.t));
      sw[side] = download(be, ot.t);
      REQUIRE_OK(be.geglu(gt.t, ut.t, ot.t));
      gg[side] = download(be, ot.t);
      REQUIRE_OK(be.scale(gt.t, 25.25f, ot.t));
      scaled[side] = download(be, ot.t);
      // A bias row: g as rows of 1 (n of them) plus u's first element, when n > 1.
      DeviceTensor rows = f32_tensor(be, {1, n, 1, 1}, g);
      DeviceTensor bias = f32_tensor(be, {1, 1, 1, 1}, std::vector<float>{u[0]});
      REQUIRE_OK(be.add(rows.t, bias.t, ot.t));
      bias_sum[side] = download(be, ot.t);
      REQUIRE_OK(be.add(gt.t, ut.t, ot.t));
      sum[side] = download(be, ot.t);
      REQUIRE_OK(be.add(gt.t, ut.t, gt.t));  // out aliases a
      sum_in_place[side] = download(be, gt.t);
    }
    INFO("n " << n);
    CHECK(nmax_err(sw[1], sw[0]) <= kTolSwiglu);
    CHECK(nmax_err(gg[1], gg[0]) <= kTolSwiglu);  // tanhf vs std::tanh
    CHECK(scaled[1] == scaled[0]);
    CHECK(bias_sum[1] == bias_sum[0]);
    CHECK(sum[1] == sum[0]);
    CHECK(sum_in_place[1] == sum[0]);
  }
}

TEST_CASE("cuda: kv_write and kv_copy_block match the CPU backend bit for bit", "[gpu]") {
  Backends b = both_or_skip();
  std::mt19937 rng(7);
  struct Case {
    int n_layers, n_kv_heads, head_dim, block_size, num_blocks, layer, n_tokens;
  };
  const Case cases[] = {{3, 2, 64, 16, 12, 1, 23}, {1, 1, 128, 1, 40, 0, 17}, {2, 4, 40, 32, 5, 1, 70}};
  for (GgmlType dtype : {GgmlType::kF32, GgmlType::kF16, GgmlType::kQ8_0})
  for (const Case& c : cases) {
    if (dtype == GgmlType::kQ8_0 && c.head_dim % 32 != 0) continue;  // q8_0 rows are whole 32-blocks
    KvCacheLayout L;
    L.dtype = dtype;
    L.n_layers = c.n_layers;
    L.n_kv_heads = c.n_kv_heads;
    L.head_dim = c.head_dim;
    L.block_size = c.block_size;
    L.num_blocks = c.num_blocks;
    CachePair cache = random_cache(b, L, rng);
    // Distinct random slots over the whole cache.
    std::vector<int32_t> all(static_cast<size_t>(L.num_blocks * L.block_size));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    const std::vector<int32_t> slots(all.begin(), all.begin() + c.n_tokens);
    const int64_t per_token = static_cast<int64_t>(c.head_dim) * c.n_kv_heads;
    const std::vector<float> k = random_floats(static_cast<size_t>(per_token * c.n_tokens), rng);
    const std::vector<float> v = random_floats(static_cast<size_t>(per_token * c.n_tokens), rng);
    const std::array<int64_t, 4> ne{c.head_dim, c.n_kv_heads, c.n_tokens, 1};
    std::vector<float> written[2], copied[2];
    for (int side = 0; side < 2; ++side) {
      Backend& be = side == 0 ? *b.cpu : *b.gpu;
      BackendBuffer& buf = side == 0 ? *cache.cpu : *cache.gpu;
      DeviceTensor kt = f32_tensor(be, ne, k);
      DeviceTensor vt = f32_tensor(be, ne, v);
      REQUIRE_OK(be.kv_write(buf, L, c.layer, kt.t, vt.t, slots));
      written[side] = download_cache(be, buf);
      REQUIRE_OK(be.kv_copy_block(buf, L, 3 % L.num_blocks, L.num_blocks - 1));
      REQUIRE_OK(be.kv_copy_block(buf, L, L.num_blocks - 2, 0));
      REQUIRE_OK(be.kv_copy_block(buf, L, 1, 1));
      copied[side] = download_cache(be, buf);
    }
    INFO(ggml_type_name(dtype) << " layers " << c.n_layers << " kv heads " << c.n_kv_heads << " head_dim "
                               << c.head_dim << " block_size " << c.block_size);
    CHECK(byte_difference(written[0], written[1], L.row_bytes()) == "");
    CHECK(byte_difference(copied[0], copied[1], L.row_bytes()) == "");
  }
}

TEST_CASE("cuda: paged_attention matches the CPU backend (GQA, mixed sequences, shuffled blocks)", "[gpu]") {
  Backends b = both_or_skip();
  std::mt19937 rng(8);
  struct Case {
    int n_heads, n_kv_heads, head_dim, block_size, n_layers, layer;
    std::vector<int> seq_lens;
    float q_scale;  // large values make the softmax peaked (tests the running max)
  };
  const std::vector<Case> cases{
      {4, 4, 64, 16, 2, 1, {1, 37, 300}, 1.0f},   {8, 2, 128, 16, 3, 2, {200, 5, 17}, 1.0f},
      {6, 1, 80, 32, 1, 0, {129, 64}, 1.0f},      {4, 2, 256, 8, 1, 0, {50}, 1.0f},
      {2, 1, 32, 1, 1, 0, {7, 3, 1}, 1.0f},       {8, 4, 64, 16, 2, 0, {150, 33}, 30.0f},
  };
  for (GgmlType dtype : {GgmlType::kF32, GgmlType::kF16, GgmlType::kQ8_0})
  for (const Case& c : cases) {
    if (dtype == GgmlType::kQ8_0 && c.head_dim % 32 != 0) continue;
    KvCacheLayout L;
    L.dtype = dtype;
    L.n_layers = c.n_layers;
    L.n_kv_heads = c.n_kv_heads;
    L.head_dim = c.head_dim;
    L.block_size = c.block_size;
    // Each sequence gets the blocks it needs plus one spare; a few blocks stay unused.
    int64_t needed = 0;
    for (int len : c.seq_lens) needed += (len + c.block_size - 1) / c.block_size + 1;
    L.num_blocks = needed + 3;
    std::vector<int32_t> ids(static_cast<size_t>(L.num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<std::vector<int32_t>> tables;
    size_t next = 0;
    for (int len : c.seq_lens) {
      const size_t n_blocks = static_cast<size_t>((len + c.block_size - 1) / c.block_size + 1);
      tables.emplace_back(ids.begin() + next, ids.begin() + next + n_blocks);
      next += n_blocks;
    }
    const std::vector<std::span<const int32_t>> table_spans(tables.begin(), tables.end());
    // Query tokens: every sequence's last position, all positions of short ones,
    // a few random ones of long ones; in shuffled order.
    std::vector<AttentionToken> tokens;
    for (size_t s = 0; s < c.seq_lens.size(); ++s) {
      const int len = c.seq_lens[s];
      if (len <= 40) {
        for (int p = 0; p < len; ++p) tokens.push_back({p, static_cast<int32_t>(s)});
      } else {
        tokens.push_back({len - 1, static_cast<int32_t>(s)});
        std::uniform_int_distribution<int32_t> pick(0, len - 2);
        for (int i = 0; i < 3; ++i) tokens.push_back({pick(rng), static_cast<int32_t>(s)});
      }
    }
    std::shuffle(tokens.begin(), tokens.end(), rng);
    const int64_t nt = static_cast<int64_t>(tokens.size());
    const std::vector<float> q =
        random_floats(static_cast<size_t>(c.head_dim * c.n_heads * nt), rng, -c.q_scale, c.q_scale);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    CachePair cache = random_cache(b, L, rng);
    const std::array<int64_t, 4> ne{c.head_dim, c.n_heads, nt, 1};
    // Full attention, then sliding windows (Gemma 3's local layers): inside one
    // block, across blocks, longer than every sequence.
    for (int window : {0, 1, 37, 1000}) {
      std::vector<float> results[2];
      for (int side = 0; side < 2; ++side) {
        Backend& be = side == 0 ? *b.cpu : *b.gpu;
        const BackendBuffer& buf = side == 0 ? *cache.cpu : *cache.gpu;
        DeviceTensor qt = f32_tensor(be, ne, q);
        DeviceTensor ot = f32_tensor(be, ne, std::vector<float>(q.size(), 0.0f));
        if (window == 0) {
          REQUIRE_OK(be.paged_attention(qt.t, buf, L, c.layer, tokens, table_spans, scale, ot.t));
        } else {
          REQUIRE_OK(be.paged_attention(qt.t, buf, L, c.layer, tokens, table_spans, scale, window, ot.t));
        }
        results[side] = download(be, ot.t);
      }
      INFO(ggml_type_name(dtype) << " heads " << c.n_heads << "/" << c.n_kv_heads << " head_dim " << c.head_dim
                                 << " block_size " << c.block_size << " tokens " << nt << " q scale " << c.q_scale
                                 << " window " << window);
      CHECK(nmax_err(results[1], results[0]) <= kTolAttention);
    }
  }
}

TEST_CASE("cuda: argument validation matches the CPU backend", "[gpu]") {
  Backends b = both_or_skip();
  std::mt19937 rng(9);
  KvCacheLayout L;
  L.n_layers = 2;
  L.n_kv_heads = 2;
  L.head_dim = 16;
  L.block_size = 4;
  L.num_blocks = 3;
  CachePair cache = random_cache(b, L, rng);

  struct Side {
    DeviceTensor table, x, w, x_wide, out, q4, kv, q, q_odd;
  };
  Side sides[2];
  for (int side = 0; side < 2; ++side) {
    Backend& be = side == 0 ? *b.cpu : *b.gpu;
    Side& s = sides[side];
    s.table = weight_tensor(be, GgmlType::kF32, 8, 5, random_floats(40, rng));
    s.x = f32_tensor(be, {8, 3, 1, 1}, random_floats(24, rng));
    s.w = f32_tensor(be, {8, 1, 1, 1}, random_floats(8, rng));
    s.x_wide = f32_tensor(be, {9, 3, 1, 1}, random_floats(27, rng));
    s.out = f32_tensor(be, {8, 3, 1, 1}, random_floats(24, rng));
    s.q4 = f32_tensor(be, {16, 4, 1, 1}, random_floats(64, rng));  // reinterpreted as a short Q4_0 row
    s.kv = f32_tensor(be, {16, 2, 2, 1}, random_floats(64, rng));
    s.q = f32_tensor(be, {16, 4, 2, 1}, random_floats(128, rng));
    s.q_odd = f32_tensor(be, {15, 2, 2, 1}, random_floats(60, rng));
  }
  auto expect_same = [&](const char* what, StatusCode code, auto&& call) {
    const Status cpu = call(*b.cpu, sides[0], *cache.cpu);
    const Status gpu = call(*b.gpu, sides[1], *cache.gpu);
    INFO(what << ": cpu " << cpu.to_string() << " / cuda " << gpu.to_string());
    CHECK(cpu.code() == code);
    CHECK(gpu.code() == code);
  };
  const StatusCode kInvalid = StatusCode::kInvalidArgument;
  const std::vector<int32_t> bad_ids{0, 5}, neg_ids{-1};
  expect_same("get_rows id past the table", kInvalid,
              [&](Backend& be, Side& s, BackendBuffer&) { return be.get_rows(s.table.t, bad_ids, s.out.t); });
  expect_same("get_rows negative id", kInvalid,
              [&](Backend& be, Side& s, BackendBuffer&) { return be.get_rows(s.table.t, neg_ids, s.out.t); });
  expect_same("get_rows out too narrow", kInvalid, [&](Backend& be, Side& s, BackendBuffer&) {
    return be.get_rows(s.table.t, std::vector<int32_t>{0}, s.x_wide.t);
  });
  expect_same("rms_norm w mismatch", kInvalid,
              [&](Backend& be, Side& s, BackendBuffer&) { return be.rms_norm(s.x_wide.t, s.w.t, 1e-5f, s.x_wide.t); });
  expect_same("matmul k mismatch", kInvalid,
              [&](Backend& be, Side& s, BackendBuffer&) { return be.matmul(s.x_wide.t, s.table.t, s.out.t); });
  expect_same("matmul out too narrow", kInvalid,
              [&](Backend& be, Side& s, BackendBuffer&) { return be.matmul(s.x.t, s.table.t, s.out.t); });
  expect_same("matmul k not a multiple of the block", kInvalid, [&](Backend& be, Side& s, BackendBuffer&) {
    Tensor w = s.q4.t;
    w.type = GgmlType::kQ4_0;  // ne[0] = 16 < 32
    Tensor out = s.q4.t;
    out.ne = {4, 4, 1, 1};  // [n, m] so that only the block-size check fails
    return be.matmul(s.q4.t, w, out);
  });
  expect_same("rope odd head_dim", kInvalid, [&](Backend& be, Side& s, BackendBuffer&) {
    return be.rope(s.q_odd.t, std::vector<int32_t>{1, 2}, 10000.0f);
  });
  expect_same("rope too few positions", kInvalid, [&](Backend& be, Side& s, BackendBuffer&) {
    return be.rope(s.q.t, std::vector<int32_t>{1}, 10000.0f);
  });
  expect_same("swiglu size mismatch", kInvalid,
              [&](Backend& be, Side& s, BackendBuffer&) { return be.swiglu(s.x.t, s.x_wide.t, s.out.t); });
  expect_same("add size mismatch", kInvalid,
              [&](Backend& be, Side& s, BackendBuffer&) { return be.add(s.x.t, s.x_wide.t, s.out.t); });
  expect_same("kv_write slot past the cache", kInvalid, [&](Backend& be, Side& s, BackendBuffer& c) {
    return be.kv_write(c, L, 0, s.kv.t, s.kv.t, std::vector<int32_t>{0, 12});
  });
  expect_same("kv_write negative slot", kInvalid, [&](Backend& be, Side& s, BackendBuffer& c) {
    return be.kv_write(c, L, 0, s.kv.t, s.kv.t, std::vector<int32_t>{-1});
  });
  expect_same("kv_write k shape", kInvalid, [&](Backend& be, Side& s, BackendBuffer& c) {
    return be.kv_write(c, L, 0, s.q.t, s.q.t, std::vector<int32_t>{0});
  });
  expect_same("kv_write Q4_0 cache", StatusCode::kUnsupported, [&](Backend& be, Side& s, BackendBuffer& c) {
    KvCacheLayout q4 = L;
    q4.dtype = GgmlType::kQ4_0;
    return be.kv_write(c, q4, 0, s.kv.t, s.kv.t, std::vector<int32_t>{0});
  });
  const std::vector<int32_t> table0{2, 0};
  const std::vector<std::span<const int32_t>> tables{table0};
  expect_same("paged_attention position past the table", kInvalid, [&](Backend& be, Side& s, BackendBuffer& c) {
    const std::vector<AttentionToken> toks{{3, 0}, {8, 0}};
    return be.paged_attention(s.q.t, c, L, 1, toks, tables, 0.25f, s.q.t);
  });
  expect_same("paged_attention bad sequence index", kInvalid, [&](Backend& be, Side& s, BackendBuffer& c) {
    const std::vector<AttentionToken> toks{{0, 1}};
    return be.paged_attention(s.q.t, c, L, 1, toks, tables, 0.25f, s.q.t);
  });
  expect_same("paged_attention head_dim mismatch", kInvalid, [&](Backend& be, Side& s, BackendBuffer& c) {
    const std::vector<AttentionToken> toks{{0, 0}};
    return be.paged_attention(s.q_odd.t, c, L, 1, toks, tables, 0.25f, s.q_odd.t);
  });
  expect_same("paged_attention heads not a multiple of kv heads", kInvalid,
              [&](Backend& be, Side& s, BackendBuffer& c) {
                Tensor q = s.q.t;
                q.ne = {16, 3, 2, 1};
                const std::vector<AttentionToken> toks{{0, 0}};
                return be.paged_attention(q, c, L, 1, toks, tables, 0.25f, q);
              });
  expect_same("paged_attention Q4_0 cache", StatusCode::kUnsupported, [&](Backend& be, Side& s, BackendBuffer& c) {
    KvCacheLayout q4 = L;
    q4.dtype = GgmlType::kQ4_0;
    const std::vector<AttentionToken> toks{{0, 0}};
    return be.paged_attention(s.q.t, c, q4, 1, toks, tables, 0.25f, s.q.t);
  });
  expect_same("kv_copy_block source past the cache", kInvalid,
              [&](Backend& be, Side&, BackendBuffer& c) { return be.kv_copy_block(c, L, 3, 0); });
  expect_same("kv_copy_block negative destination", kInvalid,
              [&](Backend& be, Side&, BackendBuffer& c) { return be.kv_copy_block(c, L, 0, -1); });
}

TEST_CASE("cuda: kv_gather and kv_scatter move the same bytes as the CPU backend, and the device has an identity", "[gpu]") {
  Backends b = both_or_skip();
  std::mt19937 rng(11);
  KvCacheLayout L;
  L.dtype = GgmlType::kF16;
  L.n_layers = 2;
  L.n_kv_heads = 3;
  L.head_dim = 64;
  L.block_size = 16;
  L.num_blocks = 9;
  CachePair cache = random_cache(b, L, rng);
  // Pieces out of order, including one at an offset that is not 16-byte aligned
  // (the unaligned kernel path) in the second round.
  const size_t piece = L.block_bytes();
  for (const std::vector<int64_t>& offsets :
       {std::vector<int64_t>{static_cast<int64_t>(L.offset(1, 0, 7)), static_cast<int64_t>(L.offset(0, 1, 2)),
                             static_cast<int64_t>(L.offset(1, 1, 0))},
        std::vector<int64_t>{3, static_cast<int64_t>(L.offset(1, 0, 4)) + 5}}) {
    std::vector<uint8_t> from_cpu(offsets.size() * piece), from_gpu(offsets.size() * piece, 0);
    REQUIRE_OK(b.cpu->kv_gather(*cache.cpu, offsets, piece, from_cpu.data()));
    REQUIRE_OK(b.gpu->kv_gather(*cache.gpu, offsets, piece, from_gpu.data()));
    CHECK(from_cpu == from_gpu);
    std::vector<uint8_t> in(offsets.size() * piece);
    for (uint8_t& x : in) x = static_cast<uint8_t>(rng());
    REQUIRE_OK(b.cpu->kv_scatter(*cache.cpu, offsets, piece, in.data()));
    REQUIRE_OK(b.gpu->kv_scatter(*cache.gpu, offsets, piece, in.data()));
    CHECK(byte_difference(download_cache(*b.cpu, *cache.cpu), download_cache(*b.gpu, *cache.gpu), piece) == "");
  }
  CHECK(b.gpu->kv_gather(*cache.gpu, std::vector<int64_t>{static_cast<int64_t>(cache.gpu->size())}, 1, nullptr)
            .is_invalid_argument());
  CHECK(b.gpu->device_memory());
  CHECK(b.gpu->native_stream() != nullptr);
  const std::string id = b.gpu->device_id();
  INFO(id);
  CHECK(id.size() == 40);  // "GPU-" + 8-4-4-4-12 hex digits
  CHECK(id.rfind("GPU-", 0) == 0);
  CHECK(backend_device_count("cuda") >= 1);
}

}  // namespace pd
