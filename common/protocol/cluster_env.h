// Death detection: whether another rank's process is known to have ended, and
// the workers' Env (util/env.h) that answers it from the rank's role table.
#pragma once

#include <utility>

#include "protocol/role_table.h"
#include "util/env.h"

namespace pd {

// Whether `rank`'s process is known to have ended: it ran on this host and its
// pid is gone (or a zombie). False when it cannot be known (another host).
// A rank that is merely stopped (SIGSTOP) is not dead: it may resume and
// complete the transfers it had begun.
bool rank_confirmed_dead(const RoleTable& t, int rank);

// The workers' Env in the cluster (util/env.h): the steady clock, and
// rank_confirmed_dead over the rank's role table.
class ClusterEnv final : public Env {
 public:
  explicit ClusterEnv(RoleTable roles) : roles_(std::move(roles)) {}
  bool rank_gone(int rank) const override { return rank_confirmed_dead(roles_, rank); }

 private:
  RoleTable roles_;
};

}  // namespace pd
