// Files other processes poll for (the router's port file, the join file, the
// cluster secret).
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

#include "util/status.h"

namespace pd {

// Writes `contents` to `path` atomically: to a temporary file beside it with a
// name no one else can have chosen (mkstemp), created with `mode` (only the
// owner may read it by default: the join file names the cluster's MPI port),
// then renamed over it, so a reader polling for the file never sees it half
// written and no other process can slip its own file in under the temporary
// name. `what` names the file in errors (a config key or a flag).
Status write_file_atomically(const std::string& path, std::string_view contents, std::string_view what,
                             mode_t mode = 0600);

}  // namespace pd
