"""Test harness for whole-cluster tests: starts an MPI job (router + prefill +
decode ranks) through deploy/launch.sh on a free port, talks to it with a real
HTTP client (http.client), and stops it. Standard library only."""
import http.client
import json
import os
import re
import signal
import subprocess
import shutil
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("PD_BUILD_DIR", os.path.join(ROOT, "build"))
DEFAULT_MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
SKIP = 77  # ctest SKIP_RETURN_CODE


def tiny_model(path, layers=2, seed=1, context=512):
    subprocess.run([os.path.join(BUILD, "tools", "pd-make-tiny-model"), "-o", path, "--layers", str(layers),
                    "--seed", str(seed), "--context", str(context)], check=True)
    return path


def reference(model, prompts, kv_dtype=None, args=()):
    """pd-generate --batch: [{"prompt", "chat", "max_tokens", "ignore_eos"}] -> list of result dicts.
    args: more pd-generate flags (e.g. --chat-template gemma)."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
        path = f.name
    try:
        cmd = [os.path.join(BUILD, "tools", "pd-generate"), "-m", model, "--batch", path, "-t", "2"]
        out = subprocess.run(cmd + (["--kv-dtype", kv_dtype] if kv_dtype else []) + list(args),
                             check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    return [json.loads(line) for line in out.splitlines() if line.strip()]


class Response:
    def __init__(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)


class Cluster:
    """with Cluster(prefill=1, decode=1, model=..., config={...}) as c: c.post(...)"""

    def __init__(self, prefill=1, decode=1, colocated=None, model=DEFAULT_MODEL, config=None, threads=1,
                 mpirun=None, startup_s=180, env=None, launch_args=None, wrap=None, client_host="127.0.0.1",
                 wait_ready=True):
        """launch_args: more launch.sh flags (--hostfile, --mca ...); wrap: an argv prefix
        the launch runs under (e.g. deploy/netns_hosts.sh exec HOST); client_host: the
        address the HTTP client connects to (the router's http.host); wait_ready=False: entering
        waits only for the router to answer /health (a router started alone, its pools to come)."""
        # The router binds port 0 and writes the port it got to a file: no
        # window in which another process can take a port picked for it.
        self.port = None
        fd, self.port_file = tempfile.mkstemp(suffix=".port")
        os.close(fd)
        os.unlink(self.port_file)
        self.model = model
        cfg = {"model": model, "http": {"port": 0, "port_file": self.port_file}}
        for k, v in (config or {}).items():
            if isinstance(v, dict):
                cfg.setdefault(k, {}).update(v)
            else:
                cfg[k] = v
        self.config = cfg
        fd, self.config_path = tempfile.mkstemp(suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(cfg, f)
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        if mpirun is not None:  # a hand-built MPMD line (per-role models): list with {config} placeholders
            cmd = [a.replace("{config}", self.config_path) for a in mpirun]
        else:
            cmd = [os.path.join(ROOT, "deploy", "launch.sh"), "--config", self.config_path, "--build", BUILD,
                   "--threads", str(threads), "--no-wait"]
            cmd += ["--colocated", str(colocated)] if colocated else ["--prefill", str(prefill), "--decode", str(decode)]
            cmd += list(launch_args or [])
        cmd = list(wrap or []) + cmd
        self.client_host = client_host
        penv = dict(os.environ)
        penv.update(env or {})
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=penv)
        self.startup_s = startup_s
        self.wait_ready = wait_ready

    def __enter__(self):
        deadline = time.time() + self.startup_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("cluster exited during start-up:\n" + self.logs())
            if self.port is None:
                try:
                    with open(self.port_file) as f:
                        self.port = int(f.read().strip())
                except (OSError, ValueError):
                    time.sleep(0.1)
                    continue
            try:
                if self.get("/health").status == 200 or not self.wait_ready:
                    return self
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("cluster not healthy within %d s:\n%s" % (self.startup_s, self.logs()))

    def __exit__(self, exc_type, exc, tb):
        self.stop()
        # A check's AssertionError carries the logs it needs; anything else (the router
        # refusing connections, a timeout) would leave no trace of why: print the tail.
        if exc_type is not None and not issubclass(exc_type, AssertionError):
            print("cluster logs at %s:\n%s" % (exc_type.__name__, self.full_logs()[-20000:]))

    def logs(self):
        return self.full_logs()[-6000:]

    def full_logs(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def router_pid(self):
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid), "-x", "pd-router"], capture_output=True, text=True)
        pids = [int(p) for p in out.stdout.split()]
        return pids[0] if pids else None

    def stop(self, timeout=60):
        """SIGTERM to the router (it drains, then shuts the workers down); returns mpirun's exit code."""
        if self.proc.poll() is None:
            pid = self.router_pid()
            if pid:
                os.kill(pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for p in (self.config_path, self.port_file):
            if os.path.exists(p):
                os.unlink(p)
        return self.proc.returncode

    # ---- HTTP
    def conn(self, timeout=300):
        return http.client.HTTPConnection(self.client_host, self.port, timeout=timeout)

    def request(self, method, path, body=None, headers=None, raw=None):
        c = self.conn()
        try:
            h = {"Content-Type": "application/json"}
            h.update(headers or {})
            data = raw if raw is not None else (json.dumps(body) if body is not None else None)
            c.request(method, path, body=data, headers=h)
            r = c.getresponse()
            return Response(r.status, dict(r.getheaders()), r.read().decode("utf-8", "replace"))
        finally:
            c.close()

    def get(self, path, headers=None):
        return self.request("GET", path, headers=headers)

    def post(self, path, body, headers=None):
        return self.request("POST", path, body, headers)

    def stream(self, path, body, headers=None):
        """POST with stream=true; returns (status, [decoded data payloads], ['[DONE]' count])."""
        c = self.conn()
        try:
            h = {"Content-Type": "application/json"}
            h.update(headers or {})
            c.request("POST", path, body=json.dumps(body), headers=h)
            r = c.getresponse()
            if r.status != 200:
                return r.status, [json.loads(r.read())]
            events = []
            for line in r.read().decode("utf-8", "replace").split("\n"):
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
            return r.status, events
        finally:
            c.close()

    def metrics(self):
        """{'name{labels}': value} from GET /metrics."""
        out = {}
        for line in self.get("/metrics").body.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
        return out

    def metric(self, key, default=0.0):
        return self.metrics().get(key, default)

    # ---- ranks as processes (chaos tests)
    ROLE_OF_EXE = {"pd-router": "router", "pd-prefill": "prefill", "pd-decode": "decode"}

    def session_pids(self, exe=None):
        """Pids of the job's processes (mpirun's session), or of those named exe. Every
        rank is in its own process group, so killpg(mpirun) does not reach them."""
        args = ["pgrep", "-s", str(self.proc.pid)] + (["-x", exe] if exe else [])
        out = subprocess.run(args, capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def rank_pids(self):
        """{MPI rank: (role, pid)} of the live ranks, from each process's OMPI_COMM_WORLD_RANK."""
        out = {}
        for exe, role in self.ROLE_OF_EXE.items():
            for pid in self.session_pids(exe):
                try:
                    with open("/proc/%d/environ" % pid, "rb") as f:
                        env = f.read().split(b"\0")
                except OSError:
                    continue  # gone meanwhile
                for e in env:
                    if e.startswith(b"OMPI_COMM_WORLD_RANK="):
                        out[int(e.split(b"=", 1)[1])] = (role, pid)
        return out

    def kill_session(self):
        """SIGKILL (after SIGCONT) every process still in the job's session: the last
        resort after stop(). Returns the pids it signalled."""
        def alive(pid):  # not a zombie waiting for its parent
            try:
                with open("/proc/%d/stat" % pid) as f:
                    return f.read().rsplit(")", 1)[1].split()[0] != "Z"
            except (OSError, IndexError):
                return False
        pids = [p for p in self.session_pids() if p != os.getpid() and alive(p)]
        for sig in (signal.SIGCONT, signal.SIGKILL):
            for p in pids:
                try:
                    os.kill(p, sig)
                except OSError:
                    pass
        return pids

    def health(self):
        """(HTTP status, JSON body or None) of GET /health."""
        r = self.get("/health")
        try:
            return r.status, r.json()
        except ValueError:
            return r.status, None


def completion_text(endpoint, resp):
    choice = resp["choices"][0]
    return choice["message"]["content"] if endpoint == "chat" else choice["text"]


def joined_stream(endpoint, events):
    """(text, finish_reasons, usage, done_count) of a streamed answer."""
    text, finishes, usage, done = "", [], None, 0
    for e in events:
        if e == "[DONE]":
            done += 1
            continue
        if "error" in e:
            raise AssertionError("stream error: %s" % e)
        if e.get("usage"):
            usage = e["usage"]
        for ch in e["choices"]:
            text += (ch.get("delta", {}).get("content") or "") if endpoint == "chat" else ch.get("text", "")
            if ch.get("finish_reason"):
                finishes.append(ch["finish_reason"])
    return text, finishes, usage, done


def request_body(endpoint, prompt, max_tokens, stream=False, **extra):
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


def path_of(endpoint):
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


# ---- shared by the suite files

def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def wait_for(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError("timed out waiting for " + what)


def metric_labels(key):
    """'name{a="1",b="x"}' -> ('name', {'a': '1', 'b': 'x'})."""
    if "{" not in key:
        return key, {}
    name, rest = key.split("{", 1)
    return name, dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest.rstrip("}")))


def per_rank(metrics, name):
    """{rank (int): value} of a per-rank series (labels role, rank) in a metrics() dict."""
    out = {}
    for key, value in metrics.items():
        n, labels = metric_labels(key)
        if n == name and "rank" in labels:
            out[int(labels["rank"])] = value
    return out


def hist(metrics, name, labels=""):
    """(sum, count) of histogram name in a metrics() dict; labels as exposed, e.g. 'stage="transfer"'."""
    suffix = "{%s}" % labels if labels else ""
    return metrics.get(name + "_sum" + suffix, 0.0), metrics.get(name + "_count" + suffix, 0.0)


def handoff_figures(m0, m1):
    """The KV handoffs between two metrics() snapshots: {'handoffs', 'bytes', 'exposed_s' (end of
    the prefill compute -> last byte sent, summed), 'gbps' (mean of the per-handoff bytes /
    (first layer posted -> last byte sent)), 'wire_s' (first layer posted -> last byte sent,
    summed, from bytes and GB/s), 'prefill_s', 'decode_queue_s', 'ttft_s' (sums)}. With one
    request between the snapshots these are that request's figures."""
    def d(name, labels=""):
        (s0, n0), (s1, n1) = hist(m0, name, labels), hist(m1, name, labels)
        return s1 - s0, n1 - n0
    exposed, n = d("pd_stage_seconds", 'stage="transfer"')
    gbps, ng = d("pd_kv_transfer_gbps")
    nbytes = m1.get("pd_kv_transfer_bytes_total", 0.0) - m0.get("pd_kv_transfer_bytes_total", 0.0)
    return {"handoffs": int(n), "bytes": nbytes, "exposed_s": exposed, "gbps": gbps / ng if ng else 0.0,
            "wire_s": nbytes / (gbps / ng) / 1e9 if ng and gbps > 0 else 0.0,
            "prefill_s": d("pd_stage_seconds", 'stage="prefill"')[0],
            "decode_queue_s": d("pd_stage_seconds", 'stage="decode_queue"')[0],
            "ttft_s": d("pd_time_to_first_token_seconds")[0]}


def blocks_all_free(c):
    m = c.metrics()
    free = {k.split("{")[1]: v for k, v in m.items() if k.startswith("pd_free_kv_blocks{")}
    total = {k.split("{")[1]: v for k, v in m.items() if k.startswith("pd_kv_blocks{")}
    return bool(total) and free == total


def need_default_model():
    if not os.path.exists(DEFAULT_MODEL):
        print("SKIP: default model missing (%s); run scripts/fetch_model.sh" % DEFAULT_MODEL)
        sys.exit(SKIP)


def run_suite(suites, script):
    """The command line of a suite file: `script SUITE`; exit 0 pass, 1 fail, 77 skip."""
    if len(sys.argv) != 2 or sys.argv[1] not in suites:
        print("usage: %s {%s}" % (script, ",".join(suites)))
        sys.exit(2)
    if not shutil.which("mpirun"):
        print("SKIP: mpirun not found (apt-get install openmpi-bin)")
        sys.exit(SKIP)
    tmp = tempfile.mkdtemp(prefix="pdcluster-test-")
    try:
        suites[sys.argv[1]](tmp)
    except AssertionError as e:
        print("FAIL:", e)
        sys.exit(1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("PASS:", sys.argv[1])
