// Files other processes poll for (the router's port file, the join file).
#pragma once

#include <string>
#include <string_view>

#include "util/status.h"

namespace pd {

// Writes `contents` to `path` atomically: to a temporary file beside it, then
// renamed over it, so a reader polling for the file never sees it half
// written. `what` names the file in errors (a config key or a flag).
Status write_file_atomically(const std::string& path, std::string_view contents, std::string_view what);

}  // namespace pd
