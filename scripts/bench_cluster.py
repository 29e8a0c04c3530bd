#!/usr/bin/env python3
"""Cluster benchmarks with the field's load generator: pdcluster disaggregated and
colocated against llama.cpp's server, on the same machine, model, cores and requests.

One command reproduces every serving figure and plot in docs/BENCHMARKS.md:

    scripts/bench_cluster.py --out bench-results

What it does (everything from outside the repository goes under --work, default
/tmp/pd-bench; nothing is committed):

 1. A virtual environment (--venv, default ~/.cache/pdcluster/bench-venv) with
    scripts/requirements-bench.txt (NVIDIA's AIPerf, pinned, plus gguf and matplotlib);
    the script re-runs itself inside it.
 2. A tokenizer directory (tokenizer.json + tokenizer_config.json) built from the GGUF's
    own vocabulary with Hugging Face `tokenizers` (scripts/make_reference.py's builder),
    for AIPerf's --tokenizer.
 3. llama.cpp's llama-server built from the source PyPI's llama-cpp-python sdist vendors
    (scripts/accuracy_llamacpp.py's builder), the peer.
 4. Seeded request traces (the Mooncake JSONL AIPerf replays with --fixed-schedule, so
    every configuration gets the same requests at the same times): a Poisson rate sweep,
    bursty (gamma) arrivals, a chat-like length mix, and long prompts arriving while many
    decodes run, over a grid of long-prompt length x background load.
 5. Each configuration in turn -- `1p1d` (1 prefill + 1 decode rank, 1 thread each),
    `colocated2` (2 ranks doing both, 1 thread each), `llamacpp` (llama-server, 2 threads,
    continuous batching) -- serves every trace, driven by `aiperf profile --endpoint-type
    chat --streaming`. Per run: AIPerf's exports, the client's CPU seconds (AIPerf's whole
    process tree) and the server's.
 6. Planner vs measured: `pd-bench-engine --threads 1 --profile` and `pd-plan pools
    --profile --trace` on the same traces; simulated TTFT/TPOT p50/p90 beside measured.
 7. `pd-bench-textbook`: KV cache vs recompute, continuous vs static batching, paged vs
    contiguous KV.
 8. results.json, summary.md (every table) and the plots (PNG) in --out.

--quick runs tiny traces (a smoke test of the whole pipeline, minutes); --configs,
--workloads and --skip pick parts. Needs a Release build in --build (default build/)
and the default model (scripts/fetch_model.sh).
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))

REQUIREMENTS = os.path.join(ROOT, "scripts", "requirements-bench.txt")
DEFAULT_MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
CONFIGS = ("1p1d", "colocated2", "llamacpp")
LABEL = {"1p1d": "pdcluster 1P+1D", "colocated2": "pdcluster colocated x2", "llamacpp": "llama.cpp server"}
COLOR = {"1p1d": "tab:blue", "colocated2": "tab:orange", "llamacpp": "tab:green"}
# The simulator's measurement window, applied to measured runs for the planner table.
SKIP_FIRST, SKIP_LAST = 0.10, 0.05


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- set-up

def ensure_venv(venv):
    """Create the venv with the pinned requirements if it lacks them; its python."""
    py = os.path.join(venv, "bin", "python")
    stamp = os.path.join(venv, ".requirements")
    want = open(REQUIREMENTS).read()
    if os.path.exists(py) and os.path.exists(stamp) and open(stamp).read() == want:
        return py
    log("# creating %s (scripts/requirements-bench.txt)" % venv)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "-r", REQUIREMENTS], check=True)
    with open(stamp, "w") as f:
        f.write(want)
    return py


def write_tokenizer(model, out_dir):
    """tokenizer.json from the GGUF's vocabulary and merges (the same builder the
    tokenizer reference data uses), plus a tokenizer_config.json with the chat template."""
    from make_reference import build_reference_tokenizer, read_gguf_meta
    if os.path.exists(os.path.join(out_dir, "tokenizer_config.json")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    _, meta = read_gguf_meta(model)
    build_reference_tokenizer(meta).save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": meta["tokens"][meta["eos_id"]],
                   "chat_template": meta["chat_template"], "model_max_length": 8192,
                   "clean_up_tokenization_spaces": False}, f)
    return out_dir


# --------------------------------------------------------------------------- workloads

def arrivals(rng, n, rate, burstiness=1.0, start=0.0):
    """n arrival times: gamma gaps of mean 1/rate and shape `burstiness` (1 = Poisson;
    < 1 burstier, the coefficient of variation is 1/sqrt(burstiness)), as vLLM's and
    AIPerf's --burstiness define it."""
    t, out = start, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def lognormal_len(rng, mean, sigma, lo, hi):
    mu = math.log(mean) - sigma * sigma / 2
    return max(lo, min(hi, int(round(math.exp(rng.gauss(mu, sigma))))))


def trace_rows(times, lengths):
    return [{"timestamp": round(t * 1000.0, 3), "input_length": p, "output_length": o}
            for t, (p, o) in sorted(zip(times, lengths))]


def make_workloads(quick, seed):
    """{name: {"rows": trace, "kind": ..., parameters}}, deterministic for the seed."""
    w = {}
    dur = 12 if quick else 40  # seconds of arrivals per point

    def uniform_lengths(rng, n, p, o):
        return [(rng.randint(*p), rng.randint(*o)) for _ in range(n)]

    short_p, short_o = (64, 256), (32, 96)
    rates = [0.5, 1.0] if quick else [0.5, 1.0, 1.5]
    for rate in rates:
        rng = random.Random(seed * 1000 + int(rate * 100))
        n = max(8, int(dur * rate))
        w["poisson@%g" % rate] = {"kind": "poisson", "rate": rate, "burstiness": 1.0,
                                  "rows": trace_rows(arrivals(rng, n, rate), uniform_lengths(rng, n, short_p, short_o))}
    rate = 1.0
    rng = random.Random(seed * 1000 + 7)
    n = max(8, int(dur * rate))
    w["bursty@%g" % rate] = {"kind": "bursty", "rate": rate, "burstiness": 0.25,
                             "rows": trace_rows(arrivals(rng, n, rate, 0.25), uniform_lengths(rng, n, short_p, short_o))}
    # Chat-like: ShareGPT-shaped lengths (long-tailed prompts and replies).
    rate = 0.6
    rng = random.Random(seed * 1000 + 11)
    n = max(8, int(dur * rate))
    lens = [(lognormal_len(rng, 220, 0.9, 16, 2000), lognormal_len(rng, 110, 0.7, 8, 400)) for _ in range(n)]
    w["chat@%g" % rate] = {"kind": "chat", "rate": rate, "burstiness": 1.0, "rows": trace_rows(arrivals(rng, n, rate), lens)}
    # Long prompts arriving while many decodes run: a background of short prompts with long
    # replies (250-400 tokens: ~7 decodes at once at 0.35 req/s on a decode rank) plus two long prompts,
    # over a grid of (prompt length, background rate). A 4K-token prefill takes ~40 s on
    # one core here.
    grid = [(512, 0.3)] if quick else [(2048, 0.15), (2048, 0.35), (4096, 0.35)]
    span = 20 if quick else 60
    for L, bg in grid:
        rng = random.Random(seed * 1000 + L + int(bg * 100))
        nb = max(4, int(span * bg))
        times = arrivals(rng, nb, bg)
        lens = [(rng.randint(32, 96), rng.randint(48, 96) if quick else rng.randint(250, 400)) for _ in range(nb)]
        for k in range(2):
            times.append(span * (0.25 + 0.45 * k))
            lens.append((L, 16))
        w["long%d@%g" % (L, bg)] = {"kind": "long", "rate": bg, "long_prompt": L, "burstiness": 1.0,
                                    "rows": trace_rows(times, lens)}
    return w


# --------------------------------------------------------------------------- servers

def stat_fields(pid):
    """/proc/PID/stat's fields after the command name (field 3 onwards), or None if gone."""
    try:
        with open("/proc/%s/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def proc_cpu_seconds(pids):
    tick = os.sysconf("SC_CLK_TCK")
    fields = [stat_fields(pid) for pid in pids]
    return sum((int(f[11]) + int(f[12])) / tick for f in fields if f)  # utime, stime


class PdServer:
    """A pdcluster job through tests/cluster's harness (deploy/launch.sh)."""

    def __init__(self, name, model, build):
        from cluster import Cluster
        os.environ["PD_BUILD_DIR"] = build
        m = re.fullmatch(r"(\d+)p(\d+)d", name)
        spec = {"prefill": int(m.group(1)), "decode": int(m.group(2))} if m else \
            {"colocated": int(re.fullmatch(r"colocated(\d+)", name).group(1))}
        self.c = Cluster(model=model, threads=1, **spec).__enter__()
        self.port = self.c.port
        self.model_name = json.loads(self.c.get("/v1/models").body)["data"][0]["id"]

    def pids(self):
        return self.c.session_pids()

    def stop(self):
        self.c.stop()


class LlamaServer:
    """llama.cpp's server with continuous batching on the same model file and cores."""

    def __init__(self, exe, model, threads, slots, ctx_per_slot, extra, log_path):
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.args = [exe, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
                     "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot), "-cb",
                     # httplib holds a thread per keep-alive connection: with the default
                     # (slots + 2) a pooling client's idle connections starve new requests.
                     "--threads-http", "64", "--no-webui"] + extra
        self.log = open(log_path, "a")  # one server per workload: keep every one's log
        self.log.write("# " + " ".join(self.args) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit("bench_cluster.py: llama-server exited at start-up; see %s" % log_path)
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit("bench_cluster.py: llama-server not healthy in 120 s; see %s" % log_path)
        self.model_name = os.path.basename(model)

    def pids(self):
        return [self.proc.pid]

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def warm_up(port, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    if r.status != 200:
        raise SystemExit("bench_cluster.py: warm-up request failed with HTTP %d" % r.status)


# --------------------------------------------------------------------------- one run

def aiperf_command(venv_bin, port, model_name, tokenizer, trace, art_dir, seed):
    return [os.path.join(venv_bin, "aiperf"), "profile", "--model", model_name, "--endpoint-type", "chat",
            "--streaming", "--url", "http://127.0.0.1:%d" % port, "--tokenizer", tokenizer,
            "--input-file", trace, "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
            "--extra-inputs", "ignore_eos:true", "--use-legacy-max-tokens", "--use-server-token-count",
            "--random-seed", str(seed), "--artifact-dir", art_dir, "--ui-type", "none",
            "--workers-max", "1", "--record-processor-service-count", "1", "--no-server-metrics",
            "--no-gpu-telemetry",
            # A connection per request: llama-server (cpp-httplib) closes idle keep-alive
            # connections after 5 s, and a pooled client that reuses one just closed
            # records a failed request that the server never saw.
            "--connection-reuse-strategy", "never"]


def tree_cpu_seconds(root):
    """CPU seconds of a process and its live descendants, reaped children included."""
    tick = os.sysconf("SC_CLK_TCK")
    kids, stats = {}, {}
    for d in os.listdir("/proc"):
        fields = stat_fields(d) if d.isdigit() else None
        if not fields:
            continue
        kids.setdefault(int(fields[1]), []).append(int(d))
        stats[int(d)] = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, 0.0)
        todo.extend(kids.get(pid, []))
    return total


def run_aiperf(cmd, server, log_path):
    """Runs AIPerf; (wall s, [(unix time, client CPU s, server CPU s)] sampled every 0.5 s).
    The samples let the CPU be taken over the requests' window alone: AIPerf's start-up
    (imports, prompt synthesis) costs more CPU than the run itself on this scale."""
    import threading
    pids = server.pids()
    # AIPerf 0.13 fails to load a local tokenizer directory when the Hugging Face
    # offline switches are set (make_reference sets them on import): run it without.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    samples = []
    t0 = time.monotonic()
    with open(log_path, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        done = threading.Event()

        def sample():
            while not done.is_set():
                samples.append((time.time(), tree_cpu_seconds(p.pid), proc_cpu_seconds(pids)))
                done.wait(0.5)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        rc = p.wait()
        done.set()
        th.join()
    wall = time.monotonic() - t0
    if rc != 0:
        raise SystemExit("bench_cluster.py: aiperf failed (%d); see %s" % (rc, log_path))
    return wall, samples


def cpu_in_window(samples, t_start, t_end):
    """(client CPU s, server CPU s, seconds) between two unix times, from the samples."""
    def at(t, k):
        prev = samples[0]
        for s in samples:
            if s[0] >= t:
                if s[0] == prev[0]:
                    return s[k]
                return prev[k] + (s[k] - prev[k]) * (t - prev[0]) / (s[0] - prev[0])
            prev = s
        return samples[-1][k]
    if not samples:
        return float("nan"), float("nan"), 0.0
    return at(t_end, 1) - at(t_start, 1), at(t_end, 2) - at(t_start, 2), t_end - t_start


def read_records(art_dir):
    """Per-request figures from AIPerf's profile_export.jsonl, in arrival order."""
    recs = []
    with open(os.path.join(art_dir, "profile_export.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            md, m = r["metadata"], r.get("metrics", {})
            rec = {"start_ns": md.get("request_start_ns"), "session": md.get("session_num"), "ok": not r.get("error")}
            if rec["ok"]:
                rec["ttft"] = m["time_to_first_token"]["value"] / 1e3
                rec["e2e"] = m["request_latency"]["value"] / 1e3
                rec["osl"] = m["output_sequence_length"]["value"]
                rec["isl"] = m.get("input_sequence_length", {}).get("value")
                rec["gaps"] = [g / 1e3 for g in m.get("inter_chunk_latency", {}).get("value", [])]
                rec["tpot"] = (rec["e2e"] - rec["ttft"]) / max(1, rec["osl"] - 1)
            else:
                rec["error"] = r.get("error")
            recs.append(rec)
    recs.sort(key=lambda r: (r["session"] if r["session"] is not None else 0))
    return recs


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100.0
    lo = int(math.floor(k))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(recs, wall_s, ttft_slo, tpot_slo):
    ok = [r for r in recs if r["ok"]]
    gaps = [g for r in ok for g in r["gaps"]]
    span_ns = [r["start_ns"] for r in recs if r["start_ns"]]
    good = [r for r in ok if r["ttft"] <= ttft_slo and r["tpot"] <= tpot_slo]
    dur = (max(r["start_ns"] / 1e9 + r.get("e2e", 0) for r in ok) - min(span_ns) / 1e9) if ok else wall_s
    out = {"requests": len(recs), "ok": len(ok), "failed": len(recs) - len(ok), "duration_s": dur,
           "output_tok_s": sum(r["osl"] for r in ok) / dur if dur > 0 else float("nan"),
           "goodput_req_s": len(good) / dur if dur > 0 else float("nan"),
           "slo_attainment": len(good) / len(recs) if recs else float("nan")}
    # stall: a request's longest gap between two tokens (what a prefill run in its way costs it)
    stalls = [max(r["gaps"]) for r in ok if r["gaps"]]
    for key, xs in (("ttft", [r["ttft"] for r in ok]), ("tpot", [r["tpot"] for r in ok]), ("itl", gaps),
                    ("e2e", [r["e2e"] for r in ok]), ("stall", stalls)):
        out[key] = {"p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99), "max": max(xs) if xs else float("nan")}
    return out


def long_prompt_figures(recs, rows, long_prompt):
    """For a long-prompt trace: the background decodes' inter-token gaps and worst stalls
    (what the long prefills cost the requests already generating), and the long prompts'
    own TTFT and first gap (their KV handoff, on the disaggregated cluster)."""
    def is_long(r):
        return r["session"] is not None and r["session"] < len(rows) and rows[r["session"]]["input_length"] >= long_prompt
    ok = [r for r in recs if r["ok"]]
    bg = [r for r in ok if not is_long(r)]
    long = [r for r in ok if is_long(r)]
    gaps = [g for r in bg for g in r["gaps"]]
    stalls = [max(r["gaps"]) for r in bg if r["gaps"]]
    return {"background": {"requests": len(bg), "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99),
                           "stall_p50": pct(stalls, 50), "stall_p90": pct(stalls, 90),
                           "stall_max": max(stalls) if stalls else float("nan"),
                           "tpot_p90": pct([r["tpot"] for r in bg], 90)},
            "long": {"requests": len(long), "ttft": [r["ttft"] for r in long],
                     "first_gap": [r["gaps"][0] if r["gaps"] else float("nan") for r in long]}}


def trace_rows_of(out_dir, name):
    with open(os.path.join(out_dir, "trace_%s.jsonl" % name.replace("@", "_at_"))) as f:
        return [json.loads(line) for line in f]


def windowed(recs):
    """The simulator's measurement window: skip the first 10% and last 5% by arrival."""
    n = len(recs)
    return recs[int(n * SKIP_FIRST):n - int(n * SKIP_LAST)]


# --------------------------------------------------------------------------- planner, textbook

def engine_profile(args, build, workloads, out_dir):
    """pd-bench-engine --profile at one thread, as each rank runs, with points spread over
    the prompt lengths and contexts the traces reach (the planner interpolates)."""
    profile = os.path.join(out_dir, "engine_profile.json")
    longest = max(r["input_length"] for w in workloads.values() for r in w["rows"])
    prefill_pts = [p for p in (64, 128, 192, 256, 384, 512, 1024, 2048, 4096) if p < longest * 2]
    contexts = "128,512,1024" if args.quick else "128,512,2048,4608"
    cmd = [os.path.join(build, "tools", "pd-bench-engine"), "-m", args.model, "--threads", "1", "--batches",
           "1,4,8,16", "--prefill-tokens", "512", "--gen", "64" if not args.quick else "16", "--reps", "3",
           "--profile-prefill", ",".join(map(str, prefill_pts)), "--profile-contexts", contexts,
           "--json", os.path.join(out_dir, "engine_bench.json"), "--profile", profile]
    log("+ " + " ".join(cmd))
    subprocess.run(cmd, check=True, stdout=open(os.path.join(out_dir, "engine_bench.txt"), "w"))
    return profile


# The serving engine's chunked prefill at its defaults (deploy/cluster.json), for pd-plan pools.
ENGINE_CHUNKING = ["--chunk-tokens", "256", "--step-tokens", "256", "--context-cost-tokens", "512"]


def planner_predictions(build, profile, out_dir, results, ttft_slo, tpot_slo):
    """pd-plan pools --trace for 1P+1D and its colocated pool of 2, per trace. The server
    sees more prompt tokens than the trace asks for (the chat template's system prompt and
    role markers): the measured difference is added to every prompt of the simulated trace."""
    preds = {}
    for name in sorted(next(iter(results.values())).keys()):
        path = os.path.join(out_dir, "trace_%s.jsonl" % name.replace("@", "_at_"))
        rows = [json.loads(line) for line in open(path)]
        extra = sorted(r["isl"] - rows[r["session"]]["input_length"] for per in results.values()
                       for r in per[name]["records"] if r["ok"] and r.get("isl") is not None and r["session"] is not None
                       and r["session"] < len(rows))
        overhead = extra[len(extra) // 2] if extra else 0
        sim_path = os.path.join(out_dir, "planner_trace_%s.jsonl" % name.replace("@", "_at_"))
        with open(sim_path, "w") as f:
            for r in rows:
                f.write(json.dumps(dict(r, input_length=r["input_length"] + overhead)) + "\n")
        common = ["--model", "smollm2-135m", "--hardware", "cpu-2core", "--profile", profile, "--trace", sim_path,
                  "--ttft", str(ttft_slo), "--tpot", str(tpot_slo), "--json"]
        cmd = [os.path.join(build, "tools", "pd-plan"), "pools"] + common + [
            "--prefill", "1", "--decode", "1", "--prefill-budget", "2048", "--max-batch", "64"] + ENGINE_CHUNKING
        p = subprocess.run(cmd, check=True, capture_output=True, text=True)
        j = json.loads(p.stdout)
        # Which layout of the two ranks: pd-plan's answer, at the engine's defaults.
        lay = json.loads(subprocess.run([os.path.join(build, "tools", "pd-plan"), "layout", "--ranks", "2"] + common,
                                        check=True, capture_output=True, text=True).stdout)
        preds[name] = {"1p1d": j["disaggregated"], "colocated2": j["colocated_same_total"],
                       "prompt_overhead_tokens": overhead,
                       "layout": {"recommended": lay["recommended"], "feasible": lay["feasible"],
                                  "goodput": {l["name"]: l["goodput_rps"] for l in lay["layouts"]}}}
    return preds


def textbook(args, build, out_dir):
    """pd-bench-textbook's three experiments at their defaults, plus paged vs contiguous at
    a pool where the contiguous reservation leaves the decode batch below saturation."""
    exe = os.path.join(build, "tools", "pd-bench-textbook")
    runs = [("textbook", []), ("textbook_paged_2048", ["--only", "paged", "--paged-budget", "2048"])]
    jsons, texts = {}, []
    for name, extra in runs:
        path = os.path.join(out_dir, name + ".json")
        cmd = [exe, "-m", args.model, "--threads", "2", "--json", path] + extra
        if args.quick:
            cmd += ["--kv-steps", "16", "--batching-requests", "8", "--paged-requests", "12"]
        log("+ " + " ".join(cmd))
        p = subprocess.run(cmd, check=True, capture_output=True, text=True)
        with open(os.path.join(out_dir, name + ".txt"), "w") as f:
            f.write(p.stdout)
        jsons[name] = json.load(open(path))
        texts.append(p.stdout.strip())
    return jsons, "\n\n".join(texts)


# --------------------------------------------------------------------------- plots

def plots(results, workloads, out_dir, preds):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 8})
    written = []
    configs = [c for c in CONFIGS if c in results]

    def cdf(ax, xs, **kw):
        xs = sorted(xs)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], **kw)

    # CDFs: TTFT and ITL for the middle Poisson rate, the chat mix and the heaviest long-prompt point.
    poisson = sorted((w["rate"], n) for n, w in workloads.items() if w["kind"] == "poisson")
    picks = [n for n in (poisson[len(poisson) // 2][1] if poisson else None,
                         next((n for n in workloads if workloads[n]["kind"] == "chat"), None),
                         max((n for n in workloads if workloads[n]["kind"] == "long"),
                             key=lambda n: (workloads[n]["long_prompt"], workloads[n]["rate"]), default=None)) if n]
    fig, axes = plt.subplots(2, len(picks), figsize=(3.3 * len(picks), 5.0), squeeze=False)
    for j, wname in enumerate(picks):
        for c in configs:
            recs = [r for r in results[c][wname]["records"] if r["ok"]]
            cdf(axes[0][j], [r["ttft"] for r in recs], label=LABEL[c], color=COLOR[c])
            cdf(axes[1][j], [g * 1e3 for r in recs for g in r["gaps"]], label=LABEL[c], color=COLOR[c])
        axes[0][j].set_title(wname)
        axes[0][j].set_xlabel("TTFT (s)")
        axes[0][j].set_xscale("log")
        axes[1][j].set_xlabel("inter-token latency (ms)")
        axes[1][j].set_xscale("log")
        for i in range(2):
            axes[i][j].set_ylabel("fraction of requests" if i == 0 else "fraction of tokens")
            axes[i][j].grid(alpha=0.3)
    axes[0][0].legend(loc="lower right")
    fig.tight_layout()
    written.append(save(fig, out_dir, "cdf_ttft_itl.png"))

    # Throughput vs p90 latency, and goodput vs rate, over the Poisson sweep.
    names = [n for _, n in poisson]
    if names:
        fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
        for c in configs:
            s = [results[c][n]["summary"] for n in names]
            tput = [x["output_tok_s"] for x in s]
            axes[0].plot(tput, [x["ttft"]["p90"] for x in s], "o-", label=LABEL[c], color=COLOR[c])
            axes[1].plot(tput, [x["itl"]["p90"] * 1e3 for x in s], "o-", label=LABEL[c], color=COLOR[c])
            axes[2].plot([workloads[n]["rate"] for n in names], [x["goodput_req_s"] for x in s], "o-",
                         label=LABEL[c], color=COLOR[c])
        axes[2].plot([workloads[n]["rate"] for n in names], [workloads[n]["rate"] for n in names], ":", color="grey",
                     label="offered")
        axes[0].set(xlabel="output tokens/s", ylabel="TTFT p90 (s)", title="throughput vs TTFT p90", yscale="log")
        axes[1].set(xlabel="output tokens/s", ylabel="ITL p90 (ms)", title="throughput vs ITL p90", yscale="log")
        axes[2].set(xlabel="offered rate (req/s)", ylabel="goodput (req/s)", title="goodput under SLOs")
        for ax in axes:
            ax.grid(alpha=0.3)
        axes[2].legend()
        fig.tight_layout()
        written.append(save(fig, out_dir, "throughput_goodput.png"))

    # Long prompts among running decodes: p99 ITL of the background decodes per grid point.
    longs = sorted((n for n in workloads if workloads[n]["kind"] == "long"),
                   key=lambda n: (workloads[n]["long_prompt"], workloads[n]["rate"]))
    if longs:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
        width = 0.8 / len(configs)
        for ax, (key, ylabel) in zip(axes, (("itl_p99", "running decodes: ITL p99 (s)"),
                                            ("stall_p90", "running decodes: worst gap, p90 (s)"))):
            for i, c in enumerate(configs):
                ys = [results[c][n]["long"]["background"][key] for n in longs]
                ax.bar([k + i * width for k in range(len(longs))], ys, width, label=LABEL[c], color=COLOR[c])
            ax.set_xticks([k + width * (len(configs) - 1) / 2 for k in range(len(longs))])
            ax.set_xticklabels(["%d-token prompts\n%g req/s decodes" % (workloads[n]["long_prompt"], workloads[n]["rate"])
                                for n in longs])
            ax.set_ylabel(ylabel)
            ax.set_yscale("log")
            ax.grid(alpha=0.3, axis="y")
        axes[0].set_title("long prompts among running decodes: their ITL p99")
        axes[1].set_title("... and the worst stall each of them sees (p90)")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        written.append(save(fig, out_dir, "long_prompts_itl.png"))

    # Planner vs measured.
    if preds:
        rows = [(n, c) for n in workloads for c in ("1p1d", "colocated2") if c in results and n in preds]
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
        for ax, key in zip(axes, ("ttft", "tpot")):
            for n, c in rows:
                m = results[c][n]["window"][key]["p90"]
                s = preds[n][c][key]["p90"]
                ax.loglog([m], [s], "o" if c == "1p1d" else "s", color=COLOR[c], alpha=0.8)
            lo = min([results[c][n]["window"][key]["p90"] for n, c in rows] + [preds[n][c][key]["p90"] for n, c in rows])
            hi = max([results[c][n]["window"][key]["p90"] for n, c in rows] + [preds[n][c][key]["p90"] for n, c in rows])
            ax.plot([lo, hi], [lo, hi], "-", color="grey", lw=0.8)
            ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="grey", alpha=0.15)
            ax.set(xlabel="measured %s p90 (s)" % key.upper(), ylabel="simulated (s)", title="pd-plan vs measured: " + key.upper())
            ax.grid(alpha=0.3, which="both")
        for c in ("1p1d", "colocated2"):
            axes[0].plot([], [], "o" if c == "1p1d" else "s", color=COLOR[c], label=LABEL[c])
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        written.append(save(fig, out_dir, "planner_vs_measured.png"))
    return written


def save(fig, out_dir, name):
    import matplotlib.pyplot as plt
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- tables

def fmt(x, unit="s"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if unit == "ms":
        return "%.0f" % (x * 1e3)
    return "%.2f" % x


def tables(results, workloads, preds, client, textbook_text):
    configs = [c for c in CONFIGS if c in results]
    lines = []
    lines.append("### Serving: every configuration on every trace (AIPerf, chat endpoint, streaming)\n")
    lines.append("| workload | configuration | ok/failed | TTFT p50 / p90 / p99 (s) | ITL p50 / p90 / p99 (ms) | "
                 "TPOT p50 / p90 (ms) | worst gap per request p50 / p90 (s) | output tok/s | goodput req/s (in SLO) |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for n in workloads:
        for c in configs:
            s = results[c][n]["summary"]
            lines.append("| %s | %s | %d/%d | %s / %s / %s | %s / %s / %s | %s / %s | %s / %s | %.1f | %.2f (%.0f%%) |" % (
                n, LABEL[c], s["ok"], s["failed"], fmt(s["ttft"]["p50"]), fmt(s["ttft"]["p90"]), fmt(s["ttft"]["p99"]),
                fmt(s["itl"]["p50"], "ms"), fmt(s["itl"]["p90"], "ms"), fmt(s["itl"]["p99"], "ms"),
                fmt(s["tpot"]["p50"], "ms"), fmt(s["tpot"]["p90"], "ms"), fmt(s["stall"]["p50"]), fmt(s["stall"]["p90"]),
                s["output_tok_s"], s["goodput_req_s"],
                100 * s["slo_attainment"]))
    longs = [n for n in workloads if workloads[n]["kind"] == "long"]
    if longs:
        lines.append("\n### Long prompts among running decodes: the decodes' gaps, the long prompts' own latency\n")
        lines.append("| workload | configuration | decodes: ITL p50 / p99 (ms) | decodes: worst gap p50 / p90 / max (s) | "
                     "decodes: TPOT p90 (ms) | long prompts: TTFT (s) | long prompts: first gap (s) |")
        lines.append("|---|---|---|---|---|---|---|")
        for n in longs:
            for c in configs:
                f = results[c][n]["long"]
                b, lg = f["background"], f["long"]
                lines.append("| %s | %s | %s / %s | %s / %s / %s | %s | %s | %s |" % (
                    n, LABEL[c], fmt(b["itl_p50"], "ms"), fmt(b["itl_p99"], "ms"), fmt(b["stall_p50"]),
                    fmt(b["stall_p90"]), fmt(b["stall_max"]), fmt(b["tpot_p90"], "ms"),
                    ", ".join(fmt(x) for x in lg["ttft"]), ", ".join(fmt(x) for x in lg["first_gap"])))
    lines.append("\n### Ratios to llama.cpp's server, same run (lower latency ratio = better)\n")
    lines.append("| workload | configuration | TTFT p90 | ITL p99 | TPOT p90 | output tok/s | goodput |")
    lines.append("|---|---|---|---|---|---|---|")
    if "llamacpp" in results:
        for n in workloads:
            b = results["llamacpp"][n]["summary"]
            for c in configs:
                if c == "llamacpp":
                    continue
                s = results[c][n]["summary"]
                r = lambda k, q: s[k][q] / b[k][q] if b[k][q] else float("nan")  # noqa: E731
                lines.append("| %s | %s | x%.2f | x%.2f | x%.2f | x%.2f | %s |" % (
                    n, LABEL[c], r("ttft", "p90"), r("itl", "p99"), r("tpot", "p90"),
                    s["output_tok_s"] / b["output_tok_s"] if b["output_tok_s"] else float("nan"),
                    ("x%.2f" % (s["goodput_req_s"] / b["goodput_req_s"])) if b["goodput_req_s"] else "-"))
    lines.append("\n### The client's CPU (AIPerf, whole process tree) and the server's, per run\n")
    lines.append("| workload | configuration | requests' window (s) | client CPU s (cores) | server CPU s (cores) | "
                 "AIPerf whole run: wall s, CPU s |")
    lines.append("|---|---|---|---|---|---|")
    for n in workloads:
        for c in configs:
            cl = client[c][n]
            w = max(cl["window_s"], 1e-9)
            lines.append("| %s | %s | %.0f | %.1f (%.2f) | %.1f (%.2f) | %.0f, %.1f |" % (
                n, LABEL[c], cl["window_s"], cl["client_cpu_s"], cl["client_cpu_s"] / w, cl["server_cpu_s"],
                cl["server_cpu_s"] / w, cl["wall_s"], cl["client_cpu_s_whole_run"]))
    if preds:
        lines.append("\n### pd-plan's simulation vs measured (same trace, requests 10%..95% by arrival)\n")
        lines.append("| workload | configuration | TTFT p50 meas / sim (err) | TTFT p90 meas / sim (err) | "
                     "TPOT p50 meas / sim (err) | TPOT p90 meas / sim (err) |")
        lines.append("|---|---|---|---|---|---|")
        for n in workloads:
            for c in ("1p1d", "colocated2"):
                if c not in results or n not in preds:
                    continue
                m, s = results[c][n]["window"], preds[n][c]
                cells = []
                for k in ("ttft", "tpot"):
                    for q in ("p50", "p90"):
                        mv, sv = m[k][q], s[k][q]
                        err = (sv - mv) / mv * 100 if mv else float("nan")
                        cells.append("%s / %s (%+.0f%%)" % (fmt(mv, "ms" if k == "tpot" else "s"),
                                                            fmt(sv, "ms" if k == "tpot" else "s"), err))
                lines.append("| %s | %s | %s |" % (n, LABEL[c], " | ".join(cells)))
        lines.append("\n### Which layout for two ranks: pd-plan's answer vs the measured better one\n")
        lines.append("(`pd-plan layout --ranks 2 --trace` at the engine's defaults; better = higher goodput, "
                     "a tie to the lower TTFT p90; measured over requests 10%..95% by arrival)\n")
        lines.append("| workload | pd-plan recommends | simulated goodput colocated x2 / 1P+1D | "
                     "measured goodput colocated x2 / 1P+1D | measured better | agree |")
        lines.append("|---|---|---|---|---|---|")
        for n in workloads:
            lay = preds.get(n, {}).get("layout")
            if not lay or "1p1d" not in results or "colocated2" not in results:
                continue
            mc, md = results["colocated2"][n]["window"], results["1p1d"][n]["window"]
            if mc["goodput_req_s"] != md["goodput_req_s"]:
                better = "colocated x2" if mc["goodput_req_s"] > md["goodput_req_s"] else "1P+1D"
            else:
                better = "colocated x2" if mc["ttft"]["p90"] <= md["ttft"]["p90"] else "1P+1D"
            g = lay["goodput"]
            lines.append("| %s | %s%s | %.2f / %.2f | %.2f / %.2f | %s | %s |" % (
                n, lay["recommended"], "" if lay["feasible"] else " (none meets the SLOs)",
                g.get("colocated x2", float("nan")), g.get("1P+1D", float("nan")),
                mc["goodput_req_s"], md["goodput_req_s"], better, "yes" if lay["recommended"] == better else "no"))
    if textbook_text:
        lines.append("\n### The textbook's claims on this engine (pd-bench-textbook)\n")
        lines.append("```\n" + textbook_text.strip() + "\n```")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-results"), help="results, tables and plots go here")
    ap.add_argument("--work", default="/tmp/pd-bench", help="llama.cpp source/build, tokenizer, AIPerf artifacts")
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/pdcluster/bench-venv"))
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--workloads", default="", help="comma-separated name prefixes (poisson, bursty, chat, long); default all")
    ap.add_argument("--skip", default="", help="comma-separated: planner, textbook")
    ap.add_argument("--quick", action="store_true", help="tiny traces: a smoke test of the pipeline")
    ap.add_argument("--report-only", action="store_true",
                    help="no measuring: tables and plots again from --out's results.json (and textbook*.txt)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (goodput)")
    ap.add_argument("--tpot-slo", type=float, default=0.15, help="seconds per output token (goodput)")
    ap.add_argument("--llamacpp-slots", type=int, default=8, help="llama-server -np")
    ap.add_argument("--llamacpp-slot-ctx", type=int, default=0,
                    help="tokens per llama-server slot (-c = slots x this); default: the longest request of the workload")
    ap.add_argument("--llamacpp-args", default="-fa --poll 0",
                    help="more llama-server flags (default: flash attention, no busy-polling threads)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="build jobs for llama.cpp")
    args = ap.parse_args()

    venv = os.path.realpath(args.venv)
    if os.path.realpath(sys.prefix) != venv:
        py = ensure_venv(venv)
        os.execv(py, [py, os.path.abspath(__file__)] + sys.argv[1:])

    if args.report_only:
        return report_only(args)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit("bench_cluster.py: --configs: unknown configuration '%s' (have %s)" % (c, ", ".join(CONFIGS)))
    skip = set(s for s in args.skip.split(",") if s)
    if skip - {"planner", "textbook"}:
        raise SystemExit("bench_cluster.py: --skip: expected planner and/or textbook, got '%s'" % args.skip)
    if not os.path.exists(args.model):
        raise SystemExit("bench_cluster.py: --model: no such file '%s' (scripts/fetch_model.sh)" % args.model)
    build = os.path.abspath(args.build)
    needed = ([] if "planner" in skip else ["tools/pd-bench-engine", "tools/pd-plan"]) + \
        ([] if "textbook" in skip else ["tools/pd-bench-textbook"])
    for exe in needed:
        if not os.path.exists(os.path.join(build, exe)):
            raise SystemExit("bench_cluster.py: --build: no %s under '%s' (build first, see README)" % (exe, build))
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    command = " ".join(["scripts/bench_cluster.py"] + sys.argv[1:])
    log("# " + command)

    tokenizer = write_tokenizer(args.model, os.path.join(args.work, "tokenizer"))
    workloads = make_workloads(args.quick, args.seed)
    if args.workloads:
        prefixes = args.workloads.split(",")
        workloads = {n: w for n, w in workloads.items() if any(n.startswith(p) for p in prefixes)}
        if not workloads:
            raise SystemExit("bench_cluster.py: --workloads: no workload starts with '%s'" % args.workloads)
    traces = {}
    for n, w in workloads.items():
        path = os.path.join(args.out, "trace_%s.jsonl" % n.replace("@", "_at_"))
        with open(path, "w") as f:
            for row in w["rows"]:
                f.write(json.dumps(row) + "\n")
        traces[n] = path
    llama_exe = None
    if os.path.exists(os.path.join(args.out, "llama-server.log")):
        os.unlink(os.path.join(args.out, "llama-server.log"))  # this run's servers append to it
    if "llamacpp" in configs:
        from accuracy_llamacpp import build_llama_cpp
        llama_exe, _ = build_llama_cpp(os.path.join(args.work, "llama.cpp"), args.jobs, "llama-server")

    results, client, llama_args = {}, {}, {}
    venv_bin = os.path.dirname(sys.executable)

    def start(c, w):
        if c != "llamacpp":
            return PdServer(c, args.model, build)
        # The peer's best settings: a slot context just above the workload's longest
        # request (llama.cpp's unified KV cache makes attention cost grow with the
        # cells in use across slots), 2 threads on the 2 cores, flash attention.
        longest = max(r["input_length"] + r["output_length"] for r in w["rows"]) + 64  # + chat template
        slot_ctx = args.llamacpp_slot_ctx or 256 * math.ceil(longest / 256)
        return LlamaServer(llama_exe, args.model, 2, args.llamacpp_slots, slot_ctx, args.llamacpp_args.split(),
                           os.path.join(args.out, "llama-server.log"))

    for c in configs:
        log("# configuration %s" % c)
        results[c], client[c] = {}, {}
        server = None
        try:
            for n, w in workloads.items():
                if server is None:
                    server = start(c, w)
                    warm_up(server.port, server.model_name)
                if c == "llamacpp":
                    llama_args[n] = server.args[1:]
                art = os.path.join(args.work, "aiperf", c, n.replace("@", "_at_"))
                shutil.rmtree(art, ignore_errors=True)
                # A seed per workload: AIPerf draws prompt k of every run from the seed, so
                # one seed would repeat prompts across workloads and a warm prefix cache
                # would answer them (the pdcluster job serves every workload in turn).
                seed = args.seed * 1000 + list(workloads).index(n)
                cmd = aiperf_command(venv_bin, server.port, server.model_name, tokenizer, traces[n], art, seed)
                wall, samples = run_aiperf(cmd, server, os.path.join(args.work, "aiperf-%s-%s.log" % (c, n)))
                recs = read_records(art)
                starts = [r["start_ns"] / 1e9 for r in recs if r["start_ns"]]
                ends = [r["start_ns"] / 1e9 + r["e2e"] for r in recs if r["ok"]]
                ccpu, scpu, window_s = cpu_in_window(samples, min(starts), max(ends + starts))
                s = summarize(recs, wall, args.ttft_slo, args.tpot_slo)
                results[c][n] = {"summary": s, "window": summarize(windowed(recs), wall, args.ttft_slo, args.tpot_slo),
                                 "records": recs}
                if w["kind"] == "long":
                    results[c][n]["long"] = long_prompt_figures(recs, w["rows"], w["long_prompt"])
                client[c][n] = {"wall_s": wall, "window_s": window_s, "client_cpu_s": ccpu, "server_cpu_s": scpu,
                                "client_cpu_s_whole_run": samples[-1][1] if samples else float("nan")}
                log("  %-16s ok %3d failed %d | TTFT p50 %.2f p90 %.2f s | ITL p50 %.0f p99 %.0f ms | %.1f tok/s | "
                    "client %.1f CPU s, server %.1f CPU s in the %.0f s of requests (AIPerf ran %.0f s)" % (
                        n, s["ok"], s["failed"], s["ttft"]["p50"], s["ttft"]["p90"], s["itl"]["p50"] * 1e3,
                        s["itl"]["p99"] * 1e3, s["output_tok_s"], ccpu, scpu, window_s, wall))
                if c == "llamacpp":  # sized per workload: a fresh server for the next
                    server.stop()
                    server = None
        finally:
            if server is not None:
                server.stop()

    preds, textbook_json, textbook_text = {}, None, ""
    if "planner" not in skip and ("1p1d" in configs or "colocated2" in configs):
        profile = engine_profile(args, build, workloads, args.out)
        preds = planner_predictions(build, profile, args.out, results, args.ttft_slo, args.tpot_slo)
    if "textbook" not in skip:
        textbook_json, textbook_text = textbook(args, build, args.out)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": command, "workloads": {n: {k: v for k, v in w.items() if k != "rows"}
                                                     for n, w in workloads.items()},
                   "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
                   "llamacpp_args": llama_args,
                   "results": results, "cpu": client, "planner": preds, "textbook": textbook_json}, f)
    return report(args.out, command, results, workloads, preds, client, textbook_text)


def report(out_dir, command, results, workloads, preds, client, textbook_text):
    written = plots(results, workloads, out_dir, preds)
    md = "Command: `%s`\n\n" % command + tables(results, workloads, preds, client, textbook_text)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(md)
    print(md)
    log("# wrote %s: summary.md, results.json, %s" % (out_dir, ", ".join(os.path.basename(p) for p in written)))
    return 0


def report_only(args):
    """Summaries recomputed from the stored per-request records, then tables and plots."""
    with open(os.path.join(args.out, "results.json")) as f:
        saved = json.load(f)
    slo = saved["slo"]
    for per_config in saved["results"].values():
        for run in per_config.values():
            recs = run["records"]
            run["summary"] = summarize(recs, 0.0, slo["ttft_s"], slo["tpot_s"])
            run["window"] = summarize(windowed(recs), 0.0, slo["ttft_s"], slo["tpot_s"])
    for per_config in saved["results"].values():
        for name, run in per_config.items():
            if saved["workloads"][name]["kind"] == "long":
                run["long"] = long_prompt_figures(run["records"], trace_rows_of(args.out, name),
                                                  saved["workloads"][name]["long_prompt"])
    profile = os.path.join(args.out, "engine_profile.json")
    preds = saved["planner"]
    if os.path.exists(profile):  # simulate again: pd-plan may have changed, the profile has not
        preds = planner_predictions(os.path.abspath(args.build), profile, args.out, saved["results"],
                                    slo["ttft_s"], slo["tpot_s"])
        saved["planner"] = preds
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(saved, f)
    texts = []
    for name in ("textbook", "textbook_paged_2048"):
        path = os.path.join(args.out, name + ".txt")
        if os.path.exists(path):
            texts.append(open(path).read().strip())
    return report(args.out, saved["command"], saved["results"], saved["workloads"], preds, saved["cpu"],
                  "\n\n".join(texts))


if __name__ == "__main__":
    sys.exit(main())
