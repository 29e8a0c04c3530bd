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

Multi-turn chat, cache-aware vs least-work routing (a separate mode: the standard library
only, no AIPerf; it runs in the bench venv where that exists, for matplotlib's plot):

    scripts/bench_cluster.py --multiturn --mt-shapes 2p1d,2p2d --mt-reps 3 --out bench-results

 - The workload (seeded): --mt-conversations x --mt-turns (6 x 5; --quick 4 x 3)
   conversations sharing one system prompt (~440 tokens); user turns of ~60-120 tokens,
   distinct per conversation; greedy answers of max_tokens 48-64 (--quick 24-32). Each
   turn sends the whole history (system, the earlier user messages and the answers as
   the server gave them) plus the new user message, streamed with usage; a conversation
   sends its next turn 0.5-1 s after the previous answer ends, and the conversations
   start ~1 s apart, so their turns interleave. A thread per conversation records per
   request its arrival, TTFT (first content token), latency, prompt/completion tokens,
   usage.prompt_tokens_details.cached_tokens (n/a where the server does not report it)
   and the answer.
 - Per shape (P prefill + D decode ranks, 1 thread each), runs alternate between
   router.policy least_work and cache_aware (ABAB..., --mt-reps each), each on a fresh
   cluster (caches empty) after one warm-up request per prefill rank that is not
   counted; /metrics before and after give each run's prefill requests per rank
   (pd_rank_requests_total), prompt tokens by source (pd_rank_prompt_tokens_total) and
   routing decisions (pd_router_routing_decisions_total, where the router has them).
 - The oracle, per request through POST /tokenize: the longest prefix its prompt shares
   with an earlier request's prompt or an earlier finished request's messages plus its
   answer, in whole 16-token KV blocks and never the whole prompt; the measured cached
   fraction is reported against it (and against earlier prompts alone: all a prefill
   rank's cache can hold).
 - Then the uniform check: distinct single-turn prompts (no system prompt) at the same
   concurrency, under --mt-uniform-policies (least_work and cache_aware): the largest
   prefill rank's share of the requests over the fair share.
 - multiturn.json, multiturn.md (TTFT p50/p90 of first and later turns per policy, the
   median over reps and per rep; least_work / cache_aware for later turns; cached
   fractions vs the oracle; rank shares) and multiturn_ttft_later.png (later turns' TTFT
   CDFs) in --out; --multiturn --report-only redoes the tables and plot from the JSON.
   --quick --mt-reps 1 is a smoke test (about a minute per shape); --mt-config adds cluster
   configuration (JSON, merged per section) to every run of both policies.
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

    def __init__(self, name, model, build, config=None):
        os.environ["PD_BUILD_DIR"] = build
        import cluster
        cluster.BUILD = build  # read at import: a build given after a first import still counts
        m = re.fullmatch(r"(\d+)p(\d+)d", name)
        spec = {"prefill": int(m.group(1)), "decode": int(m.group(2))} if m else \
            {"colocated": int(re.fullmatch(r"colocated(\d+)", name).group(1))}
        self.c = cluster.Cluster(model=model, threads=1, config=config, **spec)
        try:
            self.c.__enter__()
        except BaseException:
            self.c.stop()  # its temporary config and port files
            raise
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


# --------------------------------------------------------------------------- multi-turn chat (cache-aware routing)

MT_POLICIES = ("least_work", "cache_aware")
MT_BLOCK = 16  # kv.block_size (the default; the clusters here do not change it)
MT_HTTP_TIMEOUT_S = 300  # any one HTTP call: connect, send, or one read of the stream
MT_WORDS = (
    "the a an this that each every some any other same new old first last next early late small large long short "
    "quick slow simple careful clear exact plain useful common rare public private local remote steady sudden "
    "river garden market station library kitchen harbor village forest mountain valley island bridge tower "
    "letter report budget schedule recipe journey lesson project meeting contract ticket invoice manual "
    "engine battery sensor window ladder bicycle camera printer kettle lantern compass blanket basket "
    "teacher farmer driver pilot doctor painter student neighbor captain baker writer sailor builder "
    "water bread coffee paper metal stone glass cotton timber copper silver honey salt pepper flour "
    "morning evening winter summer weekend season century minute moment decade "
    "is was has had will would can could should must may might does did "
    "make take give keep find send bring carry build check write read count measure compare explain "
    "describe choose follow repair clean open close plan share store move turn hold print order "
    "and or but so because while when before after until unless although since if then "
    "in on at by for with from into over under between through around near behind across along "
    "quickly slowly carefully often rarely usually always never almost nearly exactly only also still").split()


def mt_sentences(rng, n_words):
    """Deterministic English-like text of about n_words words: sentences of 6 to 16 words."""
    out, left = [], n_words
    while left > 0:
        k = min(left, rng.randint(6, 16))
        words = [rng.choice(MT_WORDS) for _ in range(k)]
        out.append(" ".join([words[0].capitalize()] + words[1:]) + rng.choice(".....?!"))
        left -= k
    return " ".join(out)


def make_multiturn(conversations, turns, seed, quick):
    """The multi-turn chat workload, deterministic for the seed: a shared system prompt
    (~400 tokens) and `conversations` conversations of `turns` user messages (~60-120
    tokens each, distinct text per conversation), each turn's max_tokens, the think time
    after each answer (0.5-1 s) and each conversation's start (staggered ~1 s apart)."""
    rng = random.Random(seed * 7919 + 1)
    system = ("You are the help desk assistant of a small town. Answer in two or three short sentences, "
              "plainly and politely. The notes below describe the town; use them when they help.\n\n" +
              "\n".join("Note %d: %s" % (i + 1, mt_sentences(rng, 40)) for i in range(8)))
    convs, t = [], 0.0
    for i in range(conversations):
        crng = random.Random(seed * 7919 + 1000 + i)
        topic = " ".join(crng.choice(MT_WORDS[20:120]) for _ in range(2))
        user = ["(Visitor %d) About the %s: %s" % (i + 1, topic, mt_sentences(crng, crng.randint(50, 95)))
                for k in range(turns)]
        lo, hi = (24, 32) if quick else (48, 64)
        convs.append({"id": i, "start_s": round(t, 3), "user": user,
                      "max_tokens": [crng.randint(lo, hi) for _ in range(turns)],
                      "think_s": [round(crng.uniform(0.5, 1.0), 3) for _ in range(turns)]})
        t += rng.uniform(0.7, 1.3)
    return {"kind": "multiturn", "system": system, "conversations": convs, "history": True}


def make_uniform(lanes, per_lane, seed, quick):
    """Requests that share nothing (the uniform check): `lanes` closed-loop clients, each
    sending `per_lane` distinct single-turn prompts (no system prompt, no history) with the
    multi-turn workload's think times and staggered starts, so the concurrency matches."""
    w = make_multiturn(lanes, per_lane, seed + 104729, quick)
    for c in w["conversations"]:
        crng = random.Random(seed * 7919 + 5000 + c["id"])
        c["user"] = ["Request %d.%d: %s" % (c["id"] + 1, k + 1, mt_sentences(crng, crng.randint(50, 95)))
                     for k in range(per_lane)]
    return dict(w, kind="uniform", system="", history=False)


def mt_chat(port, model_name, messages, max_tokens, deadline):
    """One streamed chat completion (temperature 0, usage requested): {"ttft", "e2e",
    "text", "prompt_tokens", "completion_tokens", "cached_tokens" (None = not reported),
    "finish_reason"}. Raises RuntimeError on any HTTP or stream error, or at the deadline
    (time.monotonic())."""
    body = {"model": model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=max(1.0, min(MT_HTTP_TIMEOUT_S, deadline - t0)))
    try:
        c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError("HTTP %d: %s" % (r.status, r.read(2000).decode("utf-8", "replace")))
        text, ttft, usage, finish, done = [], None, None, None, False
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError("no complete answer before the run's deadline")
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            e = json.loads(payload)
            if "error" in e:
                raise RuntimeError("stream error: %s" % json.dumps(e["error"])[:500])
            if e.get("usage"):
                usage = e["usage"]
            for ch in e.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.monotonic() - t0
                text.append(piece)
                finish = ch.get("finish_reason") or finish
        if not done:
            raise RuntimeError("the stream ended without data: [DONE]")
        if usage is None:
            raise RuntimeError("no usage chunk (stream_options.include_usage was asked for)")
    finally:
        c.close()
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return {"ttft": ttft, "e2e": time.monotonic() - t0, "text": "".join(text), "finish_reason": finish,
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": cached if isinstance(cached, int) else None}


def mt_drive(port, model_name, workload, timeout_s):
    """Runs the workload: a thread per conversation, each turn sent when the previous
    answer is complete plus the think time. Returns the records in arrival order; raises
    SystemExit on the first failed request or at timeout_s."""
    import threading
    convs, records, errors = workload["conversations"], [], []
    lock, stop = threading.Lock(), threading.Event()
    t_start = time.monotonic()
    deadline = t_start + timeout_s
    system = [{"role": "system", "content": workload["system"]}] if workload["system"] else []

    def conversation(conv):
        try:
            if stop.wait(conv["start_s"]):
                return
            history = list(system)
            for k, user in enumerate(conv["user"]):
                messages = history + [{"role": "user", "content": user}]
                arrival = time.monotonic() - t_start
                rec = mt_chat(port, model_name, messages, conv["max_tokens"][k], deadline)
                rec.update(conversation=conv["id"], turn=k + 1, arrival_s=arrival, messages=messages)
                with lock:
                    records.append(rec)
                if workload["history"]:
                    history = messages + [{"role": "assistant", "content": rec["text"]}]
                if stop.wait(conv["think_s"][k]):
                    return
        except Exception as e:  # noqa: BLE001 -- any failure ends the run
            with lock:
                errors.append("conversation %d turn %d: %s: %s" % (conv["id"], k + 1, type(e).__name__, e))
            stop.set()

    threads = [threading.Thread(target=conversation, args=(c,), daemon=True) for c in convs]
    for th in threads:
        th.start()
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()) + 5)
    if any(th.is_alive() for th in threads):
        stop.set()
        raise SystemExit("bench_cluster.py: --multiturn: the run did not finish in %d s (--mt-timeout)" % timeout_s)
    if errors:
        raise SystemExit("bench_cluster.py: --multiturn: request failed: " + errors[0])
    return sorted(records, key=lambda r: r["arrival_s"])


def mt_http_json(port, method, path, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read().decode("utf-8", "replace")
    finally:
        c.close()
    if r.status != 200:
        raise SystemExit("bench_cluster.py: --multiturn: %s %s: HTTP %d: %s" % (method, path, r.status, data[:500]))
    return data


def mt_metrics(port):
    """{(name, ((label, value), ...)): value} of GET /metrics, for the series the
    multi-turn mode reads (per-rank requests, per-rank prompt tokens by source, routing
    decisions); absent series are simply missing."""
    out = {}
    for line in mt_http_json(port, "GET", "/metrics").splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        name, labels = (key.split("{", 1) + [""])[:2]
        if name not in ("pd_rank_requests_total", "pd_rank_prompt_tokens_total", "pd_router_routing_decisions_total"):
            continue
        out[(name, tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))))] = float(value)
    return out


def mt_metric_delta(m0, m1, name):
    """[(labels dict, after - before)] of one series between two mt_metrics() snapshots."""
    return [(dict(labels), v - m0.get((n, labels), 0.0)) for (n, labels), v in sorted(m1.items()) if n == name]


def mt_settled_metrics(port, base, want):
    """mt_metrics() once the ranks' pd_rank_prompt_tokens_total has grown by `want`
    tokens since the snapshot `base` (the counters follow the workers' periodic load
    reports), or after 5 s, or at once where the series does not exist."""
    deadline = time.monotonic() + 5
    while True:
        m = mt_metrics(port)
        got = sum(v for _, v in mt_metric_delta(base, m, "pd_rank_prompt_tokens_total"))
        if got >= want or time.monotonic() > deadline or not any(n == "pd_rank_prompt_tokens_total" for n, _ in m):
            return m
        time.sleep(0.25)


def mt_tokenize(port, messages, add_generation_prompt):
    return json.loads(mt_http_json(port, "POST", "/tokenize", {"messages": messages,
                                                                "add_generation_prompt": add_generation_prompt}))["tokens"]


def common_prefix(a, b):
    n, i = min(len(a), len(b)), 0
    while i + 64 <= n and a[i:i + 64] == b[i:i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


def mt_oracle(port, records, block):
    """Per record (in arrival order): "prompt_ids" (its prompt through /tokenize), and
    "oracle_cached" -- the longest common prefix with anything a prefix cache could hold
    when it arrived (an earlier request's prompt, or an earlier *completed* request's
    messages plus its answer), in whole blocks, at most floor((n-1)/block) blocks of an
    n-token prompt -- and "oracle_cached_prompts" (the same against earlier prompts only:
    what a prefill rank's cache can hold, as the answer's KV is built on the decode rank)."""
    full = []
    for r in records:
        r["prompt_ids"] = mt_tokenize(port, r["messages"], True)
        full.append(mt_tokenize(port, r["messages"] + [{"role": "assistant", "content": r["text"]}], False))
    for j, r in enumerate(records):
        ids, n = r["prompt_ids"], len(r["prompt_ids"])
        cap = (n - 1) // block * block if n else 0
        prompts = max((common_prefix(ids, records[i]["prompt_ids"]) for i in range(j)), default=0)
        answered = max((common_prefix(ids, full[i]) for i in range(j)
                        if records[i]["arrival_s"] + records[i]["e2e"] <= r["arrival_s"]), default=0)
        r["oracle_cached"] = min(cap, max(prompts, answered) // block * block)
        r["oracle_cached_prompts"] = min(cap, prompts // block * block)


def mt_run(args, build, shape, policy, workload, label):
    """One run on a fresh cluster (its caches empty): warm-up (P requests, not counted),
    metrics before, the workload, metrics after, the oracle. The run's figures."""
    config = json.loads(args.mt_config) if args.mt_config else {}
    config.setdefault("router", {})["policy"] = policy
    P = int(re.fullmatch(r"(\d+)p(\d+)d", shape).group(1))
    log("# %s: %s, router.policy %s%s" % (label, shape, policy, ", config " + args.mt_config if args.mt_config else ""))
    t0 = time.monotonic()
    try:
        server = PdServer(shape, args.model, build, config)
    except RuntimeError as e:
        raise SystemExit("bench_cluster.py: --multiturn: the %s cluster did not start:\n%s" % (shape, e))
    try:
        start_s = time.monotonic() - t0
        # Its own system prompt: the warm-up shares no whole block with the workload
        # (not even the chat template's default system prompt).
        warm = {"kind": "warm-up", "system": "Warm-up.", "history": False,
                "conversations": [{"id": i, "start_s": 0.0, "user": ["Say hello %d." % i],
                                   "max_tokens": [4], "think_s": [0.0]} for i in range(P)]}
        warm_recs = mt_drive(server.port, server.model_name, warm, 300)
        m0 = mt_settled_metrics(server.port, {}, sum(r["prompt_tokens"] or 0 for r in warm_recs))
        t1 = time.monotonic()
        recs = mt_drive(server.port, server.model_name, workload, args.mt_timeout)
        wall = time.monotonic() - t1
        m1 = mt_settled_metrics(server.port, m0, sum(r["prompt_tokens"] or 0 for r in recs))
        mt_oracle(server.port, recs, MT_BLOCK)
        sys_tokens = len(mt_tokenize(server.port, [{"role": "system", "content": workload["system"]}], False)) \
            if workload["system"] else 0
    except BaseException:
        try:
            log("# cluster log (tail):\n" + server.c.logs())
        finally:
            server.stop()
        raise
    server.stop()
    for r in recs:
        r["prompt_ids_len"] = len(r.pop("prompt_ids"))
        del r["messages"]
    per_rank, decode_rank = {}, {}
    for l, v in mt_metric_delta(m0, m1, "pd_rank_requests_total"):
        (per_rank if l.get("role") == "prefill" else decode_rank)[l["rank"]] = v
    tokens = {}
    for l, v in mt_metric_delta(m0, m1, "pd_rank_prompt_tokens_total"):
        tokens.setdefault("%s %s" % (l.get("role"), l.get("rank")), {})[l.get("source", "?")] = v
    decisions = {l.get("reason", "?"): v for l, v in mt_metric_delta(m0, m1, "pd_router_routing_decisions_total")}
    run = {"shape": shape, "policy": policy, "label": label, "prefill_ranks": P, "startup_s": start_s, "wall_s": wall,
           "system_tokens": sys_tokens, "records": recs, "rank_requests": per_rank, "decode_rank_requests": decode_rank,
           "rank_prompt_tokens": tokens, "routing_decisions": decisions}
    run["summary"] = mt_summary(run)
    s = run["summary"]
    ttft = "TTFT turn 1 p50 %s, turns>=2 p50 %s p90 %s s" % (
        fmt(s["ttft_first"]["p50"]), fmt(s["ttft_later"]["p50"]), fmt(s["ttft_later"]["p90"])) if workload["history"] \
        else "TTFT p50 %s p90 %s s" % (fmt(s["ttft_all"]["p50"]), fmt(s["ttft_all"]["p90"]))
    log("  %d requests in %.0f s | %s | cached %s (metrics %s), oracle %s | prefill ranks %s (max share / fair %s)" % (
            len(recs), wall, ttft,
            fmt_frac(s["cached_frac"]), fmt_frac(s["metrics_cached_frac"]), fmt_frac(s["oracle_frac"]),
            ",".join("%s:%d" % kv for kv in sorted(per_rank.items())), fmt(s["max_share_over_fair"])))
    return run


def fmt_frac(x):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else "%.1f%%" % (100 * x)


def mt_summary(run):
    """TTFT p50/p90 of first turns and of later turns (>= 2), cached fractions (measured from
    usage, from the ranks' metrics, the oracles), the per-rank request share."""
    recs = run["records"]
    def q(xs):
        return {"p50": pct(xs, 50), "p90": pct(xs, 90), "n": len(xs)}
    prompt = sum(r["prompt_tokens"] or 0 for r in recs)
    known = [r for r in recs if r["cached_tokens"] is not None]
    s = {"requests": len(recs), "prompt_tokens": prompt,
         "ttft_all": q([r["ttft"] for r in recs if r["ttft"] is not None]),
         "ttft_first": q([r["ttft"] for r in recs if r["turn"] == 1 and r["ttft"] is not None]),
         "ttft_later": q([r["ttft"] for r in recs if r["turn"] >= 2 and r["ttft"] is not None]),
         # Time per output token after the first: what computing follow-ups on decode ranks costs the decodes.
         "tpot": q([(r["e2e"] - r["ttft"]) / (r["completion_tokens"] - 1) for r in recs
                    if r["ttft"] is not None and (r["completion_tokens"] or 0) > 1]),
         "no_content": sum(1 for r in recs if r["ttft"] is None),
         "cached_known": len(known),
         "oracle_frac": sum(r["oracle_cached"] for r in recs) / prompt if prompt else None,
         "oracle_prompts_frac": sum(r["oracle_cached_prompts"] for r in recs) / prompt if prompt else None,
         "prompt_len_mismatch": sum(1 for r in recs if r["prompt_tokens"] != r["prompt_ids_len"])}
    if known:  # measured, and the oracle over the same requests
        kp = sum(r["prompt_tokens"] or 0 for r in known)
        s["cached_frac"] = sum(r["cached_tokens"] for r in known) / kp if kp else None
        for key, field in (("cached_over_oracle", "oracle_cached"), ("cached_over_oracle_prompts", "oracle_cached_prompts")):
            ko = sum(r[field] for r in known) / kp if kp else None
            s[key] = s["cached_frac"] / ko if ko and s["cached_frac"] is not None else None
    else:
        s["cached_frac"] = s["cached_over_oracle"] = s["cached_over_oracle_prompts"] = None
    by_source = {}  # every rank that built prompt KV: prefill ranks, and decode ranks that extended a cached prompt
    for per in run["rank_prompt_tokens"].values():
        for src, v in per.items():
            by_source[src] = by_source.get(src, 0.0) + v
    cached = by_source.get("cached", by_source.get("cache"))
    total = sum(by_source.values())
    s["metrics_cached_frac"] = cached / total if cached is not None and total else None
    counts = list(run["rank_requests"].values())  # a rank never dispatched to has no series: share 0
    n = sum(counts)
    s["max_share_over_fair"] = max(counts) * run["prefill_ranks"] / n if n and counts else None
    return s


def mt_median(xs):
    xs = sorted(x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x)))
    if not xs:
        return None
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def mt_check_shape(shape):
    m = re.fullmatch(r"(\d+)p(\d+)d", shape)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise SystemExit("bench_cluster.py: --mt-shapes: expected shapes like 2p1d (prefill ranks p, decode "
                         "ranks d, at least 1 each), got '%s'" % shape)
    return shape


def multiturn_main(args, command):
    """--multiturn: per shape, the multi-turn workload under each policy, alternated
    (least_work, cache_aware, least_work, ...) for --mt-reps reps, a fresh cluster per run,
    then the uniform check under --mt-uniform-policies; multiturn.json, multiturn.md and a plot."""
    if args.report_only:
        path = os.path.join(args.out, "multiturn.json")
        if not os.path.exists(path):
            raise SystemExit("bench_cluster.py: --multiturn --report-only: no %s (run --multiturn first)" % path)
        with open(path) as f:
            return mt_report(json.load(f), args.out)
    shapes = [mt_check_shape(s) for s in args.mt_shapes.split(",") if s]
    if not shapes:
        raise SystemExit("bench_cluster.py: --mt-shapes: no shape given")
    reps = args.mt_reps if args.mt_reps is not None else (1 if args.quick else 3)
    convs = args.mt_conversations or (4 if args.quick else 6)
    turns = args.mt_turns or (3 if args.quick else 5)
    uniform_policies = [p for p in args.mt_uniform_policies.split(",") if p]
    for p in uniform_policies:
        if p not in MT_POLICIES:
            raise SystemExit("bench_cluster.py: --mt-uniform-policies: unknown policy '%s' (have %s, or '' for "
                             "no uniform check)" % (p, ", ".join(MT_POLICIES)))
    if reps < 1 or convs < 1 or turns < 2:
        raise SystemExit("bench_cluster.py: --multiturn: need --mt-reps >= 1, --mt-conversations >= 1, --mt-turns >= 2")
    if not os.path.exists(args.model):
        raise SystemExit("bench_cluster.py: --model: no such file '%s' (scripts/fetch_model.sh)" % args.model)
    build = os.path.abspath(args.build)
    for exe in ("router/pd-router", "prefill_node/pd-prefill", "decode_node/pd-decode"):
        if not os.access(os.path.join(build, exe), os.X_OK):
            raise SystemExit("bench_cluster.py: --build: no %s under '%s' (build first, see README)" % (exe, build))
    if not shutil.which("mpirun"):
        raise SystemExit("bench_cluster.py: --multiturn: mpirun not found (apt-get install openmpi-bin)")
    os.makedirs(args.out, exist_ok=True)
    log("# " + command)
    workload = make_multiturn(convs, turns, args.seed, args.quick)
    uniform = make_uniform(convs, turns, args.seed, args.quick)
    results = {"command": command, "config": args.mt_config, "block_size": MT_BLOCK,
               "workload": {"conversations": convs, "turns": turns, "seed": args.seed, "quick": args.quick,
                            "system_words": len(workload["system"].split()),
                            "max_tokens": [c["max_tokens"] for c in workload["conversations"]],
                            "start_s": [c["start_s"] for c in workload["conversations"]]},
               "shapes": shapes, "reps": reps, "runs": [], "uniform": []}
    path = os.path.join(args.out, "multiturn.json")

    def save_json():  # after every run: a failure later keeps what was measured
        with open(path, "w") as f:
            json.dump(results, f)
    for shape in shapes:
        for rep in range(reps):
            for policy in MT_POLICIES:
                run = mt_run(args, build, shape, policy, workload, "rep %d/%d" % (rep + 1, reps))
                run["rep"] = rep
                results["runs"].append(run)
                save_json()
        for policy in uniform_policies:
            results["uniform"].append(mt_run(args, build, shape, policy, uniform, "uniform check"))
            save_json()
    return mt_report(results, args.out)


def mt_report(results, out_dir):
    md = "Command: `%s`\n\n" % results["command"] + mt_tables(results)
    with open(os.path.join(out_dir, "multiturn.md"), "w") as f:
        f.write(md)
    print(md)
    written = ["multiturn.json", "multiturn.md"]
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:  # optional: the bench venv has it
        log("# matplotlib not available: no plot (the bench venv has it: scripts/requirements-bench.txt)")
    else:
        written.append(os.path.basename(mt_plot(results, out_dir)))
    log("# wrote %s: %s" % (out_dir, ", ".join(written)))
    return 0


def mt_tables(results):
    runs, shapes = results["runs"], results["shapes"]
    w = results["workload"]
    lines = ["### Multi-turn chat: cache-aware vs least-work routing\n"]
    first = runs[0] if runs else None
    sys_tok = first.get("system_tokens") if first else None
    recs = first["records"] if first else []
    turn_len = lambda k: mt_median([r["prompt_tokens"] for r in recs if r["turn"] == k])  # noqa: E731
    lines.append("%d conversations x %d turns (seed %d), run concurrently with staggered starts; each turn sends the "
                 "whole history (a shared system prompt of %s tokens, the earlier user and assistant messages as "
                 "the server answered them) plus a new user message; greedy, max_tokens %d-%d; prompt tokens "
                 "median: turn 1 %s, turn %d %s. A fresh cluster per run (caches empty), one warm-up request per "
                 "prefill rank not counted; the policies alternate run by run. TTFT: first content token.\n" % (
                     w["conversations"], w["turns"], w["seed"], sys_tok if sys_tok is not None else "?",
                     min(min(m) for m in w["max_tokens"]), max(max(m) for m in w["max_tokens"]),
                     fmt_int(turn_len(1)), w["turns"], fmt_int(turn_len(w["turns"]))))
    if results.get("config"):
        lines.append("Cluster configuration added to every run (--mt-config): `%s`.\n" % results["config"])
    lines.append("Cached = prompt tokens served from a prefix cache over all prompt tokens: measured from "
                 "`usage.prompt_tokens_details.cached_tokens` (n/a: not reported) and from the prefill ranks' "
                 "`pd_rank_prompt_tokens_total` (all ranks); oracle = per request the longest prefix (whole %d-token "
                 "blocks, never the whole prompt) shared with an earlier prompt or an earlier finished request's "
                 "messages plus its answer; `prompts only` = shared with earlier prompts alone (what prefill ranks' "
                 "caches can hold: an answer's KV exists only on the decode rank that generated it). Median over "
                 "reps; per-rep values in brackets.\n" % results["block_size"])
    lines.append("| shape | policy | TTFT turn 1 p50 / p90 (s) | TTFT turns >= 2 p50 (s) [per rep] | "
                 "TTFT turns >= 2 p90 (s) [per rep] | TPOT p50 / p90 (ms) | cached: usage | cached: rank metrics | oracle | "
                 "oracle, prompts only | usage / oracle, / prompts only | prefill requests per rank (all reps) | max share / fair |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def med(rs, f):
        return mt_median([f(r["summary"]) for r in rs])
    for shape in shapes:
        for policy in MT_POLICIES:
            rs = [r for r in runs if r["shape"] == shape and r["policy"] == policy]
            if not rs:
                continue
            ranks = {}
            for r in rs:
                for k, v in r["rank_requests"].items():
                    ranks[k] = ranks.get(k, 0) + v
            lines.append("| %s | %s | %s / %s | %s [%s] | %s [%s] | %s / %s | %s | %s | %s | %s | %s | %s | %s |" % (
                shape, policy, fmt(med(rs, lambda s: s["ttft_first"]["p50"])), fmt(med(rs, lambda s: s["ttft_first"]["p90"])),
                fmt(med(rs, lambda s: s["ttft_later"]["p50"])), ", ".join(fmt(r["summary"]["ttft_later"]["p50"]) for r in rs),
                fmt(med(rs, lambda s: s["ttft_later"]["p90"])), ", ".join(fmt(r["summary"]["ttft_later"]["p90"]) for r in rs),
                fmt(med(rs, lambda s: s.get("tpot", {}).get("p50")), "ms"), fmt(med(rs, lambda s: s.get("tpot", {}).get("p90")), "ms"),
                fmt_frac(med(rs, lambda s: s["cached_frac"])), fmt_frac(med(rs, lambda s: s["metrics_cached_frac"])),
                fmt_frac(med(rs, lambda s: s["oracle_frac"])), fmt_frac(med(rs, lambda s: s["oracle_prompts_frac"])),
                "%s / %s" % (fmt_ratio(med(rs, lambda s: s["cached_over_oracle"])),
                             fmt_ratio(med(rs, lambda s: s.get("cached_over_oracle_prompts")))),
                " ".join("r%s:%d" % (k, v) for k, v in sorted(ranks.items(), key=lambda kv: int(kv[0]))) or "-",
                fmt(med(rs, lambda s: s["max_share_over_fair"]))))
    lines.append("\n#### least_work / cache_aware, later turns (> 1 = cache-aware faster)\n")
    lines.append("| shape | TTFT p50 ratio (of medians) | TTFT p90 ratio (of medians) | p50 ratio per rep | p90 ratio per rep |")
    lines.append("|---|---|---|---|---|")
    for shape in shapes:
        a = [r for r in runs if r["shape"] == shape and r["policy"] == "least_work"]
        b = [r for r in runs if r["shape"] == shape and r["policy"] == "cache_aware"]
        if not a or not b:
            continue

        def ratio(x, y):
            return x / y if x is not None and y and not math.isnan(x) and not math.isnan(y) else None
        cells = []
        for q in ("p50", "p90"):
            cells.append(fmt(ratio(mt_median([r["summary"]["ttft_later"][q] for r in a]),
                                   mt_median([r["summary"]["ttft_later"][q] for r in b]))))
        for q in ("p50", "p90"):
            cells.append(", ".join(fmt(ratio(x["summary"]["ttft_later"][q], y["summary"]["ttft_later"][q]))
                                   for x, y in zip(a, b)))
        lines.append("| %s | %s |" % (shape, " | ".join(cells)))
    if results["uniform"]:
        lines.append("\n#### Uniform check: requests that share nothing (distinct single-turn prompts, no system "
                     "prompt; the chat template's default system prompt is still common to all), same concurrency\n")
        lines.append("| shape | policy | requests | TTFT p50 / p90 (s) | oracle cached | prefill requests per rank | "
                     "max share / fair |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in results["uniform"]:
            s = r["summary"]
            lines.append("| %s | %s | %d | %s / %s | %s | %s | %s |" % (
                r["shape"], r["policy"], s["requests"], fmt(s["ttft_all"]["p50"]), fmt(s["ttft_all"]["p90"]),
                fmt_frac(s["oracle_frac"]),
                " ".join("r%s:%d" % (k, v) for k, v in sorted(r["rank_requests"].items(), key=lambda kv: int(kv[0]))),
                fmt(s["max_share_over_fair"])))
    decided = [r for r in runs + results["uniform"] if r["routing_decisions"]]
    if decided:
        lines.append("\n#### The router's routing decisions (pd_router_routing_decisions_total, per run)\n")
        lines.append("| shape | policy | run | decisions by reason |")
        lines.append("|---|---|---|---|")
        for r in decided:
            lines.append("| %s | %s | %s | %s |" % (r["shape"], r["policy"], r["label"], ", ".join(
                "%s %d" % kv for kv in sorted(r["routing_decisions"].items()))))
    issues = [(r, r["summary"]) for r in runs + results["uniform"]
              if r["summary"]["no_content"] or r["summary"]["prompt_len_mismatch"]]
    for r, s in issues:
        lines.append("\nNote (%s, %s, %s): %d answers without content (no TTFT), %d requests whose usage.prompt_tokens "
                     "differs from /tokenize's count." % (r["shape"], r["policy"], r["label"], s["no_content"],
                                                          s["prompt_len_mismatch"]))
    return "\n".join(lines) + "\n"


def fmt_ratio(x):
    return "n/a" if x is None else "%.2f" % x


def fmt_int(x):
    return "-" if x is None else "%d" % round(x)


def mt_plot(results, out_dir):
    """CDFs of later-turn TTFT (turns >= 2, all reps pooled) per policy, a panel per shape."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 8})
    shapes = results["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.6 * len(shapes), 3.0), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for policy, color in zip(MT_POLICIES, ("tab:blue", "tab:orange")):
            xs = sorted(rec["ttft"] for r in results["runs"] if r["shape"] == shape and r["policy"] == policy
                        for rec in r["records"] if rec["turn"] >= 2 and rec["ttft"] is not None)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label="%s (%d)" % (policy, len(xs)), color=color)
        ax.set(title="%s: TTFT of turns >= 2" % shape, xlabel="TTFT (s)", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    if results.get("config"):
        fig.suptitle("config: " + results["config"], fontsize=8)
    fig.tight_layout()
    return save(fig, out_dir, "multiturn_ttft_later.png")


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
    ap.add_argument("--cluster-config", default="",
                    help='JSON merged into every pdcluster run\'s cluster.json, e.g. \'{"decode": {"speculate": 8}}\'')
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (goodput)")
    ap.add_argument("--tpot-slo", type=float, default=0.15, help="seconds per output token (goodput)")
    ap.add_argument("--llamacpp-slots", type=int, default=8, help="llama-server -np")
    ap.add_argument("--llamacpp-slot-ctx", type=int, default=0,
                    help="tokens per llama-server slot (-c = slots x this); default: the longest request of the workload")
    ap.add_argument("--llamacpp-args", default="-fa --poll 0",
                    help="more llama-server flags (default: flash attention, no busy-polling threads)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="build jobs for llama.cpp")
    mt = ap.add_argument_group("multi-turn chat: cache-aware vs least-work routing (--multiturn)")
    mt.add_argument("--multiturn", action="store_true",
                    help="only the multi-turn comparison (standard library; matplotlib for the plot if present)")
    mt.add_argument("--mt-shapes", default="2p1d", help="comma-separated cluster shapes, e.g. 2p1d,2p2d")
    mt.add_argument("--mt-reps", type=int, default=None, help="runs per policy and shape (default 3; --quick 1)")
    mt.add_argument("--mt-conversations", type=int, default=0, help="concurrent conversations (default 6; --quick 4)")
    mt.add_argument("--mt-turns", type=int, default=0, help="turns per conversation (default 5; --quick 3)")
    mt.add_argument("--mt-timeout", type=int, default=900, help="seconds a run may take before it fails")
    mt.add_argument("--mt-config", default="",
                    help="cluster configuration (JSON) added to every run, e.g. '{\"decode\": {\"step_tokens\": 512}}'")
    mt.add_argument("--mt-uniform-policies", default="least_work,cache_aware",
                    help="policies the uniform check (requests sharing nothing) runs under, per shape; "
                         "'' skips it (least_work is the reference for cache_aware's rank shares)")
    args = ap.parse_args()
    try:
        if args.cluster_config and not isinstance(json.loads(args.cluster_config), dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise SystemExit("bench_cluster.py: --cluster-config: %s" % e)

    if args.multiturn:
        # No AIPerf needed: the bench venv only for matplotlib, where it already exists.
        venv = os.path.realpath(args.venv)
        py = os.path.join(venv, "bin", "python")
        if os.path.realpath(sys.prefix) != venv and os.access(py, os.X_OK):
            os.execv(py, [py, os.path.abspath(__file__)] + sys.argv[1:])
        return multiturn_main(args, " ".join(["scripts/bench_cluster.py"] + sys.argv[1:]))

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
            return PdServer(c, args.model, build, json.loads(args.cluster_config) if args.cluster_config else None)
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
