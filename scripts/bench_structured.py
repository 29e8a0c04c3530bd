#!/usr/bin/env python3
"""Structured output's cost on decode: a batch of chat requests, every one
constrained by the same JSON schema, against the same batch unconstrained,
through pd-generate --batch (one batched decode, as a decode rank runs it).
Both run exactly --max-tokens tokens per request (unconstrained with
ignore_eos; the schema asks for at least 24 array items, so no constrained
answer is complete sooner), alternated --reps times (ABBA: the first of each
pair alternates). Prints decode tokens/s of
each run, the medians, their ratio, and the grammar's compile times (cold and
cached, from pd-generate's stderr).

  scripts/bench_structured.py [--build build] [--model M] [--batch 32] [--max-tokens 128] [--reps 3]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 24,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 24},
                               "qty": {"type": "integer", "minimum": 0, "maximum": 1000},
                               "kind": {"enum": ["fruit", "tool", "book", "other"]}},
                "required": ["name", "qty", "kind"],
            },
        }
    },
    "required": ["items"],
}

TOPICS = ["a grocery list", "a toolbox", "a library shelf", "a picnic", "a kitchen", "a garden shed", "a classroom",
          "a camping trip"]


def run(args, batch_path, constrained):
    cmd = [os.path.join(args.build, "tools", "pd-generate"), "-m", args.model, "--batch", batch_path,
           "-t", str(args.threads)]
    if constrained:
        cmd += ["--json-schema", json.dumps(SCHEMA)]
    p = subprocess.run(cmd, check=True, capture_output=True, text=True)
    decode = float(re.search(r"decode: ([0-9.]+) tok/s", p.stderr).group(1))
    compile_ms = re.search(r"compile ([0-9.]+) ms \(cold\), ([0-9.]+) ms \(cached\)", p.stderr)
    tokens = sum(json.loads(line)["completion_tokens"] for line in p.stdout.splitlines() if line.strip())
    return decode, tokens, (float(compile_ms.group(1)), float(compile_ms.group(2))) if compile_ms else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for i in range(args.batch):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"List the things in {TOPICS[i % len(TOPICS)]} "
                                              f"(list {i}) as JSON."}],
                                "max_tokens": args.max_tokens, "ignore_eos": True}) + "\n")
        path = f.name
    try:
        free, bound, compiles = [], [], []
        for rep in range(args.reps):
            # ABBA: which one runs first alternates (a run's position in the pair must not favour it).
            for constrained in ((False, True) if rep % 2 == 0 else (True, False)):
                tps, tokens, comp = run(args, path, constrained)
                if tokens != args.batch * args.max_tokens:
                    sys.exit(f"run generated {tokens} tokens, expected {args.batch * args.max_tokens}")
                (bound if constrained else free).append(tps)
                if comp:
                    compiles.append(comp)
                print(f"rep {rep + 1} {'constrained  ' if constrained else 'unconstrained'} decode {tps:8.1f} tok/s",
                      flush=True)
    finally:
        os.unlink(path)
    mf, mb = statistics.median(free), statistics.median(bound)
    print(f"batch {args.batch}, {args.max_tokens} tokens each: unconstrained {mf:.1f} tok/s, constrained {mb:.1f} "
          f"tok/s, ratio {mb / mf:.3f} (medians of {args.reps})")
    print(f"schema compile: cold {statistics.median(c[0] for c in compiles):.2f} ms, "
          f"cached {statistics.median(c[1] for c in compiles):.4f} ms (medians)")


if __name__ == "__main__":
    main()
