// The command line every pdcluster rank shares (pd-router, pd-prefill,
// pd-decode): the config file, the flags that override its keys, and the
// flags of elastic pools.
#pragma once

#include <string>

#include "config/cluster_config.h"
#include "util/status.h"

namespace pd {

// Flags of elastic pools (docs/CLUSTER.md), not config keys: they say how this
// process was launched.
struct LaunchFlags {
  bool elastic = false;   // --elastic: a worker of the launching job that accepts ranks joining later
  std::string join;       // --join FILE: a worker joining the running cluster FILE describes
  std::string join_file;  // --join-file FILE: the router accepts joins and writes FILE; an --elastic worker
                          // joins the router FILE names next if its own is gone
  std::string secret_file;  // --secret-file FILE: the cluster secret (protocol/link_auth.h)
  // The cluster secret's file: --secret-file, else beside the join file
  // (--join or --join-file); "" when this rank neither joins nor accepts joins.
  std::string secret_path() const;
};
// Whether the command line asks for an elastic rank (read before MPI_Init: it
// decides the MPI thread level).
bool wants_elastic(int argc, char** argv);

// Parses the command line into a config: an error Status names the flag or
// file; `help` is set when --help was asked for (usage already printed).
Result<ClusterConfig> parse_cluster_args(int argc, char** argv, const char* program, bool* help,
                                         LaunchFlags* flags = nullptr);

}  // namespace pd
