#!/usr/bin/env python3
"""The KV handoff over TCP between hosts, against shared memory on one host.

Builds test hosts from network namespaces (deploy/netns_hosts.sh; needs root)
and runs, in turn, the same 1 router + 1 prefill + 1 decode cluster
(deploy/launch.sh --hostfile, default model, --threads per rank) as:

  onehost   every rank on pdh1: the handoff goes through shared memory (vader);
  hosts3    router pdh1, prefill pdh2, decode pdh3: the handoff goes over TCP;
  shaped    hosts3 with the prefill host's link shaped by tc (netem delay + rate
            where the kernel has sch_netem, else tbf rate only; printed).

The HTTP client runs in its own namespace (pdhc). The prefill rank runs one prompt
per pass (prefill.max_batch 1). For each prompt length it measures, from the
router's /metrics (docs/METRICS.md) and the client's clock:

  alone       one request at a time (--reps, median): the handoff's bytes, its
              wire time (first layer posted -> last byte sent) and GB/s (bytes /
              wire time), its exposed time (end of the prefill compute -> last
              byte sent), and the client's gap between the first and the second
              token (the first comes from the prefill rank; the second needs the
              whole KV on the decode rank and one decode step). A request that
              finds the prefill rank idle starts its pass before the decode rank
              has accepted the handoff, so all of its layers go out after the
              pass: exposed = the whole transfer.
  burst       three n-token prompts sent together (--bursts, median). The
              first starts its pass at once, as above; the decode rank accepts
              the third while the first two compute, so the third's layers go out
              while its next layers compute (whether they did shows in its
              figures: its first layer was posted before its compute ended;
              only such bursts count). hidden = 1 - the third's exposed time /
              the exposed time alone. The first one's handoff has to progress
              while the prefill rank computes the second prompt: its exposed
              time is reported too.

Then prints one table with ratios against onehost, and the BTL the prefill rank
chose for the decode rank (from btl_base_verbose) in each configuration.

    sudo scripts/bench_multihost.py --lengths 256,1024,2048 --reps 5 --bursts 3

Needs a built tree and the default model."""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "cluster"))
from cluster import DEFAULT_MODEL, Cluster, handoff_figures  # noqa: E402
from netns import NetHosts  # noqa: E402

INNER = "PD_BENCH_MULTIHOST_INNER"
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain city music science history language "
         "system program question night water room mother area money story month lot right study book").split()
BML = re.compile(r"\[([^:\]]+):(\d+)\] mca: bml: Using (\w+) btl for send to \[\[\d+,\d+\],(\d+)\] on node (\S+)")


def prompt(n, rng):
    """n tokens: each of these words is one token of SmolLM2's vocabulary with its leading space; random
    from the first word, so no two prompts share a prefix-cache block."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ------------------------------------------------------------------ inner: runs in the client namespace

def stream_two_tokens(c, text):
    """-> (prompt_tokens, seconds from the first to the second token)."""
    body = {"prompt": text, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = c.conn(timeout=600)
    times, usage = [], None
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError("HTTP %d: %s" % (r.status, r.read()[:300]))
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            elif ev.get("choices") and ev["choices"][0].get("text"):
                times.append(time.monotonic())
    finally:
        conn.close()
    if len(times) != 2 or usage is None:
        raise RuntimeError("expected 2 text chunks and a usage chunk, got %d chunks" % len(times))
    return usage["prompt_tokens"], times[1] - times[0]


def wait_handoffs(c, m0, n, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = c.metrics()
        if handoff_figures(m0, m)["handoffs"] >= n:
            return m
        time.sleep(0.02)
    raise RuntimeError("no TransferStats for %d handoff(s) within %d s" % (n, timeout))


def alone(c, n, reps, rng):
    rows = []
    for _ in range(reps):
        m0 = c.metrics()
        tokens, gap = stream_two_tokens(c, prompt(n, rng))
        f = handoff_figures(m0, wait_handoffs(c, m0, 1))
        f.update(tokens=tokens, gap_s=gap)
        rows.append(f)
    return rows


def concurrent(c, texts, poll_s=0.05):
    """Sends texts at once (one thread each); returns the handoffs in the order they ended,
    from polling /metrics. Handoffs that ended between the same two polls come as one
    record (its 'handoffs' > 1); callers use only records of one handoff."""
    errors = []

    def send(text):
        try:
            stream_two_tokens(c, text)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
    last = c.metrics()
    workers = [threading.Thread(target=send, args=(x,)) for x in texts]
    for w in workers:
        w.start()
    handoffs, deadline = [], time.time() + 600
    while sum(f["handoffs"] for f in handoffs) < len(texts) and time.time() < deadline:
        m = c.metrics()
        f = handoff_figures(last, m)
        if f["handoffs"]:
            handoffs.append(f)
            last = m
        time.sleep(poll_s)
    for w in workers:
        w.join()
    if errors:
        raise RuntimeError("concurrent requests: %s" % errors[0])
    if sum(f["handoffs"] for f in handoffs) != len(texts):
        raise RuntimeError("%d handoffs for %d requests: %s" % (sum(f["handoffs"] for f in handoffs), len(texts),
                                                                handoffs))
    return handoffs


def overlapped(f):
    """Whether a handoff's layers went out while its prompt was computed: its first layer
    was posted before its compute ended (wire time > exposed time + half the pass)."""
    return f["wire_s"] - f["exposed_s"] > 0.5 * f["prefill_s"]


def transports(c):
    """The BTL the prefill rank chose for the decode rank (from btl_base_verbose)."""
    ranks = c.rank_pids()
    prefill = [pid for rank, (role, pid) in ranks.items() if role == "prefill"]
    decode = [rank for rank, (role, pid) in ranks.items() if role == "decode"]
    for host, pid, btl, peer, node in BML.findall(c.full_logs()):
        if int(pid) in prefill and int(peer) in decode:
            return btl
    return "?"


def inner(args):
    spec = json.loads(args.inner)
    hosts = NetHosts()
    tmp = spec["tmp"]
    if spec["layout"] == "onehost":
        slots = [(hosts.host(1), 3)]
        where = {"router": hosts.host(1), "prefill": hosts.host(1), "decode": hosts.host(1)}
    else:
        slots = [(hosts.host(1), 1), (hosts.host(2), 1), (hosts.host(3), 1)]
        where = {"router": hosts.host(1), "prefill": hosts.host(2), "decode": hosts.host(3)}
    hostfile = hosts.write_hostfile(os.path.join(tmp, "hostfile-" + spec["name"]), slots)
    # decode_reuse_tokens 0: every request is handed off over the link (none computed from a decode rank's cache).
    cfg = {"http": {"host": hosts.addr(where["router"])}, "prefill": {"max_batch": 1}, "router": {"decode_reuse_tokens": 0},
           "kv": {"prefill_budget_mb": 1024}, "timeouts": {"request_ms": 300000}}
    rng = random.Random(spec["seed"])
    out = {"name": spec["name"], "lengths": {}}
    with Cluster(1, 1, model=args.model, config=cfg, threads=args.threads, wrap=hosts.exec_argv(where["router"], []),
                 launch_args=["--hostfile", hostfile, "--insecure"] + hosts.mca_args(verbose=True) + spec["mca"],
                 client_host=hosts.addr(where["router"])) as c:
        # Warm-up, not counted: a just-started cluster's first request can take seconds
        # (on one host too); the first handoff between two ranks also sets up their connection.
        alone(c, 64, 2, rng)
        for n in spec["lengths"]:
            rows = alone(c, n, spec["reps"], rng)
            bursts = [concurrent(c, [prompt(n, rng) for _ in range(3)]) for _ in range(spec["bursts"])]
            out["lengths"][str(n)] = {"alone": rows, "bursts": bursts}
            print("  %s %5d tokens: alone exposed %s ms; bursts of 3, exposed (* = overlapped) %s ms" % (
                spec["name"], n, " ".join("%.1f" % (r["exposed_s"] * 1e3) for r in rows),
                " | ".join(" ".join("%.1f%s%s" % (f["exposed_s"] * 1e3, "*" if overlapped(f) else "",
                                                   "(%d together)" % f["handoffs"] if f["handoffs"] > 1 else "")
                                    for f in q) for q in bursts)), file=sys.stderr, flush=True)
        out["kv_btl"] = transports(c)
        rc = c.stop()
        if rc != 0:
            raise RuntimeError("cluster exit code %s:\n%s" % (rc, c.logs()))
    print("RESULT " + json.dumps(out), flush=True)


# ------------------------------------------------------------------ outer: root namespace

def med(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(res):
    """{length: figures} of one configuration."""
    out = {}
    for n, d in res["lengths"].items():
        a, q = d["alone"], d["bursts"]
        exposed = med([r["exposed_s"] for r in a])
        third = [b[-1] for b in q if len(b) == 3]  # bursts whose 3 handoffs could be told apart
        o = [f for f in third if overlapped(f)]
        o_exp = med([f["exposed_s"] for f in o])
        out[int(n)] = {"tokens": a[0]["tokens"], "mb": a[0]["bytes"] / 1e6, "gbps": med([r["gbps"] for r in a]),
                       "exposed": exposed, "gap": med([r["gap_s"] for r in a]),
                       "prefill": med([r["prefill_s"] for r in a]), "o_exposed": o_exp, "o_n": len(o),
                       "o_tries": len(third), "hidden": 1 - o_exp / exposed if o and exposed > 0 else float("nan"),
                       "b1_exposed": med([b[0]["exposed_s"] for b in q if b[0]["handoffs"] == 1])}
    return out


def table(results, labels):
    base = summarize(results[0])
    print()
    print("| config | prompt tokens | KV MB | prefill s | alone: GB/s | alone: exposed ms | alone: token 1→2 ms | "
          "burst: 3rd exposed ms (overlapped/told apart) | hidden | burst: 1st exposed ms | vs one host: GB/s | exposed | "
          "token 1→2 (added ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        s = summarize(res)
        for n in sorted(s):
            f, b = s[n], base[n]
            print("| %s | %d | %.1f | %.2f | %.2f | %.1f | %.1f | %s | %s | %.0f | ×%.2f | ×%.2f | ×%.2f (%+.1f) |" % (
                labels[res["name"]], f["tokens"], f["mb"], f["prefill"], f["gbps"], f["exposed"] * 1e3,
                f["gap"] * 1e3, "%.1f (%d/%d)" % (f["o_exposed"] * 1e3, f["o_n"], f["o_tries"]) if f["o_n"] else
                "– (0/%d)" % f["o_tries"], "%.0f%%" % (100 * f["hidden"]) if f["o_n"] else "–",
                f["b1_exposed"] * 1e3, f["gbps"] / b["gbps"], f["exposed"] / b["exposed"], f["gap"] / b["gap"],
                (f["gap"] - b["gap"]) * 1e3))
    print()
    print("KV path (prefill -> decode) as the ranks chose it: " +
          "; ".join("%s: %s" % (labels[r["name"]], r["kv_btl"]) for r in results))


def outer(args):
    print("# " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]) + "   (%s)" % time.strftime("%Y-%m-%d %H:%M"),
          flush=True)
    hosts = NetHosts()
    reason = hosts.probe(need_tc=True)
    if reason:
        sys.exit("bench_multihost.py: cannot make test hosts here: " + reason)
    lengths = [int(x) for x in args.lengths.split(",")]
    tmp = os.path.join("/tmp", "pd-bench-multihost-%d" % os.getpid())
    os.makedirs(tmp, exist_ok=True)
    results, labels = [], {}
    try:
        print(hosts.up(), flush=True)
        for i, name in enumerate(args.configs.split(",")):
            if name not in ("onehost", "hosts3", "shaped"):
                sys.exit("bench_multihost.py: unknown config %r" % name)
            hosts.unthrottle(hosts.host(2))
            label = {"onehost": "one host (vader)", "hosts3": "3 hosts, TCP"}.get(name)
            if name == "shaped":
                line = hosts.throttle(hosts.host(2), args.rate, args.delay)
                print(line, flush=True)
                netem = ": netem" in line
                label = "3 hosts, TCP, %s%s" % (args.rate, " + " + args.delay if netem else " (tbf, no delay)")
            if name != "onehost":
                bps, _ = hosts.link_rate(hosts.host(2), hosts.host(3), 64 << 20)
                print("%s: TCP stream pdh2 -> pdh3 %.2f Gbit/s" % (name, bps / 1e9), flush=True)
                label += " (%.2f Gbit/s)" % (bps / 1e9)
            labels[name] = label
            spec = {"name": name, "layout": "onehost" if name == "onehost" else "hosts3", "lengths": lengths,
                    "reps": args.reps, "bursts": args.bursts, "seed": args.seed + i, "tmp": tmp,
                    "mca": [x for kv in args.mca for x in ("--mca", kv[0], kv[1])]}
            argv = [sys.executable, os.path.abspath(__file__), "--inner", json.dumps(spec), "--model", args.model,
                    "--threads", str(args.threads)]
            r = subprocess.run(hosts.exec_argv(hosts.client, argv), env=dict(hosts.env, **{INNER: "1"}),
                               stdout=subprocess.PIPE, text=True)
            lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
            if r.returncode != 0 or not lines:
                sys.exit("bench_multihost.py: %s failed (exit %d):\n%s" % (name, r.returncode, r.stdout[-3000:]))
            results.append(json.loads(lines[-1][len("RESULT "):]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"labels": labels, "results": results}, f, indent=1)
        table(results, labels)
    finally:
        hosts.down()
        subprocess.run(["rm", "-rf", tmp])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="256,1024,2048", help="prompt tokens")
    ap.add_argument("--reps", type=int, default=5, help="requests alone per length (median)")
    ap.add_argument("--bursts", type=int, default=3, help="bursts of 3 requests per length (median)")
    ap.add_argument("--configs", default="onehost,hosts3,shaped")
    ap.add_argument("--rate", default="1gbit", help="the shaped link's rate (tc units)")
    ap.add_argument("--delay", default="1ms", help="the shaped link's one-way delay (needs sch_netem)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads per worker rank")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mca", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                    help="more OpenMPI MCA parameters for every configuration (launch.sh --mca)")
    ap.add_argument("--json", help="write the raw figures here")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        inner(args)
    else:
        outer(args)


if __name__ == "__main__":
    main()
