#include "util/lifecycle.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdlib>

namespace pd {
namespace {
std::atomic<int64_t> g_illegal{0};
}

int64_t illegal_transitions() { return g_illegal.load(); }

void report_illegal_transition(const char* component, uint64_t id, const char* from, const char* to) {
  g_illegal.fetch_add(1);
  spdlog::critical("{}: request {}: illegal state transition {} -> {} (a bug; state unchanged)", component, id, from,
                   to);
#ifndef NDEBUG
  std::abort();
#endif
}

}  // namespace pd
