#!/usr/bin/env python3
"""Serving benchmark: disaggregated vs colocated, measured the way serving papers do.

Starts each cluster configuration in turn (deploy/launch.sh, same model, same machine),
sends the same Poisson stream of streaming completion requests to each, and reports
per configuration: TTFT (time to first token), TPOT (time per output token after the
first), end-to-end latency (p50/p90/p99), throughput, and goodput (requests/s meeting
both the TTFT and the TPOT SLO) — then the ratio of each configuration to the first.

    scripts/bench_serving.py --configs 1p1d,colocated2 --requests 40 --rate 0.5 \\
        --prompt-words 200 --max-tokens 32 --ttft-slo 5 --tpot-slo 0.3

Configurations: "<P>p<D>d" (disaggregated; "<P>p<D>d+elastic" started to accept joining
pools, to price that) or "colocated<N>". Requests use ignore_eos and
a fixed max_tokens so every configuration generates the same number of tokens; prompts
are drawn from a fixed word list with lengths uniform in [prompt-words/2, prompt-words]
(seeded). Prints the exact command first. Needs a built tree and the model."""
import argparse
import concurrent.futures
import json
import os
import random
import re
import statistics
import tempfile
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "cluster"))
from cluster import DEFAULT_MODEL, Cluster  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain city music science history language "
         "system program question night water room mother area money story month lot right study book").split()


def parse_config(s):
    m = re.fullmatch(r"(\d+)p(\d+)d(\+elastic)?", s)
    if m:
        spec = {"prefill": int(m.group(1)), "decode": int(m.group(2))}
        if m.group(3):  # accepting joining pools: MPI_THREAD_MULTIPLE and an accept thread per rank
            spec["launch_args"] = ["--join-file", os.path.join(tempfile.mkdtemp(prefix="pd-bench-"), "join")]
        return spec
    m = re.fullmatch(r"colocated(\d+)", s)
    if m:
        return {"colocated": int(m.group(1))}
    raise SystemExit("bench_serving.py: --configs: '%s' is neither <P>p<D>d[+elastic] nor colocated<N>" % s)


def one_request(c, prompt, max_tokens):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = c.conn(timeout=600)
    t0 = time.monotonic()
    ttft, tokens, ok = None, 0, False
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return {"ok": False, "status": r.status}
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                ok = True
                break
            ev = json.loads(payload)
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            elif ttft is None and ev.get("choices"):
                ttft = time.monotonic() - t0
    finally:
        conn.close()
    e2e = time.monotonic() - t0
    if not ok or ttft is None:
        return {"ok": False}
    tpot = (e2e - ttft) / max(1, tokens - 1)
    return {"ok": True, "ttft": ttft, "tpot": tpot, "e2e": e2e, "tokens": tokens}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))] if xs else float("nan")


def run_config(name, spec, args, prompts, arrivals):
    with Cluster(model=args.model, threads=args.threads, **spec) as c:
        one_request(c, "warm up", 4)
        results = [None] * len(prompts)
        t_start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            futs = {}
            for i, (p, at) in enumerate(zip(prompts, arrivals)):
                delay = at - (time.monotonic() - t_start)
                if delay > 0:
                    time.sleep(delay)
                futs[pool.submit(one_request, c, p, args.max_tokens)] = i
            for f in concurrent.futures.as_completed(futs):
                results[futs[f]] = f.result()
        wall = time.monotonic() - t_start
        c.stop()
    good = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in good]
    tpot = [r["tpot"] for r in good]
    e2e = [r["e2e"] for r in good]
    meets = [r for r in good if r["ttft"] <= args.ttft_slo and r["tpot"] <= args.tpot_slo]
    return {"config": name, "ok": len(good), "failed": len(results) - len(good), "wall_s": wall,
            "throughput_tok_s": sum(r["tokens"] for r in good) / wall, "goodput_req_s": len(meets) / wall,
            "slo_attainment": len(meets) / len(results),
            "ttft": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99), "mean": statistics.fmean(ttft) if ttft else float("nan")},
            "tpot": {"p50": pct(tpot, 50), "p90": pct(tpot, 90), "p99": pct(tpot, 99), "mean": statistics.fmean(tpot) if tpot else float("nan")},
            "e2e": {"p50": pct(e2e, 50), "p90": pct(e2e, 90), "p99": pct(e2e, 99)}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="1p1d,colocated2")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=0.5, help="Poisson arrival rate, requests/s")
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ttft-slo", type=float, default=5.0, help="seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.3, help="seconds per output token")
    ap.add_argument("--threads", type=int, default=1, help="compute threads per worker rank")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if not os.path.exists(args.model):
        raise SystemExit("bench_serving.py: --model: no such file '%s' (scripts/fetch_model.sh)" % args.model)
    if args.requests < 1 or args.rate <= 0 or args.max_tokens < 2:
        raise SystemExit("bench_serving.py: need --requests >= 1, --rate > 0, --max-tokens >= 2")
    print("# " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]), flush=True)
    rng = random.Random(args.seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(args.prompt_words // 2, args.prompt_words)))
               for _ in range(args.requests)]
    t, arrivals = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        arrivals.append(t)
    rows = []
    for name in args.configs.split(","):
        r = run_config(name, parse_config(name), args, prompts, arrivals)
        rows.append(r)
        print("%-12s ok %3d failed %2d | TTFT p50 %6.2f p90 %6.2f p99 %6.2f s | TPOT p50 %6.3f p90 %6.3f s | "
              "e2e p50 %6.2f s | %6.1f tok/s | goodput %.3f req/s (%.0f%% within SLO)"
              % (name, r["ok"], r["failed"], r["ttft"]["p50"], r["ttft"]["p90"], r["ttft"]["p99"], r["tpot"]["p50"],
                 r["tpot"]["p90"], r["e2e"]["p50"], r["throughput_tok_s"], r["goodput_req_s"],
                 100 * r["slo_attainment"]), flush=True)
    base = rows[0]
    for r in rows[1:]:
        print("%s vs %s: TTFT p50 x%.2f, TPOT p50 x%.2f, throughput x%.2f, goodput x%.2f"
              % (r["config"], base["config"], r["ttft"]["p50"] / base["ttft"]["p50"],
                 r["tpot"]["p50"] / base["tpot"]["p50"], r["throughput_tok_s"] / base["throughput_tok_s"],
                 (r["goodput_req_s"] / base["goodput_req_s"]) if base["goodput_req_s"] else float("nan")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
