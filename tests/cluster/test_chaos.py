#!/usr/bin/env python3
"""Chaos tests: a rank dies, or stops and comes back, while the cluster is under load.

    tests/cluster/test_chaos.py {decode_kill,prefill_kill,stop_cont,router_kill,colocated_kill,reuse_stop}

Each suite starts 1 router + 2 prefill + 2 decode ranks (default model, one
thread each, timeouts.heartbeat_ms 4000) and sends 32 concurrent streamed
greedy requests (ignore_eos, a few dozen tokens each):

decode_kill:  kill -9 the busiest decode rank once most streams have started
              (the streams it held migrate: they go on from the next token on
              the other decode rank).
prefill_kill: kill -9 the prefill rank with prompts still queued once a few
              streams have started (its queued prompts must be re-run elsewhere).
stop_cont:    kill -STOP the busiest decode rank once most streams have started;
              it is declared down; its streams migrate; new requests are served
              by the others; every stream ends while it is still stopped;
              kill -CONT: it is re-admitted (pd_rank_up back to 1) and every KV
              block of every rank comes back.
colocated_kill: decode_kill on 1 router + 2 colocated ranks (each prefills and
              decodes): the streams of the killed rank migrate to the other.
reuse_stop:   two conversations' first turns, then kill -STOP a decode rank holding
              one's answer, and the follow-ups (stream and not) of both: those the
              router sends back to the stopped rank (decode_reuse) are re-run through
              the prefill pool once it is declared down; every one ends once, within
              the bound, with pd-generate's text; kill -CONT: re-admitted, every KV
              block back. (Not under the 32-stream load below: its own checks.)
router_kill:  kill -9 the router under load (timeouts.router_ms 3000): every
              stream's connection ends (none hangs), every worker rank stops
              within router_ms plus MPI's bounded finalize, saying why, and
              mpirun exits: the pools do not linger.

What every suite checks after the fault:
  - the MPI job survives it (mpirun runs with orte_enable_recovery);
  - every request ends exactly once: one terminal event (a chunk with
    finish_reason), nothing after it but the usage chunk and one [DONE], and
    the response ends; it has all its tokens and pd-generate's greedy text
    (none ends with an error: one that had streamed nothing was re-run, one
    that had was migrated);
  - every request ended within BOUND_S of the fault;
  - requests sent afterwards (stream and not, completion and chat) succeed;
  - GET /health is 200 "degraded" naming the faulty rank down (others up);
    pd_rank_up is 0 for it and 1 for the others, pd_rank_down_total >= 1 for it;
  - the router counted each request once (pd_requests_total);
  - every KV block of every rank still up comes back (pd_free_kv_blocks ==
    pd_kv_blocks).

Exit 0 = pass, 1 = fail, 77 = skipped (printed why)."""
import contextlib
import http.client
import json
import os
import random
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import (DEFAULT_MODEL, Cluster, check, need_default_model, path_of, per_rank, reference,  # noqa: E402
                     request_body, run_suite, wait_for)
from loadgen import words  # noqa: E402

HEARTBEAT_MS = 4000
HEARTBEAT_S = HEARTBEAT_MS / 1000.0
# request_ms: nothing hangs for ever; stop_grace_ms: a failed suite's teardown is quick.
CONFIG = {"timeouts": {"heartbeat_ms": HEARTBEAT_MS, "request_ms": 60000, "stop_grace_ms": 10000}}
N = 32              # concurrent streamed requests
MAX_TOKENS = 48
# The fault -> every request of the load has ended: heartbeat_ms plus a generous
# margin for re-runs on 2 cores, and well below the fallbacks that would end them
# anyway (timeouts.transfer_ms 30 s, timeouts.request_ms 60 s).
BOUND_S = 25
SETTLE_S = 30       # KV blocks back, re-admission


# ------------------------------------------------------------------ streams

def sampling_of(i):
    """Every 8th stream of a load samples (seeded: the text is still known in advance)."""
    return {"temperature": 0.8, "top_p": 1.0, "seed": 1000 + i} if i % 8 == 5 else {}


class Stream:
    """One streamed request, read line by line with the times that matter."""

    def __init__(self, i, endpoint, prompt, max_tokens, sampling=None):
        self.i, self.endpoint, self.max_tokens = i, endpoint, max_tokens
        # skip_special_tokens false: past EOS (ignore_eos) control tokens come, and pd-generate prints them.
        self.body = request_body(endpoint, prompt, max_tokens, stream=True, ignore_eos=True, skip_special_tokens=False,
                                 **(sampling or {}))
        self.status, self.http_body, self.problem = None, "", ""
        self.events = []                     # parsed data payloads ('[DONE]' or dicts), in order
        self.t_sent = self.t_text = self.t_end = None   # sent, first non-empty text, response over
        self.t_last = None                               # the last event

    def piece(self, choice):
        if self.endpoint == "chat":
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""

    def text(self):
        return "".join(self.piece(ch) for ev in self.events if isinstance(ev, dict) for ch in ev.get("choices", []))

    def read(self, port, on_text, timeout, host="127.0.0.1"):
        self.t_sent = time.time()
        c = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            c.request("POST", path_of(self.endpoint), body=json.dumps(self.body),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            self.status = r.status
            if r.status != 200:
                self.http_body = r.read().decode("utf-8", "replace")
                return
            while True:
                line = r.readline()
                if not line:
                    break  # the response is over (last chunk, or the connection closed)
                line = line.decode("utf-8", "replace").rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                ev = payload if payload == "[DONE]" else json.loads(payload)
                self.events.append(ev)
                self.t_last = time.time()
                if self.t_text is None and isinstance(ev, dict) and any(self.piece(ch) for ch in ev.get("choices", [])):
                    self.t_text = time.time()
                    on_text()
        except (OSError, http.client.HTTPException, ValueError) as e:
            self.problem = "%s: %s" % (type(e).__name__, e)
        finally:
            self.t_end = time.time()
            c.close()

    def still_running(self):
        if self.status is None:
            return "still running: no response yet"
        text = sum(1 for ev in self.events if isinstance(ev, dict) and any(self.piece(ch) for ch in ev.get("choices", [])))
        return "still running: %d chunks with text, the last event %s" % (
            text, "%.1f s ago" % (time.time() - self.t_last) if self.t_last else "never")

    def verdict(self):
        """('finished' | 'errored' | 'bad', detail)."""
        if self.problem:
            return "bad", "transport: " + self.problem
        if self.status != 200:
            return "bad", "HTTP %s (should have been re-run on a healthy rank): %s" % (self.status, self.http_body[:300])
        text, terminal, done, usage = "", None, 0, None
        for k, ev in enumerate(self.events):
            if ev == "[DONE]":
                done += 1
                if k != len(self.events) - 1:
                    return "bad", "events after [DONE]: %s" % self.events[k + 1:][:3]
                continue
            if "error" in ev:
                if terminal is not None:
                    return "bad", "an error event after the terminal %s: %s" % (terminal, ev)
                terminal = ("error", ev["error"])
                continue
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                piece = self.piece(ch)
                if terminal is not None and piece:
                    return "bad", "text after the terminal %s: %r" % (terminal, piece)
                text += piece
                if ch.get("finish_reason"):
                    if terminal is not None:
                        return "bad", "a second terminal event (finish_reason %r) after %s" % (ch["finish_reason"],
                                                                                                terminal)
                    terminal = ("finish", ch["finish_reason"])
        if terminal is None:
            return "bad", "no terminal event in %d events (last: %s)" % (len(self.events), self.events[-2:])
        if done != 1:
            return "bad", "%d [DONE] after the terminal %s" % (done, terminal)
        if terminal[0] == "error":
            if not text:
                return "bad", ("an error before any text (should have been re-run on a healthy rank): %s"
                               % terminal[1])
            return "errored", str(terminal[1].get("message", terminal[1]) if isinstance(terminal[1], dict)
                                  else terminal[1])[:200]
        if terminal[1] not in ("length", "stop"):
            return "bad", "finish_reason %r" % terminal[1]
        got = (usage or {}).get("completion_tokens")
        if got != self.max_tokens:
            return "bad", "finished with %s completion tokens, want %d (usage %s)" % (got, self.max_tokens, usage)
        if not text:
            return "bad", "finished with no text"
        return "finished", terminal[1]


class Load:
    """N streamed requests sent at once, each on its own thread."""

    def __init__(self, port, prompts, max_tokens=MAX_TOKENS):
        self.streams = [Stream(i, "chat" if i % 4 == 3 else "completion", p, max_tokens, sampling_of(i))
                        for i, p in enumerate(prompts)]
        self.lock = threading.Lock()
        self.texting = 0
        self.threads = [threading.Thread(target=s.read, args=(port, self.on_text, BOUND_S + 60), daemon=True)
                        for s in self.streams]
        for t in self.threads:
            t.start()

    def on_text(self):
        with self.lock:
            self.texting += 1

    def started(self):
        with self.lock:
            return self.texting

    def running(self):
        return sum(t.is_alive() for t in self.threads)

    def join(self, deadline):
        for t in self.threads:
            t.join(max(0.0, deadline - time.time()))
        return self.running() == 0

    def report(self, t_fault):
        """{kind: count}, [(stream, kind, detail)] for the bad ones, latest end after the fault."""
        counts, bad = {}, []
        for s in self.streams:
            kind, detail = s.verdict() if s.t_end is not None else ("bad", s.still_running())
            counts[kind] = counts.get(kind, 0) + 1
            if kind == "bad":
                bad.append((s.i, detail))
        latest = max((s.t_end for s in self.streams if s.t_end is not None), default=t_fault) - t_fault
        return counts, bad, latest

    def errored_detail(self):
        return sorted({s.verdict()[1] for s in self.streams if s.t_end is not None and s.verdict()[0] == "errored"})


def prompts(n, seed, lo, hi):
    rng = random.Random(seed)
    return [words(rng.randint(lo, hi), rng) for _ in range(n)]


def greedy_texts(prompt_list):
    """pd-generate's text for each prompt, as Load sends it (every 4th one as chat; greedy, or
    sampled with the same seed: sampling_of)."""
    t0 = time.time()
    cases = [dict({"prompt": p, "chat": i % 4 == 3, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                   "temperature": 0.0}, **{k: v for k, v in sampling_of(i).items() if k != "top_p"})
             for i, p in enumerate(prompt_list)]
    want = [r["text"] for r in reference(DEFAULT_MODEL, cases)]
    print("pd-generate reference for %d prompts: %.1f s" % (len(want), time.time() - t0))
    return want


# ------------------------------------------------------------------ cluster state

def outcomes(c):
    return {k.split('"')[1]: v for k, v in c.metrics().items() if k.startswith("pd_requests_total{")}


def delta(after, before):
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in set(after) | set(before)
            if after.get(k, 0) != before.get(k, 0)}


def workers(c):
    """{rank: role} of the worker ranks (from the processes at start-up)."""
    return {r: role for r, (role, _) in c.rank_pids().items() if role != "router"}


def health_shows(c, down, all_ranks):
    """/health is 200 'degraded' with exactly the ranks in `down` down and the rest up
    (200 'ok' with every rank up when down is empty); -> (bool, what it said)."""
    try:
        status, body = c.health()
    except OSError as e:
        return False, "GET /health: %s" % e
    want = "degraded" if down else "ok"
    if status != 200 or not isinstance(body, dict) or body.get("status") != want:
        return False, "%s %s" % (status, body)
    states = {}
    for r in body.get("ranks") or []:
        states[r.get("rank")] = (r.get("role"), r.get("state"))
    expect = {r: (role, "down" if r in down else "up") for r, role in all_ranks.items()}
    got = {r: states.get(r) for r in expect}
    return got == expect, "%s %s" % (status, body)


def rank_states(c, all_ranks):
    """(pd_rank_up, pd_rank_down_total) per worker rank."""
    m = c.metrics()
    return per_rank(m, "pd_rank_up"), per_rank(m, "pd_rank_down_total")


def blocks_back(c, ranks):
    """Every rank in `ranks` reports pd_rank_up 1 and all its KV blocks free."""
    m = c.metrics()
    up, free, total = per_rank(m, "pd_rank_up"), per_rank(m, "pd_free_kv_blocks"), per_rank(m, "pd_kv_blocks")
    return all(up.get(r) == 1 and r in total and total[r] > 0 and free.get(r) == total[r] for r in ranks)


def wait_blocks_back(c, ranks, what):
    try:
        wait_for(lambda: blocks_back(c, ranks), SETTLE_S, "KV blocks")
    except AssertionError:
        up = per_rank(c.metrics(), "pd_rank_up")
        raise AssertionError("%s: KV blocks of ranks %s not all back within %d s: %s; pd_rank_up %s"
                             % (what, sorted(ranks), SETTLE_S, blocks_text(c), up))


def blocks_text(c):
    m = c.metrics()
    free, total = per_rank(m, "pd_free_kv_blocks"), per_rank(m, "pd_kv_blocks")
    return ", ".join("rank %d: %s/%s free" % (r, free.get(r), total[r]) for r in sorted(total))


def new_requests(c, what):
    """Four sequential requests (completion and chat, stream and not): each 200 with text."""
    for endpoint in ("completion", "chat"):
        for stream in (False, True):
            t0 = time.time()
            if stream:
                s = Stream(0, endpoint, "Name three colours.", 12)
                s.read(c.port, lambda: None, BOUND_S)
                kind, detail = s.verdict()
                check(kind == "finished", "%s: streamed %s request: %s" % (what, endpoint, detail))
            else:
                body = request_body(endpoint, "Name three colours.", 12, ignore_eos=True)
                try:
                    r = c.post(path_of(endpoint), body)
                except OSError as e:
                    raise AssertionError("%s: %s request: %s" % (what, endpoint, e))
                check(r.status == 200, "%s: %s request: HTTP %s %s" % (what, endpoint, r.status, r.body[:300]))
                ch = r.json()["choices"][0]
                text = ch["message"]["content"] if endpoint == "chat" else ch["text"]
                check(text and ch["finish_reason"] in ("length", "stop"),
                      "%s: %s request: %r finish %r" % (what, endpoint, text, ch["finish_reason"]))
            check(time.time() - t0 < BOUND_S, "%s: a %s request took %.0f s" % (what, endpoint, time.time() - t0))
    print("%s: 4 new requests (completion/chat, stream or not) served" % what)


@contextlib.contextmanager
def chaos_cluster(extra=None, colocated=False):
    """A 2P+2D cluster, or colocated x2 (CONFIG plus `extra`); on the way out every STOPped rank is
    continued, the job is stopped (SIGTERM to the router, SIGKILL after 60 s), and anything left of it killed."""
    stopped = set()
    cfg = json.loads(json.dumps(CONFIG))
    for k, v in (extra or {}).items():
        cfg.setdefault(k, {}).update(v)
    c = Cluster(colocated=2, config=cfg, threads=1) if colocated else Cluster(prefill=2, decode=2, config=cfg, threads=1)
    c.stopped = stopped
    try:
        with c:
            try:
                yield c
            except AssertionError:
                print("---- cluster log (tail)\n" + c.logs())
                for pid in stopped:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except OSError:
                        pass
                c.stop(timeout=30)
                raise
            finally:
                for pid in stopped:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except OSError:
                        pass
    finally:
        left = c.kill_session()
        if left:
            print("killed %d processes left of the job: %s" % (len(left), left))


def signal_rank(c, rank, sig):
    role, pid = c.rank_pids()[rank]
    os.kill(pid, sig)
    if sig == signal.SIGSTOP:
        c.stopped.add(pid)
    elif sig == signal.SIGCONT:
        c.stopped.discard(pid)
    return pid


def busiest(c, role, ranks, series):
    """The rank of `role` with the most of the sum of `series` (its last report); ties: the lowest."""
    m = c.metrics()
    load = {r: sum(per_rank(m, s).get(r, 0) for s in series) for r in ranks if ranks[r] == role}
    return max(sorted(load), key=lambda r: load[r]), load


# ------------------------------------------------------------------ the fault, then the checks

def check_load(c, load, t_fault, what, want):
    """Every stream of the load ended exactly once within BOUND_S of the fault, finished, with
    pd-generate's text (`want`, by stream)."""
    load.join(t_fault + BOUND_S + 5)
    counts, bad, latest = load.report(t_fault)
    for st in load.streams:
        if st.t_end is not None and st.verdict()[0] == "errored":
            bad.append((st.i, "ended with an error event (should have migrated): " + st.verdict()[1]))
        elif st.t_end is not None and st.verdict()[0] == "finished" and st.text() != want[st.i]:
            bad.append((st.i, "text %r != pd-generate's %r" % (st.text()[:80], want[st.i][:80])))
    print("%s: %d requests: %d finished, %d ended with an error event, %d bad; last ended %.1f s after the fault"
          % (what, N, counts.get("finished", 0), counts.get("errored", 0), counts.get("bad", 0), latest))
    if counts.get("errored"):
        print("%s: error events: %s" % (what, load.errored_detail()))
    if bad:
        m = c.metrics()
        print("%s: per rank now: running %s, waiting %s, up %s" % (what, per_rank(m, "pd_running_sequences"),
              per_rank(m, "pd_waiting_requests"), per_rank(m, "pd_rank_up")))
    check(c.proc.poll() is None, "%s: the MPI job ended after the fault (mpirun exit %s); %d requests bad, e.g. %s"
          % (what, c.proc.returncode, len(bad), bad[:3]))
    check(not bad, "%s: %d of %d requests did not end exactly once with pd-generate's text: %s"
          % (what, len(bad), N, bad[:5]))
    check(latest <= BOUND_S, "%s: a request ended %.1f s after the fault (bound %d s)" % (what, latest, BOUND_S))
    return counts


def check_down(c, rank, ranks, what):
    t0 = time.time()
    said = [""]

    def shows():
        ok, said[0] = health_shows(c, {rank}, ranks)
        return ok
    try:
        wait_for(shows, 2 * HEARTBEAT_S + 10, "/health to show rank %d down" % rank)
    except AssertionError:
        raise AssertionError("%s: /health did not show rank %d (%s) down and the others up: %s"
                             % (what, rank, ranks[rank], said[0]))
    up, downs = rank_states(c, ranks)
    check(up.get(rank) == 0 and all(up.get(r) == 1 for r in ranks if r != rank),
          "%s: pd_rank_up %s, want 0 for rank %d and 1 for the others" % (what, up, rank))
    check(downs.get(rank, 0) >= 1, "%s: pd_rank_down_total %s, want >= 1 for rank %d" % (what, downs, rank))
    return time.time() - t0


def kill_suite(role, prompt_words, trigger, extra=None, colocated=False):
    need_default_model()
    load_prompts = prompts(N, seed=len(role) + colocated, lo=prompt_words[0], hi=prompt_words[1])
    want = greedy_texts(load_prompts)
    with chaos_cluster(extra, colocated) as c:
        ranks = workers(c)
        layout = ["decode", "decode"] if colocated else ["decode", "decode", "prefill", "prefill"]
        check(sorted(ranks.values()) == layout, "worker ranks: %s" % ranks)
        h0 = health_shows(c, set(), ranks)
        before = outcomes(c)
        retried0 = c.metric("pd_requests_retried_total")
        migrated0 = c.metric("pd_requests_migrated_total")
        load = Load(c.port, load_prompts)
        wait_for(lambda: trigger(c, load, ranks) or load.running() == 0, 120, "the load to reach the fault point")
        check(load.running() > 0, "the load ended before the fault point (too fast a machine?): adjust the trigger")
        series = ("pd_running_sequences",) if role == "decode" else ("pd_waiting_requests",)
        victim, seen = busiest(c, role, ranks, series)
        pid = signal_rank(c, victim, signal.SIGKILL)
        t_fault = time.time()
        what = "kill -9 %s rank %d" % (role, victim)
        print("%s (pid %d) with %d of %d streams started, %d running; %s per %s rank: %s"
              % (what, pid, load.started(), N, load.running(), series[0], role, seen))
        counts = check_load(c, load, t_fault, what, want)
        took = check_down(c, victim, ranks, what)
        print("%s: /health degraded with rank %d down (%.1f s after the load ended)" % (what, victim, took))
        new_requests(c, what + ", afterwards")
        check(h0[0], "before the fault: /health should be 200 'ok' with every rank up: %s" % h0[1])
        retried = c.metric("pd_requests_retried_total", -1)
        check(retried >= 0, "no pd_requests_retried_total in /metrics")
        migrated = c.metric("pd_requests_migrated_total", -1) - migrated0
        print("%s: pd_requests_retried_total %d, pd_requests_migrated_total %d" % (what, retried - retried0, migrated))
        if role == "decode" and seen[victim] >= 1:
            # Sequences running on the killed rank had streamed tokens: they must have migrated.
            check(migrated >= 1, "%s: it ran %d sequences, pd_requests_migrated_total moved by %d"
                  % (what, seen[victim], migrated))
        if role == "prefill" and seen[victim] >= 1:
            # Prompts still queued on the killed rank had streamed nothing: they must have been re-run.
            check(retried - retried0 >= 1, "%s: it had %d prompts queued, pd_requests_retried_total moved by %d"
                  % (what, seen[victim], retried - retried0))
        d = delta(outcomes(c), before)
        check(sum(d.values()) == N + 4 and d.get("finished", 0) == counts.get("finished", 0) + 4,
              "%s: router outcomes moved by %s, want %d in all, finished %d"
              % (what, d, N + 4, counts.get("finished", 0) + 4))
        survivors = [r for r in ranks if r != victim]
        wait_blocks_back(c, survivors, what + ", survivors")
        print("%s: survivors' KV blocks all back (%s)" % (what, blocks_text(c)))
        t_stop = time.time()
        rc = c.stop(timeout=30)
        print("%s: mpirun exit code %s after %.1f s (not checked after a kill -9)" % (what, rc, time.time() - t_stop))
        if rc == -signal.SIGKILL:  # the drain did not end the job: show why (a known open problem)
            print("---- the job did not shut down within 30 s of SIGTERM; cluster log (tail)\n" + c.logs()[-4000:])


def suite_decode_kill(tmp):
    # Most streams have started: the killed rank holds requests mid-stream (they
    # migrate) and maybe some not yet started (re-run).
    kill_suite("decode", (20, 40), lambda c, load, ranks: load.started() >= N * 3 // 4)


def suite_decode_kill_spec(tmp):
    # The same with speculative decoding on the decode pool: streams that migrate
    # mid-speculation (drafts verified, rolled back) still end with pd-generate's text.
    kill_suite("decode", (20, 40), lambda c, load, ranks: load.started() >= N * 3 // 4,
               extra={"decode": {"speculate": 4, "speculate_max_batch": 64}})


def suite_colocated_kill(tmp):
    # Colocated x2: the killed rank's streams migrate to the other rank, which prefills
    # prompt + tokens so far itself.
    kill_suite("decode", (20, 40), lambda c, load, ranks: load.started() >= N * 3 // 4, colocated=True)


def suite_prefill_kill(tmp):
    # Longer prompts and prefill batches of 4: prefill is the bottleneck; once a few
    # streams have started, other prompts still wait in the prefill ranks' queues
    # (they have streamed nothing: the killed rank's must be re-run elsewhere).
    def trigger(c, load, ranks):
        if load.started() < N // 8:
            return False
        waiting = per_rank(c.metrics(), "pd_waiting_requests")
        return any(waiting.get(r, 0) >= 2 for r in ranks if ranks[r] == "prefill")
    kill_suite("prefill", (60, 120), trigger, extra={"prefill": {"max_batch": 4}})


def suite_stop_cont(tmp):
    need_default_model()
    load_prompts = prompts(N, seed=3, lo=20, hi=40)
    want = greedy_texts(load_prompts)
    with chaos_cluster() as c:
        ranks = workers(c)
        h0 = health_shows(c, set(), ranks)
        before = outcomes(c)
        load = Load(c.port, load_prompts)
        wait_for(lambda: load.started() >= N * 3 // 4 or load.running() == 0, 120, "most streams to start")
        check(load.running() > 0, "the load ended before the fault point (too fast a machine?)")
        victim, seen = busiest(c, "decode", ranks, ("pd_running_sequences",))
        pid = signal_rank(c, victim, signal.SIGSTOP)
        t_fault = time.time()
        what = "kill -STOP decode rank %d" % victim
        print("%s (pid %d) with %d of %d streams started; running per decode rank: %s"
              % (what, pid, load.started(), N, seen))
        took = check_down(c, victim, ranks, what)
        print("%s: declared down %.1f s after the STOP (heartbeat %d ms)" % (what, took, HEARTBEAT_MS))
        check(took <= 2 * HEARTBEAT_S + 2, "%s: declared down only after %.1f s (heartbeat_ms %d)"
              % (what, took, HEARTBEAT_MS))
        new_requests(c, what + ", while stopped")
        # Every request of the load ends while the rank is still stopped.
        counts = check_load(c, load, t_fault, what, want)
        check(h0[0], "before the fault: /health should be 200 'ok' with every rank up: %s" % h0[1])
        signal_rank(c, victim, signal.SIGCONT)
        t_cont = time.time()
        said = [""]

        def back():
            ok, said[0] = health_shows(c, set(), ranks)
            return ok and rank_states(c, ranks)[0].get(victim) == 1
        try:
            wait_for(back, SETTLE_S, "re-admission")
        except AssertionError:
            raise AssertionError("kill -CONT rank %d: not re-admitted within %d s: pd_rank_up %s; /health %s"
                                 % (victim, SETTLE_S, rank_states(c, ranks)[0], said[0]))
        print("kill -CONT rank %d: re-admitted %.1f s later" % (victim, time.time() - t_cont))
        new_requests(c, "after re-admission")
        up, downs = rank_states(c, ranks)
        check(downs.get(victim, 0) >= 1, "pd_rank_down_total %s, want >= 1 for rank %d" % (downs, victim))
        d = delta(outcomes(c), before)
        check(sum(d.values()) == N + 8 and d.get("finished", 0) == counts.get("finished", 0) + 8,
              "router outcomes moved by %s, want %d in all, finished %d" % (d, N + 8, counts.get("finished", 0) + 8))
        wait_blocks_back(c, list(ranks), "after re-admission")
        print("every rank's KV blocks back (%s)" % blocks_text(c))
        check(c.stop() == 0, "clean exit after re-admission:\n" + c.logs())


def suite_reuse_stop(tmp):
    """A decode rank hangs holding conversations' last answers; their follow-ups go back to it."""
    need_default_model()
    heads = [" ".join(["The history of the printing press begins in the fifteenth century, when movable type "
                       "changed how books were made and shared across Europe."] * 8),
             " ".join(["A river rises in the hills, runs past farms and mills, and reaches the sea at a "
                       "harbour town where ships load grain."] * 8)]
    ask = " Tell me more about it, and say what came after."
    # Without warm-ups (the default, said here as the suite depends on it): the answers' KV stays on
    # the decode ranks only, so follow-ups go back there.
    with chaos_cluster({"router": {"warm_prefill": False}}) as c:
        ranks = workers(c)
        before = outcomes(c)
        # First turns: each answer's KV stays on the decode rank that generated it.
        firsts = []
        for head in heads:
            r = c.post("/v1/completions", {"prompt": head, "max_tokens": 32, "temperature": 0})
            check(r.status == 200, "first turn: HTTP %d %s" % (r.status, r.body[:300]))
            firsts.append(r.json()["choices"][0]["text"])
        served = per_rank(c.metrics(), "pd_rank_requests_total")
        decode = sorted(r for r, role in ranks.items() if role == "decode" and served.get(r, 0) >= 1)
        victim = decode[0]
        time.sleep(0.5)  # the first turns' KV events reach the router
        reuse0 = c.metric('pd_router_routing_decisions_total{reason="decode_reuse"}', 0)
        pid = signal_rank(c, victim, signal.SIGSTOP)
        t_fault = time.time()
        what = "kill -STOP decode rank %d (holding %d of 2 conversations)" % (victim, served.get(victim, 0))
        print("%s (pid %d)" % (what, pid))
        # Follow-ups, streamed and not: the router still counts the rank up and sends
        # the follow-up it holds back to it; once the rank is declared down each is re-run
        # through the prefill pool.
        follows = [head + first + ask for head, first in zip(heads, firsts)]
        cases = [{"prompt": f, "chat": False, "max_tokens": 24, "ignore_eos": True, "temperature": 0.0}
                 for f in follows]
        want = [x["text"] for x in reference(DEFAULT_MODEL, cases)]
        results = [None] * (2 * len(follows))

        def one(i):
            f = follows[i % len(follows)]
            body = {"prompt": f, "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stream": i >= len(follows),
                    "skip_special_tokens": False}  # as pd-generate prints them
            try:
                if body["stream"]:
                    status, events = c.stream("/v1/completions", body)
                    finals = [e for e in events if e != "[DONE]" and e.get("choices")
                              and e["choices"][0].get("finish_reason")]
                    text = "".join(e["choices"][0]["text"] for e in events if e != "[DONE]" and e.get("choices"))
                    ok = status == 200 and len(finals) == 1 and events[-1:] == ["[DONE]"]
                    results[i] = ("ok", text) if ok else ("error", "HTTP %d %s" % (status, events[-3:]))
                else:
                    r = c.post("/v1/completions", body)
                    results[i] = (("ok", r.json()["choices"][0]["text"]) if r.status == 200
                                  else ("error", "HTTP %d %s" % (r.status, r.body[:300])))
            except OSError as e:
                results[i] = ("error", str(e))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND_S + 5)
        took = time.time() - t_fault
        for i, res in enumerate(results):
            check(res is not None, "%s: follow-up %d did not end within %d s" % (what, i, BOUND_S + 5))
            check(res == ("ok", want[i % len(follows)]), "%s: follow-up %d: %s, want pd-generate's %r"
                  % (what, i, res, want[i % len(follows)]))
        check(took <= BOUND_S, "%s: the follow-ups took %.0f s" % (what, took))
        reused = c.metric('pd_router_routing_decisions_total{reason="decode_reuse"}', 0) - reuse0
        check(reused >= 1, "%s: no follow-up was sent back to a decode rank (decode_reuse +%d)" % (what, reused))
        sent = per_rank(c.metrics(), "pd_rank_requests_total").get(victim, 0) - served.get(victim, 0)
        check(sent >= 1, "%s: no follow-up was sent to the stopped rank" % what)
        check_down(c, victim, ranks, what)
        print("%s: %d follow-ups (%d sent back to a decode rank first, %d to the stopped one) ended with "
              "pd-generate's text in %.1f s" % (what, len(results), reused, sent, took))
        signal_rank(c, victim, signal.SIGCONT)
        wait_for(lambda: health_shows(c, set(), ranks)[0], SETTLE_S, "rank %d re-admitted" % victim)
        new_requests(c, "after re-admission")
        d = delta(outcomes(c), before)
        want_n = len(heads) + len(results) + 4
        check(d == {"finished": want_n}, "router outcomes moved by %s, want finished=%d" % (d, want_n))
        wait_blocks_back(c, list(ranks), "after re-admission")
        check(c.stop() == 0, "clean exit after re-admission:\n" + c.logs())


ROUTER_MS = 3000


def suite_router_kill(tmp):
    need_default_model()
    with chaos_cluster({"timeouts": {"router_ms": ROUTER_MS}}) as c:
        pids = c.rank_pids()
        router = [pid for role, pid in pids.values() if role == "router"]
        workers_pids = {r: pid for r, (role, pid) in pids.items() if role != "router"}
        check(len(router) == 1 and len(workers_pids) == 4, "ranks: %s" % pids)
        load = Load(c.port, prompts(8, seed=4, lo=20, hi=40))
        wait_for(lambda: load.started() >= 4 or load.running() == 0, 120, "4 streams to start")
        check(load.running() > 0, "the load ended before the fault point (too fast a machine?)")
        os.kill(router[0], signal.SIGKILL)
        t_fault = time.time()
        what = "kill -9 the router (pid %d)" % router[0]
        print("%s with %d of 8 streams started" % (what, load.started()))
        check(load.join(t_fault + 10), "%s: %d streams still open 10 s later" % (what, load.running()))
        print("%s: every stream's connection ended within %.1f s" % (what, time.time() - t_fault))

        def alive(pid):
            try:
                os.kill(pid, 0)
            except OSError:
                return False
            with open("/proc/%d/stat" % pid) as f:
                return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
        bound = ROUTER_MS / 1000.0 + 15  # router_ms, then at most 5 s in MPI_Finalize, and margin
        try:
            wait_for(lambda: not any(alive(p) for p in workers_pids.values()), bound, "the workers to stop")
        except AssertionError:
            raise AssertionError("%s: worker ranks still running %.0f s later: %s" % (
                what, bound, {r: p for r, p in workers_pids.items() if alive(p)}))
        print("%s: every worker rank stopped %.1f s after it" % (what, time.time() - t_fault))
        try:
            c.proc.wait(timeout=15)
        except Exception:
            raise AssertionError("%s: mpirun still running after every rank ended" % what)
        log = c.logs()
        check("(timeouts.router_ms): it is gone" in log,
              "%s: no worker said why it stopped:\n%s" % (what, log[-3000:]))
        print("%s: mpirun exited (%s) %.1f s after it; the workers said why" % (
            what, c.proc.returncode, time.time() - t_fault))


SUITES = {"decode_kill": suite_decode_kill, "prefill_kill": suite_prefill_kill, "stop_cont": suite_stop_cont,
          "router_kill": suite_router_kill, "colocated_kill": suite_colocated_kill, "reuse_stop": suite_reuse_stop,
          "decode_kill_spec": suite_decode_kill_spec}

if __name__ == "__main__":
    run_suite(SUITES, "test_chaos.py")
