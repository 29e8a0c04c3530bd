#include "protocol/cluster_env.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <string>

namespace pd {

bool rank_confirmed_dead(const RoleTable& t, int rank) {
  if (rank < 0 || rank >= static_cast<int>(t.pids.size()) || t.self < 0) return false;
  if (t.hosts[rank] != t.hosts[t.self]) return false;
  const pid_t pid = t.pids[rank];
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  // Still a process table entry: dead if it is a zombie not yet reaped.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && (line[close + 2] == 'Z' || line[close + 2] == 'X');
}

}  // namespace pd
