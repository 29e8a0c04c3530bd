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
  CHECK(st.message().find("/nonexistent-dir/sub/port") != std::string::npos);
}

TEST_CASE("write_file_atomically writes only the owner's file, through a name no one could plant", "[files]") {
  const auto dir = std::filesystem::temp_directory_path() / ("pd_files_mode_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "cluster.join").string();
  // Another user's link at the old fixed temporary name must not be written through.
  const std::string bait = (dir / "bait").string();
  { std::ofstream(bait) << "untouched"; }
  std::filesystem::create_symlink(bait, path + ".tmp");
  REQUIRE(write_file_atomically(path, "{}\n", "join file").is_ok());
  CHECK(read_all(path) == "{}\n");
  CHECK(read_all(bait) == "untouched");
  const auto perms = std::filesystem::status(path).permissions();
  CHECK((perms & std::filesystem::perms::all) == (std::filesystem::perms::owner_read | std::filesystem::perms::owner_write));
  // Nothing but the file, the bait and its link are left in the folder.
  int entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++entries;
  CHECK(entries == 3);
  REQUIRE(write_file_atomically(path, "1", "http.port_file", 0644).is_ok());
  CHECK((std::filesystem::status(path).permissions() & std::filesystem::perms::others_read) ==
        std::filesystem::perms::others_read);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pd
