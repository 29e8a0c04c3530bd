// util/files.h: the atomic write other processes poll for.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "util/files.h"

namespace pd {
namespace {

std::string read_all(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST_CASE("write_file_atomically replaces the file whole and leaves no temporary behind", "[files]") {
  const auto dir = std::filesystem::temp_directory_path() / ("pd_files_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "port").string();
  REQUIRE(write_file_atomically(path, "8080\n", "http.port_file").is_ok());
  CHECK(read_all(path) == "8080\n");
  REQUIRE(write_file_atomically(path, "9", "http.port_file").is_ok());  // shorter: nothing of the old is left
  CHECK(read_all(path) == "9");
  CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("write_file_atomically names what it could not write", "[files]") {
  const Status st = write_file_atomically("/nonexistent-dir/sub/port", "1", "http.port_file");
  REQUIRE_FALSE(st.is_ok());
  CHECK(st.is_io_error());
  CHECK(st.message().find("http.port_file") != std::string::npos);
  CHECK(st.message().find("/nonexistent-dir/sub/port.tmp") != std::string::npos);
}

}  // namespace
}  // namespace pd
