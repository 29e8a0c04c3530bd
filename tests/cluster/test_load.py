#!/usr/bin/env python3
"""Whole-cluster load and soak tests: the cluster holds under more work than it
can do at once, under clients that give up at any moment, and under long runs.

    tests/cluster/test_load.py {load,soak}

load (default model): long prompts at a concurrency above what the pools run at
  once, on 1 prefill + 1 decode and on 2 prefill + 1 decode (oversubscribed: more
  ranks than cores), with a short KV-transfer deadline: every request finishes;
  none fails for time spent waiting its turn. Then requests cancelled while they
  still wait in a prefill rank's queue leave the cluster serving.
soak (tiny model): 2,000 mixed requests (chat/completion, stream or not, a fifth
  of the clients leaving at random moments, including while queued) on a small
  decode pool, with a burst of long generations in the middle that cannot all fit
  in it, so it must preempt whatever the machine's speed: every request ends
  exactly once, every KV block comes back, no request is left in flight, and the
  router's memory stays flat.

Exit 0 = pass, 1 = fail, 77 = skipped (printed why)."""
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import (Cluster, blocks_all_free, check, need_default_model, run_suite, tiny_model,  # noqa: E402
                     wait_for)
from loadgen import Spec, mixed_specs, run_load, summary, words  # noqa: E402


def outcomes(c):
    m = c.metrics()
    return {k.split('"')[1]: v for k, v in m.items() if k.startswith("pd_requests_total{")}


def delta(after, before):
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in set(after) | set(before)
            if after.get(k, 0) != before.get(k, 0)}


def pools_settled(c):
    """Every KV block back in its pool and nothing in flight."""
    return blocks_all_free(c) and c.metric("pd_requests_in_flight", 1) == 0


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


# ------------------------------------------------------------------ load

def long_prompt_specs(n, seed):
    """n streaming/non-streaming completions with prompts of 300-1,100 tokens."""
    rng = random.Random(seed)
    return [Spec(rng.choice(("completion", "chat")), words(rng.randint(300, 1100), rng), 16, i % 2 == 0)
            for i in range(n)]


def load_run(prefill, decode, n, concurrency, seed):
    # A short transfer deadline and small prefill batches: requests wait their turn
    # in the prefill queue far longer than transfer_ms. Waiting is not a lack of
    # progress, so none of them may fail for it.
    cfg = {"timeouts": {"transfer_ms": 5000}, "prefill": {"max_batch": 2, "token_budget": 1024}}
    with Cluster(prefill, decode, config=cfg) as c:
        before = outcomes(c)
        t0 = time.time()
        res = run_load(c.port, long_prompt_specs(n, seed), concurrency)
        took = time.time() - t0
        bad = [o for o in res if o.kind != "ok"]
        print("load %dP+%dD: %d requests, concurrency %d, %.1f s: %s" % (prefill, decode, n, concurrency, took,
                                                                           summary(res)))
        check(not bad, "%dP+%dD: %d of %d requests did not finish: %s" % (prefill, decode, len(bad), n, bad[:3]))
        d = delta(outcomes(c), before)
        check(d == {"finished": n}, "%dP+%dD: outcome counters moved by %s, want finished=%d" % (prefill, decode, d, n))
        wait_for(lambda: pools_settled(c), 30, "every KV block back and nothing in flight")
        if prefill == 1:
            queued_cancel(c)
        check(c.stop() == 0, "clean exit:\n" + c.logs())


def queued_cancel(c):
    """A long prompt occupies the prefill rank; three short requests whose clients
    give up after 0.3 s are cancelled while still in its queue; the cluster serves on."""
    rng = random.Random(7)
    before = outcomes(c)
    long_result = []
    t = threading.Thread(target=lambda: long_result.extend(
        run_load(c.port, [Spec("completion", words(1500, rng), 4, False)], 1)))
    t.start()
    wait_for(lambda: c.metric('pd_running_sequences{role="prefill",rank="1"}') >= 1, 30,
             "the long prompt to start on the prefill rank")
    shorts = [Spec("completion", words(20, rng), 4, i % 2 == 0, abandon_after=0.3) for i in range(3)]
    res = run_load(c.port, shorts, len(shorts))
    t.join(300)
    check(long_result and long_result[0].kind == "ok", "the long request: %s" % long_result)
    check(all(o.kind == "abandoned" for o in res), "short requests: %s" % res)
    after_short = run_load(c.port, [Spec("chat", "What is 2 + 2?", 8, True)], 1)
    check(after_short[0].kind == "ok", "a request after the queued cancels: %s" % after_short[0])
    check(c.get("/health").status == 200, "/health after the queued cancels")
    d = delta(outcomes(c), before)
    check(d.get("finished", 0) == 2 and d.get("cancelled", 0) == 3 and len(d) == 2,
          "outcomes after queued cancels: %s (want finished=2, cancelled=3)" % d)
    wait_for(lambda: pools_settled(c), 30, "every KV block back after the queued cancels")
    print("queued cancel: 3 clients left while queued; cluster still serving")


def suite_load(tmp):
    need_default_model()
    load_run(1, 1, n=10, concurrency=10, seed=1)
    load_run(2, 1, n=10, concurrency=10, seed=2)


# ------------------------------------------------------------------ soak

def preempting_burst(c, block_size, rng):
    """Long generations, all in flight at once, whose KV together is 1.6x the
    decode pool and each of which fits alone: the pool must preempt. (The mixed
    requests alone preempt only when enough of them meet in the decode rank,
    which depends on the machine's speed.)"""
    pool_tokens = sum(v for k, v in c.metrics().items() if k.startswith('pd_kv_blocks{role="decode"')) * block_size
    n, prompt, new = 16, 10, 400  # 16 x ~410 tokens; the tiny model's context is 512
    check(n * (prompt + new) > 1.5 * pool_tokens, "the burst (%d tokens) does not overfill the decode pool (%d)"
          % (n * (prompt + new), pool_tokens))
    return [Spec(rng.choice(("completion", "chat")), words(prompt, rng), new, i % 2 == 0) for i in range(n)]


def suite_soak(tmp):
    model = tiny_model(os.path.join(tmp, "tiny.gguf"))
    total = int(os.environ.get("PD_SOAK_REQUESTS", "2000"))
    cfg = {"kv": {"decode_budget_mb": 1, "block_size": 16},  # 256 blocks on the tiny model
           "prefill": {"max_batch": 4, "token_budget": 256},
           "router": {"max_queued": 100000}}
    with Cluster(1, 1, model=model, config=cfg) as c:
        pid = c.router_pid()
        base = outcomes(c)
        warm = mixed_specs(200, seed=100, prompt_tokens=(2, 50), max_tokens=(1, 48), abandon_s=(0.0, 0.08))
        run_load(c.port, warm, 24)
        wait_for(lambda: pools_settled(c), 60, "pools to settle after the warm-up")
        rss0 = rss_kib(pid)
        before = outcomes(c)
        specs = mixed_specs(total, seed=101, prompt_tokens=(2, 50), max_tokens=(1, 48), abandon_s=(0.0, 0.08))
        burst = preempting_burst(c, cfg["kv"]["block_size"], random.Random(102))
        specs[total // 2:total // 2 + len(burst)] = burst  # in flight together (concurrency 32), amid the churn
        total = len(specs)
        t0 = time.time()
        res = run_load(c.port, specs, 32)
        took = time.time() - t0
        wait_for(lambda: pools_settled(c), 60, "every KV block back and nothing in flight after the soak")
        rss1 = rss_kib(pid)
        d = delta(outcomes(c), before)
        counts = summary(res)
        m = c.metrics()
        pre = sum(v for k, v in m.items() if k.startswith("pd_preemptions{"))
        print("soak: %d requests in %.1f s: clients saw %s; router counted %s; preemptions %d; "
              "router RSS %d -> %d KiB" % (total, took, counts, d, pre, rss0, rss1))
        errors = [o for o in res if o.kind == "error"]
        check(not errors, "%d requests failed: %s" % (len(errors), errors[:3]))
        ok = counts.get("ok", 0)
        # Exactly once: every request the router took ended in one outcome; every
        # answer a client read to its end was a finished one.
        check(sum(d.values()) == total, "router outcomes %s add up to %d, want %d" % (d, sum(d.values()), total))
        check(set(d) <= {"finished", "cancelled"}, "unexpected outcomes %s" % d)
        check(d.get("finished", 0) >= ok, "finished %d < %d complete answers" % (d.get("finished", 0), ok))
        check(d.get("cancelled", 0) <= counts.get("abandoned", 0),
              "cancelled %d > %d abandoned clients" % (d.get("cancelled", 0), counts.get("abandoned", 0)))
        check(pre > 0, "the decode pool never preempted: the soak did not exercise preemption")
        check(rss1 - rss0 < 16 * 1024, "router RSS grew by %d KiB over the soak" % (rss1 - rss0))
        check(c.get("/health").status == 200, "/health after the soak")
        print("soak totals since start: %s" % delta(outcomes(c), base))
        check(c.stop() == 0, "clean exit:\n" + c.logs())


SUITES = {"load": suite_load, "soak": suite_soak}

if __name__ == "__main__":
    run_suite(SUITES, "test_load.py")
