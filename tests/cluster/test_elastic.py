#!/usr/bin/env python3
"""Elastic pools: a decode pool started by its own mpirun joins a running cluster while it
streams, serves, and leaves again; a rank of the launching job is drained out.

    tests/cluster/test_elastic.py elastic

1 router + 1 prefill + 1 decode rank (default model), launched with --join-file:
  0. a pool given another cluster's secret (--secret-file), or started on another model file, is
     refused and nothing of it joins;
  1. 16 greedy streamed requests start; once they stream, `launch.sh --join FILE --decode 1`
     adds a decode pool (its own mpirun, MPI_Comm_connect through ompi-server);
  2. once /health lists the joined rank up, 8 more streamed requests: some go to it
     (pd_rank_requests_total);
  3. while those stream, SIGTERM to the pool's launch.sh: the rank asks to leave, finishes what
     it holds, and its mpirun exits 0; /health drops it; pd_ranks_left_total counts it;
  4. a second pool of one prefill and one decode rank joins (the next two ids: the pool's ranks
     reach each other through their own MPI job, the others through new links), then POST
     /admin/drain removes the launching job's decode rank (its process exits; requests go
     through both prefill ranks to the joined decode rank);
  5. every request ends exactly once, with the text pd-generate gives (greedy), and every KV
     block of the ranks left comes back.

Exit 0 = pass, 1 = fail, 77 = skipped (printed why)."""
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import (BUILD, DEFAULT_MODEL, ROOT, Cluster, blocks_all_free, check, need_default_model, per_rank,  # noqa: E402
                     reference, run_suite, tiny_model, wait_for)
from loadgen import words  # noqa: E402
from test_chaos import Stream  # noqa: E402

# The admin key: POST /admin/drain needs it (the admin endpoints are closed without one).
ADMIN_KEY = "test-elastic-admin"
CONFIG = {"timeouts": {"heartbeat_ms": 4000, "request_ms": 120000, "stop_grace_ms": 30000, "rank_drain_ms": 30000}, "http": {"admin_key": ADMIN_KEY}}
MAX_TOKENS = 96  # long enough that the first 16 still stream when a pool has joined (~3-5 s)


class Pool:
    """A pool joining the cluster: deploy/launch.sh --join FILE --decode N [--prefill M], in its own
    session; `wrap` runs it elsewhere (another host), `launch_args` adds flags (--hostfile, --mca)."""

    def __init__(self, join_file, config_path, decode=1, prefill=0, wrap=None, launch_args=None):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [os.path.join(ROOT, "deploy", "launch.sh"), "--join", join_file, "--decode", str(decode),
               "--prefill", str(prefill), "--config", config_path, "--build", BUILD, "--threads", "1"]
        cmd = list(wrap or []) + cmd + list(launch_args or [])
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def logs(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def leave(self, timeout=60):
        """SIGTERM to launch.sh (as Ctrl-C): the pool drains out; returns mpirun's exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@contextlib.contextmanager
def pools_of(c):
    """A list the suite appends its Pools to. On a failed check, prints the cluster's and every
    pool's log; at the end a pool still running leaves (30 s), then is killed if it has not."""
    pools = []
    try:
        yield pools
    except AssertionError:
        print(c.logs())
        for p in pools:
            print("--- pool log\n" + p.logs())
        raise
    finally:
        for p in pools:
            if p.proc.poll() is None:
                p.leave(30)
            p.kill()


def ranks(c):
    status, body = c.health()
    return {r["rank"]: (r["role"], r["state"]) for r in (body or {}).get("ranks", [])}


def text_of(s):
    return "".join(s.piece(ch) for ev in s.events if isinstance(ev, dict) for ch in ev.get("choices", []))


def start(c, prompts, first):
    # Request j is a chat when j % 4 == 3, as workload()'s fourth prompt.
    streams = [Stream(first + i, "chat" if (first + i) % 4 == 3 else "completion", p, MAX_TOKENS)
               for i, p in enumerate(prompts)]
    for s in streams:
        s.body["ignore_eos"] = True
    threads = [threading.Thread(target=s.read, args=(c.port, lambda: None, 300, c.client_host), daemon=True)
               for s in streams]
    for t in threads:
        t.start()
    return streams, threads


def texting(streams):
    return sum(1 for s in streams if s.t_text is not None)


def workload(model):
    """32 prompts (four distinct: two lengths, completion and chat, each sent 8 times: the
    reference costs four pd-generate runs) and pd-generate's greedy text for each."""
    rng = random.Random(5)
    distinct = [words(n, rng) for n in (14, 40, 14, 40)]
    prompts = [distinct[i % 4] for i in range(32)]
    cases = [{"prompt": p, "chat": i == 3, "max_tokens": MAX_TOKENS, "ignore_eos": True} for i, p in enumerate(distinct)]
    t_ref = time.time()
    want = [r["text"] for r in reference(model, cases)] * 8
    print("pd-generate reference: %.1f s" % (time.time() - t_ref))
    return prompts, want


def grow_and_shrink(c, make_pool, prompts, pools):
    """Steps 1-3: a one-decode-rank pool (make_pool()) joins while 16 requests stream, serves
    some of 8 more, and leaves while they stream. Returns (streams, threads, seconds to join)."""
    before = set(ranks(c))
    streams, threads = start(c, prompts[:16], 0)
    wait_for(lambda: texting(streams) >= 1, 120, "the first stream to start")
    t0 = time.time()
    pools.append(make_pool())
    new = []

    def joined_up():
        new[:] = [r for r, (role, state) in ranks(c).items() if r not in before and role == "decode" and state == "up"]
        return bool(new)
    # The join happens under load however long it takes: while the pool is not up, streams
    # that ended are replaced (request ids from 100 on, prompt and expected text i % 32).
    refills = 0
    t_poll = time.time()  # the last poll that found the pool not up yet: it came up after this
    while not joined_up():
        t_poll = time.time()
        check(time.time() - t0 < 120, "the joined decode rank up in /health: not within 120 s")
        alive = sum(1 for t in threads if t.is_alive())
        if alive < 4:
            ids = [100 + refills + k for k in range(4 - alive)]
            more, more_threads = start(c, [prompts[i % len(prompts)] for i in ids], ids[0])
            streams += more
            threads += more_threads
            refills += len(ids)
        time.sleep(0.1)
    rank = new[0]
    joined_s = time.time() - t0
    # Streams running while the pool came up (between the last two polls): refills of
    # equal length end together, so a count taken at this instant alone can catch the
    # moment between one set's end and the next poll's refill.
    streaming = sum(1 for s in streams if s.t_end is None or s.t_end >= t_poll)
    print("a decode pool joined (rank %d) in %.1f s, with %d streams running (%d started while it joined)"
          % (rank, joined_s, streaming, refills))
    check(streaming > 0, "every stream ended before the pool joined: the join did not happen under load")
    more, more_threads = start(c, prompts[16:24], 16)
    streams += more
    threads += more_threads
    wait_for(lambda: texting(more) >= 4, 120, "4 of the 8 later streams to start")
    served = per_rank(c.metrics(), "pd_rank_requests_total").get(rank, 0)
    check(served >= 1, "no request went to the joined rank: %s" % per_rank(c.metrics(), "pd_rank_requests_total"))
    left = c.metric('pd_ranks_left_total{role="decode"}')
    rc = pools[-1].leave()
    check(rc == 0, "the leaving pool's mpirun exited %s:\n%s" % (rc, pools[-1].logs()))
    check(rank not in ranks(c), "/health still lists rank %d after it left: %s" % (rank, ranks(c)))
    check(c.metric('pd_ranks_left_total{role="decode"}') == left + 1, "pd_ranks_left_total did not count it")
    for t in threads:
        t.join(240)
    check(not any(t.is_alive() for t in threads), "streams still running long after the pool left")
    return streams, threads, joined_s


def check_all(c, streams, want):
    """Every request ended exactly once with pd-generate's greedy text; the router counted each once."""
    bad = []
    for s in streams:
        kind, detail = s.verdict()
        if kind != "finished":
            bad.append("request %d: %s %s" % (s.i, kind, detail))
        elif text_of(s) != want[s.i % len(want)]:
            bad.append("request %d: text %r != pd-generate's %r" % (s.i, text_of(s)[:80], want[s.i % len(want)][:80]))
    check(not bad, "%d of %d requests wrong:\n  %s" % (len(bad), len(streams), "\n  ".join(bad[:8])))
    m = c.metrics()
    check(m.get('pd_requests_total{outcome="finished"}', 0) >= len(streams),
          "pd_requests_total finished %s < %d" % (m.get('pd_requests_total{outcome="finished"}'), len(streams)))
    check(m.get('pd_requests_total{outcome="failed"}', 0) == 0, "some request failed: %s" % m)


def refuse_without_secret(c, join_file, tmp, pools):
    """Step 0: the join file and the secret beside it are the owner's alone; a pool given
    another secret (--secret-file) is refused by the router — its ranks stop, saying so — and
    nothing of it joins."""
    secret = join_file + ".secret"
    for path in (join_file, secret):
        mode = os.stat(path).st_mode & 0o777
        check(mode == 0o600, "%s has mode %o, not 600" % (path, mode))
    wrong = os.path.join(tmp, "wrong.secret")
    with open(wrong, "w") as f:
        f.write("a secret of some other cluster, long enough\n")
    os.chmod(wrong, 0o600)
    rc = refused_pool(c, join_file, pools, ["--secret-file", wrong], "cluster secret")
    check(c.metric("pd_refused_links") == 1, "pd_refused_links = %s, want 1" % c.metric("pd_refused_links"))
    print("a pool without the secret was refused (mpirun exit %s)" % rc)


def refuse_other_model(c, join_file, tmp, pools):
    """Step 0 too: a pool started on another model file (with the secret) is refused at join,
    naming the model file: it would fail every handoff, or serve another model's text."""
    rc = refused_pool(c, join_file, pools, ["--model", tiny_model(os.path.join(tmp, "other.gguf"))], "model file")
    print("a pool on another model file was refused (mpirun exit %s)" % rc)


def refused_pool(c, join_file, pools, launch_args, why):
    """Starts a pool with `launch_args` that the router must refuse: its ranks stop within 90 s,
    its log says `why`, and nothing of it joins. Returns mpirun's exit code."""
    before = ranks(c)
    pool = Pool(join_file, c.config_path, launch_args=launch_args)
    pools.append(pool)
    try:
        rc = pool.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        rc = None
    # (mpirun's exit code says nothing here: with orte_enable_recovery a job whose every rank
    # called MPI_Abort can exit 0; the log says what happened.)
    check(rc is not None, "a pool the router should refuse (%s) is still running:\n%s" % (launch_args, pool.logs()))
    check(why in pool.logs(), "the refused pool does not say why (%r):\n%s" % (why, pool.logs()))
    check(ranks(c) == before, "ranks changed after a refused join: %s -> %s" % (before, ranks(c)))
    pools.remove(pool)
    return rc


def suite_elastic(tmp):
    need_default_model()
    model = DEFAULT_MODEL
    join_file = os.path.join(tmp, "cluster.join")
    prompts, want = workload(model)
    with Cluster(prefill=1, decode=1, model=model, config=CONFIG, launch_args=["--join-file", join_file]) as c, \
            pools_of(c) as pools:
        wait_for(lambda: os.path.exists(join_file), 30, "the join file")
        refuse_without_secret(c, join_file, tmp, pools)
        refuse_other_model(c, join_file, tmp, pools)
        streams, threads, joined_s = grow_and_shrink(c, lambda: Pool(join_file, c.config_path), prompts, pools)
        # 4. a second pool (1 prefill + 1 decode) joins; the launching job's decode rank is drained out
        before = set(ranks(c))
        pools.append(Pool(join_file, c.config_path, decode=1, prefill=1))
        second = {}

        def second_pool_up():
            second.clear()
            second.update({role: r for r, (role, state) in ranks(c).items() if r not in before and state == "up"})
            return set(second) == {"prefill", "decode"}
        wait_for(second_pool_up, 120, "the second pool's prefill and decode ranks up")
        rank_pids = c.rank_pids()
        check(2 in rank_pids, "no process for decode rank 2: %s" % rank_pids)
        last, last_threads = start(c, prompts[24:32], 24)
        streams += last
        threads += last_threads
        wait_for(lambda: texting(last) >= 2, 120, "2 of the last 8 streams to start")
        r = c.post("/admin/drain", {"rank": 2}, headers={"Authorization": "Bearer " + ADMIN_KEY})
        check(r.status == 200, "POST /admin/drain: HTTP %d %s" % (r.status, r.body))
        wait_for(lambda: 2 not in ranks(c), 120, "decode rank 2 drained out")
        pid = rank_pids[2][1]
        wait_for(lambda: not os.path.exists("/proc/%d" % pid) or
                 open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[0] == "Z", 30,
                 "decode rank 2's process to exit")
        for t in threads:
            t.join(240)
        served = per_rank(c.metrics(), "pd_rank_requests_total")
        check(served.get(second["prefill"], 0) >= 1 and served.get(second["decode"], 0) >= 1,
              "the second pool %s served nothing: %s" % (second, served))
        # 5. every request: exactly one end, greedy text as pd-generate's
        check_all(c, streams, want)
        check(c.post("/v1/completions", {"prompt": prompts[0], "max_tokens": 4, "temperature": 0}).status == 200,
              "a request after the changes failed")
        wait_for(lambda: blocks_all_free(c), 30, "every KV block of the ranks left free")
        print("pool joined in %.1f s; %d requests, all exact; ranks now %s" % (joined_s, len(streams), ranks(c)))


if __name__ == "__main__":
    run_suite({"elastic": suite_elastic}, sys.argv[0])
