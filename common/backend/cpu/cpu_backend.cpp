#include "backend/cpu/cpu_backend.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "backend/cpu/cpu_kernels.h"
#include "gguf/gguf_reader.h"

namespace pd {
namespace {

class HostBuffer final : public BackendBuffer {
 public:
  explicit HostBuffer(size_t bytes) : size_(bytes) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    data_ = rounded ? std::aligned_alloc(64, rounded) : nullptr;
  }
  ~HostBuffer() override { std::free(data_); }
  void* data() override { return data_; }
  size_t size() const override { return size_; }
  bool ok() const { return data_ != nullptr || size_ == 0; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

const float* f32(const Tensor& t) { return static_cast<const float*>(t.data); }
float* f32(Tensor& t) { return static_cast<float*>(t.data); }

Status expect_f32(const Tensor& t, const char* op, const char* arg) {
  if (t.type != GgmlType::kF32)
    return Status::invalid_argument(std::string(op) + ": " + arg + " must be F32, got " + ggml_type_name(t.type));
  return Status::ok();
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuBackendConfig& cfg) : cfg_(cfg) {
    n_threads_ = cfg.n_threads > 0 ? cfg.n_threads : omp_get_num_procs();
    // We split GEMMs across our own threads; each sgemm call runs on one.
    openblas_set_num_threads(1);
  }

  std::string name() const override { return "cpu"; }

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
    return t;
  }

  Status copy_to_host(const Tensor& src, void* dst, size_t bytes) override {
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
#pragma omp parallel for num_threads(n_threads_) schedule(static) if (n > 4)
    for (int64_t i = 0; i < n; ++i) {
      cpu::dequant_row(table.type, base + static_cast<size_t>(ids[i]) * row_bytes, d, f32(out) + i * d);
    }
    return Status::ok();
  }

  Status rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override {
    PD_RETURN_IF_ERROR(expect_f32(x, "rms_norm", "x"));
    PD_RETURN_IF_ERROR(expect_f32(w, "rms_norm", "w"));
    const int64_t d = x.ne[0], n = x.n_rows();
    if (w.ne[0] != d || out.ne[0] != d || out.n_rows() < n) return Status::invalid_argument("rms_norm: shape mismatch");
    const float* xs = f32(x);
    const float* ws = f32(w);
    float* os = f32(out);
#pragma omp parallel for num_threads(n_threads_) schedule(static) if (n > 8)
    for (int64_t i = 0; i < n; ++i) {
      const float* xi = xs + i * d;
      float* oi = os + i * d;
      double ss = 0.0;
      for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(xi[j]) * xi[j];
      const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
      for (int64_t j = 0; j < d; ++j) oi[j] = xi[j] * scale * ws[j];
    }
    return Status::ok();
  }

  Status matmul(const Tensor& x, const Tensor& w, Tensor& out) override {
    PD_RETURN_IF_ERROR(expect_f32(x, "matmul", "x"));
    PD_RETURN_IF_ERROR(expect_f32(out, "matmul", "out"));
    const int64_t k = w.ne[0], n = w.n_rows(), m = x.n_rows();
    if (x.ne[0] != k || out.ne[0] != n || out.n_rows() < m)
      return Status::invalid_argument("matmul: shape mismatch (x [" + std::to_string(x.ne[0]) + ", " +
                                      std::to_string(m) + "], w [" + std::to_string(k) + ", " +
                                      std::to_string(n) + "], out [" + std::to_string(out.ne[0]) + "])");
    if (k % cpu::block_elems(w.type) != 0) return Status::invalid_argument("matmul: k not a multiple of the block size");
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

  Status rope(Tensor& x, std::span<const int32_t> positions, float freq_base) override {
    PD_RETURN_IF_ERROR(expect_f32(x, "rope", "x"));
    const int64_t hd = x.ne[0], nh = x.ne[1], nt = x.ne[2];
    if (hd % 2 != 0 || static_cast<int64_t>(positions.size()) < nt)
      return Status::invalid_argument("rope: odd head_dim or too few positions");
    if (static_cast<int64_t>(inv_freq_.size()) != hd / 2 || inv_freq_base_ != freq_base) {
      inv_freq_.resize(hd / 2);
      for (int64_t i = 0; i < hd / 2; ++i)
        inv_freq_[i] = std::pow(static_cast<double>(freq_base), -2.0 * static_cast<double>(i) / static_cast<double>(hd));
      inv_freq_base_ = freq_base;
    }
    float* xs = f32(x);
#pragma omp parallel for num_threads(n_threads_) schedule(static) if (nt > 4)
    for (int64_t t = 0; t < nt; ++t) {
      const double pos = positions[t];
      float cs[256], sn[256];
      for (int64_t i = 0; i < hd / 2; ++i) {
        const double theta = pos * inv_freq_[i];
        cs[i] = static_cast<float>(std::cos(theta));
        sn[i] = static_cast<float>(std::sin(theta));
      }
      for (int64_t h = 0; h < nh; ++h) {
        float* v = xs + (t * nh + h) * hd;
        for (int64_t i = 0; i < hd / 2; ++i) {
          const float a = v[2 * i], b = v[2 * i + 1];
          v[2 * i] = a * cs[i] - b * sn[i];
          v[2 * i + 1] = a * sn[i] + b * cs[i];
        }
      }
    }
    return Status::ok();
  }

  Status swiglu(const Tensor& gate, const Tensor& up, Tensor& out) override {
    const int64_t n = gate.n_elements();
    if (up.n_elements() != n || out.n_elements() < n) return Status::invalid_argument("swiglu: shape mismatch");
    const float* g = f32(gate);
    const float* u = f32(up);
    float* o = f32(out);
#pragma omp parallel for num_threads(n_threads_) schedule(static) if (n > 4096)
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    return Status::ok();
  }

  Status add(const Tensor& a, const Tensor& b, Tensor& out) override {
    const int64_t n = a.n_elements();
    if (b.n_elements() != n || out.n_elements() < n) return Status::invalid_argument("add: shape mismatch");
    const float* as = f32(a);
    const float* bs = f32(b);
    float* o = f32(out);
#pragma omp parallel for num_threads(n_threads_) schedule(static) if (n > 4096)
    for (int64_t i = 0; i < n; ++i) o[i] = as[i] + bs[i];
    return Status::ok();
  }

  Status kv_write(BackendBuffer& cache, const KvCacheLayout& L, int layer, const Tensor& k, const Tensor& v,
                  std::span<const int32_t> slots) override {
    if (L.dtype != GgmlType::kF32) return Status::unsupported("cpu: KV cache dtype must be F32");
    const int64_t hd = L.head_dim, nkv = L.n_kv_heads;
    if (k.ne[0] != hd || k.ne[1] != nkv || v.ne[0] != hd || v.ne[1] != nkv)
      return Status::invalid_argument("kv_write: k/v shape does not match the cache layout");
    const int64_t n = static_cast<int64_t>(slots.size());
    uint8_t* base = static_cast<uint8_t*>(cache.data());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t block = slots[i] / L.block_size, off = slots[i] % L.block_size;
      if (slots[i] < 0 || block >= L.num_blocks) return Status::invalid_argument("kv_write: slot out of range");
      float* kb = reinterpret_cast<float*>(base + L.offset(layer, 0, block));
      float* vb = reinterpret_cast<float*>(base + L.offset(layer, 1, block));
      for (int64_t g = 0; g < nkv; ++g) {
        std::memcpy(kb + (g * L.block_size + off) * hd, f32(k) + (i * nkv + g) * hd, hd * sizeof(float));
        std::memcpy(vb + (g * L.block_size + off) * hd, f32(v) + (i * nkv + g) * hd, hd * sizeof(float));
      }
    }
    return Status::ok();
  }

  Status paged_attention(const Tensor& q, const BackendBuffer& cache, const KvCacheLayout& L, int layer,
                         std::span<const AttentionToken> tokens,
                         std::span<const std::span<const int32_t>> block_tables, float scale,
                         Tensor& out) override {
    if (L.dtype != GgmlType::kF32) return Status::unsupported("cpu: KV cache dtype must be F32");
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
#pragma omp parallel for collapse(2) num_threads(n_threads_) schedule(dynamic, 1)
    for (int64_t t = 0; t < nt; ++t) {
      for (int64_t h = 0; h < nh; ++h) {
        const AttentionToken tok = tokens[t];
        const std::span<const int32_t> table = block_tables[tok.seq];
        const int64_t g = h / group;
        const float* qv = qs + (t * nh + h) * hd;
        float acc[256];
        for (int64_t j = 0; j < hd; ++j) acc[j] = 0.0f;
        float m = -std::numeric_limits<float>::infinity();
        float l = 0.0f;
        const int64_t n_ctx = tok.position + 1;
        for (int64_t p0 = 0; p0 < n_ctx; p0 += bs) {
          const int64_t block = table[p0 / bs];
          const float* kb = reinterpret_cast<const float*>(base + L.offset(layer, 0, block)) + g * bs * hd;
          const float* vb = reinterpret_cast<const float*>(base + L.offset(layer, 1, block)) + g * bs * hd;
          const int64_t n_in = std::min(bs, n_ctx - p0);
          float s[256];
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t r = 0; r < n_in; ++r) {
            const float* kr = kb + r * hd;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < hd; ++j) dot += qv[j] * kr[j];
            s[r] = dot * scale;
            block_max = std::max(block_max, s[r]);
          }
          const float m_new = std::max(m, block_max);
          const float correction = std::exp(m - m_new);
          l *= correction;
          for (int64_t j = 0; j < hd; ++j) acc[j] *= correction;
          for (int64_t r = 0; r < n_in; ++r) {
            const float p = std::exp(s[r] - m_new);
            l += p;
            const float* vr = vb + r * hd;
#pragma omp simd
            for (int64_t j = 0; j < hd; ++j) acc[j] += p * vr[j];
          }
          m = m_new;
        }
        float* ov = os + (t * nh + h) * hd;
        const float inv_l = 1.0f / l;
        for (int64_t j = 0; j < hd; ++j) ov[j] = acc[j] * inv_l;
      }
    }
    return Status::ok();
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
  std::vector<std::vector<float>> panel_bufs_;  // per-thread dequantized weight panels
  std::vector<double> inv_freq_;
  float inv_freq_base_ = 0.0f;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const CpuBackendConfig& cfg) { return std::make_unique<CpuBackend>(cfg); }

}  // namespace pd
