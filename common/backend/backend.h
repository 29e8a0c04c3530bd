// Backend: the only place that knows where tensors live and how ops run.
//
// The model's forward pass is written once against this interface. The CPU
// backend is always built; the CUDA backend is built when the toolkit is
// found (PD_USE_CUDA, seen only by backend_registry.cpp).
//
// Conventions
//  - Tensors are views {type, ne, data} into backend memory; ne is in ggml
//    order (ne[0] is the contiguous dimension), rows are ne[1] * ne[2] * ne[3].
//  - Activations are F32. Weights may be any supported GgmlType.
//  - Ops may run asynchronously; copy_to_host() and synchronize() wait.
//  - Host-side index arrays (token ids, positions, slots) are passed as spans
//    and may be released as soon as the call returns.
//  - One thread drives a backend at a time (a worker's engine loop).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "util/status.h"

namespace pd {

struct GgufTensorInfo;

struct Tensor {
  GgmlType type = GgmlType::kF32;
  std::array<int64_t, 4> ne{1, 1, 1, 1};
  void* data = nullptr;  // backend memory (host for CPU, device for CUDA)
  // How a weight's data is laid out: 0 = ggml rows as in the GGUF file; other
  // values are private to the backend that loaded it (the CPU backend repacks
  // quantized matrices for its integer kernels). Activations are always 0.
  uint8_t layout = 0;

  int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  int64_t n_rows() const { return ne[1] * ne[2] * ne[3]; }
  size_t row_bytes() const { return ggml_row_bytes(type, ne[0]); }
  size_t n_bytes() const { return row_bytes() * static_cast<size_t>(n_rows()); }
};

// Memory owned by a backend, freed when the buffer is destroyed.
class BackendBuffer {
 public:
  virtual ~BackendBuffer() = default;
  virtual void* data() = 0;
  virtual size_t size() const = 0;
};

// Layout of the paged KV cache in backend memory. For layer l, block b:
//   K: [n_kv_heads][block_size] rows of head_dim elements of `dtype`
//      at  base + ((l * 2 + 0) * num_blocks + b) * block_bytes
//   V: the same with 1 in place of 0.
// A row is one token's one head: head_dim floats (f32), halves (f16) or
// head_dim / 32 q8_0 blocks (q8_0). Each layer's K (and V) blocks are
// contiguous, so one layer of one sequence is a list of num_blocks-strided
// pieces (what the KV transport ships).
struct KvCacheLayout {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int block_size = 16;
  int64_t num_blocks = 0;
  GgmlType dtype = GgmlType::kF32;  // F32, F16 or Q8_0

  // Bytes of one token's one head.
  size_t row_bytes() const { return ggml_row_bytes(dtype, head_dim); }
  size_t block_bytes() const { return static_cast<size_t>(n_kv_heads) * block_size * row_bytes(); }
  // Byte offset of (layer, kind 0=K/1=V, block).
  size_t offset(int layer, int kind, int64_t block) const {
    return ((static_cast<size_t>(layer) * 2 + kind) * num_blocks + block) * block_bytes();
  }
  size_t total_bytes() const { return static_cast<size_t>(n_layers) * 2 * num_blocks * block_bytes(); }
};

// How rope() rotates (ggml's rope modes and frequency scalings). Pair i of a
// head turns by angle position * freq_scale * freq_base^(-2i / head_dim) /
// freq_factors[i] (ggml_rope_ext with ext_factor 0: no YaRN).
struct RopeSpec {
  float freq_base = 10000.0f;
  // false: adjacent pairs (x[2i], x[2i+1]), ggml's "normal" mode, matching the
  // permuted Q/K rows llama.cpp writes for Llama; true: pairs (x[i], x[i + d/2])
  // (GPT-NeoX's, used by Qwen2, Qwen3, Gemma 3, whose rows are not permuted).
  bool neox = false;
  float freq_scale = 1.0f;  // linear RoPE scaling: 1 / factor
  // Empty, or head_dim / 2 per-pair divisors of the frequency (Llama 3.x's
  // rope_freqs.weight). Host memory, read during the call.
  std::span<const float> freq_factors;
};

// Per query token: where it sits and which sequence's blocks it attends over.
struct AttentionToken {
  int32_t position;  // absolute position in its sequence; attends to [0, position]
  int32_t seq;       // index into the block-table list
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // ---- memory
  virtual Result<std::unique_ptr<BackendBuffer>> alloc(size_t bytes) = 0;
  // A weight tensor from the GGUF mapping. The CPU backend returns a zero-copy
  // view (valid while the GgufFile lives); others copy into `storage`.
  virtual Result<Tensor> load_weight(const GgufTensorInfo& info, std::unique_ptr<BackendBuffer>* storage) = 0;
  virtual Status copy_to_host(const Tensor& src, void* dst, size_t bytes) = 0;
  virtual Status copy_from_host(const void* src, Tensor& dst, size_t bytes) = 0;
  virtual Status synchronize() = 0;

  // ---- ops (activations F32)
  // out[i, :] = dequant(table[ids[i], :]).           table [d, vocab], out [d, n]
  virtual Status get_rows(const Tensor& table, std::span<const int32_t> ids, Tensor& out) = 0;
  // out = x / rms(x) * w, per row.                       x, out [d, n]; w [d]
  virtual Status rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) = 0;
  // out[i, j] = sum_k x[i, k] * w[j, k].                 x [k, m], w [k, n] (any type), out [n, m]
  virtual Status matmul(const Tensor& x, const Tensor& w, Tensor& out) = 0;
  // outs[i] = x * ws[i] for each i: several matmuls of one input (Q/K/V,
  // gate/up). By default one matmul() each; a backend may prepare the input
  // once and run them all in one parallel pass. Results equal matmul()'s.
  virtual Status matmul_multi(const Tensor& x, std::span<const Tensor* const> ws, std::span<Tensor* const> outs) {
    if (ws.size() != outs.size()) return Status::invalid_argument("matmul_multi: weight and output counts differ");
    for (size_t i = 0; i < ws.size(); ++i) PD_RETURN_IF_ERROR(matmul(x, *ws[i], *outs[i]));
    return Status::ok();
  }
  // Rotary embedding in place, as `spec` says, of each head of each token.
  // x [head_dim, n_heads, n_tokens]; positions[n_tokens].
  virtual Status rope(Tensor& x, std::span<const int32_t> positions, const RopeSpec& spec) = 0;
  // The plain Llama rotation: adjacent pairs, no scaling.
  Status rope(Tensor& x, std::span<const int32_t> positions, float freq_base) {
    RopeSpec spec;
    spec.freq_base = freq_base;
    return rope(x, positions, spec);
  }
  // out = silu(gate) * up, elementwise.
  virtual Status swiglu(const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  // out = gelu(gate) * up, elementwise, with GELU's tanh approximation
  // 0.5 g (1 + tanh(sqrt(2/pi) g (1 + 0.044715 g^2))) in fp32 (ggml's
  // ggml_gelu_f32 and PyTorch's gelu(approximate="tanh"); ggml's CPU build
  // looks the GELU up in an fp16 table instead).
  virtual Status geglu(const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  // out = a + b, elementwise (out may alias a). b either has a's element
  // count or is one row of a.ne[0] elements, added to every row of a (a bias).
  virtual Status add(const Tensor& a, const Tensor& b, Tensor& out) = 0;
  // out = x * s, elementwise (out may alias x).
  virtual Status scale(const Tensor& x, float s, Tensor& out) = 0;

  // ---- paged KV cache
  // Writes token i's K and V (k, v: [head_dim, n_kv_heads, n_tokens]) of `layer`
  // into cache slot slots[i] = block * block_size + offset.
  virtual Status kv_write(BackendBuffer& cache, const KvCacheLayout& layout, int layer, const Tensor& k,
                          const Tensor& v, std::span<const int32_t> slots) = 0;
  // Causal attention of each query token over its own sequence's paged KV
  // (positions 0..tokens[i].position, written beforehand with kv_write).
  // q, out: [head_dim, n_heads, n_tokens]; block_tables[s] lists sequence s's
  // blocks in order; n_heads must be a multiple of n_kv_heads (grouped-query).
  // window > 0: sliding-window attention, a token at position p attends to
  // positions (p - window, p] only (Gemma 3's local layers); blocks wholly
  // before that are not read. 0: the whole prefix.
  virtual Status paged_attention(const Tensor& q, const BackendBuffer& cache, const KvCacheLayout& layout,
                                 int layer, std::span<const AttentionToken> tokens,
                                 std::span<const std::span<const int32_t>> block_tables, float scale, int window,
                                 Tensor& out) = 0;
  // Full causal attention (no window).
  Status paged_attention(const Tensor& q, const BackendBuffer& cache, const KvCacheLayout& layout, int layer,
                         std::span<const AttentionToken> tokens,
                         std::span<const std::span<const int32_t>> block_tables, float scale, Tensor& out) {
    return paged_attention(q, cache, layout, layer, tokens, block_tables, scale, 0, out);
  }
  // Copies one block (all layers, K and V) — copy-on-write of a shared block.
  virtual Status kv_copy_block(BackendBuffer& cache, const KvCacheLayout& layout, int64_t src, int64_t dst) = 0;

  // ---- KV bytes to and from host memory (checksums, host-staged transfers)
  // Copies pieces of `piece_bytes` at byte `offsets` of `cache` into `host`,
  // back to back in the order given (a KvRegion's wire order), and waits for
  // the copy and for every op enqueued before it. The default reads
  // cache.data() directly (host memory).
  virtual Status kv_gather(const BackendBuffer& cache, std::span<const int64_t> offsets, size_t piece_bytes,
                           void* host);
  // The reverse: contiguous `host` bytes into the pieces; done on return.
  virtual Status kv_scatter(BackendBuffer& cache, std::span<const int64_t> offsets, size_t piece_bytes,
                            const void* host);

  // ---- where memory lives (the KV transport picks its path from these)
  // True when buffers are device memory the host cannot address (CUDA).
  virtual bool device_memory() const { return false; }
  // A stable identity of the device (CUDA: "GPU-<uuid>"), "" for host memory.
  // Two processes with the same identity share one device.
  virtual std::string device_id() const { return ""; }
  // The stream every op is enqueued on (CUDA: a cudaStream_t), nullptr where
  // ops are synchronous. A device transport orders its reads of the KV cache
  // after the ops enqueued here, and this stream's later ops after its writes.
  virtual void* native_stream() { return nullptr; }
  // OK while the device can run work. After an op failed, an error here means
  // the device itself is gone (a sticky CUDA fault: every later call fails
  // too), not just that op: the rank must stop and be handled as a failed one.
  virtual Status device_health() { return Status::ok(); }
};

struct BackendConfig {
  std::string kind = "cpu";  // "cpu" or "cuda"
  int n_threads = 0;         // CPU: 0 = all cores
  int device = 0;            // CUDA device ordinal
  // CPU: same matmul kernel for every batch size (see CpuBackendConfig).
  bool batch_invariant = true;
  // CPU: 8-bit activations and integer dot products for quantized weights
  // (see CpuBackendConfig::int8_activations).
  bool int8_activations = true;
  // CUDA: GEMMs on TF32 tensor cores (see CudaBackendConfig::tf32).
  bool cuda_tf32 = false;
};

// For kv_gather / kv_scatter implementations: InvalidArgument naming `op` when
// a piece of `piece_bytes` at one of `offsets` lies outside a buffer of
// `buffer_bytes`.
Status check_kv_pieces(size_t buffer_bytes, std::span<const int64_t> offsets, size_t piece_bytes, const char* op);

// Creates a backend. Unsupported (naming the kind) when it wasn't built or no
// device exists.
Result<std::unique_ptr<Backend>> create_backend(const BackendConfig& cfg);
// Backend kinds compiled into this binary, e.g. {"cpu", "cuda"}.
std::vector<std::string> available_backends();
// Devices of a kind this process sees: 1 for "cpu"; CUDA devices for "cuda"
// (0 where none exists or the kind was not built).
int backend_device_count(const std::string& kind);

}  // namespace pd
