#!/usr/bin/env python3
"""KV transfer tags under cancellation, on a whole cluster: 1 prefill + 1 decode rank on the
default model with 4 tags per prefill rank (kv.tag_span). 20 streamed requests with long
prompts, sent 4 at a time, whose clients leave while the prompts are queued or being computed
(their handoffs accepted, some of their KV sent): each ends a handoff early, so each tag is
reclaimed (swept up to the prefill rank's seal, docs/FAULTS.md "KV transfer tags"). Then
normal requests are all served, and the decode rank reports no tag retired and none left in
reclaim (pd_kv_tags_retired, pd_kv_tags_reclaiming). Before tags were reclaimed the first 4
such handoffs retired the pair's 4 tags for good and every later handoff was refused.
About 30 s on 2 cores.

    tests/cluster/test_kv_tags.py cancel_storm

Exit 0 = pass, 1 = fail, 77 = skipped (printed why)."""
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster, blocks_all_free, check, need_default_model, per_rank, run_suite, wait_for  # noqa: E402
from loadgen import Spec, run_load, summary, words  # noqa: E402


def tag_gauges(c):
    """({decode rank: retired tags}, {decode rank: tags in reclaim}) from /metrics."""
    m = c.metrics()
    return per_rank(m, "pd_kv_tags_retired"), per_rank(m, "pd_kv_tags_reclaiming")


def suite_cancel_storm(tmp):
    need_default_model()
    rng = random.Random(11)
    # Chunks of 128 tokens: a ~700-token prompt takes several passes, its first KV segment
    # (256 tokens) going out behind the later ones.
    cfg = {"kv": {"tag_span": 4}, "prefill": {"chunk_tokens": 128}}
    with Cluster(1, 1, config=cfg) as c:
        t0 = time.time()
        cancelled0 = c.metric('pd_requests_total{outcome="cancelled"}')
        outcomes = []
        for wave in range(5):
            # Each client leaves 0.15-1.2 s after sending (loadgen: half its delay once the
            # answer's head came, else the whole delay): queued, computing, or some KV sent.
            specs = [Spec("completion", words(700, rng), 16, True, abandon_after=0.3 + 0.3 * i) for i in range(4)]
            outcomes += run_load(c.port, specs, concurrency=4, timeout=60)
        check(all(o.kind == "abandoned" for o in outcomes), "the storm's clients: %s" % summary(outcomes))
        wait_for(lambda: c.metric('pd_requests_total{outcome="cancelled"}') >= cancelled0 + 20, 30,
                 "the 20 abandoned requests to end as cancelled")
        wait_for(lambda: blocks_all_free(c), 30, "every KV block to come back after the cancellations")
        storm_s = time.time() - t0

        # The pair serves on: more requests than it has tags, streamed and not.
        normal = [Spec("completion", words(200, rng), 8, i % 2 == 0) for i in range(6)]
        served = run_load(c.port, normal, concurrency=3, timeout=120)
        check(all(o.kind == "ok" for o in served),
              "requests after the storm: %s\n%s" % ([o for o in served if o.kind != "ok"], c.logs()))

        # Load reports reach the router at least once a second.
        wait_for(lambda: (lambda g: bool(g[1]) and all(v == 0 for v in g[1].values()))(tag_gauges(c)), 10,
                 "no KV tag left in reclaim (pd_kv_tags_reclaiming 0)")
        retired, reclaiming = tag_gauges(c)
        check(retired and all(v == 0 for v in retired.values()),
              "pd_kv_tags_retired after 20 cancelled handoffs: %s (want 0 on every decode rank)\n%s"
              % (retired, c.logs()))
        print("20 handoffs cancelled in %.1f s; retired tags %s, in reclaim %s; %d requests served after"
              % (storm_s, retired, reclaiming, len(served)))
        rc = c.stop()
        check(rc == 0, "cluster exit code %s after SIGTERM:\n%s" % (rc, c.logs()))


SUITES = {"cancel_storm": suite_cancel_storm}

if __name__ == "__main__":
    run_suite(SUITES, "test_kv_tags.py")
