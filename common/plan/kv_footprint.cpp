#include "plan/kv_footprint.h"

#include <cmath>
#include <cstdio>
#include <string>

namespace pd::plan {

KvGeometry kv_geometry(const ModelSpec& m, Precision kv) {
  KvGeometry g;
  g.n_layers = m.n_layers;
  g.n_kv_heads = m.n_kv_heads;
  g.head_dim = m.head_dim;
  const int bits = precision_bits(kv);
  if (bits % 8 == 0) {
    g.bytes_per_element = bits / 8;
  } else {
    g.bytes_per_element = 1;
    g.bits_per_element = bits;
  }
  return g;
}

KvGeometry kv_geometry_mha(const ModelSpec& m, Precision kv) {
  KvGeometry g = kv_geometry(m, kv);
  g.n_kv_heads = m.n_heads;
  return g;
}

int64_t kv_bytes_per_token(const ModelSpec& m, Precision kv) { return kv_geometry(m, kv).bytes_per_token(); }

int64_t kv_bytes(const ModelSpec& m, Precision kv, int64_t context, int64_t batch) {
  return kv_bytes_per_token(m, kv) * context * batch;
}

int64_t weight_bytes(const ModelSpec& m, Precision weights) {
  return parameter_count(m) * precision_bits(weights) / 8;
}

Result<std::vector<KvFootprintRow>> kv_footprint_table(const ModelSpec& m, Precision kv, Precision weights,
                                                       std::span<const int64_t> contexts,
                                                       std::span<const int64_t> batches) {
  if (contexts.empty()) return Status::invalid_argument("context: at least one context length is needed");
  if (batches.empty()) return Status::invalid_argument("batch: at least one batch size is needed");
  for (int64_t c : contexts) {
    if (c <= 0) return Status::invalid_argument("context: must be positive, got " + std::to_string(c));
    if (c > (int64_t{1} << 30)) return Status::invalid_argument("context: implausibly large: " + std::to_string(c));
  }
  for (int64_t b : batches) {
    if (b <= 0) return Status::invalid_argument("batch: must be positive, got " + std::to_string(b));
    if (b > (int64_t{1} << 24)) return Status::invalid_argument("batch: implausibly large: " + std::to_string(b));
  }
  const int64_t w = weight_bytes(m, weights);
  const int64_t per_token = kv_bytes_per_token(m, kv);
  const int64_t per_token_mha = kv_geometry_mha(m, kv).bytes_per_token();
  std::vector<KvFootprintRow> rows;
  rows.reserve(contexts.size() * batches.size());
  for (int64_t c : contexts) {
    for (int64_t b : batches) {
      KvFootprintRow r;
      r.context = c;
      r.batch = b;
      r.kv_bytes = per_token * c * b;
      r.kv_bytes_mha = per_token_mha * c * b;
      r.weight_bytes = w;
      r.kv_percent_of_weights = w > 0 ? 100.0 * static_cast<double>(r.kv_bytes) / static_cast<double>(w) : 0.0;
      r.kv_share_percent = 100.0 * static_cast<double>(r.kv_bytes) / static_cast<double>(r.kv_bytes + w);
      rows.push_back(r);
    }
  }
  return rows;
}

int64_t KvPoolPlan::max_sequences(int64_t context) const {
  if (context <= 0 || block_size <= 0) return 0;
  const int64_t blocks_per_seq = (context + block_size - 1) / block_size;
  return num_blocks / blocks_per_seq;
}

Result<KvPoolPlan> plan_kv_pool(const ModelSpec& m, Precision kv, Precision weights, const KvPoolConfig& cfg) {
  if (cfg.device_memory_bytes <= 0) {
    return Status::invalid_argument("device_memory: must be positive, got " + std::to_string(cfg.device_memory_bytes));
  }
  if (cfg.devices <= 0) return Status::invalid_argument("tp: must be positive, got " + std::to_string(cfg.devices));
  if (!(cfg.memory_fraction > 0.0 && cfg.memory_fraction <= 1.0)) {
    return Status::invalid_argument("memory_fraction: must be in (0, 1], got " + std::to_string(cfg.memory_fraction));
  }
  if (cfg.reserve_bytes < 0) {
    return Status::invalid_argument("reserve: must not be negative, got " + std::to_string(cfg.reserve_bytes));
  }
  if (cfg.block_size <= 0) {
    return Status::invalid_argument("block_size: must be positive, got " + std::to_string(cfg.block_size));
  }
  if (m.n_kv_heads % cfg.devices != 0 && cfg.devices % m.n_kv_heads != 0) {
    return Status::invalid_argument("tp: " + std::to_string(cfg.devices) + " devices cannot split " +
                                    std::to_string(m.n_kv_heads) + " KV heads evenly");
  }
  KvPoolPlan p;
  p.block_size = cfg.block_size;
  p.usable_bytes_per_device =
      static_cast<int64_t>(std::floor(static_cast<double>(cfg.device_memory_bytes) * cfg.memory_fraction));
  const int64_t w = weight_bytes(m, weights);
  p.weight_bytes_per_device = (w + cfg.devices - 1) / cfg.devices;
  p.kv_budget_per_device = p.usable_bytes_per_device - p.weight_bytes_per_device - cfg.reserve_bytes;
  // Each device holds n_kv_heads / devices heads of every block; with more devices
  // than KV heads, heads are replicated and each device holds one.
  KvGeometry g = kv_geometry(m, kv);
  g.n_kv_heads = m.n_kv_heads >= cfg.devices ? m.n_kv_heads / cfg.devices : 1;
  p.kv_heads_per_device = g.n_kv_heads;
  p.kv_bytes_per_token_per_device = g.bytes_per_token();
  p.num_blocks = kv_blocks_for_budget(g, cfg.block_size, p.kv_budget_per_device);
  if (p.num_blocks <= 0) {
    char msg[320];
    std::snprintf(msg, sizeof msg,
                  "device_memory: %.4g GB x %.3g usable per device leaves no room for one KV block after %.4g GB of "
                  "weights and %.4g GB reserved per device (model '%s', %d device(s) per rank)",
                  cfg.device_memory_bytes / 1e9, cfg.memory_fraction, p.weight_bytes_per_device / 1e9,
                  cfg.reserve_bytes / 1e9, m.name.c_str(), cfg.devices);
    return Status::resource_exhausted(msg);
  }
  p.token_capacity = p.num_blocks * cfg.block_size;
  return p;
}

}  // namespace pd::plan
