// A measured per-phase cost profile of one engine rank: how long a prefill
// forward pass takes for N prompt tokens and how long a decode step takes for
// a batch of B sequences at context L. The engine benchmark (pd-bench-engine)
// writes it; the pool simulator reads it in place of the roofline model, so the
// same simulator predicts this machine and a datacenter.
//
// Schema (format "pd-engine-profile", version 1; docs/PLANNER.md has an example):
//   {
//     "format": "pd-engine-profile", "version": 1,
//     "model": "...", "hardware": "...",                  (informational strings)
//     "kv_bytes_per_token": 46080,                         (optional, informational)
//     "prefill": [ {"tokens": 64, "seconds": 0.05}, ... ], (one forward pass over
//                 `tokens` prompt tokens in all, batched; >= 1 point, distinct tokens)
//     "decode":  [ {"batch": 1, "context": 256, "seconds": 0.004}, ... ],
//                 (one decode step; the points must form a full grid: every
//                 batch measured at every context)
//     "kv_transfer": {"bytes_per_second": 9e9, "latency_seconds": 2e-5}  (optional)
//   }
//
// Interpolation: piecewise linear between measured points; below the smallest
// point the smallest point's time (fixed overheads dominate there); above the
// largest, the last segment's slope (never negative) continues. Prefill with a
// single point scales in proportion to tokens. Decode is bilinear over the
// (batch, context) grid with the same rule on each axis.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace pd::plan {

struct EngineProfile {
  std::string model;
  std::string hardware;
  int64_t kv_bytes_per_token = 0;  // 0 when absent
  // Prefill: sorted by tokens, distinct.
  std::vector<double> prefill_tokens;
  std::vector<double> prefill_seconds;
  // Decode grid: decode_seconds[i * contexts.size() + j] = step time at batches[i], contexts[j].
  std::vector<double> decode_batches;
  std::vector<double> decode_contexts;
  std::vector<double> decode_seconds;
  // KV transfer link, when measured (0: absent).
  double kv_transfer_bytes_per_second = 0;
  double kv_transfer_latency_seconds = 0;

  // Time of one prefill pass over `tokens` prompt tokens (tokens > 0).
  double prefill_time(double tokens) const;
  // Time of one decode step of `batch` sequences at mean context `context`.
  double decode_step_time(double batch, double context) const;
};

// Parses and validates a profile. InvalidArgument naming `source` and the bad
// field (missing, wrong type, non-positive, duplicate point, incomplete grid).
Result<EngineProfile> engine_profile_from_json(std::string_view json_text, std::string_view source);
Result<EngineProfile> engine_profile_from_file(const std::string& path);
// The JSON text of a profile (the schema above), e.g. for the benchmark to write.
std::string engine_profile_to_json(const EngineProfile& p);

}  // namespace pd::plan
