#include "protocol/link_auth.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <variant>

#include "util/files.h"

namespace pd {
namespace {

std::string hex(const unsigned char* bytes, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = kDigits[bytes[i] >> 4];
    out[2 * i + 1] = kDigits[bytes[i] & 15];
  }
  return out;
}

std::string random_hex(size_t bytes) {
  std::string raw(bytes, '\0');
  // OpenSSL's CSPRNG (seeded from the kernel); it fails only without entropy.
  if (RAND_bytes(reinterpret_cast<unsigned char*>(raw.data()), static_cast<int>(bytes)) != 1)
    throw std::runtime_error("no random bytes from OpenSSL (RAND_bytes)");
  return hex(reinterpret_cast<const unsigned char*>(raw.data()), bytes);
}

// The message as proven: its MessagePack bytes with its own proof left out.
std::vector<uint8_t> proven_bytes(const proto::Message& m) {
  proto::Message copy = m;
  if (auto* join = std::get_if<proto::Join>(&copy)) join->proof.clear();
  else if (auto* hello = std::get_if<proto::Hello>(&copy)) hello->proof.clear();
  return proto::serialize(copy);
}

}  // namespace

Result<ClusterSecret> ClusterSecret::load(const std::string& path) {
  std::ifstream f(path);
  if (!f) return Status::not_found("cannot read the cluster secret '" + path + "' (--secret-file)");
  std::string key;
  std::getline(f, key);
  while (!key.empty() && (key.back() == '\r' || key.back() == ' ' || key.back() == '\t')) key.pop_back();
  if (key.size() < kMinLength)
    return Status::invalid_argument("the cluster secret '" + path + "' is shorter than " + std::to_string(kMinLength) +
                                    " characters (--secret-file)");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & (S_IRWXG | S_IRWXO)) != 0)
    spdlog::warn("the cluster secret '{}' may be read by other users (mode {:o}): chmod 600 it", path,
                 st.st_mode & 0777);
  return ClusterSecret(std::move(key));
}

Result<ClusterSecret> ClusterSecret::load_or_create(const std::string& path) {
  if (::access(path.c_str(), F_OK) == 0) return load(path);
  std::string key;
  try {
    key = random_hex(32);
  } catch (const std::exception& e) {
    return Status::internal(std::string("generating the cluster secret: ") + e.what());
  }
  PD_RETURN_IF_ERROR(write_file_atomically(path, key + "\n", "cluster secret", 0600));
  spdlog::info("generated the cluster secret '{}' (readable by its owner only)", path);
  return ClusterSecret(std::move(key));
}

std::string ClusterSecret::challenge() { return random_hex(32); }

std::string ClusterSecret::prove(const std::string& challenge, const proto::Message& m) const {
  // What is signed: a fixed label (a proof of this protocol's and no other),
  // the challenge, and the message.
  std::string data = "pdcluster link proof v1\n" + challenge + "\n";
  const std::vector<uint8_t> bytes = proven_bytes(m);
  data.append(bytes.begin(), bytes.end());
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key_.data(), static_cast<int>(key_.size()), reinterpret_cast<const unsigned char*>(data.data()),
           data.size(), mac, &len) == nullptr)
    return std::string();  // never equal to a proof: verify() fails closed
  return hex(mac, len);
}

bool ClusterSecret::verify(const std::string& challenge, const proto::Message& m) const {
  const std::string* proof = nullptr;
  if (const auto* join = std::get_if<proto::Join>(&m)) proof = &join->proof;
  else if (const auto* hello = std::get_if<proto::Hello>(&m)) proof = &hello->proof;
  if (proof == nullptr || challenge.empty()) return false;
  const std::string expected = prove(challenge, m);
  if (expected.empty() || proof->size() != expected.size()) return false;
  return CRYPTO_memcmp(proof->data(), expected.data(), expected.size()) == 0;
}

std::string secret_file_beside(const std::string& join_file) { return join_file + ".secret"; }

}  // namespace pd
