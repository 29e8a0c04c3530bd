// KV-cache footprint of a model: bytes per token, per context and batch, next to
// the weights, and the KV block pool a device's memory holds.
//
// Every byte count goes through pd::KvGeometry::bytes_per_token() and
// pd::kv_blocks_for_budget() (common/kv/kv_block_manager.h): the one formula for
// KV bytes in the codebase, shared with the decode workers' pool sizing.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kv/kv_block_manager.h"
#include "plan/model_spec.h"
#include "plan/precision.h"
#include "util/status.h"

namespace pd::plan {

// The model's KV geometry at a KV precision (int4: bits_per_element = 4).
KvGeometry kv_geometry(const ModelSpec& m, Precision kv);
// The same model if it used plain multi-head attention (kv heads = query heads).
KvGeometry kv_geometry_mha(const ModelSpec& m, Precision kv);
int64_t kv_bytes_per_token(const ModelSpec& m, Precision kv);
// KV bytes of `batch` sequences holding `context` tokens each.
int64_t kv_bytes(const ModelSpec& m, Precision kv, int64_t context, int64_t batch);
// Weight bytes at a precision: parameter_count x bits / 8 (scales not counted).
int64_t weight_bytes(const ModelSpec& m, Precision weights);

struct KvFootprintRow {
  int64_t context = 0;
  int64_t batch = 0;
  int64_t kv_bytes = 0;        // the model as it is (grouped-query where it is)
  int64_t kv_bytes_mha = 0;    // the same with kv heads = query heads
  int64_t weight_bytes = 0;
  double kv_percent_of_weights = 0;  // 100 x kv / weights
  double kv_share_percent = 0;       // 100 x kv / (kv + weights)
};
// One row per (context, batch) pair, contexts outer. InvalidArgument naming
// "context" or "batch" when a value is not positive.
Result<std::vector<KvFootprintRow>> kv_footprint_table(const ModelSpec& m, Precision kv, Precision weights,
                                                       std::span<const int64_t> contexts,
                                                       std::span<const int64_t> batches);

// How a rank's devices are used: a rank is a tensor-parallel group of
// `devices` identical devices; weights and KV heads are split across them.
struct KvPoolConfig {
  int64_t device_memory_bytes = 0;   // per device
  int devices = 1;                   // tensor-parallel degree of a rank
  double memory_fraction = 0.9;      // of device memory the engine may use
  int64_t reserve_bytes = 0;         // per device, for activations and workspace
  int block_size = 16;               // tokens per KV block
};

struct KvPoolPlan {
  int64_t usable_bytes_per_device = 0;   // device_memory x memory_fraction
  int64_t weight_bytes_per_device = 0;   // weights / devices
  int64_t kv_budget_per_device = 0;      // usable - weights - reserve
  int kv_heads_per_device = 0;           // n_kv_heads / devices (1 when replicated)
  int64_t kv_bytes_per_token_per_device = 0;
  int64_t num_blocks = 0;                // kv_blocks_for_budget(per-device geometry, ...)
  int block_size = 0;
  int64_t token_capacity = 0;            // num_blocks x block_size, per rank
  // Sequences of `context` tokens the pool holds at once (whole blocks each).
  int64_t max_sequences(int64_t context) const;
};

// Sizes a rank's KV pool. InvalidArgument naming the field for a bad config
// (non-positive memory, devices, block size; fraction outside (0, 1]; n_kv_heads
// and devices not dividing one another); ResourceExhausted when the weights and
// reserve leave no room for a single block.
Result<KvPoolPlan> plan_kv_pool(const ModelSpec& m, Precision kv, Precision weights, const KvPoolConfig& cfg);

}  // namespace pd::plan
