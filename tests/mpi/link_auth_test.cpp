// Two-rank test of the links a rank accepts (run: mpirun -np 2): the control
// channel of rank 1 listens as a worker does (protocol/mpi_links.h), rank 0
// opens links to its port and speaks on each as a joining rank would, with and
// without the cluster secret. Only a Hello that answers its own link's
// Challenge with the secret, naming a rank that has no link yet, is let
// through (protocol/link_auth.h); every other link is freed and counted, and
// nothing it said reaches the worker — a first message too large for a proof
// is not even received.
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "mpi/mpi_test_support.h"
#include "protocol/join_handshake.h"
#include "protocol/link_auth.h"
#include "protocol/mpi_channel.h"
#include "protocol/mpi_runtime.h"

namespace {

using pd::test::failures;
constexpr int kTagPort = 77, kTagDone = 78;

// The next control message on `links`' link `id` (a Challenge), within 20 s.
std::string receive_challenge(pd::MpiLinks& links, int id) {
  const auto ep = links.endpoint(id);
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (ep && std::chrono::steady_clock::now() < end) {
    int flag = 0;
    MPI_Status st;
    MPI_Iprobe(ep->rank, pd::proto::kTagControl, ep->comm, &flag, &st);
    if (flag) {
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      std::vector<uint8_t> buf(static_cast<size_t>(count));
      MPI_Recv(buf.data(), count, MPI_BYTE, ep->rank, pd::proto::kTagControl, ep->comm, MPI_STATUS_IGNORE);
      auto m = pd::proto::deserialize(buf.data(), buf.size());
      if (m.is_ok())
        if (auto* c = std::get_if<pd::proto::Challenge>(&*m)) return c->nonce;
      return "";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return "";
}

// Rank 0: a joining rank's side. Each link: connect, take the Challenge, send `first`.
void joiner(const std::string& port, const pd::ClusterSecret& secret, const pd::ClusterSecret& wrong) {
  pd::MpiLinks links;
  std::string replayed_proof, replayed_challenge;
  auto open = [&](auto&& first_message) {
    auto id = links.connect(port, pd::MpiLinks::kProvisionalBase);
    EXPECT(id.is_ok(), "connect: %s", id.status().to_string().c_str());
    if (!id.is_ok()) return;
    const std::string challenge = receive_challenge(links, *id);
    EXPECT(challenge.size() == 64, "no Challenge on a new link");
    const pd::Status st = pd::send_now(links, *id, first_message(challenge));
    EXPECT(st.is_ok(), "send: %s", st.to_string().c_str());
    // Anything said after an unproven first message must be ignored too.
    (void)pd::send_now(links, *id, pd::proto::Message{pd::proto::Drain{}});
  };
  using pd::proto::Hello;
  using pd::proto::Message;
  // 1. No proof at all.
  open([&](const std::string&) { return Message{Hello{5, 0}}; });
  // 2. A proof made with another cluster's secret.
  open([&](const std::string& c) {
    Hello h{5, 0};
    h.proof = wrong.prove(c, h);
    return Message{h};
  });
  // 3. A true proof, claiming rank 0: a rank of rank 1's world already (the router's id, in a cluster).
  open([&](const std::string& c) {
    Hello h{0, 0};
    h.proof = secret.prove(c, h);
    return Message{h};
  });
  // 4. Not a Hello first: the router's Shutdown, unproven.
  open([&](const std::string&) { return Message{pd::proto::Shutdown{}}; });
  // 5. The one link that proves it: rank 7 says Hello, then reports its load.
  {
    auto id = links.connect(port, 7);
    EXPECT(id.is_ok(), "connect: %s", id.status().to_string().c_str());
    const std::string challenge = receive_challenge(links, 7);
    Hello h{7, 0};
    h.proof = secret.prove(challenge, h);
    replayed_proof = h.proof;
    replayed_challenge = challenge;
    EXPECT(pd::send_now(links, 7, Message{h}).is_ok(), "send Hello");
    pd::proto::LoadReport r;
    r.waiting = 42;
    EXPECT(pd::send_now(links, 7, Message{r}).is_ok(), "send LoadReport");
  }
  // 6. Link 5's proof replayed on a new link (another challenge), for rank 8.
  open([&](const std::string& c) {
    EXPECT(c != replayed_challenge, "the same challenge twice");
    Hello h{7, 0};
    h.proof = replayed_proof;
    return Message{h};
  });
  // 7. A first message far larger than any Join or Hello — a true proof for rank 8,
  // padded with a field the parser would skip: refused before it is received.
  {
    auto id = links.connect(port, pd::MpiLinks::kProvisionalBase);
    EXPECT(id.is_ok(), "connect: %s", id.status().to_string().c_str());
    if (id.is_ok()) {
      const std::string challenge = receive_challenge(links, *id);
      EXPECT(challenge.size() == 64, "no Challenge on a new link");
      const nlohmann::json padded{{"t", "hello"}, {"rank", 8}, {"epoch", 0},
                                  {"proof", secret.prove(challenge, Message{Hello{8, 0}})},
                                  {"pad", std::string(64 << 10, 'x')}};
      static std::vector<uint8_t> big;  // outlives the send, which is never received
      big = nlohmann::json::to_msgpack(padded);
      const auto ep = links.endpoint(*id);
      MPI_Request req = MPI_REQUEST_NULL;
      MPI_Isend(big.data(), static_cast<int>(big.size()), MPI_BYTE, ep->rank, pd::proto::kTagControl, ep->comm, &req);
      MPI_Request_free(&req);
    }
  }
  int done = 1;
  MPI_Send(&done, 1, MPI_INT, 1, kTagDone, MPI_COMM_WORLD);
  int ack = 0;
  MPI_Recv(&ack, 1, MPI_INT, 1, kTagDone, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  links.close_all();
}

// Rank 1: a worker accepting links with the cluster secret in `secret_path`.
void acceptor(const std::string& secret_path) {
  auto links = std::make_shared<pd::MpiLinks>();
  const pd::Status st = links->listen(-1, secret_path);
  EXPECT(st.is_ok(), "listen: %s", st.to_string().c_str());
  const std::string& port = links->port();
  MPI_Send(port.c_str(), static_cast<int>(port.size()) + 1, MPI_CHAR, 0, kTagPort, MPI_COMM_WORLD);
  pd::MpiControlChannel channel(links);
  std::vector<std::pair<int, std::string>> delivered;
  auto receive = [&] {
    channel.receive([&](int source, pd::proto::Message& m) {
      std::string what = pd::proto::message_name(m);
      if (auto* r = std::get_if<pd::proto::LoadReport>(&m)) what += ":" + std::to_string(r->waiting);
      delivered.emplace_back(source, what);
    });
    channel.progress();
  };
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int flag = 0; !flag && std::chrono::steady_clock::now() < end;) {
    receive();
    MPI_Iprobe(0, kTagDone, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
    if (!flag) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  int done = 0;
  MPI_Recv(&done, 1, MPI_INT, 0, kTagDone, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  for (int i = 0; i < 200; ++i) {  // whatever is still on its way
    receive();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT(channel.flush(std::chrono::milliseconds(5000)), "challenges not sent");
  MPI_Send(&done, 1, MPI_INT, 0, kTagDone, MPI_COMM_WORLD);
  const std::vector<std::pair<int, std::string>> want{{7, "Hello"}, {7, "LoadReport:42"}};
  EXPECT(delivered == want, "delivered %zu messages, want the Hello and LoadReport of rank 7 only", delivered.size());
  for (const auto& [source, what] : delivered) std::fprintf(stderr, "  delivered %s from %d\n", what.c_str(), source);
  EXPECT(channel.refused_links() == 6, "refused %lld links, want 6", static_cast<long long>(channel.refused_links()));
}

}  // namespace

int main(int argc, char** argv) {
  if (!pd::mpi_init(&argc, &argv, /*elastic=*/true).is_ok()) return 2;
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2) {
    if (rank == 0) std::fprintf(stderr, "run with mpirun -np 2\n");
    MPI_Finalize();
    return 2;
  }
  // Both ranks read one secret file (as a cluster's ranks do); another cluster's beside it.
  const auto dir = std::filesystem::temp_directory_path() / "pd_link_auth_mpi_test";
  int pid = rank == 0 ? ::getpid() : 0;
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
  const auto own = dir / ("secret-" + std::to_string(pid));
  const auto other = dir / ("other-" + std::to_string(pid));
  if (rank == 0) {
    std::filesystem::create_directories(dir);
    EXPECT(pd::ClusterSecret::load_or_create(own.string()).is_ok(), "create the secret");
    EXPECT(pd::ClusterSecret::load_or_create(other.string()).is_ok(), "create another secret");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) {
    char port[MPI_MAX_PORT_NAME] = {};
    MPI_Recv(port, MPI_MAX_PORT_NAME, MPI_CHAR, 1, kTagPort, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    auto secret = pd::ClusterSecret::load(own.string());
    auto wrong = pd::ClusterSecret::load(other.string());
    if (secret.is_ok() && wrong.is_ok()) joiner(port, *secret, *wrong);
  } else {
    acceptor(own.string());
  }
  int mine = failures, total = 0;
  MPI_Allreduce(&mine, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) {
    std::filesystem::remove(own);
    std::filesystem::remove(other);
    std::printf(total == 0 ? "link auth: all checks passed\n" : "link auth: %d checks failed\n", total);
  }
  pd::mpi_finalize_bounded(total == 0 ? 0 : 1);
  return total == 0 ? 0 : 1;
}
