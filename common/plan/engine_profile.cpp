#include "plan/engine_profile.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

namespace pd::plan {
namespace {

// Piecewise-linear through (xs[i], y(i)), xs strictly increasing, the rules in the header.
template <typename Y>
double interpolate(const std::vector<double>& xs, Y y, double x, bool proportional_single) {
  const size_t n = xs.size();
  if (n == 1) return proportional_single ? y(0) * x / xs[0] : y(0);
  if (x <= xs[0]) return y(0);
  const size_t hi = static_cast<size_t>(std::upper_bound(xs.begin(), xs.end(), x) - xs.begin());
  if (hi >= n) {
    const double last = y(n - 1);
    const double slope = std::max(0.0, (last - y(n - 2)) / (xs[n - 1] - xs[n - 2]));
    return last + slope * (x - xs[n - 1]);
  }
  const size_t lo = hi - 1;
  const double t = (x - xs[lo]) / (xs[hi] - xs[lo]);
  const double a = y(lo);
  return a + t * (y(hi) - a);
}

std::string where(std::string_view source) { return "engine profile '" + std::string(source) + "'"; }

Status number_field(const nlohmann::json& obj, const char* key, std::string_view source, const std::string& ctx,
                    bool positive, double* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return Status::invalid_argument(where(source) + ": " + ctx + ": missing field '" + key + "'");
  if (!it->is_number()) {
    return Status::invalid_argument(where(source) + ": " + ctx + ": field '" + key + "' must be a number, got " +
                                    it->dump());
  }
  const double v = it->get<double>();
  if (!std::isfinite(v) || (positive ? v <= 0 : v < 0)) {
    return Status::invalid_argument(where(source) + ": " + ctx + ": field '" + key + "' must be " +
                                    (positive ? "positive" : "non-negative") + ", got " + it->dump());
  }
  *out = v;
  return Status::ok();
}

}  // namespace

double EngineProfile::prefill_time(double tokens) const {
  return interpolate(prefill_tokens, [&](size_t i) { return prefill_seconds[i]; }, tokens, true);
}

double EngineProfile::decode_step_time(double batch, double context) const {
  const size_t nc = decode_contexts.size();
  // Along context within a batch row, then along batch.
  auto row = [&](size_t i) {
    return interpolate(decode_contexts, [&](size_t j) { return decode_seconds[i * nc + j]; }, context, false);
  };
  return interpolate(decode_batches, row, batch, false);
}

Result<EngineProfile> engine_profile_from_json(std::string_view json_text, std::string_view source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    return Status::invalid_argument(where(source) + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) return Status::invalid_argument(where(source) + ": top level must be an object");
  auto fmt = j.find("format");
  if (fmt == j.end() || !fmt->is_string() || fmt->get<std::string>() != "pd-engine-profile") {
    return Status::invalid_argument(where(source) + ": field 'format' must be \"pd-engine-profile\"");
  }
  auto ver = j.find("version");
  if (ver == j.end() || !ver->is_number_integer() || ver->get<int64_t>() != 1) {
    return Status::invalid_argument(where(source) + ": field 'version' must be 1");
  }
  EngineProfile p;
  if (auto it = j.find("model"); it != j.end() && it->is_string()) p.model = it->get<std::string>();
  if (auto it = j.find("hardware"); it != j.end() && it->is_string()) p.hardware = it->get<std::string>();
  if (auto it = j.find("kv_bytes_per_token"); it != j.end()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0) {
      return Status::invalid_argument(where(source) + ": field 'kv_bytes_per_token' must be a non-negative integer");
    }
    p.kv_bytes_per_token = it->get<int64_t>();
  }

  auto pre = j.find("prefill");
  if (pre == j.end() || !pre->is_array() || pre->empty()) {
    return Status::invalid_argument(where(source) + ": field 'prefill' must be a non-empty array");
  }
  std::vector<std::pair<double, double>> pts;
  for (size_t i = 0; i < pre->size(); ++i) {
    const nlohmann::json& e = (*pre)[i];
    const std::string ctx = "prefill[" + std::to_string(i) + "]";
    if (!e.is_object()) return Status::invalid_argument(where(source) + ": " + ctx + " must be an object");
    double tokens = 0, seconds = 0;
    PD_RETURN_IF_ERROR(number_field(e, "tokens", source, ctx, true, &tokens));
    PD_RETURN_IF_ERROR(number_field(e, "seconds", source, ctx, true, &seconds));
    pts.emplace_back(tokens, seconds);
  }
  std::sort(pts.begin(), pts.end());
  for (size_t i = 0; i < pts.size(); ++i) {
    if (i > 0 && pts[i].first == pts[i - 1].first) {
      return Status::invalid_argument(where(source) + ": prefill: two points at tokens = " +
                                      std::to_string(static_cast<int64_t>(pts[i].first)));
    }
    p.prefill_tokens.push_back(pts[i].first);
    p.prefill_seconds.push_back(pts[i].second);
  }

  auto dec = j.find("decode");
  if (dec == j.end() || !dec->is_array() || dec->empty()) {
    return Status::invalid_argument(where(source) + ": field 'decode' must be a non-empty array");
  }
  std::map<std::pair<double, double>, double> grid;
  for (size_t i = 0; i < dec->size(); ++i) {
    const nlohmann::json& e = (*dec)[i];
    const std::string ctx = "decode[" + std::to_string(i) + "]";
    if (!e.is_object()) return Status::invalid_argument(where(source) + ": " + ctx + " must be an object");
    double batch = 0, context = 0, seconds = 0;
    PD_RETURN_IF_ERROR(number_field(e, "batch", source, ctx, true, &batch));
    PD_RETURN_IF_ERROR(number_field(e, "context", source, ctx, true, &context));
    PD_RETURN_IF_ERROR(number_field(e, "seconds", source, ctx, true, &seconds));
    if (!grid.emplace(std::make_pair(batch, context), seconds).second) {
      return Status::invalid_argument(where(source) + ": " + ctx + ": duplicate point (batch " + e["batch"].dump() +
                                      ", context " + e["context"].dump() + ")");
    }
    p.decode_batches.push_back(batch);
    p.decode_contexts.push_back(context);
  }
  for (std::vector<double>* axis : {&p.decode_batches, &p.decode_contexts}) {
    std::sort(axis->begin(), axis->end());
    axis->erase(std::unique(axis->begin(), axis->end()), axis->end());
  }
  for (double b : p.decode_batches) {
    for (double c : p.decode_contexts) {
      auto it = grid.find({b, c});
      if (it == grid.end()) {
        std::ostringstream msg;
        msg << where(source) << ": decode: points must form a full grid; missing batch " << b << " at context " << c;
        return Status::invalid_argument(msg.str());
      }
      p.decode_seconds.push_back(it->second);
    }
  }

  if (auto kt = j.find("kv_transfer"); kt != j.end()) {
    if (!kt->is_object()) return Status::invalid_argument(where(source) + ": field 'kv_transfer' must be an object");
    PD_RETURN_IF_ERROR(number_field(*kt, "bytes_per_second", source, "kv_transfer", true,
                                    &p.kv_transfer_bytes_per_second));
    if (kt->contains("latency_seconds")) {
      PD_RETURN_IF_ERROR(number_field(*kt, "latency_seconds", source, "kv_transfer", false,
                                      &p.kv_transfer_latency_seconds));
    }
  }
  return p;
}

Result<EngineProfile> engine_profile_from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::io_error(where(path) + ": cannot open file");
  std::ostringstream ss;
  ss << in.rdbuf();
  return engine_profile_from_json(ss.str(), path);
}

std::string engine_profile_to_json(const EngineProfile& p) {
  nlohmann::json j;
  j["format"] = "pd-engine-profile";
  j["version"] = 1;
  j["model"] = p.model;
  j["hardware"] = p.hardware;
  if (p.kv_bytes_per_token > 0) j["kv_bytes_per_token"] = p.kv_bytes_per_token;
  j["prefill"] = nlohmann::json::array();
  for (size_t i = 0; i < p.prefill_tokens.size(); ++i) {
    j["prefill"].push_back({{"tokens", p.prefill_tokens[i]}, {"seconds", p.prefill_seconds[i]}});
  }
  j["decode"] = nlohmann::json::array();
  for (size_t b = 0; b < p.decode_batches.size(); ++b) {
    for (size_t c = 0; c < p.decode_contexts.size(); ++c) {
      j["decode"].push_back({{"batch", p.decode_batches[b]},
                             {"context", p.decode_contexts[c]},
                             {"seconds", p.decode_seconds[b * p.decode_contexts.size() + c]}});
    }
  }
  if (p.kv_transfer_bytes_per_second > 0) {
    j["kv_transfer"] = {{"bytes_per_second", p.kv_transfer_bytes_per_second},
                        {"latency_seconds", p.kv_transfer_latency_seconds}};
  }
  return j.dump(2) + "\n";
}

}  // namespace pd::plan
