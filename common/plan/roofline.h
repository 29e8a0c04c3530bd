// Roofline model of prefill and decode: arithmetic intensity of each kernel
// group, which side of the ridge it falls on, and time estimates per prefill
// and per decode step; plus the FLOP cost of generating without a KV cache.
//
// Conventions: a multiply-add is 2 FLOPs; S is bytes per element; d is the
// hidden size; G = query heads / KV heads. All counts are for the whole model on
// one rank (a tensor-parallel group of `tp` devices splits FLOPs and bytes evenly).
#pragma once

#include <cstdint>

#include "plan/hardware.h"
#include "plan/model_spec.h"
#include "plan/precision.h"
#include "util/status.h"

namespace pd::plan {

// ---- Arithmetic intensity (FLOP per byte) ----------------------------------

// A [T, d] x [d, d] linear layer: 2Td^2 FLOPs over reading the input (Td S_a),
// the weight (d^2 S_w) and writing the output (Td S_a):
//   2 T d^2 / (2 T d S_a + d^2 S_w)   (= 2Td^2 / ((2Td + d^2) S) when S_a = S_w = S).
// T is the prompt length P for prefill and the batch B for decode.
double linear_intensity(double tokens, double d, double s_weights, double s_act);
// Its weight-dominated limit, T << d/2: 2T / S (prefill 2P/S, decode 2B/S).
// (As T grows past d the exact value saturates at d / S_a.)
double linear_intensity_limit(double tokens, double s);
// Decode attention over the cache: 4 H hd L FLOPs over 2 L H_kv hd S bytes = 2G/S.
double decode_attention_intensity(int gqa_group, double s_kv);

// ---- Time estimates ----------------------------------------------------------

struct RooflineConfig {
  Precision weights = Precision::kBf16;
  Precision kv = Precision::kBf16;
  Precision activations = Precision::kBf16;
  int tp = 1;  // devices per rank (tensor parallel)
};
Status validate_roofline_config(const ModelSpec& m, const RooflineConfig& c);

// One group of kernels: its FLOPs and bytes on the whole rank, and the time
// each takes at the rank's effective peak / bandwidth.
struct KernelCost {
  double flops = 0;
  double bytes = 0;
  double compute_seconds = 0;
  double memory_seconds = 0;
  double intensity() const { return bytes > 0 ? flops / bytes : 0; }
  double seconds() const { return compute_seconds > memory_seconds ? compute_seconds : memory_seconds; }
  bool compute_bound() const { return compute_seconds >= memory_seconds; }
};

struct PhaseCost {
  KernelCost linear;     // all projections, MLP and the LM head
  KernelCost attention;  // score and value products over the KV cache (+ KV writes)
  double comm_seconds = 0;  // tensor-parallel all-reduces (2 per layer, ring)
  // Sum of each group's roofline time (the kernels run one after another) + comm.
  double seconds() const { return linear.seconds() + attention.seconds() + comm_seconds; }
  double flops() const { return linear.flops + attention.flops; }
  double bytes() const { return linear.bytes + attention.bytes; }
};

// One prefill forward pass over `num_prompts` prompts of `total_tokens` tokens
// in all, whose squared lengths sum to `sum_sq_tokens` (causal attention costs
// sum p(p+1)/2 query-key pairs). Logits for the last token of each prompt only.
// Chunked prefill: each "prompt" is a chunk of n_i tokens after p_i tokens of
// its prompt already cached; `cross_pairs` = sum n_i p_i query-key pairs against
// those prefixes (4 H hd FLOPs each per layer), `prefix_tokens` = sum p_i cached
// tokens whose K and V the chunks read. Both 0 for whole prompts.
PhaseCost prefill_cost(const ModelSpec& m, const HardwareSpec& hw, const RooflineConfig& c, double total_tokens,
                       double num_prompts, double sum_sq_tokens, double cross_pairs = 0, double prefix_tokens = 0);
// Shorthand: one prompt of P tokens.
inline PhaseCost prefill_cost(const ModelSpec& m, const HardwareSpec& hw, const RooflineConfig& c, double p) {
  return prefill_cost(m, hw, c, p, 1, p * p);
}
// One decode step for `batch` sequences whose caches hold `mean_context` tokens
// on average (one new token each; logits for each).
PhaseCost decode_step_cost(const ModelSpec& m, const HardwareSpec& hw, const RooflineConfig& c, double batch,
                           double mean_context);

// ---- Generating with and without a KV cache ----------------------------------

struct GenerationFlops {
  double attention = 0;    // QK^T and PV
  double projections = 0;  // Wq, Wk, Wv, Wo and the MLP (no LM head)
};
struct GenerationCost {
  GenerationFlops cached_per_layer, naive_per_layer;
  GenerationFlops cached_model, naive_model;  // x layers; LM head added to projections
};
// FLOPs of the step that produces the token at position n (1-based: n tokens in
// the sequence after it). Cached: the new token only (projections 2W, attention
// 4 H hd n). Naive: all n tokens recomputed (projections 2Wn, causal attention
// 2 H hd n (n + 1)). W = matrix weights per layer.
GenerationCost generation_step_flops(const ModelSpec& m, double n);
// Sum over the N steps after a prompt of `prompt` tokens (positions prompt+1 ..
// prompt+N). From an empty prompt: cached attention 2 H hd N(N+1) (~N^2), naive
// 2 H hd N(N+1)(N+2)/3 (~N^3); cached projections 2WN (~N), naive W N(N+1) (~N^2).
GenerationCost generation_total_flops(const ModelSpec& m, double generated, double prompt = 0);

}  // namespace pd::plan
