#!/usr/bin/env python3
"""Speculative decoding at batch 1: decode tokens/s with and without prompt-lookup
speculation, on a workload whose answers copy from the prompt and on one with
nothing to copy, through pd-generate (one sequence, greedy); the two settings
alternated ABBA --reps times; the texts must be identical. With --llamacpp
(a python with llama-cpp-python, see scripts/bench_llamacpp.py), llama.cpp on
the same file and prompts, plain and with its prompt-lookup drafting
(LlamaPromptLookupDecoding, the same number of draft tokens), measured the same
way: generated tokens over (wall time - the prompt's time).

  scripts/bench_speculation.py [--build build] [--speculate 8] [--reps 3] [--llamacpp /tmp/llvenv/bin/python]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

COPY = [
    "Repeat the following paragraph word for word. Paragraph: In the beginning the Universe was created. This has "
    "made a lot of people very angry and been widely regarded as a bad move. Many were increasingly of the opinion "
    "that they had all made a big mistake in coming down from the trees in the first place.",
    "Copy this code exactly:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n",
    "Quote the sentence back to me: The quick brown fox jumps over the lazy dog while the five boxing wizards jump "
    "quickly and pack my box with five dozen liquor jugs.",
    "Repeat this text exactly, word for word: The committee met on Tuesday to review the budget for next year. "
    "After a long discussion, the members agreed to increase spending on schools and roads, and to reduce "
    "spending on administration. The final vote was seven to two.",
    "Rewrite this Python function with the variable name total changed to result, and change nothing "
    "else:\ndef sum_list(values):\n    total = 0\n    for v in values:\n        total = total + v\n    return "
    "total\n",
    "Repeat the following list exactly:\n1. Preheat the oven to 180 degrees.\n2. Mix the flour, sugar and "
    "butter in a large bowl.\n3. Add two eggs and stir until smooth.\n4. Pour the batter into a tin and bake "
    "for 30 minutes.",
    "Copy this JSON exactly: {\"name\": \"Alice\", \"age\": 30, \"city\": \"Paris\", \"languages\": "
    "[\"English\", \"French\", \"German\"], \"employed\": true}",
    "Echo back this sentence without any changes: Machine learning models are trained on large datasets and "
    "evaluated on held-out test sets to measure how well they generalize to new data.",
    "Fix the spelling mistake in this sentence and repeat the rest unchanged: The quick brown fox jumpd over "
    "the lazy dog and ran into the forest where the tall trees grow.",
]
FREE = [
    "Write a short story about a dragon who learns to paint.",
    "Give me three tips for staying healthy.",
    "Explain how a bicycle works.",
]


def pd_run(args, prompt, speculate):
    cmd = [os.path.join(args.build, "tools", "pd-generate"), "-m", args.model, "--chat", "-p", prompt,
           "-n", str(args.tokens), "-t", str(args.threads), "--speculate", str(speculate)]
    p = subprocess.run(cmd, check=True, capture_output=True, text=True)
    tps = float(re.search(r"decode: ([0-9.]+) tok/s", p.stderr).group(1))
    return tps, p.stdout


LLAMA = r'''
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
model, threads, tokens, k, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
out = []
for draft in (0, k, 0, k):
    llm = Llama(model_path=model, n_threads=threads, n_ctx=1024, verbose=False,
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=draft) if draft else None)
    for p in prompts:
        msgs = [{"role": "user", "content": p}]
        t0 = time.time(); llm.create_chat_completion(messages=msgs, max_tokens=1, temperature=0); t1 = time.time()
        llm.reset()
        t2 = time.time(); r = llm.create_chat_completion(messages=msgs, max_tokens=tokens, temperature=0); t3 = time.time()
        llm.reset()
        n = r["usage"]["completion_tokens"]
        out.append({"draft": draft, "prompt": p[:20], "tps": n / max((t3 - t2) - (t1 - t0), 1e-6), "tokens": n})
print(json.dumps(out))
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--speculate", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp", help="a python that imports llama_cpp")
    args = ap.parse_args()
    for name, prompts in (("copy", COPY), ("nothing to copy", FREE)):
        plain, spec = [], []
        for rep in range(args.reps):
            for on in ((False, True) if rep % 2 == 0 else (True, False)):
                rates = []
                for p in prompts:
                    tps, text = pd_run(args, p, args.speculate if on else 0)
                    rates.append(tps)
                    if on:
                        _, ref = pd_run(args, p, 0) if rep == 0 else (0, None)
                        if ref is not None and ref != text:
                            sys.exit("speculation changed the text of %r" % p[:40])
                (spec if on else plain).append(statistics.mean(rates))
        print(f"pdcluster, {name}: plain {', '.join(f'{x:.1f}' for x in plain)} tok/s; speculate "
              f"{args.speculate}: {', '.join(f'{x:.1f}' for x in spec)} tok/s; ratio of medians "
              f"{statistics.median(spec) / statistics.median(plain):.2f}")
        if args.llamacpp:
            r = subprocess.run([args.llamacpp, "-c", LLAMA, args.model, str(args.threads), str(args.tokens),
                                str(args.speculate), json.dumps(prompts)], check=True, capture_output=True, text=True)
            rows = json.loads(r.stdout.strip().splitlines()[-1])
            by = {0: [], args.speculate: []}
            for i in range(0, len(rows), len(prompts)):
                chunk = rows[i:i + len(prompts)]
                by[chunk[0]["draft"]].append(statistics.mean(x["tps"] for x in chunk))
            print(f"llama.cpp, {name}: plain {', '.join(f'{x:.1f}' for x in by[0])} tok/s; prompt lookup "
                  f"{args.speculate}: {', '.join(f'{x:.1f}' for x in by[args.speculate])} tok/s; ratio "
                  f"{statistics.median(by[args.speculate]) / statistics.median(by[0]):.2f}")


if __name__ == "__main__":
    main()
