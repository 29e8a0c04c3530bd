#include "plan/roofline.h"

#include <string>

#include "plan/kv_footprint.h"

namespace pd::plan {

double linear_intensity(double tokens, double d, double s_weights, double s_act) {
  const double bytes = 2.0 * tokens * d * s_act + d * d * s_weights;
  return bytes > 0 ? 2.0 * tokens * d * d / bytes : 0.0;
}

double linear_intensity_limit(double tokens, double s) { return s > 0 ? 2.0 * tokens / s : 0.0; }

double decode_attention_intensity(int gqa_group, double s_kv) { return s_kv > 0 ? 2.0 * gqa_group / s_kv : 0.0; }

Status validate_roofline_config(const ModelSpec& m, const RooflineConfig& c) {
  if (c.tp <= 0) return Status::invalid_argument("tp: must be positive, got " + std::to_string(c.tp));
  if (c.tp > 1 && (m.n_heads % c.tp != 0)) {
    return Status::invalid_argument("tp: " + std::to_string(c.tp) + " devices cannot split " +
                                    std::to_string(m.n_heads) + " query heads of model '" + m.name + "' evenly");
  }
  return Status::ok();
}

namespace {

struct Shape {
  double layers, d, q_width, kv_width, ffn, vocab, heads, head_dim;
  double linear_weights;  // matrix weights per layer
  double act_io;          // activation elements read + written per token per layer by the matrices
};

Shape shape_of(const ModelSpec& m) {
  Shape s;
  s.layers = m.n_layers;
  s.d = m.hidden;
  s.q_width = static_cast<double>(m.n_heads) * m.head_dim;
  s.kv_width = static_cast<double>(m.n_kv_heads) * m.head_dim;
  s.ffn = m.ffn;
  s.vocab = m.vocab;
  s.heads = m.n_heads;
  s.head_dim = m.head_dim;
  s.linear_weights = static_cast<double>(parameter_breakdown(m).linear_per_layer);
  // Wq (d -> q), Wk, Wv (d -> kv), Wo (q -> d), gate, up (d -> ffn), down (ffn -> d).
  s.act_io = (s.d + s.q_width) + 2 * (s.d + s.kv_width) + (s.q_width + s.d) + 2 * (s.d + s.ffn) + (s.ffn + s.d);
  return s;
}

void finish(KernelCost* k, const HardwareSpec& hw, int tp) {
  k->compute_seconds = k->flops / (tp * hw.effective_flops());
  k->memory_seconds = k->bytes / (tp * hw.effective_bandwidth());
}

// Two ring all-reduces per layer of [tokens, d] activations across tp devices.
double tp_comm_seconds(const Shape& s, const HardwareSpec& hw, int tp, double tokens, double s_act) {
  if (tp <= 1) return 0.0;
  const double bytes = tokens * s.d * s_act;
  return 2.0 * s.layers * 2.0 * (tp - 1) / tp * bytes / hw.intra_node_bandwidth;
}

}  // namespace

PhaseCost prefill_cost(const ModelSpec& m, const HardwareSpec& hw, const RooflineConfig& c, double total_tokens,
                       double num_prompts, double sum_sq_tokens, double cross_pairs, double prefix_tokens) {
  const Shape s = shape_of(m);
  const double sw = precision_bytes(c.weights);
  const double sa = precision_bytes(c.activations);
  const double kv_per_token = static_cast<double>(kv_bytes_per_token(m, c.kv));
  const double skv = precision_bytes(c.kv);
  PhaseCost p;
  p.linear.flops = 2.0 * total_tokens * s.layers * s.linear_weights + 2.0 * num_prompts * s.vocab * s.d;
  p.linear.bytes = (s.layers * s.linear_weights + s.vocab * s.d) * sw + total_tokens * s.layers * s.act_io * sa +
                   num_prompts * (s.d + s.vocab) * sa;
  // Causal: prompt p has sum_{i=1..p} i = p(p+1)/2 query-key pairs, 4 H hd FLOPs each (QK^T and PV).
  // A chunk after p cached tokens adds n x p pairs against them.
  p.attention.flops = s.layers * 2.0 * s.heads * s.head_dim * (sum_sq_tokens + total_tokens + 2.0 * cross_pairs);
  // Read Q, write O (activations), read K and V once, write them to the cache;
  // chunks also read their prompt's cached K and V.
  p.attention.bytes = total_tokens * s.layers * 2.0 * s.q_width * sa + total_tokens * s.layers * 2.0 * s.kv_width * skv +
                      total_tokens * kv_per_token + prefix_tokens * kv_per_token;
  finish(&p.linear, hw, c.tp);
  finish(&p.attention, hw, c.tp);
  p.comm_seconds = tp_comm_seconds(s, hw, c.tp, total_tokens, sa);
  return p;
}

PhaseCost decode_step_cost(const ModelSpec& m, const HardwareSpec& hw, const RooflineConfig& c, double batch,
                           double mean_context) {
  const Shape s = shape_of(m);
  const double sw = precision_bytes(c.weights);
  const double sa = precision_bytes(c.activations);
  const double kv_per_token = static_cast<double>(kv_bytes_per_token(m, c.kv));
  PhaseCost p;
  p.linear.flops = 2.0 * batch * (s.layers * s.linear_weights + s.vocab * s.d);
  p.linear.bytes = (s.layers * s.linear_weights + s.vocab * s.d) * sw + batch * s.layers * s.act_io * sa +
                   batch * (s.d + s.vocab) * sa;
  // Each sequence's new query attends over its L cached tokens: 4 H hd L FLOPs per layer,
  // reading L tokens of K and V (kv_bytes_per_token covers every layer).
  p.attention.flops = s.layers * 4.0 * s.heads * s.head_dim * batch * mean_context;
  p.attention.bytes = batch * mean_context * kv_per_token + batch * s.layers * 2.0 * s.q_width * sa;
  finish(&p.linear, hw, c.tp);
  finish(&p.attention, hw, c.tp);
  p.comm_seconds = tp_comm_seconds(s, hw, c.tp, batch, sa);
  return p;
}

namespace {

GenerationCost scale_to_model(const ModelSpec& m, GenerationCost g, double lm_head_flops) {
  g.cached_model.attention = g.cached_per_layer.attention * m.n_layers;
  g.naive_model.attention = g.naive_per_layer.attention * m.n_layers;
  g.cached_model.projections = g.cached_per_layer.projections * m.n_layers + lm_head_flops;
  g.naive_model.projections = g.naive_per_layer.projections * m.n_layers + lm_head_flops;
  return g;
}

}  // namespace

GenerationCost generation_step_flops(const ModelSpec& m, double n) {
  const double w = static_cast<double>(parameter_breakdown(m).linear_per_layer);
  const double a = static_cast<double>(m.n_heads) * m.head_dim;
  GenerationCost g;
  g.cached_per_layer.projections = 2.0 * w;
  g.cached_per_layer.attention = 4.0 * a * n;
  g.naive_per_layer.projections = 2.0 * w * n;
  g.naive_per_layer.attention = 2.0 * a * n * (n + 1);  // sum_{i=1..n} 4 a i
  return scale_to_model(m, g, 2.0 * m.vocab * static_cast<double>(m.hidden));
}

GenerationCost generation_total_flops(const ModelSpec& m, double generated, double prompt) {
  const double w = static_cast<double>(parameter_breakdown(m).linear_per_layer);
  const double a = static_cast<double>(m.n_heads) * m.head_dim;
  auto s1 = [](double x) { return x * (x + 1) / 2; };            // sum_{n=1..x} n
  auto s2 = [](double x) { return x * (x + 1) * (x + 2) / 3; };  // sum_{n=1..x} n(n+1)
  const double hi = prompt + generated;
  GenerationCost g;
  g.cached_per_layer.projections = 2.0 * w * generated;
  g.cached_per_layer.attention = 4.0 * a * (s1(hi) - s1(prompt));
  g.naive_per_layer.projections = 2.0 * w * (s1(hi) - s1(prompt));
  g.naive_per_layer.attention = 2.0 * a * (s2(hi) - s2(prompt));
  return scale_to_model(m, g, 2.0 * m.vocab * static_cast<double>(m.hidden) * generated);
}

}  // namespace pd::plan
