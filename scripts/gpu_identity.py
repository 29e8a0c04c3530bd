#!/usr/bin/env python3
"""Greedy identity of a cluster on a backend with pd-generate on the same backend.

    scripts/gpu_identity.py --build DIR --model FILE [--backend cuda] [--kv-dtype f16] [--tokens 32]
                            [--json FILE]

Starts 1 router + 1 prefill + 1 decode rank (deploy/launch.sh, through
tests/cluster/cluster.py) with "engine": {"backend": BACKEND}, sends a few chat
and completion prompts (temperature 0, --tokens tokens), each alone (streamed
and not) and then all at once, and compares text, token count and finish
reason with `pd-generate --backend BACKEND` run on each prompt alone, on the
same model. On one GPU both ranks share the device.

What must be identical: every answer to a request that ran alone (the cluster
then runs the same shapes as pd-generate: one prompt's prefill, batch-1 decode
steps). Answers to the requests sent all at once must be identical too on the
CPU backend, whose kernels are batch-invariant; on CUDA they are compared and
reported but do not fail the run, because the CUDA matmul is not
batch-invariant (cuBLAS from 8 rows, a fused kernel below), so a request
batched with others may differ in the last bits of a logit and so in a
near-tie token. Standard library only. Exit 0 when every answer that must be
identical is, 1 otherwise (each difference printed), 2 when the cluster or the
reference could not run."""
import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))

PROMPTS = [
    ("chat", "What is the capital of France?"),
    ("chat", "Write a haiku about the sea."),
    ("chat", "Explain what a prime number is."),
    ("completion", "The quick brown fox jumps over the lazy dog. Paris is the capital of"),
    ("completion", "In 1969, astronauts first walked on the Moon. Water boils at"),
    ("completion", "Shakespeare wrote many plays, including"),
]


def reference(build, model, backend, cases, threads, kv_dtype):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for endpoint, prompt, n in cases:
            f.write(json.dumps({"prompt": prompt, "chat": endpoint == "chat", "max_tokens": n}) + "\n")
        path = f.name
    try:
        cmd = [os.path.join(build, "tools", "pd-generate"), "-m", model, "--batch", path, "--temp", "0",
               "--backend", backend, "-t", str(threads), "--kv-dtype", kv_dtype]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout
    finally:
        os.unlink(path)
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", required=True, help="build tree with router/, prefill_node/, decode_node/, tools/")
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--kv-dtype", default="f16", choices=["f16", "q8_0", "f32"],
                    help="KV cache elements of the cluster and of pd-generate")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads per rank (and for pd-generate)")
    ap.add_argument("--startup-s", type=int, default=180)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--pid-file", help="write the cluster's process group id here (to stop it from outside)")
    args = ap.parse_args()
    # SIGTERM (a timeout): leave through the Cluster context manager, which stops the cluster.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
    os.environ["PD_BUILD_DIR"] = os.path.abspath(args.build)
    from cluster import Cluster  # noqa: E402  (reads PD_BUILD_DIR)
    from test_cluster import run_case  # noqa: E402

    # Where this cannot run at all, skip (77, as ctest counts it) and say why.
    if not os.path.exists(args.model):
        print("SKIPPED: model file not found: %s (scripts/fetch_model.sh fetches the default model)" % args.model)
        return 77
    probe = subprocess.run([os.path.join(args.build, "tools", "pd-generate"), "-m", args.model, "-p", "hi", "-n", "1",
                            "--backend", args.backend, "-t", "1"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0 and ("no CUDA device" in probe.stderr or "was not built" in probe.stderr):
        print("SKIPPED: %s" % probe.stderr.strip().splitlines()[-1])
        return 77

    cases = [(e, p, args.tokens) for e, p in PROMPTS]
    result = {"backend": args.backend, "kv_dtype": args.kv_dtype, "model": args.model, "tokens": args.tokens,
              "cases": [], "ok": False}
    t0 = time.time()
    try:  # one pd-generate per prompt: each reference runs alone, as the "alone" requests do
        refs = [reference(args.build, args.model, args.backend, [case], args.threads, args.kv_dtype)[0] for case in cases]
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        print("pd-generate failed: %s\n%s" % (e, getattr(e, "stderr", "")), file=sys.stderr)
        result["error"] = "pd-generate failed"
        return finish(result, args, 2)
    result["reference_s"] = round(time.time() - t0, 2)
    print("pd-generate --backend %s: %d references in %.1f s" % (args.backend, len(refs), result["reference_s"]))

    config = {"engine": {"backend": args.backend}, "kv": {"dtype": args.kv_dtype},
              "sampling": {"temperature": 0.0, "top_p": 1.0}}
    differences = 0  # among the answers that must be identical
    must_match_together = args.backend == "cpu"
    try:
        t1 = time.time()
        with Cluster(1, 1, model=args.model, config=config, threads=args.threads, startup_s=args.startup_s) as c:
            result["startup_s"] = round(time.time() - t1, 2)
            if args.pid_file:
                with open(args.pid_file, "w") as f:
                    f.write(str(c.proc.pid))
            print("cluster (1P+1D, backend %s, KV %s) healthy in %.1f s"
                  % (args.backend, args.kv_dtype, result["startup_s"]))
            runs = []
            for case in cases:  # each alone, not streamed and streamed
                for stream in (False, True):
                    runs.append(("alone", case, stream, run_case(c, *case, stream)))
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(cases)) as pool:  # all at once
                futs = [(case, i % 2 == 1, pool.submit(run_case, c, *case, i % 2 == 1))
                        for i, case in enumerate(cases)]
                for case, stream, fut in futs:
                    runs.append(("together", case, stream, fut.result()))
            for mode, case, stream, (text, n, reason) in runs:
                ref = refs[cases.index(case)]
                same = (text, n, reason) == (ref["text"], ref["completion_tokens"], ref["finish_reason"])
                binding = mode == "alone" or must_match_together
                differences += 0 if same or not binding else 1
                result["cases"].append({"mode": mode, "endpoint": case[0], "prompt": case[1], "stream": stream,
                                        "identical": same, "text": text, "tokens": n, "finish_reason": reason,
                                        "reference_text": ref["text"], "reference_tokens": ref["completion_tokens"],
                                        "reference_finish_reason": ref["finish_reason"]})
                print("%-8s %-10s stream=%-5s %s  %r"
                      % (mode, case[0], stream, "same" if same else ("DIFFERS" if binding else "differs (batched, "
                                                                      "not batch-invariant: reported only)"), text[:60]))
                if not same:
                    print("   pd-generate: %r (%d tokens, %s)\n   cluster:     %r (%d tokens, %s)"
                          % (ref["text"], ref["completion_tokens"], ref["finish_reason"], text, n, reason))
            result["exit_code"] = c.stop()
    except Exception as e:  # the cluster did not start, or a request failed
        print("cluster run failed: %s" % e, file=sys.stderr)
        result["error"] = str(e)[-4000:]
        return finish(result, args, 2)
    result["identical"] = sum(1 for r in result["cases"] if r["identical"])
    result["compared"] = len(result["cases"])
    result["together_identical"] = sum(1 for r in result["cases"] if r["mode"] == "together" and r["identical"])
    result["ok"] = differences == 0
    print("note: %d of %d answers identical to pd-generate --backend %s --kv-dtype %s (%.1f s)"
          % (result["identical"], result["compared"], args.backend, args.kv_dtype, time.time() - t0))
    return finish(result, args, 0 if differences == 0 else 1)


def finish(result, args, code):
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
