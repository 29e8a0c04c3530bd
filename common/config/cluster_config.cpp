#include "config/cluster_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"

namespace pd {
namespace {

using nlohmann::json;

// Reads section `name` of `j` into fields; every key must be known.
class Reader {
 public:
  Reader(const json& j, std::string prefix) : j_(j), prefix_(std::move(prefix)) {}
  template <typename T>
  Reader& get(const char* key, T& out) {
    known_.push_back(key);
    if (!status_.is_ok() || !j_.contains(key)) return *this;
    const json& v = j_.at(key);
    constexpr bool kInt = std::is_integral_v<T> && !std::is_same_v<T, bool>;
    const bool ok = std::is_same_v<T, bool>          ? v.is_boolean()
                    : std::is_same_v<T, std::string> ? v.is_string()
                    : kInt                           ? v.is_number_integer()
                                                     : v.is_number();
    if (!ok) {
      status_ = Status::invalid_argument("config: '" + prefix_ + key + "' has the wrong type (" + v.type_name() +
                                         (kInt ? ", want an integer)" : ")"));
      return *this;
    }
    if constexpr (kInt) {
      // JSON integers are int64 or uint64; a value beyond T is refused, never wrapped.
      const bool fits = v.is_number_unsigned()
                            ? v.template get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max())
                            : v.template get<int64_t>() >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
                                  v.template get<int64_t>() <= static_cast<int64_t>(std::numeric_limits<T>::max());
      if (!fits) {
        status_ = Status::invalid_argument("config: '" + prefix_ + key + "' = " + v.dump() + " is out of range [" +
                                           std::to_string(std::numeric_limits<T>::min()) + ", " +
                                           std::to_string(std::numeric_limits<T>::max()) + "]");
        return *this;
      }
    }
    out = v.get<T>();
    return *this;
  }
  // A key read elsewhere (a section object).
  Reader& known(const char* key) {
    known_.push_back(key);
    return *this;
  }
  Status finish() {
    if (!status_.is_ok()) return status_;
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      if (std::find(known_.begin(), known_.end(), it.key()) == known_.end())
        return Status::invalid_argument("config: unknown key '" + prefix_ + it.key() + "'");
    }
    return Status::ok();
  }

 private:
  const json& j_;
  std::string prefix_;
  std::vector<std::string> known_;
  Status status_;
};

// http.allowed_origins: "*", or origins as a browser sends them in Origin —
// scheme://host[:port], no path, no trailing slash (one would never match).
Status read_origins(const json& v, const std::string& prefix, std::vector<std::string>& out) {
  const std::string key = prefix + "allowed_origins";
  if (!v.is_array()) return Status::invalid_argument("config: '" + key + "' must be an array of origins (strings)");
  out.clear();
  for (const json& o : v) {
    if (!o.is_string()) return Status::invalid_argument("config: '" + key + "' holds " + o.dump() + "; each entry is a string");
    const std::string s = o.get<std::string>();
    const size_t sep = s.find("://");
    const bool origin = sep != std::string::npos && sep > 0 && sep + 3 < s.size() &&
                        s.find_first_of("/?# ", sep + 3) == std::string::npos;
    if (s != "*" && s != "null" && !origin)
      return Status::invalid_argument("config: '" + key + "' holds \"" + s +
                                      "\"; each entry is \"*\" or an origin as browsers send it: "
                                      "scheme://host[:port], without a path or a trailing '/'");
    out.push_back(s);
  }
  return Status::ok();
}

Status section(const json& root, const char* name, const std::function<Status(const json&, std::string)>& fn) {
  if (!root.contains(name)) return Status::ok();
  if (!root.at(name).is_object()) return Status::invalid_argument(std::string("config: '") + name + "' must be an object");
  return fn(root.at(name), std::string(name) + ".");
}

Status range(const char* key, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    return Status::invalid_argument(std::string("config: '") + key + "' = " + std::to_string(v) + " is out of range [" +
                                    std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return Status::ok();
}

}  // namespace

Result<ClusterConfig> ClusterConfig::parse(const std::string& text) {
  json root;
  // The key path being read ("kv.block_size"), kept by the parser callback so
  // that a number beyond double range (an exception thrown mid-parse) is named.
  std::vector<std::string> keys;
  const json::parser_callback_t track = [&keys](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key) {
      keys.resize(static_cast<size_t>(std::max(depth - 1, 0)));  // depth = open containers
      keys.push_back(parsed.get<std::string>());
    } else if (event == json::parse_event_t::object_end || event == json::parse_event_t::array_end) {
      keys.resize(std::min(keys.size(), static_cast<size_t>(std::max(depth, 0))));
    }
    return true;
  };
  try {
    root = json::parse(text, track, true, /*ignore_comments=*/true);
  } catch (const json::out_of_range& e) {  // 406: a number such as 1e400
    std::string key;
    for (const std::string& k : keys) key += (key.empty() ? "" : ".") + k;
    return Status::invalid_argument("config: '" + key + "' is beyond the range of a double (" + e.what() + ")");
  } catch (const json::exception& e) {
    return Status::invalid_argument(std::string("config: invalid JSON: ") + e.what());
  }
  if (!root.is_object()) return Status::invalid_argument("config: the top level must be an object");
  ClusterConfig c;
  Reader top(root, "");
  top.get("model", c.model).get("served_model_name", c.served_model_name).get("chat_template", c.chat_template);
  // Sections are read below; list them as known keys.
  for (const char* s : {"http", "engine", "kv", "prefill", "decode", "router", "sampling", "timeouts"}) top.known(s);
  PD_RETURN_IF_ERROR(top.finish());
  PD_RETURN_IF_ERROR(section(root, "http", [&](const json& j, std::string p) {
    if (j.contains("allowed_origins")) PD_RETURN_IF_ERROR(read_origins(j.at("allowed_origins"), p, c.http.allowed_origins));
    return Reader(j, p).get("host", c.http.host).get("port", c.http.port).get("threads", c.http.threads)
        .get("max_body_bytes", c.http.max_body_bytes).get("api_key", c.http.api_key)
        .get("read_timeout_ms", c.http.read_timeout_ms).get("max_connections", c.http.max_connections)
        .get("max_header_bytes", c.http.max_header_bytes).get("metrics_require_key", c.http.metrics_require_key)
        .get("port_file", c.http.port_file).get("admin_key", c.http.admin_key)
        .get("max_write_buffer_bytes", c.http.max_write_buffer_bytes).known("allowed_origins").finish();
  }));
  PD_RETURN_IF_ERROR(section(root, "engine", [&](const json& j, std::string p) {
    Reader r(j, p);
    r.get("int8_activations", c.engine.int8_activations).get("backend", c.engine.backend).known("devices");
    if (j.contains("devices")) {
      const json& d = j.at("devices");
      if (!d.is_array()) return Status::invalid_argument("config: '" + p + "devices' must be an array of device ordinals");
      c.engine.devices.clear();
      for (const json& v : d) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 1023)
          return Status::invalid_argument("config: '" + p + "devices' holds " + v.dump() +
                                          "; each entry is a device ordinal in [0, 1023]");
        c.engine.devices.push_back(v.get<int>());
      }
    }
    return r.finish();
  }));
  PD_RETURN_IF_ERROR(section(root, "kv", [&](const json& j, std::string p) {
    return Reader(j, p).get("block_size", c.kv.block_size).get("decode_budget_mb", c.kv.decode_budget_mb)
        .get("prefill_budget_mb", c.kv.prefill_budget_mb).get("checksum", c.kv.checksum).get("dtype", c.kv.dtype)
        .get("prefix_cache", c.kv.prefix_cache).get("tag_span", c.kv.tag_span).finish();
  }));
  PD_RETURN_IF_ERROR(section(root, "prefill", [&](const json& j, std::string p) {
    return Reader(j, p).get("token_budget", c.prefill.token_budget).get("max_batch", c.prefill.max_batch)
        .get("chunk_tokens", c.prefill.chunk_tokens).get("context_cost_tokens", c.prefill.context_cost_tokens)
        .get("threads", c.prefill.threads).finish();
  }));
  PD_RETURN_IF_ERROR(section(root, "decode", [&](const json& j, std::string p) {
    return Reader(j, p).get("max_running", c.decode.max_running).get("step_tokens", c.decode.step_tokens)
        .get("threads", c.decode.threads).get("speculate", c.decode.speculate)
        .get("speculate_max_batch", c.decode.speculate_max_batch).finish();
  }));
  PD_RETURN_IF_ERROR(section(root, "router", [&](const json& j, std::string p) {
    return Reader(j, p).get("max_queued", c.router.max_queued)
        .get("max_inflight_per_worker", c.router.max_inflight_per_worker)
        .get("retry_after_s", c.router.retry_after_s).get("max_attempts", c.router.max_attempts)
        .get("migrate", c.router.migrate).get("policy", c.router.policy).get("queue_weight", c.router.queue_weight)
        .get("balance_ratio", c.router.balance_ratio).get("balance_tokens", c.router.balance_tokens)
        .get("decode_reuse_tokens", c.router.decode_reuse_tokens)
        .get("decode_reuse_weight", c.router.decode_reuse_weight).get("warm_prefill", c.router.warm_prefill)
        .get("min_cached_fraction", c.router.min_cached_fraction)
        .get("max_answer_entries", c.router.max_answer_entries).finish();
  }));
  PD_RETURN_IF_ERROR(section(root, "sampling", [&](const json& j, std::string p) {
    return Reader(j, p).get("temperature", c.sampling.temperature).get("top_p", c.sampling.top_p)
        .get("top_k", c.sampling.top_k).get("min_p", c.sampling.min_p).finish();
  }));
  PD_RETURN_IF_ERROR(section(root, "timeouts", [&](const json& j, std::string p) {
    Reader r(j, p);
    // drain_ms named both deadlines once: it still sets both, and either new key wins over it.
    if (j.contains("drain_ms")) {
      r.get("drain_ms", c.timeouts.stop_grace_ms).get("drain_ms", c.timeouts.rank_drain_ms);
      c.warnings.push_back("config: '" + p + "drain_ms' is deprecated: it sets both '" + p +
                           "stop_grace_ms' (in-flight requests' time to finish when the router stops) and '" + p +
                           "rank_drain_ms' (a draining rank's deadline); set those instead");
    }
    return r.get("handoff_ms", c.timeouts.handoff_ms).get("transfer_ms", c.timeouts.transfer_ms)
        .get("prefill_queue_ms", c.timeouts.prefill_queue_ms).get("request_ms", c.timeouts.request_ms)
        .get("queue_ms", c.timeouts.queue_ms)
        .get("stop_grace_ms", c.timeouts.stop_grace_ms).get("rank_drain_ms", c.timeouts.rank_drain_ms)
        .get("startup_ms", c.timeouts.startup_ms)
        .get("heartbeat_ms", c.timeouts.heartbeat_ms).get("router_ms", c.timeouts.router_ms)
        .get("rejoin_ms", c.timeouts.rejoin_ms).finish();
  }));
  PD_RETURN_IF_ERROR(c.validate());
  return c;
}

Result<ClusterConfig> ClusterConfig::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::io_error("config: cannot read '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  auto c = parse(ss.str());
  if (!c.is_ok()) return Status::invalid_argument(path + ": " + c.status().message());
  return c;
}

int ClusterConfig::EngineSection::device_of(int local_rank, int device_count) const {
  const int local = std::max(local_rank, 0);
  if (!devices.empty()) return devices[static_cast<size_t>(local) % devices.size()];
  return device_count > 0 ? local % device_count : 0;
}

Status ClusterConfig::validate() const {
  if (engine.backend != "cpu" && engine.backend != "cuda")
    return Status::invalid_argument("config: 'engine.backend' = \"" + engine.backend + "\" (expected \"cpu\" or \"cuda\")");
  if (model.empty()) return Status::invalid_argument("config: 'model' must name a GGUF file");
  static constexpr const char* kTemplateNames[] = {"chatml", "gemma", "llama3", "llama3.1", "hermes", "qwen2.5"};
  if (!chat_template.empty() &&
      std::find(std::begin(kTemplateNames), std::end(kTemplateNames), chat_template) == std::end(kTemplateNames))
    return Status::invalid_argument("config: 'chat_template' = \"" + chat_template +
                                    "\" (expected \"\" for the model's own, \"chatml\", \"gemma\", \"llama3\", "
                                    "\"llama3.1\", \"hermes\" or \"qwen2.5\")");
  PD_RETURN_IF_ERROR(range("http.port", http.port, 0, 65535));
  PD_RETURN_IF_ERROR(range("http.threads", http.threads, 1, 64));
  PD_RETURN_IF_ERROR(range("http.max_body_bytes", http.max_body_bytes, 1024, int64_t{1} << 30));
  PD_RETURN_IF_ERROR(range("http.read_timeout_ms", http.read_timeout_ms, 100, 3600000));
  PD_RETURN_IF_ERROR(range("http.max_connections", http.max_connections, 0, 1 << 20));  // 0 = unlimited
  PD_RETURN_IF_ERROR(range("http.max_header_bytes", http.max_header_bytes, 1024, 1 << 20));
  PD_RETURN_IF_ERROR(range("http.max_write_buffer_bytes", http.max_write_buffer_bytes, 4096, int64_t{1} << 30));
  if (!http.admin_key.empty() && http.admin_key == http.api_key)
    return Status::invalid_argument("config: 'http.admin_key' must differ from 'http.api_key' (the API key must not "
                                    "open the admin endpoints)");
  PD_RETURN_IF_ERROR(range("kv.block_size", kv.block_size, 1, 1024));
  PD_RETURN_IF_ERROR(range("kv.decode_budget_mb", kv.decode_budget_mb, 1, int64_t{1} << 20));
  PD_RETURN_IF_ERROR(range("kv.prefill_budget_mb", kv.prefill_budget_mb, 1, int64_t{1} << 20));
  PD_RETURN_IF_ERROR(range("kv.tag_span", kv.tag_span, 1, 30000));
  PD_RETURN_IF_ERROR(parse_kv_dtype(kv.dtype, "config: 'kv.dtype'").status());
  PD_RETURN_IF_ERROR(range("prefill.token_budget", prefill.token_budget, 1, 1 << 20));
  PD_RETURN_IF_ERROR(range("prefill.max_batch", prefill.max_batch, 1, 4096));
  PD_RETURN_IF_ERROR(range("prefill.chunk_tokens", prefill.chunk_tokens, 0, 1 << 20));  // 0 = whole prompts
  PD_RETURN_IF_ERROR(range("prefill.context_cost_tokens", prefill.context_cost_tokens, 0, 1 << 24));  // 0 = off
  PD_RETURN_IF_ERROR(range("prefill.threads", prefill.threads, 0, 1024));
  PD_RETURN_IF_ERROR(range("decode.max_running", decode.max_running, 1, 4096));
  PD_RETURN_IF_ERROR(range("decode.step_tokens", decode.step_tokens, 1, 1 << 20));
  PD_RETURN_IF_ERROR(range("decode.speculate", decode.speculate, 0, 16));
  PD_RETURN_IF_ERROR(range("decode.speculate_max_batch", decode.speculate_max_batch, 1, 4096));
  PD_RETURN_IF_ERROR(range("decode.threads", decode.threads, 0, 1024));
  PD_RETURN_IF_ERROR(range("router.max_queued", router.max_queued, 1, 1 << 20));  // 0 would refuse every request
  PD_RETURN_IF_ERROR(range("router.max_inflight_per_worker", router.max_inflight_per_worker, 1, 1 << 20));
  PD_RETURN_IF_ERROR(range("router.max_attempts", router.max_attempts, 1, 10));
  PD_RETURN_IF_ERROR(range("router.max_answer_entries", router.max_answer_entries, 1, int64_t{1} << 40));
  PD_RETURN_IF_ERROR(range("router.retry_after_s", router.retry_after_s, 0, 3600));
  if (router.policy != "cache_aware" && router.policy != "least_work")
    return Status::invalid_argument("config: 'router.policy' = \"" + router.policy +
                                    "\" (expected \"cache_aware\" or \"least_work\")");
  PD_RETURN_IF_ERROR(range("router.balance_tokens", router.balance_tokens, 0, int64_t{1} << 40));
  PD_RETURN_IF_ERROR(range("router.decode_reuse_tokens", router.decode_reuse_tokens, 0, 1 << 24));
  auto real_range = [](const char* key, double v, double lo, double hi, bool open_lo) {
    if (std::isfinite(v) && (open_lo ? v > lo : v >= lo) && v <= hi) return Status::ok();
    return Status::invalid_argument(std::string("config: '") + key + "' = " + std::to_string(v) + " is out of range " +
                                    (open_lo ? "(" : "[") + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  };
  PD_RETURN_IF_ERROR(real_range("router.queue_weight", router.queue_weight, 0.0, 1000.0, false));
  PD_RETURN_IF_ERROR(real_range("router.balance_ratio", router.balance_ratio, 1.0, 1000.0, false));
  PD_RETURN_IF_ERROR(real_range("router.decode_reuse_weight", router.decode_reuse_weight, 0.0, 1000.0, true));
  PD_RETURN_IF_ERROR(real_range("router.min_cached_fraction", router.min_cached_fraction, 0.0, 1.0, false));
  PD_RETURN_IF_ERROR(real_range("sampling.temperature", sampling.temperature, 0.0, 2.0, false));
  PD_RETURN_IF_ERROR(real_range("sampling.top_p", sampling.top_p, 0.0, 1.0, true));
  PD_RETURN_IF_ERROR(real_range("sampling.min_p", sampling.min_p, 0.0, 1.0, false));
  PD_RETURN_IF_ERROR(range("sampling.top_k", sampling.top_k, -1, 1 << 20));
  for (auto [k, v] : {std::pair{"timeouts.handoff_ms", timeouts.handoff_ms}, {"timeouts.transfer_ms", timeouts.transfer_ms},
                      {"timeouts.prefill_queue_ms", timeouts.prefill_queue_ms},
                      {"timeouts.request_ms", timeouts.request_ms}, {"timeouts.queue_ms", timeouts.queue_ms},
                      {"timeouts.stop_grace_ms", timeouts.stop_grace_ms},
                      {"timeouts.rank_drain_ms", timeouts.rank_drain_ms}, {"timeouts.startup_ms", timeouts.startup_ms}})
    PD_RETURN_IF_ERROR(range(k, v, 1, 86400000));
  // Workers report at least once a second: a shorter deadline would take healthy ranks for dead.
  PD_RETURN_IF_ERROR(range("timeouts.heartbeat_ms", timeouts.heartbeat_ms, 1500, 86400000));
  // The router beats once a second: the same floor.
  PD_RETURN_IF_ERROR(range("timeouts.router_ms", timeouts.router_ms, 1500, 86400000));
  PD_RETURN_IF_ERROR(range("timeouts.rejoin_ms", timeouts.rejoin_ms, 0, 86400000));
  return Status::ok();
}

std::string ClusterConfig::model_name() const {
  if (!served_model_name.empty()) return served_model_name;
  return std::filesystem::path(model).stem().string();
}

}  // namespace pd
