#include "plan/phase_cost.h"

#include <algorithm>
#include <utility>

#include "plan/kv_footprint.h"

namespace pd::plan {

RooflineCostModel::RooflineCostModel(ModelSpec model, HardwareSpec hw, RooflineConfig cfg)
    : model_(std::move(model)), hw_(std::move(hw)), cfg_(cfg) {
  kv_bytes_per_token_ = static_cast<double>(kv_bytes_per_token(model_, cfg_.kv));
}

double RooflineCostModel::prefill_seconds(double total_tokens, double num_prompts, double sum_sq_tokens) const {
  return prefill_cost(model_, hw_, cfg_, total_tokens, num_prompts, sum_sq_tokens).seconds();
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
}

double ProfileCostModel::prefill_seconds(double total_tokens, double, double) const {
  return profile_.prefill_time(total_tokens);
}

double ProfileCostModel::decode_step_seconds(double batch, double mean_context) const {
  return profile_.decode_step_time(batch, mean_context);
}

double ProfileCostModel::kv_transfer_seconds(double tokens) const { return tokens * kv_bytes_per_token_ / link_bw_; }

}  // namespace pd::plan
