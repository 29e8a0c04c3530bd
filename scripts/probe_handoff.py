#!/usr/bin/env python3
"""Probes a running cluster for what the KV handoff costs a user.

  deploy/launch.sh --prefill 1 --decode 1 &            # the cluster under test
  scripts/probe_handoff.py --url http://127.0.0.1:8000 --words 1000 --reps 3
  scripts/probe_handoff.py --probe mixed --layouts 1p1d,colocated2 --words 3000 --reps 3   # starts each layout itself

lone: one streaming request with a prompt of about --tokens tokens, alone on the
  cluster, --max-tokens greedy tokens. Reports TTFT, the token 1 -> token 2 gap
  (where the handoff shows: token 1 comes from the prefill rank, token 2 from
  the decode rank once the KV has landed), the median later gap (a normal decode
  step), and the cluster's own per-handoff figures from /metrics: the hidden
  ratio (bytes sent before the prompt's last layer was computed) and the exposed
  transfer time.
burst: one long prompt, then --short short prompts --delay seconds later: each
  short one's TTFT (what a long pass does to the prompts behind it).
mixed: --running streams decoding, then one long prompt, then --short short
  prompts --delay seconds later (what a long prompt's prefill and KV do to the
  requests around it). Reports each short prompt's TTFT and token 1 -> token 2
  gap, the running streams' worst gap while the long prompt and the short ones
  are served, the decode step (the running streams' median gap meanwhile, and
  before the long prompt came), the long prompt's TTFT, and the cluster's
  per-request transfer-wait and decode-wait figures from /metrics.

--layouts starts each named cluster in turn with deploy/launch.sh (--threads
per rank, on --port), waits for /health, runs the probe, and stops it.

Standard library only; prints one JSON object per rep and a summary.
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {"1p1d": ["--prefill", "1", "--decode", "1"], "colocated2": ["--colocated", "2"]}

WORDS = ("river stone lantern quiet harbor maple copper violet meadow thunder silver orchard canyon velvet "
         "ember glacier willow saffron compass falcon prism marble cedar tide beacon juniper lattice quartz "
         "amber fable mosaic nimbus onyx pepper quiver raven sable tundra umber vertex walnut yonder zephyr").split()


def prompt_of(n_words, salt):
    # Distinct per rep (salt) so the prefix cache cannot serve it.
    return " ".join(WORDS[(i * 7 + salt * 13 + i // len(WORDS)) % len(WORDS)] for i in range(n_words))


def post(url, body, timeout=600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def count_tokens(base, text):
    with post(base + "/tokenize", {"prompt": text}) as r:
        return len(json.load(r)["tokens"])


def stream(base, prompt, max_tokens, t0=None, stop=None):
    """Token arrival times (seconds from t0, default the request's start) of a greedy streaming
    completion; it hangs up (cancelling the request) once `stop` is set."""
    t0 = time.monotonic() if t0 is None else t0
    times = []
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    with post(base + "/v1/completions", body) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                times.append(time.monotonic() - t0)
            if stop is not None and stop.is_set():
                break
    return times


# Per-request figures the cluster keeps (docs/METRICS.md): (metric, label filter) -> a name here.
WAIT_METRICS = {
    "transfer_wait": ("pd_stage_seconds", 'stage="transfer"'),        # token 1 out -> its KV's last byte sent
    "decode_wait": ("pd_stage_seconds", 'stage="decode_queue"'),      # KV complete -> its first decode step
    "first_itl": ("pd_first_inter_token_seconds", ""),                # token 1 -> token 2 at the router
}


def metrics(base, names=("pd_kv_transfer_hidden_ratio", "pd_kv_transfer_seconds")):
    """{name: (sum, count)} of histograms in /metrics (labels summed)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for name in names:
        sums = [float(v) for v in re.findall(rf"^{name}_sum(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)]
        counts = [float(v) for v in re.findall(rf"^{name}_count(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)]
        out[name] = (sum(sums), sum(counts))
    return out


def wait_figures(base):
    """{short name: (sum, count)} of WAIT_METRICS."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for key, (name, label) in WAIT_METRICS.items():
        sel = r"\{" + re.escape(label) + r"\}" if label else r"(?:\{\})?"
        s = re.search(rf"^{name}_sum{sel} ([0-9.eE+-]+)$", text, re.M)
        c = re.search(rf"^{name}_count{sel} ([0-9.eE+-]+)$", text, re.M)
        out[key] = (float(s.group(1)) if s else 0.0, float(c.group(1)) if c else 0.0)
    return out


def lone(args):
    rows = []
    for rep in range(args.reps):
        text = prompt_of(args.words, rep + args.seed)
        n = count_tokens(args.url, text)
        before = metrics(args.url)
        times = stream(args.url, text, args.max_tokens)
        time.sleep(0.5)  # the handoff's stats reach the router after its last byte
        after = metrics(args.url)
        d = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}
        gaps = [b - a for a, b in zip(times, times[1:])]
        row = {
            "prompt_tokens": n,
            "ttft_s": round(times[0], 4),
            "gap_1_2_s": round(gaps[0], 4),
            "median_later_gap_s": round(statistics.median(gaps[1:]), 4),
            "hidden_ratio": round(d["pd_kv_transfer_hidden_ratio"][0] / d["pd_kv_transfer_hidden_ratio"][1], 4)
            if d["pd_kv_transfer_hidden_ratio"][1] else None,
            "exposed_s": round(d["pd_kv_transfer_seconds"][0] / d["pd_kv_transfer_seconds"][1], 4)
            if d["pd_kv_transfer_seconds"][1] else None,
        }
        row["gap_1_2_over_step"] = round(row["gap_1_2_s"] / row["median_later_gap_s"], 2)
        print(json.dumps({"probe": "lone", "rep": rep, **row}), flush=True)
        rows.append(row)
    print(json.dumps({"probe": "lone", "summary": {
        k: statistics.median([r[k] for r in rows if r[k] is not None] or [0])
        for k in ("prompt_tokens", "ttft_s", "gap_1_2_s", "median_later_gap_s", "gap_1_2_over_step", "hidden_ratio",
                  "exposed_s")}}), flush=True)


def burst(args):
    for rep in range(args.reps):
        long_text = prompt_of(args.words, 100 + rep + args.seed)
        results = {}

        def run(key, text, max_tokens):
            results[key] = stream(args.url, text, max_tokens)

        threads = [threading.Thread(target=run, args=("long", long_text, 4))]
        threads[0].start()
        time.sleep(args.delay)
        for i in range(args.short):
            t = threading.Thread(target=run, args=(f"short{i}", prompt_of(48, 1000 * rep + i + args.seed), 4))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        shorts = [results[f"short{i}"][0] for i in range(args.short)]
        print(json.dumps({"probe": "burst", "rep": rep, "long_ttft_s": round(results["long"][0], 3),
                          "short_ttft_s": [round(x, 3) for x in shorts]}), flush=True)


def mixed(args):
    rows = []
    for rep in range(args.reps):
        before = wait_figures(args.url)
        stop = threading.Event()
        results = {}
        t0 = time.monotonic()

        def run(key, text, max_tokens, hang_up):
            results[key] = stream(args.url, text, max_tokens, t0, stop if hang_up else None)

        threads = []
        for i in range(args.running):
            t = threading.Thread(target=run, args=(f"run{i}", prompt_of(32, 500 * rep + i + args.seed), 4000, True))
            t.start()
            threads.append(t)
        time.sleep(args.warmup)
        long_at = time.monotonic() - t0
        t = threading.Thread(target=run, args=("long", prompt_of(args.words, 100 + rep + args.seed), 4, False))
        t.start()
        threads.append(t)
        time.sleep(args.delay)
        shorts = []
        for i in range(args.short):
            t = threading.Thread(target=run, args=(f"short{i}", prompt_of(48, 1000 * rep + i + args.seed),
                                                   args.max_tokens, False))
            t.start()
            shorts.append(t)
        for t in shorts + [threads[-1]]:
            t.join()
        end_at = time.monotonic() - t0
        stop.set()
        for t in threads:
            t.join()
        time.sleep(0.5)  # the last requests' figures reach the router
        after = wait_figures(args.url)

        def gaps(ts):
            return [b - a for a, b in zip(ts, ts[1:])]

        # A decode step: the running streams' median gap while the long prompt and the
        # short ones are served (the conditions the short prompts' gaps are measured in).
        step = statistics.median(
            g for i in range(args.running) for a, g in zip(results[f"run{i}"], gaps(results[f"run{i}"]))
            if long_at < a < end_at)
        idle_step = statistics.median(
            g for i in range(args.running) for a, g in zip(results[f"run{i}"], gaps(results[f"run{i}"])) if a < long_at)
        running_worst = max(
            (b - a for i in range(args.running) for a, b in zip(results[f"run{i}"], results[f"run{i}"][1:])
             if b > long_at and a < end_at), default=0.0)
        short_start = long_at + args.delay
        row = {
            "decode_step_s": round(step, 4),
            "decode_step_alone_s": round(idle_step, 4),
            "long_ttft_s": round(results["long"][0] - long_at, 3),
            "short_ttft_s": [round(results[f"short{i}"][0] - short_start, 3) for i in range(args.short)],
            "short_gap_1_2_s": [round(gaps(results[f"short{i}"])[0], 4) for i in range(args.short)],
            "short_worst_gap_s": round(max(max(gaps(results[f"short{i}"])) for i in range(args.short)), 4),
            "running_worst_gap_s": round(running_worst, 3),
        }
        row["short_gap_1_2_over_step"] = round(max(row["short_gap_1_2_s"]) / step, 2)
        for key in WAIT_METRICS:  # means over this rep's requests (None: none observed, e.g. colocated)
            n = after[key][1] - before[key][1]
            row["mean_" + key + "_s"] = round((after[key][0] - before[key][0]) / n, 4) if n else None
        print(json.dumps({"probe": "mixed", "rep": rep, **row}), flush=True)
        rows.append(row)
    print(json.dumps({"probe": "mixed", "summary": {
        "short_ttft_max_s": max(max(r["short_ttft_s"]) for r in rows),
        "short_gap_1_2_max_s": max(max(r["short_gap_1_2_s"]) for r in rows),
        "short_gap_1_2_max_over_step": max(r["short_gap_1_2_over_step"] for r in rows),
        "running_worst_gap_max_s": max(r["running_worst_gap_s"] for r in rows),
        "long_ttft_median_s": statistics.median(r["long_ttft_s"] for r in rows)}}), flush=True)


def healthy(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return json.load(r).get("status") == "ok"
    except (OSError, ValueError):
        return False


def with_layout(name, args, probe):
    """Starts layout `name` on --port, runs probe(args) against it, stops it."""
    cmd = [os.path.join(ROOT, "deploy", "launch.sh"), *LAYOUTS[name], "--threads", str(args.threads),
           "--port", str(args.port), "--build", args.build]
    print(json.dumps({"layout": name, "command": " ".join(cmd[1:])}), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = "http://127.0.0.1:%d" % args.port
        deadline = time.monotonic() + 300
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("probe_handoff.py: layout %s did not come up on port %d" % (name, args.port))
            time.sleep(1)
        args.url = url
        probe(args)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # launch.sh drains the cluster
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--probe", choices=["lone", "burst", "mixed"], default="lone")
    ap.add_argument("--words", type=int, default=1000, help="prompt length in words (~2 tokens each here)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--short", type=int, default=4, help="burst: short prompts after the long one")
    ap.add_argument("--delay", type=float, default=1.0, help="burst: seconds between the long and the short prompts")
    ap.add_argument("--running", type=int, default=3, help="mixed: streams decoding before the long prompt comes")
    ap.add_argument("--warmup", type=float, default=2.0, help="mixed: seconds the running streams decode alone")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", default="", help="comma-separated: " + ", ".join(LAYOUTS) +
                    " (start each in turn; default: probe --url as it is)")
    ap.add_argument("--threads", type=int, default=1, help="--layouts: threads per rank")
    ap.add_argument("--port", type=int, default=8123, help="--layouts: the router's port")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"),
                    help="--layouts: the build whose binaries run (another commit's, to compare)")
    args = ap.parse_args()
    probe = {"lone": lone, "burst": burst, "mixed": mixed}[args.probe]
    layouts = [x for x in args.layouts.split(",") if x]
    for name in layouts:
        if name not in LAYOUTS:
            ap.error("--layouts: unknown layout %r (known: %s)" % (name, ", ".join(LAYOUTS)))
    if not layouts:
        probe(args)
    for name in layouts:
        with_layout(name, args, probe)


if __name__ == "__main__":
    sys.exit(main())
