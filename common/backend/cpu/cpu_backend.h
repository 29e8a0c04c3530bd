// The CPU backend: quantized weights repacked at load for integer kernels that
// multiply them by 8-bit activations (q8_kernels.h; AVX512-VNNI, AVX2 or
// portable, chosen at run time), attention and SiLU through the same kernel
// table, OpenMP threads. With int8_activations off, weights are used in
// place from the GGUF mapping against fp32 activations (cpu_kernels.h), and
// OpenBLAS sgemm on dequantized panels serves large batches when
// batch_invariant is off as well.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "backend/backend.h"

namespace pd {

// Which matmul a weight serves, from its GGUF tensor name.
enum CpuMatmulKind : uint32_t {
  kMatmulQkv = 1u << 0,      // attn_q, attn_k, attn_v
  kMatmulAttnOut = 1u << 1,  // attn_output
  kMatmulGateUp = 1u << 2,   // ffn_gate, ffn_up
  kMatmulDown = 1u << 3,     // ffn_down
  kMatmulLmHead = 1u << 4,   // output (or token_embd when tied)
};

struct CpuBackendConfig {
  int n_threads = 0;  // 0 = all cores
  // Batches with at least this many rows use dequantize + sgemm; smaller ones
  // use the fused dequantize-dot kernel (one weight stream for the batch).
  int gemm_min_rows = 8;
  // Every matmul row computed by the same row-dot kernel whatever the batch
  // size, so a sequence's logits (and greedy tokens) do not depend on what it
  // was batched with: the serving cluster needs this to match pd-generate
  // token for token under continuous batching and preemption. Off = the
  // sgemm path above gemm_min_rows (faster prefill, batch-dependent rounding).
  bool batch_invariant = true;
  // Quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
  // repacked at load and multiplied by activations quantized to 8 bits per
  // 32-block, in integer arithmetic (q8_kernels.h): the fast path, batch
  // invariant. Off = fp32 activations against the weights as stored (the
  // reference path, slower).
  bool int8_activations = true;
  // Kernel instruction set: "" = the widest this CPU runs (or PD_CPU_ISA),
  // else "scalar", "avx2", "avxvnni" or "avx512vnni" (ignored when this CPU cannot run
  // it; name() says what runs). For comparing ISAs in one process.
  std::string isa;
  // With int8_activations: the matmuls of these kinds (CpuMatmulKind bits)
  // in these layers take their activations in two 8-bit passes, x ~ d1*q1 +
  // d2*q2 with q2 the 8-bit quantization of the residual x - d1*q1, each
  // multiplied by the same integer kernels and the two results added: about
  // 15 bits of activation precision for twice that matmul's integer work.
  // Still batch invariant and the same bits on every ISA. The default, Q/K/V
  // and the LM head, halves the mean KL divergence from the fp32 path; it
  // costs ~15% of compute-bound work on one AVX2 core (prefill, batched
  // decode), within the noise on two, nothing at batch-1 decode
  // (docs/ACCURACY.md). PD_CPU_INT8X2=none|KIND+KIND|all overrides.
  uint32_t int8x2_matmul_kinds = kMatmulQkv | kMatmulLmHead;
  uint64_t int8x2_matmul_layers = ~uint64_t{0};
  // With the LM head in int8x2_matmul_kinds and this > 0: its second pass
  // runs only for the logits whose first-pass value is within this many
  // nats of the row's largest (in groups of 8 vocabulary rows); the rest
  // keep the one-pass value. Those logits are the same bits as with the
  // second pass everywhere, so the argmax is too while the one-pass error
  // stays under half the margin; the tail's softmax mass is too small for
  // its error to move the distribution measurably (docs/ACCURACY.md).
  // 0 = the second pass for every logit. PD_CPU_LM_HEAD_MARGIN overrides (a
  // number >= 0; anything else is reported on stderr and ignored).
  float lm_head_two_pass_margin = 12.0f;
  // Diagnostics (pd-perplexity): with int8_activations, the matmuls of these
  // kinds (CpuMatmulKind bits) in these layers (bit l = layer l; the LM head
  // has no layer and follows its kind bit alone) take fp32 activations
  // against the exactly dequantized weights instead. 0 = none (the default).
  uint32_t fp32_matmul_kinds = 0;
  uint64_t fp32_matmul_layers = ~uint64_t{0};
};


std::unique_ptr<Backend> make_cpu_backend(const CpuBackendConfig& cfg);

}  // namespace pd
