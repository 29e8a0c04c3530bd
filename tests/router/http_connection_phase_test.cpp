// Every HTTP server test of this binary also checks the connections' phase
// machine (router/http_server.cpp, ConnPhase): after each test case, no
// connection may have attempted an illegal phase change (util/lifecycle.h
// counts them). A listener rather than a test case, so that every exchange the
// other tests drive — keep-alive, "100 Continue", refusals, eviction, SSE,
// pipelining, clients leaving — is checked.
#define CATCH_CONFIG_EXTERNAL_INTERFACES
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>

#include "util/lifecycle.h"

namespace pd::router {
namespace {

class IllegalTransitionCheck : public Catch::TestEventListenerBase {
 public:
  using TestEventListenerBase::TestEventListenerBase;
  void testCaseEnded(const Catch::TestCaseStats& stats) override {
    const int64_t n = illegal_transitions();
    if (n == 0) return;
    std::fprintf(stderr, "test case '%s': %lld illegal state transition(s) (see the log above)\n",
                 stats.testInfo.name.c_str(), static_cast<long long>(n));
    std::fflush(stderr);
    std::_Exit(1);
  }
};
CATCH_REGISTER_LISTENER(IllegalTransitionCheck)

}  // namespace
}  // namespace pd::router
