// protocol/link_auth.h: the cluster secret's file, and the proofs a joining
// link answers its Challenge with.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "protocol/link_auth.h"

namespace pd {
namespace {

struct TempDir {
  std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("pd_link_auth_test_" + std::to_string(::getpid()));
  TempDir() { std::filesystem::create_directories(path); }
  ~TempDir() { std::filesystem::remove_all(path); }
};

TEST_CASE("cluster secret: created owner-only when missing, read back the same, refused when short", "[link_auth]") {
  TempDir dir;
  const std::string path = (dir.path / "cluster.join.secret").string();
  auto made = ClusterSecret::load_or_create(path);
  REQUIRE(made.is_ok());
  const auto perms = std::filesystem::status(path).permissions() & std::filesystem::perms::all;
  CHECK(perms == (std::filesystem::perms::owner_read | std::filesystem::perms::owner_write));
  auto again = ClusterSecret::load_or_create(path);  // exists: read, not replaced
  REQUIRE(again.is_ok());
  auto read = ClusterSecret::load(path);
  REQUIRE(read.is_ok());
  const std::string challenge = ClusterSecret::challenge();
  const proto::Hello hello{5, 0};
  CHECK(made->prove(challenge, hello) == read->prove(challenge, hello));
  CHECK(again->prove(challenge, hello) == read->prove(challenge, hello));

  const std::string missing = (dir.path / "none").string();
  CHECK(ClusterSecret::load(missing).status().is_not_found());
  CHECK(ClusterSecret::load(missing).status().message().find(missing) != std::string::npos);
  const std::string short_file = (dir.path / "short").string();
  std::ofstream(short_file) << "tooshort\n";
  const Status st = ClusterSecret::load(short_file).status();
  CHECK(st.is_invalid_argument());
  CHECK(st.message().find(short_file) != std::string::npos);
}

TEST_CASE("cluster secret: a proof holds only for its secret, its challenge and its message", "[link_auth]") {
  TempDir dir;
  const std::string a_path = (dir.path / "a").string(), b_path = (dir.path / "b").string();
  std::ofstream(a_path) << "operator-given secret number one\n";
  std::ofstream(b_path) << "operator-given secret number two\n";
  auto a = ClusterSecret::load(a_path);
  auto b = ClusterSecret::load(b_path);
  REQUIRE((a.is_ok() && b.is_ok()));

  const std::string challenge = ClusterSecret::challenge();
  CHECK(challenge.size() == 64);
  CHECK(challenge != ClusterSecret::challenge());  // fresh each time

  proto::Join join{2, "node-b", 77, 16, "port-b", "node-b:70", "f16"};
  join.proof = a->prove(challenge, join);
  CHECK(a->verify(challenge, join));
  CHECK_FALSE(b->verify(challenge, join));                          // another cluster's secret
  CHECK_FALSE(a->verify(ClusterSecret::challenge(), join));         // replayed on another link
  proto::Join changed = join;
  changed.role = 1;                                                  // a field changed after proving
  CHECK_FALSE(a->verify(challenge, changed));
  proto::Join unproven = join;
  unproven.proof.clear();
  CHECK_FALSE(a->verify(challenge, unproven));
  CHECK_FALSE(a->verify("", join));

  proto::Hello hello{9, 1};
  hello.proof = a->prove(challenge, hello);
  CHECK(a->verify(challenge, hello));
  proto::Hello other_rank = hello;
  other_rank.rank = 0;  // the router's id, with the proof of rank 9
  CHECK_FALSE(a->verify(challenge, other_rank));
  // Only a Join or a Hello carries a proof.
  CHECK_FALSE(a->verify(challenge, proto::Shutdown{}));
}

}  // namespace
}  // namespace pd
