// CUDA kernels of the CUDA backend. Straightforward, correctness-first: each
// computes what the CPU backend's kernels compute (backend/cpu/), in fp32,
// with the same decoding of ggml's block formats.
#include "backend/cuda/cuda_kernels.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

namespace pd::cuda {
namespace {

constexpr int kQK = 32;  // elements per Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 block (K-quants: kQK_K)
constexpr int kThreads = 256;

// Blocks for a grid-stride loop over `total` items (never 0 for total > 0).
unsigned grid_for(int64_t total, int threads) {
  const int64_t blocks = (total + threads - 1) / threads;
  return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(blocks, 1), int64_t{1} << 20));
}

// ---- element decoding (ggml block formats; see gguf/ggml_types.h)

__device__ __forceinline__ float fp16_bits_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float bf16_bits_to_float(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}
// Little-endian 16-bit load that needs no alignment (Q4_0 / Q8_0 blocks are 18 / 34 bytes).
__device__ __forceinline__ uint16_t load_u16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (static_cast<uint16_t>(p[1]) << 8));
}

// Element e of a row of type T. Products are rounded separately (no FMA) so
// the result is the one the scalar CPU decoder produces.
template <GgmlType T>
__device__ __forceinline__ float load_elem(const uint8_t* row, int64_t e) {
  if constexpr (T == GgmlType::kF32) {
    return reinterpret_cast<const float*>(row)[e];
  } else if constexpr (T == GgmlType::kF16) {
    return fp16_bits_to_float(load_u16(row + 2 * e));
  } else if constexpr (T == GgmlType::kBF16) {
    return bf16_bits_to_float(load_u16(row + 2 * e));
  } else if constexpr (T == GgmlType::kQ4_0) {
    const uint8_t* b = row + (e / kQK) * sizeof(BlockQ4_0);
    const int j = static_cast<int>(e % kQK);
    const uint8_t byte = b[2 + (j & 15)];
    const int q = j < 16 ? (byte & 0x0F) : (byte >> 4);
    return __fmul_rn(fp16_bits_to_float(load_u16(b)), static_cast<float>(q - 8));
  } else if constexpr (T == GgmlType::kQ4_1) {
    const uint8_t* b = row + (e / kQK) * sizeof(BlockQ4_1);
    const int j = static_cast<int>(e % kQK);
    const uint8_t byte = b[4 + (j & 15)];
    const int q = j < 16 ? (byte & 0x0F) : (byte >> 4);
    return __fadd_rn(__fmul_rn(fp16_bits_to_float(load_u16(b)), static_cast<float>(q)),
                     fp16_bits_to_float(load_u16(b + 2)));
  } else if constexpr (T == GgmlType::kQ8_0) {
    const uint8_t* b = row + (e / kQK) * sizeof(BlockQ8_0);
    const int j = static_cast<int>(e % kQK);
    return __fmul_rn(fp16_bits_to_float(load_u16(b)), static_cast<float>(static_cast<int8_t>(b[2 + j])));
  } else if constexpr (T == GgmlType::kQ5_0 || T == GgmlType::kQ5_1) {
    constexpr bool has_min = T == GgmlType::kQ5_1;
    const uint8_t* b = row + (e / kQK) * (has_min ? sizeof(BlockQ5_1) : sizeof(BlockQ5_0));
    const int j = static_cast<int>(e % kQK);
    const uint8_t* qh = b + (has_min ? 4 : 2);  // bit j of the little-endian u32: element j's fifth bit
    const uint8_t byte = qh[4 + (j & 15)];
    const int q = (j < 16 ? (byte & 0x0F) : (byte >> 4)) | (((qh[j / 8] >> (j % 8)) & 1) << 4);
    const float d = fp16_bits_to_float(load_u16(b));
    if constexpr (has_min) return __fadd_rn(__fmul_rn(d, static_cast<float>(q)), fp16_bits_to_float(load_u16(b + 2)));
    return __fmul_rn(static_cast<float>(q - 16), d);
  } else if constexpr (T == GgmlType::kQ4_K || T == GgmlType::kQ5_K) {
    constexpr bool five = T == GgmlType::kQ5_K;
    const uint8_t* b = row + (e / kQK_K) * (five ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K));
    const int i = static_cast<int>(e % kQK_K), c = i / 64, hi = (i % 64) / 32, l = i % 32, sub = 2 * c + hi;
    const uint8_t* scales = b + 4;
    const uint8_t byte = b[(five ? 48 : 16) + 32 * c + l];
    int q = hi ? (byte >> 4) : (byte & 0x0F);
    if constexpr (five) q += ((b[16 + l] >> sub) & 1) ? 16 : 0;
    int sc, m;  // kquant_scale_min
    if (sub < 4) {
      sc = scales[sub] & 63;
      m = scales[sub + 4] & 63;
    } else {
      sc = (scales[sub + 4] & 0xF) | ((scales[sub - 4] >> 6) << 4);
      m = (scales[sub + 4] >> 4) | ((scales[sub] >> 6) << 4);
    }
    const float d1 = __fmul_rn(fp16_bits_to_float(load_u16(b)), static_cast<float>(sc));
    const float m1 = __fmul_rn(fp16_bits_to_float(load_u16(b + 2)), static_cast<float>(m));
    return __fsub_rn(__fmul_rn(d1, static_cast<float>(q)), m1);
  } else if constexpr (T == GgmlType::kQ6_K) {
    const uint8_t* b = row + (e / kQK_K) * sizeof(BlockQ6_K);
    // Element 128n + 32k + l: low 4 bits in ql[64n + l + 32 (k & 1)] (high
    // nibble for k >= 2), high 2 bits at 2k of qh[32n + l], scale 8n + l/16 + 2k.
    const int i = static_cast<int>(e % kQK_K), n = i / 128, k = (i % 128) / 32, l = i % 32;
    const uint8_t lo = b[64 * n + l + 32 * (k & 1)];
    const int q = ((k >= 2 ? lo >> 4 : lo & 0x0F) | (((b[128 + 32 * n + l] >> (2 * k)) & 3) << 4)) - 32;
    const float sc = static_cast<float>(static_cast<int8_t>(b[192 + 8 * n + l / 16 + 2 * k]));
    return __fmul_rn(__fmul_rn(fp16_bits_to_float(load_u16(b + 208)), sc), static_cast<float>(q));
  } else {  // kQ8_K
    const uint8_t* b = row + (e / kQK_K) * sizeof(BlockQ8_K);
    float d;
    memcpy(&d, b, 4);
    return __fmul_rn(d, static_cast<float>(static_cast<int8_t>(b[4 + e % kQK_K])));
  }
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the thread block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
template <typename T>
__device__ T block_sum(T v) {
  __shared__ T partial[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < n_warps; ++w) total += partial[w];
  return total;
}

// ---- weights

// One thread block per row.
template <GgmlType T>
__global__ void dequant_rows_kernel(const uint8_t* w, size_t row_bytes, int64_t k, int64_t rows, float* dst) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const uint8_t* row = w + static_cast<size_t>(r) * row_bytes;
    float* out = dst + r * k;
    for (int64_t e = threadIdx.x; e < k; e += blockDim.x) out[e] = load_elem<T>(row, e);
  }
}

template <GgmlType T>
__global__ void get_rows_kernel(const uint8_t* table, size_t row_bytes, int64_t d, const int32_t* ids, int64_t n,
                                float* out) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const uint8_t* row = table + static_cast<size_t>(ids[i]) * row_bytes;
    float* o = out + i * d;
    for (int64_t e = threadIdx.x; e < d; e += blockDim.x) o[e] = load_elem<T>(row, e);
  }
}

// One warp per weight row j: lane l decodes elements l, l + 32, ... (for the
// block types: element l of every block) and dots them with the m inputs.
constexpr int kMatvecWarps = 4;
template <GgmlType T>
__global__ void matvec_kernel(const uint8_t* w, size_t row_bytes, int64_t k, int64_t n, const float* x, int m,
                              float* out, int64_t out_stride) {
  const int lane = threadIdx.x % 32;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kMatvecWarps + threadIdx.x / 32;
  if (j >= n) return;  // uniform per warp
  const uint8_t* row = w + static_cast<size_t>(j) * row_bytes;
  float acc[kMaxFusedRows];
#pragma unroll
  for (int i = 0; i < kMaxFusedRows; ++i) acc[i] = 0.0f;
  for (int64_t e = lane; e < k; e += 32) {
    const float wv = load_elem<T>(row, e);
#pragma unroll
    for (int i = 0; i < kMaxFusedRows; ++i) {
      if (i < m) acc[i] += wv * x[i * k + e];
    }
  }
#pragma unroll
  for (int i = 0; i < kMaxFusedRows; ++i) {
    if (i < m) {
      const float v = warp_sum(acc[i]);
      if (lane == 0) out[i * out_stride + j] = v;
    }
  }
}

// ---- activations

// One thread block per row; the sum of squares is accumulated in double.
__global__ void rms_norm_kernel(const float* x, const float* w, int64_t d, int64_t n, float eps, float* out) {
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const float* xr = x + r * d;
    double ss = 0.0;
    for (int64_t e = threadIdx.x; e < d; e += blockDim.x) ss += static_cast<double>(xr[e]) * xr[e];
    ss = block_sum(ss);
    const float scale = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(d) + eps));
    float* o = out + r * d;
    for (int64_t e = threadIdx.x; e < d; e += blockDim.x) o[e] = __fmul_rn(__fmul_rn(xr[e], scale), w[e]);
  }
}

// One thread block per token; thread i owns pair i of every head. Angles in
// double like the CPU backend (positions reach 1e5+, where fp32 angles drift).
// Pair i is (2i, 2i+1), or (i, i + hd/2) in NEOX mode.
__global__ void rope_kernel(float* x, int64_t hd, int64_t nh, int64_t nt, const int32_t* positions,
                            float freq_base, bool neox, float freq_scale, const float* freq_factors) {
  const int64_t stride = neox ? 1 : 2, second = neox ? hd / 2 : 1;
  for (int64_t t = blockIdx.x; t < nt; t += gridDim.x) {
    const double pos = positions[t];
    for (int64_t i = threadIdx.x; i < hd / 2; i += blockDim.x) {
      double inv_freq =
          pow(static_cast<double>(freq_base), -2.0 * static_cast<double>(i) / static_cast<double>(hd));
      if (freq_scale != 1.0f) inv_freq *= freq_scale;
      if (freq_factors != nullptr) inv_freq /= freq_factors[i];
      double s, c;
      sincos(pos * inv_freq, &s, &c);
      const float cs = static_cast<float>(c), sn = static_cast<float>(s);
      for (int64_t h = 0; h < nh; ++h) {
        float* v = x + (t * nh + h) * hd + stride * i;
        const float a = v[0], b = v[second];
        v[0] = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
        v[second] = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs));
      }
    }
  }
}

__global__ void swiglu_kernel(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

// GELU, tanh approximation, with ggml's constants (ggml_gelu_f32; cpu_kernels.h's gelu_tanh).
__global__ void geglu_kernel(const float* gate, const float* up, int64_t n, float* out) {
  constexpr float kCoefA = 0.044715f;
  constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = 0.5f * g * (1.0f + tanhf(kSqrt2OverPi * g * (1.0f + kCoefA * g * g))) * up[i];
  }
}

__global__ void add_kernel(const float* a, const float* b, int64_t n, float* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = a[i] + b[i];
}

__global__ void add_row_kernel(const float* a, const float* b, int64_t d, int64_t n, float* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = a[i] + b[i % d];
}

__global__ void scale_kernel(const float* x, float s, int64_t n, float* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = x[i] * s;
}

// ---- paged KV cache

__device__ __forceinline__ uint8_t* kv_row(const KvLayerView& kv, size_t kind_offset, int32_t block, int g, int off) {
  return kv.base + kind_offset + static_cast<size_t>(block) * kv.block_bytes +
         (static_cast<size_t>(g) * kv.block_size + off) * kv.row_bytes;
}

// Stores hd floats as one cache row of type T. Q8_0: one thread per 32-element
// block, with ggml's reference arithmetic (d = amax / 127, q = round(x / d)).
template <GgmlType T>
__device__ void store_row(const float* src, uint8_t* dst, int hd) {
  if constexpr (T == GgmlType::kF32) {
    float* d = reinterpret_cast<float*>(dst);
    for (int e = threadIdx.x; e < hd; e += blockDim.x) d[e] = src[e];
  } else if constexpr (T == GgmlType::kF16) {
    __half* d = reinterpret_cast<__half*>(dst);
    for (int e = threadIdx.x; e < hd; e += blockDim.x) d[e] = __float2half_rn(src[e]);
  } else {  // kQ8_0
    for (int b = threadIdx.x; b < hd / kQK; b += blockDim.x) {
      const float* x = src + b * kQK;
      uint8_t* out = dst + b * sizeof(BlockQ8_0);
      float amax = 0.0f;
      for (int j = 0; j < kQK; ++j) amax = fmaxf(amax, fabsf(x[j]));
      const float d = __fdiv_rn(amax, 127.0f);
      const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
      // The scale in one 16-bit store, as F16 rows are written (rows and 34-byte
      // blocks start at even offsets). Stored as two separate bytes, its low byte
      // came out 0 on an H200 (CUDA 13.0, sm_90; the PTX looked right, the
      // machine code was not inspected): ctest's gpu kv_write case caught it.
      *reinterpret_cast<__half*>(out) = __float2half_rn(d);
      for (int j = 0; j < kQK; ++j) out[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(roundf(__fmul_rn(x[j], id))));
    }
  }
}

// One thread block per (token, kv head).
template <GgmlType T>
__global__ void kv_write_kernel(KvLayerView kv, const float* k, const float* v, const int32_t* slots, int64_t n) {
  const int64_t n_items = n * kv.n_kv_heads;
  for (int64_t item = blockIdx.x; item < n_items; item += gridDim.x) {
    const int64_t i = item / kv.n_kv_heads;
    const int g = static_cast<int>(item % kv.n_kv_heads);
    const int32_t slot = slots[i];
    const int32_t block = slot / kv.block_size;
    const int off = slot % kv.block_size;
    store_row<T>(k + item * kv.head_dim, kv_row(kv, kv.k_offset, block, g, off), kv.head_dim);
    store_row<T>(v + item * kv.head_dim, kv_row(kv, kv.v_offset, block, g, off), kv.head_dim);
  }
}

// One thread block of kAttnThreads per (token, head). The context is walked in
// chunks of kAttnChunk positions: each warp scores positions (q . k, lanes
// split head_dim), then an online-softmax update rescales the accumulator;
// thread t owns output dims t and t + kAttnThreads.
constexpr int kAttnThreads = 128;
constexpr int kAttnChunk = 128;
static_assert(2 * kAttnThreads >= kMaxAttnHeadDim, "each thread owns at most two output dims");
static_assert(kAttnChunk <= kAttnThreads, "one thread per position of a chunk computes its weight");

template <GgmlType T>
__global__ void __launch_bounds__(kAttnThreads)
    paged_attention_kernel(KvLayerView kv, const float* q, int n_heads, const int32_t* tokens, int64_t n_tokens,
                           const int32_t* table_offsets, const int32_t* tables, float scale, int window,
                           float* out) {
  __shared__ float q_sh[kMaxAttnHeadDim];
  __shared__ float s_sh[kAttnChunk];
  __shared__ float p_sh[kAttnChunk];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  constexpr int kWarps = kAttnThreads / 32;
  const int hd = kv.head_dim, bs = kv.block_size;
  const int group = n_heads / kv.n_kv_heads;

  for (int64_t item = blockIdx.x; item < n_tokens * n_heads; item += gridDim.x) {
    const int64_t t = item / n_heads;
    const int h = static_cast<int>(item % n_heads);
    const int g = h / group;
    const int32_t position = tokens[2 * t];
    const int32_t* table = tables + table_offsets[tokens[2 * t + 1]];

    __syncthreads();  // the previous item is done with the shared arrays
    const float* qv = q + item * hd;
    for (int e = tid; e < hd; e += kAttnThreads) q_sh[e] = qv[e];
    __syncthreads();

    float acc0 = 0.0f, acc1 = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const int64_t n_ctx = static_cast<int64_t>(position) + 1;
    const int64_t first = window > 0 && n_ctx > window ? n_ctx - window : 0;  // sliding window: (p - window, p]
    for (int64_t c0 = first; c0 < n_ctx; c0 += kAttnChunk) {
      const int n_in = n_ctx - c0 < kAttnChunk ? static_cast<int>(n_ctx - c0) : kAttnChunk;
      for (int r = warp; r < n_in; r += kWarps) {
        const int64_t p = c0 + r;
        const uint8_t* kr = kv_row(kv, kv.k_offset, table[p / bs], g, static_cast<int>(p % bs));
        float dot = 0.0f;
        for (int e = lane; e < hd; e += 32) dot += q_sh[e] * load_elem<T>(kr, e);
        dot = warp_sum(dot);
        if (lane == 0) s_sh[r] = dot * scale;
      }
      __syncthreads();
      float chunk_max = -INFINITY;
      for (int r = 0; r < n_in; ++r) chunk_max = fmaxf(chunk_max, s_sh[r]);
      const float m_new = fmaxf(m, chunk_max);
      const float correction = expf(m - m_new);  // 0 on the first chunk (m = -inf)
      if (tid < n_in) p_sh[tid] = expf(s_sh[tid] - m_new);
      __syncthreads();
      float p_sum = 0.0f;
      acc0 *= correction;
      acc1 *= correction;
      for (int r = 0; r < n_in; ++r) {
        const int64_t p = c0 + r;
        const float pr = p_sh[r];
        p_sum += pr;
        const uint8_t* vr = kv_row(kv, kv.v_offset, table[p / bs], g, static_cast<int>(p % bs));
        if (tid < hd) acc0 += pr * load_elem<T>(vr, tid);
        if (tid + kAttnThreads < hd) acc1 += pr * load_elem<T>(vr, tid + kAttnThreads);
      }
      l = l * correction + p_sum;
      m = m_new;
      __syncthreads();  // s_sh / p_sh are rewritten by the next chunk
    }
    float* ov = out + item * hd;
    const float inv_l = 1.0f / l;
    if (tid < hd) ov[tid] = acc0 * inv_l;
    if (tid + kAttnThreads < hd) ov[tid + kAttnThreads] = acc1 * inv_l;
  }
}

// Calls f with the weight type as a template argument (std::integral_constant-like).
template <GgmlType T>
struct TypeTag {
  static constexpr GgmlType value = T;
};
template <typename F>
cudaError_t dispatch_type(GgmlType type, F&& f) {
  switch (type) {
    case GgmlType::kF32: return f(TypeTag<GgmlType::kF32>{});
    case GgmlType::kF16: return f(TypeTag<GgmlType::kF16>{});
    case GgmlType::kBF16: return f(TypeTag<GgmlType::kBF16>{});
    case GgmlType::kQ4_0: return f(TypeTag<GgmlType::kQ4_0>{});
    case GgmlType::kQ4_1: return f(TypeTag<GgmlType::kQ4_1>{});
    case GgmlType::kQ8_0: return f(TypeTag<GgmlType::kQ8_0>{});
    case GgmlType::kQ5_0: return f(TypeTag<GgmlType::kQ5_0>{});
    case GgmlType::kQ5_1: return f(TypeTag<GgmlType::kQ5_1>{});
    case GgmlType::kQ4_K: return f(TypeTag<GgmlType::kQ4_K>{});
    case GgmlType::kQ5_K: return f(TypeTag<GgmlType::kQ5_K>{});
    case GgmlType::kQ6_K: return f(TypeTag<GgmlType::kQ6_K>{});
    case GgmlType::kQ8_K: return f(TypeTag<GgmlType::kQ8_K>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t dequant_rows(GgmlType type, const void* w, size_t row_bytes, int64_t k, int64_t rows, float* dst,
                         cudaStream_t stream) {
  if (rows <= 0 || k <= 0) return cudaSuccess;
  return dispatch_type(type, [&](auto tag) {
    dequant_rows_kernel<decltype(tag)::value><<<grid_for(rows, 1), kThreads, 0, stream>>>(
        static_cast<const uint8_t*>(w), row_bytes, k, rows, dst);
    return cudaGetLastError();
  });
}

cudaError_t get_rows(GgmlType type, const void* table, size_t row_bytes, int64_t d, const int32_t* ids, int64_t n,
                     float* out, cudaStream_t stream) {
  if (n <= 0 || d <= 0) return cudaSuccess;
  return dispatch_type(type, [&](auto tag) {
    get_rows_kernel<decltype(tag)::value><<<grid_for(n, 1), kThreads, 0, stream>>>(
        static_cast<const uint8_t*>(table), row_bytes, d, ids, n, out);
    return cudaGetLastError();
  });
}

cudaError_t matvec(GgmlType type, const void* w, size_t row_bytes, int64_t k, int64_t n, const float* x, int m,
                   float* out, int64_t out_stride, cudaStream_t stream) {
  if (n <= 0 || m <= 0) return cudaSuccess;
  if (m > kMaxFusedRows) return cudaErrorInvalidValue;
  const int64_t blocks = (n + kMatvecWarps - 1) / kMatvecWarps;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  return dispatch_type(type, [&](auto tag) {
    matvec_kernel<decltype(tag)::value><<<static_cast<unsigned>(blocks), kMatvecWarps * 32, 0, stream>>>(
        static_cast<const uint8_t*>(w), row_bytes, k, n, x, m, out, out_stride);
    return cudaGetLastError();
  });
}

cudaError_t rms_norm(const float* x, const float* w, int64_t d, int64_t n, float eps, float* out,
                     cudaStream_t stream) {
  if (n <= 0 || d <= 0) return cudaSuccess;
  rms_norm_kernel<<<grid_for(n, 1), kThreads, 0, stream>>>(x, w, d, n, eps, out);
  return cudaGetLastError();
}

cudaError_t rope(float* x, int64_t hd, int64_t nh, int64_t nt, const int32_t* positions, float freq_base, bool neox,
                 float freq_scale, const float* freq_factors, cudaStream_t stream) {
  if (nt <= 0 || nh <= 0 || hd <= 0) return cudaSuccess;
  rope_kernel<<<grid_for(nt, 1), 128, 0, stream>>>(x, hd, nh, nt, positions, freq_base, neox, freq_scale,
                                                   freq_factors);
  return cudaGetLastError();
}

cudaError_t swiglu(const float* gate, const float* up, int64_t n, float* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  swiglu_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(gate, up, n, out);
  return cudaGetLastError();
}

cudaError_t geglu(const float* gate, const float* up, int64_t n, float* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  geglu_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(gate, up, n, out);
  return cudaGetLastError();
}

cudaError_t add(const float* a, const float* b, int64_t n, float* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  add_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(a, b, n, out);
  return cudaGetLastError();
}

cudaError_t add_row(const float* a, const float* b, int64_t d, int64_t rows, float* out, cudaStream_t stream) {
  if (d <= 0 || rows <= 0) return cudaSuccess;
  add_row_kernel<<<grid_for(d * rows, kThreads), kThreads, 0, stream>>>(a, b, d, d * rows, out);
  return cudaGetLastError();
}

cudaError_t scale(const float* x, float s, int64_t n, float* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  scale_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(x, s, n, out);
  return cudaGetLastError();
}

cudaError_t kv_write(const KvLayerView& kv, const float* k, const float* v, const int32_t* slots, int64_t n,
                     cudaStream_t stream) {
  if (n <= 0 || kv.n_kv_heads <= 0 || kv.head_dim <= 0) return cudaSuccess;
  const unsigned grid = grid_for(n * kv.n_kv_heads, 1);
  switch (kv.dtype) {
    case GgmlType::kF32: kv_write_kernel<GgmlType::kF32><<<grid, 128, 0, stream>>>(kv, k, v, slots, n); break;
    case GgmlType::kF16: kv_write_kernel<GgmlType::kF16><<<grid, 128, 0, stream>>>(kv, k, v, slots, n); break;
    case GgmlType::kQ8_0: kv_write_kernel<GgmlType::kQ8_0><<<grid, 128, 0, stream>>>(kv, k, v, slots, n); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t paged_attention(const KvLayerView& kv, const float* q, int n_heads, const int32_t* tokens,
                            int64_t n_tokens, const int32_t* table_offsets, const int32_t* tables, float scale,
                            int window, float* out, cudaStream_t stream) {
  if (n_tokens <= 0 || n_heads <= 0) return cudaSuccess;
  if (kv.head_dim > kMaxAttnHeadDim || kv.n_kv_heads <= 0 || n_heads % kv.n_kv_heads != 0)
    return cudaErrorInvalidValue;
  const unsigned grid = grid_for(n_tokens * n_heads, 1);
  auto launch = [&](auto kernel) {
    kernel<<<grid, kAttnThreads, 0, stream>>>(kv, q, n_heads, tokens, n_tokens, table_offsets, tables, scale, window,
                                              out);
  };
  switch (kv.dtype) {
    case GgmlType::kF32: launch(paged_attention_kernel<GgmlType::kF32>); break;
    case GgmlType::kF16: launch(paged_attention_kernel<GgmlType::kF16>); break;
    case GgmlType::kQ8_0: launch(paged_attention_kernel<GgmlType::kQ8_0>); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace pd::cuda
