// CUDA kernels of the CUDA backend, behind plain launchers: device pointers
// in, work enqueued on `stream`, the launch error (cudaGetLastError) out.
// Arguments are validated by the caller (cuda_backend.cu); launchers assume
// them sane and return cudaSuccess without launching for empty work.
// Weight types: F32, F16, BF16, Q4_0, Q4_1, Q8_0, decoded bit-exactly as ggml.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "gguf/ggml_types.h"

namespace pd::cuda {

// Rows one matvec launch handles; larger batches are split by the caller.
inline constexpr int kMaxFusedRows = 8;
// Largest head_dim paged_attention supports (same limit as the CPU backend).
inline constexpr int kMaxAttnHeadDim = 256;

// dst[r, 0..k) = dequant(w row r) for r < rows.  w rows are row_bytes apart; dst [k, rows].
cudaError_t dequant_rows(GgmlType type, const void* w, size_t row_bytes, int64_t k, int64_t rows, float* dst,
                         cudaStream_t stream);

// out[i, :] = dequant(table row ids[i]).  ids: device [n]; out [d, n].
cudaError_t get_rows(GgmlType type, const void* table, size_t row_bytes, int64_t d, const int32_t* ids, int64_t n,
                     float* out, cudaStream_t stream);

// out[i, j] = sum_e x[i, e] * w[j, e] for i < m (m <= kMaxFusedRows), j < n.
// x [k, m] rows k apart; out rows out_stride apart.
cudaError_t matvec(GgmlType type, const void* w, size_t row_bytes, int64_t k, int64_t n, const float* x, int m,
                   float* out, int64_t out_stride, cudaStream_t stream);

// out = x / rms(x) * w per row.  x, out [d, n]; w [d].  out may alias x.
cudaError_t rms_norm(const float* x, const float* w, int64_t d, int64_t n, float eps, float* out,
                     cudaStream_t stream);

// Rotary embedding in place (see RopeSpec in backend.h): pairs (2i, 2i+1), or
// (i, i + hd/2) with neox; pair i turns by position * freq_scale *
// freq_base^(-2i/hd) / freq_factors[i].  x [hd, nh, nt]; positions: device [nt];
// freq_factors: device [hd/2] or nullptr (all 1).
cudaError_t rope(float* x, int64_t hd, int64_t nh, int64_t nt, const int32_t* positions, float freq_base, bool neox,
                 float freq_scale, const float* freq_factors, cudaStream_t stream);

// out = silu(gate) * up, out = gelu_tanh(gate) * up, out = a + b and out = x * s,
// elementwise over n (out may alias an input).
cudaError_t swiglu(const float* gate, const float* up, int64_t n, float* out, cudaStream_t stream);
cudaError_t geglu(const float* gate, const float* up, int64_t n, float* out, cudaStream_t stream);
cudaError_t add(const float* a, const float* b, int64_t n, float* out, cudaStream_t stream);
cudaError_t scale(const float* x, float s, int64_t n, float* out, cudaStream_t stream);
// out[r, j] = a[r, j] + b[j] for r < rows, j < d (out may alias a).
cudaError_t add_row(const float* a, const float* b, int64_t d, int64_t rows, float* out, cudaStream_t stream);

// One layer of the paged KV cache (see KvCacheLayout): F32, F16 or Q8_0 rows.
struct KvLayerView {
  GgmlType dtype = GgmlType::kF32;
  size_t row_bytes = 0;      // one token's one head
  uint8_t* base = nullptr;   // the cache buffer
  size_t k_offset = 0;       // byte offset of (layer, K, block 0)
  size_t v_offset = 0;       // byte offset of (layer, V, block 0)
  size_t block_bytes = 0;
  int block_size = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
};

// Token i's K and V (k, v: [head_dim, n_kv_heads, n]) go to slot slots[i] (device [n]),
// rounded as the CPU backend rounds them (fp16 to nearest even; q8_0 as ggml's
// reference quantizer), so both backends store the same bytes.
cudaError_t kv_write(const KvLayerView& kv, const float* k, const float* v, const int32_t* slots, int64_t n,
                     cudaStream_t stream);

// Causal attention over the paged cache, one thread block per (token, head).
//  tokens:        device [n_tokens] pairs {position, seq} (AttentionToken's layout)
//  table_offsets: device [n_seqs + 1]; sequence s's blocks are tables[table_offsets[s] ..]
//  q, out:        [head_dim, n_heads, n_tokens]; head_dim <= kMaxAttnHeadDim
//  window:        > 0: a token at position p attends to (p - window, p] only
cudaError_t paged_attention(const KvLayerView& kv, const float* q, int n_heads, const int32_t* tokens,
                            int64_t n_tokens, const int32_t* table_offsets, const int32_t* tables, float scale,
                            int window, float* out, cudaStream_t stream);

}  // namespace pd::cuda
