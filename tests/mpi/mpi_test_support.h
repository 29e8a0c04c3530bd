// What the multi-rank transport tests (run under mpirun, no Catch2) share: a
// failure counter with EXPECT, the byte pattern a sequence's blocks hold, and
// a bounded wait for a transfer op.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>

#include "kvtransfer/transport.h"

namespace pd::test {

inline int failures = 0;
#define EXPECT(cond, ...)                                       \
  do {                                                          \
    if (!(cond)) {                                              \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                        \
      std::fprintf(stderr, "\n");                               \
      ++::pd::test::failures;                                   \
    }                                                           \
  } while (0)

// The byte a sequence holds at (layer, kind, logical block, offset in block).
inline uint8_t pattern(int layer, int kind, int logical_block, size_t i) {
  return static_cast<uint8_t>(layer * 131 + kind * 71 + logical_block * 29 + i * 7 + 1);
}

// Tests `op` until it leaves kPending (at most 60 s). An error is kPending,
// with its message in *err (printed when err is null).
inline OpState wait(Transport& t, TransferOp op, std::string* err = nullptr) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < end) {
    auto r = t.test(op);
    if (!r.is_ok()) {
      if (err)
        *err = r.status().to_string();
      else
        std::fprintf(stderr, "op %lld: %s\n", static_cast<long long>(op.value), r.status().to_string().c_str());
      return OpState::kPending;
    }
    if (*r != OpState::kPending) return *r;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (err) *err = "timed out";
  return OpState::kPending;
}

}  // namespace pd::test
