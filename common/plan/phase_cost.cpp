#include "plan/phase_cost.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "plan/kv_footprint.h"

namespace pd::plan {
namespace {

// The n^2 coefficient of a least-squares fit t = a + b n + c n^2 to the
// prefill points, each weighted by 1/t (relative error, so the short prompts
// count as much as the long ones); 0 with fewer than three points or when the
// fit bends the wrong way.
double fit_quadratic_term(const EngineProfile& p) {
  const size_t n = p.prefill_tokens.size();
  if (n < 3) return 0;
  double m[3][4] = {};  // normal equations, augmented
  for (size_t i = 0; i < n; ++i) {
    const double x = p.prefill_tokens[i], y = p.prefill_seconds[i], w = 1.0 / (y * y);
    const double f[3] = {1, x, x * x};
    for (int r = 0; r < 3; ++r) {
      for (int c = 0; c < 3; ++c) m[r][c] += w * f[r] * f[c];
      m[r][3] += w * f[r] * y;
    }
  }
  for (int col = 0; col < 3; ++col) {  // Gauss-Jordan with partial pivoting
    int piv = col;
    for (int r = col + 1; r < 3; ++r)
      if (std::abs(m[r][col]) > std::abs(m[piv][col])) piv = r;
    if (std::abs(m[piv][col]) < 1e-300) return 0;
    std::swap(m[col], m[piv]);
    for (int r = 0; r < 3; ++r) {
      if (r == col) continue;
      const double k = m[r][col] / m[col][col];
      for (int c = col; c < 4; ++c) m[r][c] -= k * m[col][c];
    }
  }
  const double c = m[2][3] / m[2][2];
  return std::isfinite(c) && c > 0 ? c : 0;
}

}  // namespace

RooflineCostModel::RooflineCostModel(ModelSpec model, HardwareSpec hw, RooflineConfig cfg)
    : model_(std::move(model)), hw_(std::move(hw)), cfg_(cfg) {
  kv_bytes_per_token_ = static_cast<double>(kv_bytes_per_token(model_, cfg_.kv));
}

double RooflineCostModel::prefill_seconds(double total_tokens, double num_prompts, double sum_sq_tokens) const {
  return prefill_cost(model_, hw_, cfg_, total_tokens, num_prompts, sum_sq_tokens).seconds();
}

double RooflineCostModel::prefill_pass_seconds(const PrefillPass& pass) const {
  return prefill_cost(model_, hw_, cfg_, pass.tokens, pass.prompts, pass.sum_sq, pass.cross, pass.prefix).seconds();
}

double RooflineCostModel::decode_step_seconds(double batch, double mean_context) const {
  return decode_step_cost(model_, hw_, cfg_, batch, mean_context).seconds();
}

double RooflineCostModel::kv_transfer_seconds(double tokens) const {
  // Each device of the tensor-parallel group sends its own heads over its own NIC.
  return tokens * kv_bytes_per_token_ / (cfg_.tp * hw_.inter_node_bandwidth);
}

ProfileCostModel::ProfileCostModel(EngineProfile profile, double kv_bytes_per_token, int n_layers,
                                   double link_bytes_per_second, double link_latency)
    : profile_(std::move(profile)),
      kv_bytes_per_token_(kv_bytes_per_token),
      n_layers_(std::max(1, n_layers)),
      link_bw_(link_bytes_per_second),
      latency_(link_latency) {
  if (profile_.kv_transfer_bytes_per_second > 0) {
    link_bw_ = profile_.kv_transfer_bytes_per_second;
    latency_ = profile_.kv_transfer_latency_seconds;
  }
  attention_coeff_ = fit_quadratic_term(profile_);
}

double ProfileCostModel::prefill_seconds(double total_tokens, double num_prompts, double sum_sq_tokens) const {
  const double one_prompt = profile_.prefill_time(total_tokens);
  if (num_prompts <= 1) return one_prompt;
  // Never below one prompt of sum_sq / total tokens (no longer than the pass's longest
  // prompt, so its time alone is a lower bound), nor a quarter of the single-prompt
  // time (guards against a poor fit).
  const double excess = attention_coeff_ * std::max(0.0, total_tokens * total_tokens - sum_sq_tokens);
  return std::max({one_prompt - excess, profile_.prefill_time(sum_sq_tokens / total_tokens), 0.25 * one_prompt});
}

double ProfileCostModel::prefill_pass_seconds(const PrefillPass& pass) const {
  return prefill_seconds(pass.tokens, pass.prompts, pass.sum_sq) + 2.0 * attention_coeff_ * pass.cross;
}

double ProfileCostModel::decode_step_seconds(double batch, double mean_context) const {
  return profile_.decode_step_time(batch, mean_context);
}

double ProfileCostModel::kv_transfer_seconds(double tokens) const { return tokens * kv_bytes_per_token_ / link_bw_; }

}  // namespace pd::plan
