// Tests of the API-key check: the Bearer scheme in any case with one or more
// blanks, exact (case-sensitive) tokens, everything else refused, no key = open;
// and of the admin key's: the same match, but no key = closed.
#include "router/auth.h"

#include <catch2/catch.hpp>

#include <string>

namespace pd::router {
namespace {

TEST_CASE("auth: an empty key authorizes everything", "[auth]") {
  CHECK(authorized("", ""));
  CHECK(authorized("Bearer anything", ""));
  CHECK(authorized("Basic dXNlcjpwYXNz", ""));
}

TEST_CASE("auth: the Bearer scheme in any letter case, one or more blanks", "[auth]") {
  for (const char* h : {"Bearer sekret", "bearer sekret", "BEARER sekret", "bEaReR sekret", "Bearer   sekret",
                        "Bearer\tsekret", "Bearer \t sekret", "Bearer sekret ", "  Bearer sekret", "Bearer sekret\t"}) {
    INFO(h);
    CHECK(authorized(h, "sekret"));
  }
}

TEST_CASE("auth: anything but the exact token is refused", "[auth]") {
  for (const char* h : {"", "Bearer", "Bearer ", "Bearer  \t ", "Bearersekret", "Bearer: sekret", "Basic sekret",
                        "sekret", "Bearer Sekret", "Bearer SEKRET", "Bearer sekre", "Bearer sekret2",
                        "Bearer sekretsekret", "Bearer s", "Bearer xekret", "Bearer sekreT", "Bearer sek ret",
                        "Bearer sekret sekret", "Token sekret", "Bear sekret", "XBearer sekret"}) {
    INFO(h);
    CHECK_FALSE(authorized(h, "sekret"));
  }
  // The header is not a prefix match either way, and NUL bytes are bytes.
  CHECK_FALSE(authorized(std::string("Bearer sekret\0", 14), "sekret"));
  CHECK_FALSE(authorized("Bearer sekret", std::string("sekret\0", 7)));
  CHECK(authorized(std::string("Bearer a\0b", 10), std::string("a\0b", 3)));
}

TEST_CASE("auth: constant_time_equal is plain equality", "[auth]") {
  CHECK(constant_time_equal("", ""));
  CHECK(constant_time_equal("abc", "abc"));
  CHECK_FALSE(constant_time_equal("abc", "abd"));
  CHECK_FALSE(constant_time_equal("xbc", "abc"));
  CHECK_FALSE(constant_time_equal("ab", "abc"));
  CHECK_FALSE(constant_time_equal("abc", "ab"));
  CHECK_FALSE(constant_time_equal("", "a"));
  CHECK_FALSE(constant_time_equal("a", ""));
  // A guess that repeats the secret (the loop wraps around b) is still unequal.
  CHECK_FALSE(constant_time_equal("abcabc", "abc"));
  CHECK_FALSE(constant_time_equal("abc", "abcabc"));
  const std::string key(4096, 'k');
  std::string guess = key;
  CHECK(constant_time_equal(guess, key));
  guess.back() = 'j';
  CHECK_FALSE(constant_time_equal(guess, key));
  guess = key;
  guess.front() = 'j';
  CHECK_FALSE(constant_time_equal(guess, key));
  CHECK(constant_time_equal(std::string("\xff\x00\x80", 3), std::string("\xff\x00\x80", 3)));
  CHECK_FALSE(constant_time_equal(std::string("\xff\x00\x80", 3), std::string("\xff\x00\x81", 3)));
}

TEST_CASE("auth: the admin endpoints are closed without an admin key and opened only by it", "[auth]") {
  // No admin key: closed to everyone, whatever is sent (an empty key is no key).
  for (const char* h : {"", "Bearer ", "Bearer x", "Basic x"}) {
    INFO(h);
    CHECK(admin_access(h, "") == AdminAccess::kDisabled);
  }
  // A key: the same Bearer match as the API key's.
  CHECK(admin_access("Bearer adm1n", "adm1n") == AdminAccess::kAllowed);
  CHECK(admin_access("bearer \t adm1n ", "adm1n") == AdminAccess::kAllowed);
  for (const char* h : {"", "Bearer", "Bearer adm1", "Bearer adm1n2", "Bearer ADM1N", "Basic adm1n", "adm1n"}) {
    INFO(h);
    CHECK(admin_access(h, "adm1n") == AdminAccess::kDenied);
  }
}

}  // namespace
}  // namespace pd::router
