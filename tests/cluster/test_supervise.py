#!/usr/bin/env python3
"""The supervised cluster keeps its size (deploy/launch.sh --supervise).

    tests/cluster/test_supervise.py pools

Starts `launch.sh --supervise --prefill 1 --decode 1` on the default model (one thread a
rank, timeouts.heartbeat_ms 2000, timeouts.router_ms 3000), then:
  1. kill -9 the decode rank: within 30 s a replacement has joined and is up, /health
     counts one decode rank up again, and a request is served by the new rank;
  2. kill -STOP the decode rank past the heartbeat: a replacement joins; kill -CONT: the
     resumed rank is re-admitted, the pool is one too large, and the newest replacement
     leaves again (within 40 s), the resumed rank serving;
  3. kill -9 the cluster's mpirun: its ranks outlive it; within 60 s the cluster is
     restarted and serves, and none of the old job's processes is left;
  4. kill -9 the router while 4 streams run: each stream's connection ends within 10 s
     (the HTTP side died with the router; nothing hangs), and within 60 s a new router
     answers and serves a request with the same pools (the same worker processes: they
     dropped what they held and joined the new router, models loaded); a long prompt sent
     before the kill is found in the prefill rank's prefix cache after it;
  5. SIGTERM to the supervisor: every process it started ends (within 90 s), and the
     supervisor exits.
First, a flag launch.sh refuses (--model of a missing file) ends the supervisor at once
with exit 2 and launch.sh's message, instead of restarting.

Exit 0 = pass, 1 = fail, 77 = skipped (printed why)."""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import BUILD, DEFAULT_MODEL, ROOT, check, need_default_model, run_suite, wait_for  # noqa: E402

CONFIG = {"model": DEFAULT_MODEL, "http": {"port": 0},
          "timeouts": {"heartbeat_ms": 2000, "router_ms": 3000, "stop_grace_ms": 10000, "rank_drain_ms": 10000}}


class Supervised:
    """launch.sh --supervise in its own session, its output in a log file."""

    def __init__(self, tmp):
        self.config = os.path.join(tmp, "cluster.json")
        with open(self.config, "w") as f:
            json.dump(CONFIG, f)
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [os.path.join(ROOT, "deploy", "launch.sh"), "--supervise", "--prefill", "1", "--decode", "1",
               "--config", self.config, "--build", BUILD, "--threads", "1"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def url(self):
        """The URL of the newest cluster it started (a restart binds a new port)."""
        found = re.findall(r"pdcluster is up: (http://\S+)", self.output())
        return found[-1] if found else None

    def get(self, path):
        try:
            with urllib.request.urlopen(self.url() + path, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except (OSError, TypeError):
            return None, ""

    def health(self):
        status, body = self.get("/health")
        try:
            return status, json.loads(body)
        except ValueError:
            return status, {}

    def complete(self, prompt="The capital of France is"):
        req = urllib.request.Request(self.url() + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": prompt, "max_tokens": 8,
                                                      "temperature": 0}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())["choices"][0]["text"]
        except urllib.error.HTTPError as e:
            raise AssertionError("POST /v1/completions: HTTP %d %s" % (e.code, e.read().decode(errors="replace")))

    def stream(self, i):
        """A long greedy stream; records its tokens so far and how it ended (stream_tokens, stream_ends)."""
        self.__dict__.setdefault("stream_tokens", {})
        self.__dict__.setdefault("stream_ends", {})
        req = urllib.request.Request(self.url() + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "Once upon a time %d" % i, "max_tokens": 400,
                                                      "temperature": 0, "ignore_eos": True,
                                                      "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        self.stream_tokens[i] = 0
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                for line in r:
                    if line.startswith(b"data: {"):
                        self.stream_tokens[i] += 1
            self.stream_ends[i] = "closed after %d events" % self.stream_tokens[i]
        except Exception as e:  # noqa: BLE001 - how it ended is what is recorded
            self.stream_ends[i] = "%s after %d events" % (type(e).__name__, self.stream_tokens[i])

    def processes(self):
        """{pid: exe} of the pd-* processes using this test's config."""
        out = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            argv = cmdline(pid)
            if not argv:
                continue
            exe = os.path.basename(argv[0].decode(errors="replace"))
            if exe.startswith("pd-") and self.config.encode() in argv:
                out[int(pid)] = exe
        return out

    def kill_all(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def cmdline(pid):
    """The argv of process `pid` (bytes), [] once it is gone."""
    try:
        with open("/proc/%s/cmdline" % pid, "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


LONG_PROMPT = " ".join(["The history of the river towns is long and full of trade."] * 6)  # ~75 tokens


def cached_prompt_tokens(s):
    """Prompt tokens the ranks found in their prefix caches, as the current router counts them."""
    status, body = s.get("/metrics")
    total = 0.0
    for line in body.splitlines():
        if line.startswith("pd_rank_prompt_tokens_total{") and 'source="cache"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def ranks_up(h):
    """{role: ranks up} from a /health body."""
    out = {}
    for r in h.get("ranks") or []:
        if r.get("state") == "up":
            out[r["role"]] = out.get(r["role"], 0) + 1
    return out


def healthy(s):
    status, h = s.health()
    return status == 200 and h.get("status") in ("ok", "degraded") and ranks_up(h) == {"prefill": 1, "decode": 1}


def bad_options():
    """A flag launch.sh refuses ends the supervisor at once with launch.sh's message (no restarts)."""
    t0 = time.time()
    r = subprocess.run([os.path.join(ROOT, "deploy", "launch.sh"), "--supervise", "--model", "/nonexistent.gguf",
                        "--build", BUILD], capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    check(r.returncode == 2 and "--model: no such file" in out and "nothing to supervise" in out,
          "a bad --model under --supervise: exit %s, output:\n%s" % (r.returncode, out[-2000:]))
    print("a bad --model: exit 2 in %.1f s, naming the flag" % (time.time() - t0))


def suite_pools(tmp):
    need_default_model()
    bad_options()
    s = Supervised(tmp)
    try:
        wait_for(lambda: s.url() and healthy(s), 180, "the supervised cluster to come up")
        want = s.complete()
        print("up at %s; a request: %r" % (s.url(), want))

        # 1. a decode rank dies: replaced within 30 s
        decode = [pid for pid, exe in s.processes().items() if exe == "pd-decode"]
        check(len(decode) == 1, "decode processes: %s" % decode)
        os.kill(decode[0], signal.SIGKILL)
        t0 = time.time()

        def replaced():
            status, h = s.health()
            new = [r for r in h.get("ranks") or [] if r.get("role") == "decode" and r.get("state") == "up"]
            return status == 200 and len(new) == 1 and any(pid not in decode for pid, exe in s.processes().items()
                                                          if exe == "pd-decode")
        try:
            wait_for(replaced, 30, "a replacement decode rank up")
        except AssertionError:
            raise AssertionError("kill -9 the decode rank: no replacement up within 30 s: /health %s\n%s"
                                 % (s.health(), s.output()[-4000:]))
        print("kill -9 decode rank (pid %d): replaced, up %.1f s later" % (decode[0], time.time() - t0))
        got = s.complete()
        check(got == want, "after the replacement: %r != %r" % (got, want))
        print("the replacement serves: %r" % got)

        # 2. the decode rank is stopped past heartbeat_ms (replaced), then resumes: the pool is
        # one too large, and the newest replacement leaves again
        first = [pid for pid, exe in s.processes().items() if exe == "pd-decode"]
        check(len(first) == 1, "decode processes: %s" % first)
        os.kill(first[0], signal.SIGSTOP)
        t0 = time.time()
        try:
            wait_for(lambda: len([p for p, e in s.processes().items() if e == "pd-decode"]) == 2 and healthy(s), 30,
                     "a replacement for the stopped decode rank")
        except AssertionError:
            raise AssertionError("kill -STOP the decode rank: no replacement within 30 s: /health %s\n%s"
                                 % (s.health(), s.output()[-4000:]))
        os.kill(first[0], signal.SIGCONT)
        print("kill -STOP decode rank (pid %d): replaced %.1f s later; kill -CONT" % (first[0], time.time() - t0))
        t0 = time.time()
        try:
            wait_for(lambda: [p for p, e in s.processes().items() if e == "pd-decode"] == first and healthy(s), 40,
                     "the pool back to 1 decode rank, the resumed one")
        except AssertionError:
            raise AssertionError("after kill -CONT: the pool did not shrink back within 40 s: /health %s\n%s"
                                 % (s.health(), s.output()[-4000:]))
        got = s.complete()
        check(got == want, "after the surplus replacement left: %r != %r" % (got, want))
        print("the resumed rank was re-admitted and the surplus replacement left %.1f s later" % (time.time() - t0))

        # 3. the cluster's mpirun is killed: its ranks outlive it (each in its own process
        # group), still serving; the supervisor restarts the cluster, and every process of
        # the old job ends first (the router held the port, the ranks their memory)
        old = s.processes()
        old_url = s.url()
        mpirun = [pid for pid in filter(str.isdigit, os.listdir("/proc"))
                  if cmdline(pid)[:1] == [b"mpirun"] and s.config.encode() in cmdline(pid)]
        check(len(mpirun) >= 1, "no mpirun running this test's config")
        for pid in mpirun:
            os.kill(int(pid), signal.SIGKILL)
        t0 = time.time()
        try:
            wait_for(lambda: s.url() != old_url and healthy(s), 60, "a restarted cluster")
        except AssertionError:
            raise AssertionError("kill -9 mpirun: no restarted cluster serving within 60 s: /health %s\n%s"
                                 % (s.health(), s.output()[-4000:]))
        left = sorted(pid for pid in old if pid in s.processes())
        check(not left, "processes of the killed job still run after the restart: %s" % left)
        got = s.complete()
        check(got == want, "after the restart: %r != %r" % (got, want))
        print("kill -9 mpirun: the cluster restarted, serving %.1f s later; none of its %d processes left"
              % (time.time() - t0, len(old)))

        # 4. the router dies: a new one serves within 60 s, with the same pools
        router = [pid for pid, exe in s.processes().items() if exe == "pd-router"]
        check(len(router) == 1, "router processes: %s" % router)
        workers = sorted(pid for pid, exe in s.processes().items() if exe != "pd-router")
        long_answer = s.complete(LONG_PROMPT)  # its KV blocks stay in the prefill rank's prefix cache
        old_url = s.url()
        streams = [threading.Thread(target=s.stream, args=(i,), daemon=True) for i in range(4)]
        for t in streams:
            t.start()
        wait_for(lambda: len(s.stream_tokens) == 4 and min(s.stream_tokens.values()) >= 2, 60,
                 "4 streams to be under way")
        os.kill(router[0], signal.SIGKILL)
        t0 = time.time()
        for t in streams:  # the HTTP side died with the router: each client sees its connection end
            t.join(timeout=max(0.1, t0 + 10 - time.time()))
        check(not any(t.is_alive() for t in streams), "a stream in flight when the router died still hangs 10 s later")
        print("streams in flight when the router died: %s" % sorted(s.stream_ends.values()))
        try:
            wait_for(lambda: s.url() != old_url and healthy(s), 60, "a new router")
        except AssertionError:
            raise AssertionError("kill -9 the router: no new router serving within 60 s: /health %s\n%s"
                                 % (s.health(), s.output()[-4000:]))
        took = time.time() - t0
        now = sorted(pid for pid, exe in s.processes().items() if exe != "pd-router")
        check(now == workers, "the pools after the router restart: worker pids %s, before %s" % (now, workers))
        got = s.complete()
        check(got == want, "after the router restart: %r != %r" % (got, want))
        check("joined the new router" in s.output(), "no worker says it joined the new router")
        check(s.complete(LONG_PROMPT) == long_answer, "the long prompt's answer changed after the router restart")
        wait_for(lambda: cached_prompt_tokens(s) >= 32, 10,
                 "the new router to count prompt tokens the prefill rank found in its prefix cache")
        print("the prefill rank kept its prefix cache: %d prompt tokens of the repeated prompt came from it"
              % cached_prompt_tokens(s))
        print("kill -9 router (pid %d): a new router serves at %s %.1f s later, with the same %d workers"
              % (router[0], s.url(), took, len(workers)))

        # 5. SIGTERM: everything ends
        os.kill(s.proc.pid, signal.SIGTERM)
        t0 = time.time()
        try:
            rc = s.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            raise AssertionError("SIGTERM: the supervisor still runs 90 s later\n" + s.output()[-4000:])
        wait_for(lambda: not s.processes(), 15, "every pd-* process to end")
        print("SIGTERM: the supervisor exited %s and every process ended %.1f s later" % (rc, time.time() - t0))
    except AssertionError:
        print("---- supervisor output (tail)\n" + s.output()[-6000:])
        raise
    finally:
        s.kill_all()


if __name__ == "__main__":
    run_suite({"pools": suite_pools}, "test_supervise.py")
