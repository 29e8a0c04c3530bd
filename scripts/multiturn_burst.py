#!/usr/bin/env python3
"""Bursts of chat follow-ups on a 2 prefill + 1 decode cluster: where they go and how long
their first tokens take.

    scripts/multiturn_burst.py [--build build] [--model FILE] [--runs 1:2048:cache_aware ...]

Each run (WARM:BUDGET:POLICY = router.warm_prefill 0/1, prefill.token_budget,
router.policy) starts a fresh cluster and plays the multi-turn benchmark's first six
conversations (scripts/bench_cluster.py --multiturn: the shared system prompt, the same
user messages): turn 1 of each sent alone, one after another, then turns 2 and 3 each
sent as one burst (all six at once, 2 s apart). It prints each burst's TTFTs (sorted),
their median, the prompt tokens each computed, the routing decisions and per-rank
requests the burst added to /metrics, and the CPU seconds each rank used from the burst's
start until its last answer ended (against that wall time: a rank at 1.0 x the wall time
had a core to itself and used all of it). Where the benchmark's staggered turns are noisy
(think times and starts spread them), a burst shows how the router and the ranks share
simultaneous follow-ups."""
import argparse
import os
import sys
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))


def cpu_seconds(ranks):
    """{rank: user + system CPU seconds} of the ranks' processes ({rank: (role, pid)})."""
    out = {}
    for rank, (_, pid) in ranks.items():
        try:
            with open("/proc/%d/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[rank] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def run(bc, build, model, warm, budget, policy):
    workload = bc.make_multiturn(6, 3, 1, False)
    system = [{"role": "system", "content": workload["system"]}]
    config = {"router": {"policy": policy, "warm_prefill": warm}, "prefill": {"token_budget": budget}}
    server = bc.PdServer("2p1d", model, build, config)
    history = [list(system) for _ in workload["conversations"]]
    ranks = server.c.rank_pids()
    try:
        for turn in range(3):
            m0 = bc.mt_metrics(server.port)
            cpu0, t0 = cpu_seconds(ranks), time.monotonic()
            recs = [None] * len(history)

            def one(i):
                msgs = history[i] + [{"role": "user", "content": workload["conversations"][i]["user"][turn]}]
                recs[i] = bc.mt_chat(server.port, server.model_name, msgs, 50, time.monotonic() + 300)
                recs[i]["messages"] = msgs

            if turn == 0:
                for i in range(len(history)):
                    one(i)
            else:
                threads = [threading.Thread(target=one, args=(i,)) for i in range(len(history))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            wall, cpu1 = time.monotonic() - t0, cpu_seconds(ranks)
            time.sleep(2.0)  # warm-ups done, metrics settled
            m1 = bc.mt_metrics(server.port)
            for i, r in enumerate(recs):
                history[i] = r["messages"] + [{"role": "assistant", "content": r["text"]}]
            if turn == 0:
                continue
            ttfts = sorted(r["ttft"] for r in recs)
            added = {"%s%s" % (k[0].replace("pd_", ""), dict(k[1])): int(m1[k] - m0.get(k, 0)) for k in m1
                     if m1[k] - m0.get(k, 0) and k[0] != "pd_rank_prompt_tokens_total"}
            print("warm_prefill=%d token_budget=%d %s, burst of turn %d: TTFT %s s, median %.2f s; computed %s"
                  % (warm, budget, policy, turn + 1, " ".join("%.2f" % x for x in ttfts),
                     (ttfts[2] + ttfts[3]) / 2, [r["prompt_tokens"] - r["cached_tokens"] for r in recs]))
            print("    " + ", ".join("%s %d" % kv for kv in sorted(added.items())))
            print("    CPU seconds in the burst's %.2f s: %s" % (wall, ", ".join(
                "%s %d %.2f" % (ranks[r][0], r, cpu1[r] - cpu0[r]) for r in sorted(cpu1) if r in cpu0)))
    finally:
        server.c.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--runs", nargs="+", default=["0:2048:cache_aware", "1:2048:cache_aware"],
                    help="WARM:BUDGET:POLICY per run, in order (alternate them for A/B)")
    args = ap.parse_args()
    os.environ["PD_BUILD_DIR"] = os.path.abspath(args.build)
    import bench_cluster as bc  # noqa: E402  (after PD_BUILD_DIR)
    runs = []
    for spec in args.runs:
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] not in ("0", "1") or not parts[1].isdigit() or \
                parts[2] not in ("cache_aware", "least_work"):
            sys.exit("multiturn_burst.py: --runs takes WARM:BUDGET:POLICY, e.g. 1:2048:cache_aware; got %r" % spec)
        runs.append((parts[0] == "1", int(parts[1]), parts[2]))
    for warm, budget, policy in runs:
        run(bc, os.path.abspath(args.build), args.model, warm, budget, policy)


if __name__ == "__main__":
    main()
