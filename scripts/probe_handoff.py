#!/usr/bin/env python3
"""Probes a running cluster for what the KV handoff costs a user.

  deploy/launch.sh --prefill 1 --decode 1 &            # the cluster under test
  scripts/probe_handoff.py --url http://127.0.0.1:8000 --tokens 2000 --reps 3

lone: one streaming request with a prompt of about --tokens tokens, alone on the
  cluster, --max-tokens greedy tokens. Reports TTFT, the token 1 -> token 2 gap
  (where the handoff shows: token 1 comes from the prefill rank, token 2 from
  the decode rank once the KV has landed), the median later gap (a normal decode
  step), and the cluster's own per-handoff figures from /metrics: the hidden
  ratio (bytes sent before the prompt's last layer was computed) and the exposed
  transfer time.
burst: one long prompt, then --short short prompts --delay seconds later: each
  short one's TTFT (what a long pass does to the prompts behind it).

Standard library only; prints one JSON object per rep and a summary.
"""
import argparse
import json
import re
import statistics
import sys
import threading
import time
import urllib.request

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


def stream(base, prompt, max_tokens):
    """Token arrival times (seconds from the request's start) of a greedy streaming completion."""
    t0 = time.monotonic()
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
    return times


def metrics(base):
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for name in ("pd_kv_transfer_hidden_ratio", "pd_kv_transfer_seconds"):
        s = re.search(rf"^{name}_sum(?:{{}})? ([0-9.eE+-]+)$", text, re.M)
        c = re.search(rf"^{name}_count(?:{{}})? ([0-9.eE+-]+)$", text, re.M)
        out[name] = (float(s.group(1)) if s else 0.0, float(c.group(1)) if c else 0.0)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--probe", choices=["lone", "burst"], default="lone")
    ap.add_argument("--words", type=int, default=1000, help="prompt length in words (~2 tokens each here)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--short", type=int, default=4, help="burst: short prompts after the long one")
    ap.add_argument("--delay", type=float, default=1.0, help="burst: seconds between the long and the short prompts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    (lone if args.probe == "lone" else burst)(args)


if __name__ == "__main__":
    sys.exit(main())
