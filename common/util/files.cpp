#include "util/files.h"

#include <cstdio>
#include <fstream>

namespace pd {

Status write_file_atomically(const std::string& path, std::string_view contents, std::string_view what) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc | std::ios::binary);
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    if (!out.flush()) return Status::io_error("cannot write " + std::string(what) + " '" + tmp + "'");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    return Status::io_error("cannot rename '" + tmp + "' to " + std::string(what) + " '" + path + "'");
  return Status::ok();
}

}  // namespace pd
