// What one rank's phases cost in time: a prefill pass, a decode step, a KV
// handoff. From the roofline model, from a measured engine profile, or affine
// (tests, what-ifs). The pool simulator asks these and nothing else.
#pragma once

#include "plan/engine_profile.h"
#include "plan/hardware.h"
#include "plan/model_spec.h"
#include "plan/roofline.h"

namespace pd::plan {

// One prefill pass as chunks: chunk i computes n_i prompt tokens of a prompt
// whose first p_i tokens are already in the cache (p_i = 0: a whole prompt, or
// its first chunk). Its causal attention has n_i (n_i + 1) / 2 query-key pairs
// within the chunk plus n_i x p_i against the cached prefix, which it reads.
struct PrefillPass {
  double tokens = 0;   // sum of n_i
  double prompts = 0;  // chunks (one per prompt in the pass)
  double sum_sq = 0;   // sum of n_i^2
  double cross = 0;    // sum of n_i x p_i: query-key pairs against the cached prefix
  double prefix = 0;   // sum of p_i: cached tokens the chunks read
  void add(double n, double p) {
    tokens += n;
    prompts += 1;
    sum_sq += n * n;
    cross += n * p;
    prefix += p;
  }
  bool empty() const { return prompts == 0; }
};

// What the simulator asks of a rank. Implementations must be pure functions.
class PhaseCostModel {
 public:
  virtual ~PhaseCostModel() = default;
  // One prefill pass over `num_prompts` prompts, `total_tokens` tokens in all,
  // squared lengths summing to `sum_sq_tokens`.
  virtual double prefill_seconds(double total_tokens, double num_prompts, double sum_sq_tokens) const = 0;
  // One prefill pass of chunks (chunked prefill). Equals prefill_seconds when
  // every chunk starts at position 0; the default ignores the cached prefix.
  virtual double prefill_pass_seconds(const PrefillPass& pass) const {
    return prefill_seconds(pass.tokens, pass.prompts, pass.sum_sq);
  }
  // One decode step of `batch` sequences at mean context `mean_context`.
  virtual double decode_step_seconds(double batch, double mean_context) const = 0;
  // Wire time of one sequence's KV cache of `tokens` tokens between two ranks.
  virtual double kv_transfer_seconds(double tokens) const = 0;
  virtual double kv_transfer_latency() const = 0;
  // Layers the KV is sent in (overlap granularity); >= 1.
  virtual int transfer_chunks() const = 0;
};

// Costs from the roofline model of `model` on `hw` (a rank = `cfg.tp` devices;
// the rank's KV link is `tp` NICs of hw.inter_node_bandwidth each).
class RooflineCostModel final : public PhaseCostModel {
 public:
  RooflineCostModel(ModelSpec model, HardwareSpec hw, RooflineConfig cfg);
  double prefill_seconds(double total_tokens, double num_prompts, double sum_sq_tokens) const override;
  // The roofline of the chunks: attention over the cached prefix's pairs, its KV read.
  double prefill_pass_seconds(const PrefillPass& pass) const override;
  double decode_step_seconds(double batch, double mean_context) const override;
  double kv_transfer_seconds(double tokens) const override;
  double kv_transfer_latency() const override { return hw_.link_latency; }
  int transfer_chunks() const override { return model_.n_layers; }

 private:
  ModelSpec model_;
  HardwareSpec hw_;
  RooflineConfig cfg_;
  double kv_bytes_per_token_ = 0;
};

// Costs from a measured engine profile; the KV link from the profile when it
// has one, else `link_bytes_per_second` / `link_latency`. The profile's
// prefill points are single prompts, whose attention grows with the square of
// their length; a pass of several prompts attends only within each, so it
// costs the profile's time for its total tokens less c x (total^2 - sum of
// squared lengths), c the n^2 term of a least-squares fit a + b n + c n^2 to
// the points (0 with fewer than three). A chunk of n tokens after p cached ones
// adds the attention of its n x p pairs against the prefix, 2c x n x p (a prompt
// of L tokens costs c L^2 of attention, L^2 / 2 pairs), to the pass's time as if
// its chunks were whole prompts: a prompt cut into k chunks costs its
// single-pass time plus k - 1 passes' fixed overheads.
class ProfileCostModel final : public PhaseCostModel {
 public:
  ProfileCostModel(EngineProfile profile, double kv_bytes_per_token, int n_layers, double link_bytes_per_second,
                   double link_latency);
  double prefill_seconds(double total_tokens, double num_prompts, double sum_sq_tokens) const override;
  double prefill_pass_seconds(const PrefillPass& pass) const override;
  double decode_step_seconds(double batch, double mean_context) const override;
  double kv_transfer_seconds(double tokens) const override;
  double kv_transfer_latency() const override { return latency_; }
  int transfer_chunks() const override { return n_layers_; }
  double prefill_quadratic_coefficient() const { return attention_coeff_; }

 private:
  EngineProfile profile_;
  double attention_coeff_ = 0;
  double kv_bytes_per_token_;
  int n_layers_;
  double link_bw_;
  double latency_;
};

// Affine costs, for tests and what-ifs: prefill = p0 + p1 x tokens; decode step
// = d0 + d1 x batch + d2 x batch x context; transfer = tokens x bytes_per_token / bw.
struct LinearCosts {
  double prefill_fixed = 0, prefill_per_token = 0;
  double decode_fixed = 0, decode_per_seq = 0, decode_per_context_token = 0;
  double kv_bytes_per_token = 0, link_bytes_per_second = 1e12, link_latency = 0;
  int chunks = 1;
};
class LinearCostModel final : public PhaseCostModel {
 public:
  explicit LinearCostModel(LinearCosts c) : c_(c) {}
  double prefill_seconds(double total_tokens, double, double) const override {
    return c_.prefill_fixed + c_.prefill_per_token * total_tokens;
  }
  double decode_step_seconds(double batch, double mean_context) const override {
    return c_.decode_fixed + c_.decode_per_seq * batch + c_.decode_per_context_token * batch * mean_context;
  }
  double kv_transfer_seconds(double tokens) const override {
    return tokens * c_.kv_bytes_per_token / c_.link_bytes_per_second;
  }
  double kv_transfer_latency() const override { return c_.link_latency; }
  int transfer_chunks() const override { return c_.chunks; }

 private:
  LinearCosts c_;
};

}  // namespace pd::plan
