#!/usr/bin/env python3
"""Keeps a pdcluster at its configured size (deploy/launch.sh --supervise runs this).

    deploy/supervise.py --prefill 2 --decode 2 [other launch.sh options]
    deploy/supervise.py --colocated 2 [...]

Starts the cluster with deploy/launch.sh (accepting pools that join: --join-file), then
every second reads the router's GET /health:
  - a pool one rank short (a rank died, or was fenced and is down) gets a replacement: a
    one-rank pool started with `launch.sh --join` that joins through the cluster's join
    path. One replacement per pool at a time; one that does not come up within
    --start-timeout, or ends within a minute, counts as a failure, and the next waits
    twice as long (1 s, 2 s, 4 s ... up to 60 s). After --max-failures failures in a row
    the pool is given up on, with a message saying so; a minute up resets the count.
  - a pool larger than asked for 5 s (a rank that was only stopped came back after its
    replacement joined): the newest replacement leaves the cluster (it drains first).
  - the router gone (its process ended, or /health unanswered for --router-timeout
    seconds while no pd-router runs): a new router is started alone (`launch.sh
    --new-router`); the workers notice the silence after timeouts.router_ms, drop what
    they held and join it, keeping their models and caches. Replacements wait until they
    have had the time to (timeouts.router_ms + 30 s). When that cannot work — a colocated
    cluster, the pools' job ended too, or a new router that never got healthy — the whole
    job is stopped and started again instead — every process of it, ranks that outlived
    a killed mpirun included, ends before the new one starts (its port, its memory). At
    most --max-restarts restarts in a row that do not reach a healthy cluster.
SIGTERM / Ctrl-C: the replacement pools leave, the cluster drains (launch.sh), everything
started here ends; the exit code is the cluster's."""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "deploy", "launch.sh")
# A replacement that ends sooner than this after it started counts as a failed one.
STABLE_S = 60.0
# A pool larger than asked for this long (a stopped rank came back) gives back its newest replacement.
SURPLUS_S = 5.0
# launch.sh options a replacement pool repeats (the rest concern the router and the job).
POOL_OPTIONS = ("--model", "--config", "--build", "--threads", "--kv-dtype", "--mca")
# ... and those a new router repeats.
ROUTER_OPTIONS = ("--model", "--config", "--build", "--kv-dtype", "--mca", "--port", "--host", "--insecure")
# Of those, the ones that take no value.
FLAGS = ("--insecure",)
# This cluster's pd-router process, by its command line (anchored: mpirun's names pd-router too).
ROUTER_PATTERN = "^[^ ]*pd-router .*--join-file "
# Time the workers get, past timeouts.router_ms, to join a new router before pools are replaced.
REJOIN_MARGIN_S = 30.0


def log(msg):
    print("supervise: " + msg, file=sys.stderr, flush=True)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    ap.add_argument("--prefill", type=int, default=None)
    ap.add_argument("--decode", type=int, default=None)
    ap.add_argument("--colocated", type=int, default=None)
    ap.add_argument("--start-timeout", type=float, default=180.0, help="seconds for a replacement to come up")
    ap.add_argument("--max-failures", type=int, default=5, help="failed replacements in a row before giving up")
    ap.add_argument("--router-timeout", type=float, default=3.0, help="seconds of unanswered /health (no pd-router)")
    ap.add_argument("--max-restarts", type=int, default=5, help="restarts in a row without a healthy cluster")
    args, rest = ap.parse_known_args(argv)
    for flag in ("--join", "--join-file", "--dry-run", "--no-wait"):
        if flag in rest:
            ap.error("%s is not taken with --supervise (it runs its own join file and stays in the foreground)" % flag)
    if args.colocated is not None:
        if args.prefill is not None or args.decode is not None:
            ap.error("--colocated takes no --prefill or --decode")
        targets = {"decode": args.colocated}
        job = ["--colocated", str(args.colocated)]
    else:
        targets = {"prefill": 1 if args.prefill is None else args.prefill, "decode": 1 if args.decode is None else args.decode}
        job = ["--prefill", str(targets["prefill"]), "--decode", str(targets["decode"])]
    if min(targets.values()) < 1:
        ap.error("every pool needs at least 1 rank to be kept")
    args.colocated_job = args.colocated is not None
    return args, targets, job + rest, options(rest, POOL_OPTIONS), options(rest, ROUTER_OPTIONS)


def options(argv, names):
    """The options of `names` in a launch.sh command line, with their values."""
    out, i = [], 0
    while i < len(argv):
        n = (3 if argv[i] == "--mca" else 2) if argv[i] in POOL_OPTIONS + ROUTER_OPTIONS and argv[i] not in FLAGS else 1
        if argv[i] in names:
            out += argv[i:i + n]
        i += n
    return out


def router_ms(argv):
    """timeouts.router_ms of the config launch.sh will use (its // comments allowed)."""
    path = os.path.join(ROOT, "deploy", "cluster.json")
    if "--config" in argv and argv.index("--config") + 1 < len(argv):
        path = argv[argv.index("--config") + 1]
    try:
        with open(path) as f:
            text = re.sub(r"//[^\n]*", "", f.read())
        return int(json.loads(text).get("timeouts", {}).get("router_ms", 15000))
    except (OSError, ValueError, TypeError, AttributeError):
        return 15000


class Job:
    """One launch.sh process (the cluster, or a pool) in its own process group."""

    def __init__(self, argv, name):
        self.name, self.started = name, time.time()
        self.proc = subprocess.Popen([LAUNCH] + argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.url = None
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self):
        for line in self.proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            m = re.search(r"(?:pdcluster is up:|the router answers at) (http://\S+)", line)
            if m:
                self.url = m.group(1)

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        """SIGTERM: launch.sh drains the cluster, or the pool leaves it (a second one kills the job)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout):
        """Waits `timeout` s after stop(); then a second SIGTERM (launch.sh kills its mpirun), then SIGKILL."""
        for sig, grace in ((None, timeout), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            if sig == signal.SIGKILL:
                try:
                    os.killpg(self.proc.pid, sig)
                except OSError:
                    pass
            elif sig is not None and self.alive():
                self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.wait()


def health(url, timeout=2.0):
    """(status, body) of GET /health, or (None, None) when unanswered."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {}
    except (OSError, ValueError):
        return None, None


def live_counts(body):
    """Ranks per pool that are up, starting or draining (not down)."""
    out = {"prefill": 0, "decode": 0}
    for r in (body or {}).get("ranks") or []:
        if r.get("state") != "down":
            out["prefill" if r.get("role") == "prefill" else "decode"] += 1
    return out


def cluster_processes(join_file):
    """Pids of the processes this supervisor's cluster runs: every rank, mpirun, ompi-server
    and launch.sh carry its join file's path (unique to this supervisor) on their command
    lines — also ranks that outlived their mpirun (kill -9 of mpirun leaves them running,
    each in its own process group)."""
    mark, out = join_file.encode(), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(mark in a for a in argv):
            out.append(int(pid))
    return out


def sweep(join_file, grace=5.0):
    """Ends what is left of the cluster's processes (SIGTERM, then SIGKILL after `grace`
    s), so that a cluster started next finds its port and its ranks' memory free."""
    for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        left = cluster_processes(join_file)
        if not left:
            return
        if sig == signal.SIGKILL:
            log("%d processes of the old cluster did not end: killing them (%s)"
                % (len(left), " ".join(map(str, left))))
        for pid in left:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.time() + wait_s
        while time.time() < deadline and cluster_processes(join_file):
            time.sleep(0.1)


def router_running(join_file):
    """Whether this cluster's pd-router runs (launch.sh passes it the join file)."""
    return subprocess.run(["pgrep", "-f", ROUTER_PATTERN + re.escape(join_file)],
                          capture_output=True).returncode == 0


class Pool:
    """Replacements for one pool: one at a time, with back-off, given up on after failing too often."""

    def __init__(self, role, target, sup):
        self.role, self.target, self.sup = role, target, sup
        self.pending, self.live, self.leaving = None, [], []
        self.failures, self.next_try, self.given_up = 0, 0.0, False
        self.surplus_since = None

    def step(self, counts, join_file):
        now = time.time()
        self.leaving = [j for j in self.leaving if j.alive()]
        for j in [j for j in self.live if not j.alive()]:
            self.live.remove(j)
            if now - j.started < STABLE_S:
                self.failed("a replacement ended %.0f s after it started" % (now - j.started))
        if self.failures and self.live and all(now - j.started >= STABLE_S for j in self.live):
            self.failures = 0  # it stayed up: the pool is healthy again
        if self.pending is not None:
            if counts[self.role] >= self.target and self.pending.alive():
                log("%s replacement joined after %.1f s" % (self.role, now - self.pending.started))
                self.live.append(self.pending)
                self.pending = None
            elif not self.pending.alive() or now - self.pending.started > self.sup.start_timeout:
                why = "the replacement ended" if not self.pending.alive() else "the replacement did not come up"
                self.pending.stop()
                self.pending.wait(10)
                self.pending = None
                self.failed(why)
            return
        if self.trim(counts, now) or counts[self.role] >= self.target or self.given_up or now < self.next_try:
            return
        log("%s pool has %d of %d ranks: starting a replacement" % (self.role, counts[self.role], self.target))
        self.pending = Job(["--join", join_file, "--" + self.role, "1"] + self.sup.pool_args, self.role)

    def trim(self, counts, now):
        """A rank that was only stopped came back after its replacement joined: the pool is larger than
        asked. Once that has lasted SURPLUS_S, the newest replacement leaves (it drains first)."""
        if counts[self.role] <= self.target or not self.live:
            self.surplus_since = None
            return False
        if self.leaving:
            return True  # one is leaving already (a draining rank still counts)
        self.surplus_since = self.surplus_since or now
        if now - self.surplus_since >= SURPLUS_S:
            newest = max(self.live, key=lambda j: j.started)
            log("%s pool has %d of %d ranks (a rank came back): the newest replacement leaves"
                % (self.role, counts[self.role], self.target))
            self.live.remove(newest)
            newest.stop()
            self.leaving.append(newest)
            self.surplus_since = None
        return True

    def failed(self, why):
        self.failures += 1
        if self.failures >= self.sup.max_failures:
            self.given_up = True
            log("%s: %s; %d replacements in a row failed: not replacing %s ranks any more (see the log above)"
                % (self.role, why, self.failures, self.role))
            return
        delay = min(60.0, 2.0 ** (self.failures - 1))
        self.next_try = time.time() + delay
        log("%s: %s (failure %d of %d); next try in %.0f s" % (self.role, why, self.failures, self.sup.max_failures, delay))

    def jobs(self):
        return self.live + self.leaving + ([self.pending] if self.pending else [])


class Supervisor:
    def __init__(self, args, targets, job_argv, pool_args, router_args):
        self.start_timeout, self.max_failures = args.start_timeout, args.max_failures
        self.router_timeout, self.max_restarts = args.router_timeout, args.max_restarts
        self.targets, self.job_argv, self.pool_args, self.router_args = targets, job_argv, pool_args, router_args
        self.colocated = args.colocated_job
        self.rejoin_s = router_ms(job_argv) / 1000.0 + REJOIN_MARGIN_S
        self.join_file = os.path.join(tempfile.mkdtemp(prefix="pd-supervise-"), "cluster.join")
        self.stopping = False

    def start_cluster(self):
        self.cluster = Job(self.job_argv + ["--join-file", self.join_file], "cluster")
        self.router = None  # a router started alone for the cluster's pools (the first one died)
        self.router_healthy = False  # whether the newest router has served
        self.pools = {role: Pool(role, n, self) for role, n in self.targets.items()}
        self.unanswered_since = None
        self.replace_after = 0.0  # no replacement pools before (the workers may be joining a new router)

    def router_job(self):
        return self.router or self.cluster

    def router_lost(self, status):
        """The router is gone: its job ended, or /health unanswered with no pd-router running."""
        job = self.router_job()
        if not job.alive():
            return "the %s's mpirun ended (exit %s)" % (job.name, job.proc.returncode)
        if job.url is None or status is not None:
            self.unanswered_since = None
            return None
        self.unanswered_since = self.unanswered_since or time.time()
        if time.time() - self.unanswered_since > self.router_timeout and not router_running(self.join_file):
            return "GET /health unanswered for %.0f s and no pd-router running" % self.router_timeout
        return None

    def restart(self, why, restarts):
        pools_kept = not self.colocated and self.cluster.alive() and (self.router is None or self.router_healthy)
        if restarts > 1:
            time.sleep(min(30.0, 2.0 ** (restarts - 2)))
        if pools_kept:
            log("the router is gone (%s): starting a new router for the running pools (restart %d of %d)"
                % (why, restarts, self.max_restarts))
            if self.router is not None:
                self.router.stop()
                self.router.wait(5)
            self.router = Job(["--new-router", self.join_file] + self.router_args, "router")
            self.router_healthy = False
            self.unanswered_since = None
            self.replace_after = time.time() + self.rejoin_s
            return
        log("the router is gone (%s): restarting the cluster (restart %d of %d)" % (why, restarts, self.max_restarts))
        self.end_all(timeout=5)
        self.start_cluster()

    def end_all(self, timeout=60):
        """Every job started here ends: asked to (drain, leave), then made to after `timeout` s."""
        jobs = [j for p in self.pools.values() for j in p.jobs()] + [self.router_job()]
        for j in jobs:
            j.stop()
        for j in jobs:
            j.wait(timeout)
        if self.router is not None:
            # The first job's workers drained through the new router and exit;
            # its mpirun ends with them (or is made to).
            self.cluster.wait(15)
        # What outlived its job (ranks whose mpirun was killed) ends too.
        sweep(self.join_file)

    def run(self):
        try:
            return self.supervise()
        finally:
            shutil.rmtree(os.path.dirname(self.join_file), ignore_errors=True)  # the join file's own directory

    def supervise(self):
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        self.start_cluster()
        restarts = 0
        while not self.stopping:
            time.sleep(1.0)
            if self.stopping:
                break
            url = self.router_job().url
            status, body = health(url) if url else (None, None)
            why = self.router_lost(status)
            if why and self.router is None and self.cluster.url is None and self.cluster.proc.returncode == 2:
                log("launch.sh exited 2 (its options refused, or the cluster could not start: above): nothing to supervise")
                self.end_all(timeout=5)
                return 2
            if why:
                restarts += 1
                if restarts > self.max_restarts:
                    log("the router keeps failing (%d restarts in a row): giving up" % (restarts - 1))
                    self.end_all(timeout=5)
                    return 1
                self.restart(why, restarts)
                continue
            if status == 200 and body.get("status") == "ok":
                restarts = 0
                self.router_healthy = True
            if body is not None and time.time() >= self.replace_after:
                counts = live_counts(body)
                for pool in self.pools.values():
                    pool.step(counts, self.join_file)
        log("stopping: replacement pools leave, the cluster drains")
        self.end_all()
        return self.router_job().proc.returncode or 0

    def on_signal(self, signum, frame):
        self.stopping = True


def main(argv):
    return Supervisor(*parse(argv)).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
