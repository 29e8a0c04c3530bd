// The cluster secret, and how a link proves it.
//
// The ranks of the launching mpirun reach each other over MPI_COMM_WORLD:
// mpirun started each of them, so those links are trusted as they are. Every
// other link — a pool started later by its own mpirun joining through the
// router's MPI port, its ranks linking to the workers' ports — is opened by a
// process nobody vouched for. Whoever accepts such a link (the router, a
// worker) first sends a Challenge (a fresh random nonce); the joiner's first
// message (Join to the router, Hello to a worker) must carry the proof: an
// HMAC-SHA256, under the cluster secret, of the challenge and of the message
// itself. Anything else on an unproven link is dropped and the link freed, so
// a process without the secret is never handed a prompt, never publishes KV,
// and never steers a rank. A proof answers one challenge on one link: a
// recorded proof is worth nothing on another.
//
// The secret is a file only its owner can read (docs/SECURITY.md): the router
// generates it beside the join file when it does not exist, or the operator
// provides it (--secret-file).
//
// Threading: a ClusterSecret is an immutable value; any thread may use it.
#pragma once

#include <string>

#include "protocol/messages.h"
#include "util/status.h"

namespace pd {

class ClusterSecret {
 public:
  // Reads the secret in `path` (its first line; at least kMinLength
  // characters). NotFound when the file is missing; InvalidArgument naming
  // the file when it is too short. A file others may read is used, with a
  // warning naming it.
  static Result<ClusterSecret> load(const std::string& path);
  // load(), or — when `path` does not exist — a new secret of 32 random bytes
  // (hex) written there, readable by its owner only (the router at start-up).
  static Result<ClusterSecret> load_or_create(const std::string& path);
  static constexpr size_t kMinLength = 16;

  // A fresh challenge: 32 random bytes, hex.
  static std::string challenge();
  // The proof of this secret for `m` (a Join or a Hello; its own `proof` is
  // not part of it) sent on the link `challenge` came from.
  std::string prove(const std::string& challenge, const proto::Message& m) const;
  // Whether `m` (a Join or a Hello) carries the proof prove() gives. Compared
  // in constant time; any other message type is false.
  bool verify(const std::string& challenge, const proto::Message& m) const;

 private:
  explicit ClusterSecret(std::string key) : key_(std::move(key)) {}
  std::string key_;
};

// Where the secret of the cluster whose join file is `join_file` lives unless
// configured: beside it, "<join_file>.secret".
std::string secret_file_beside(const std::string& join_file);

}  // namespace pd
