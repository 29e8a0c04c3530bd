// A worker rank's communication side: one thread that owns every MPI call of
// the rank — control messages in and out, KV sends and receives, heartbeats —
// and keeps them progressing all the time, while the rank's compute side (the
// engine loop) runs passes that may last seconds.
//
//   CommSide comm(std::make_unique<MpiControlChannel>(links), make_kv_transport(...), {.router = r});
//   PrefillWorker w(cfg, roles, engine, comm.transport(), comm.channel());
//   comm.start();
//   w.run();            // the compute side: never calls MPI
//   comm.stop();
//
// The compute side holds two ends that look like the real ones (a
// ControlChannel and a Transport) and exchange commands and events with the
// thread through queues:
// - channel(): send() queues the message, the thread sends it at once (woken);
//   messages that arrive are taken off the network by the thread as they come
//   (stamped with that moment: arrival()) and wait in an inbox for receive() or
//   receive_while().
// - transport(): a post queues the operation and returns its id at once; the
//   thread posts it, tests it every round and records how it ended; test()
//   reads that record. A post the real transport refuses is reported by the
//   op's test(). Operations are posted in the order the compute side asked
//   (so sends under one tag keep their order), cancel() and abandon() follow
//   the operation they name.
// - liveness: the thread re-sends the compute side's last LoadReport to the
//   router when none went out for `heartbeat`, so a long pass never makes the
//   rank look dead — unless the compute side has made no call at all for
//   `compute_stall` (a wedged engine loop must still be fenced).
//
// Waiting: the thread sleeps on a condition variable between rounds —
// `busy_wait` after a round that moved something while operations are in
// flight (MPI moves a large message only inside MPI calls), doubling while
// nothing moves (a receive posted long before its sender computes the layer
// need not be tested every 50 us), up to `idle_wait`, which is also the wait
// when nothing is in flight (an arriving message is noticed within it) — and
// wakes at once when the compute side queues work. It never spins: three ranks
// share two cores here.
//
// Threading: channel() and transport() each belong to one compute thread; the
// real channel and transport are used by the communication thread alone once
// start() has run (and by the caller again after stop()).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>

#include "kvtransfer/transport.h"
#include "protocol/control_channel.h"
#include "protocol/mpi_thread_check.h"

namespace pd {

struct CommSideOptions {
  std::chrono::microseconds busy_wait{50};
  std::chrono::microseconds idle_wait{1000};
  int router = -1;  // where heartbeats go (LoadReports sent there are repeated); -1: none
  std::chrono::milliseconds heartbeat{1000};
  std::chrono::milliseconds compute_stall{30000};
};

// Counters of the communication side (read with stats(); all since start()).
struct CommStats {
  int64_t rounds = 0;          // progress rounds
  int64_t messages_in = 0;     // control messages taken off the network
  int64_t messages_out = 0;    // control messages sent
  int64_t ops_posted = 0;      // transport operations posted
  int64_t ops_ended = 0;       // ... that ended (done, cancelled or failed)
  int64_t heartbeats = 0;      // LoadReports repeated on the compute side's behalf
};

class CommSide {
 public:
  CommSide(std::unique_ptr<ControlChannel> channel, std::unique_ptr<Transport> transport, CommSideOptions opts = {});
  // stop()s.
  ~CommSide();
  CommSide(const CommSide&) = delete;
  CommSide& operator=(const CommSide&) = delete;

  // The compute side's ends (op ids are unique across every transport end
  // taken, so two ends never see each other's operations); they stay safe to call
  // after stop() and after this object is gone (sends then vanish, posts fail
  // with Cancelled).
  std::unique_ptr<ControlChannel> channel();
  std::unique_ptr<Transport> transport();

  // Starts the thread (once). Its first act is Transport::bind_thread().
  void start();
  // Runs every command queued so far, then ends the thread. Operations still in
  // flight are left to the real transport (the caller flushes first).
  void stop();
  CommStats stats() const;

 private:
  struct Shared;
  class Channel;
  class Port;
  class Loop;
  void loop();
  std::shared_ptr<Shared> shared_;
  std::thread thread_;
};

// Runs a worker's compute side (`run`, on the calling thread, marked a compute
// thread: it may not call MPI) against a communication side over `channel`
// and `transport`; `make` builds the worker from the compute side's ends.
// Returns what the worker's run() returned, once the communication side has
// stopped.
template <typename Worker, typename Make>
Status serve_with_comm_side(std::unique_ptr<ControlChannel> channel, std::unique_ptr<Transport> transport,
                            CommSideOptions opts, Make&& make) {
  CommSide comm(std::move(channel), std::move(transport), opts);
  std::unique_ptr<Worker> worker = make(comm.channel(), comm.transport());
  comm.start();
  Status st;
  {
    ComputeThreadScope compute;
    st = worker->run();
  }
  comm.stop();
  return st;
}

}  // namespace pd
