#include "util/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

namespace pd {

Status write_file_atomically(const std::string& path, std::string_view contents, std::string_view what,
                             mode_t mode) {
  std::vector<char> tmp(path.begin(), path.end());
  for (char c : std::string_view(".XXXXXX")) tmp.push_back(c);
  tmp.push_back('\0');
  const int fd = ::mkstemp(tmp.data());  // 0600, a name only this call holds
  if (fd < 0)
    return Status::io_error("cannot create a temporary file beside " + std::string(what) + " '" + path +
                            "': " + std::strerror(errno));
  const std::string tmp_path(tmp.data());
  auto fail = [&](const char* doing) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    ::unlink(tmp_path.c_str());
    return Status::io_error(std::string("cannot ") + doing + " " + std::string(what) + " '" + tmp_path + "': " + why);
  };
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return fail("write");
    done += static_cast<size_t>(n);
  }
  if (::fchmod(fd, mode) != 0) return fail("set the mode of");
  if (::fsync(fd) != 0) return fail("sync");
  if (::close(fd) != 0) {
    ::unlink(tmp_path.c_str());
    return Status::io_error("cannot write " + std::string(what) + " '" + tmp_path + "'");
  }
  if (std::rename(tmp_path.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp_path.c_str());
    return Status::io_error("cannot rename '" + tmp_path + "' to " + std::string(what) + " '" + path + "': " + why);
  }
  return Status::ok();
}

}  // namespace pd
