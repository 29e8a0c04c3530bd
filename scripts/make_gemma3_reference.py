#!/usr/bin/env python3
"""Greedy continuations of the Gemma 3 270M GGUF by llama.cpp, for tests/model/gemma3_reference_test.cpp.

Run (from the repository root, with a llama.cpp build that has llama-simple and llama-tokenize):

    python3 scripts/make_gemma3_reference.py --llama-cpp /path/to/llama.cpp \\
        --model models/gemma-3-270m-q4_k_m.gguf --out tests/data/gemma3/greedy.json

Nothing here uses pdcluster code. For each prompt:
  * prompt ids: `llama-tokenize -p PROMPT --ids` (llama.cpp adds <bos>, as the GGUF asks);
  * the continuation: `llama-simple -n N PROMPT`, llama.cpp's greedy sampler, on its CPU
    backend (it prints <bos>, the prompt, the N generated pieces and a newline);
  * continuation ids: `llama-tokenize` of prompt + continuation, minus the prompt ids (the
    script fails unless the prompt's ids are a prefix of them). This re-tokenization is
    not the generated ids themselves (llama-simple prints text only); should the two ever
    differ, the test fails rather than passes.
Deterministic: llama.cpp's CPU greedy decoding of one sequence gives the same text run to run.

With --transformers (run the script with the venv of scripts/requirements-reference.txt), the
same teacher-forced positions are also scored by Hugging Face transformers' Gemma3ForCausalLM,
loaded from the same GGUF (`from_pretrained(dir, gguf_file=...)`: gguf-py dequantizes every
tensor to fp32, fp32 forward on CPU, eager attention): for each step, its 8 highest logits and
the logit of llama.cpp's token. llama.cpp multiplies the K-quant weights by 8-bit activations;
transformers, like our fp32 path, by fp32 ones, so its logits are the tight reference.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

PROMPTS = [
    ("capital", "The capital of France is", 16),
    ("code", "def fibonacci(n):", 16),
    # Past the model's 512-token sliding window, so its local layers see only part of the prompt.
    ("long", None, 16),
]


def tokenize(bin_dir: str, model: str, text: str) -> list[int]:
    out = subprocess.run([os.path.join(bin_dir, "llama-tokenize"), "-m", model, "-p", text, "--ids", "--log-disable"],
                         check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return json.loads(out)


def score_with_transformers(model_path: str, cases: list[dict]) -> str:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(model_path)),
                                             gguf_file=os.path.basename(model_path), dtype=torch.float32,
                                             attn_implementation="eager").eval()
    for c in cases:
        ids = c["prompt_ids"] + c["continuation_ids"]
        with torch.no_grad():
            logits = m(torch.tensor([ids])).logits[0]
        n = len(c["prompt_ids"])
        steps = []
        for i, tok in enumerate(c["continuation_ids"]):
            row = logits[n - 1 + i]
            top = torch.topk(row, 8)
            steps.append({"top_ids": top.indices.tolist(), "top_logits": [round(float(x), 6) for x in top.values],
                          "llama_cpp_token_logit": round(float(row[tok]), 6)})
        c["transformers"] = steps
    return f"transformers {transformers.__version__}, torch {torch.__version__} (fp32, CPU, eager)"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source dir with build/bin/llama-simple")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--transformers", action="store_true", help="also score the steps with transformers")
    args = ap.parse_args()
    bin_dir = os.path.join(args.llama_cpp, "build", "bin")
    commit = subprocess.run(["git", "-C", args.llama_cpp, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    text_path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "text", "pride_and_prejudice_ch1-11.txt")
    long_text = open(text_path, encoding="utf-8").read()[:2200]
    with open(args.model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    cases = []
    for name, prompt, n in PROMPTS:
        if prompt is None:
            prompt = long_text
        ids = tokenize(bin_dir, args.model, prompt)
        run = subprocess.run([os.path.join(bin_dir, "llama-simple"), "-m", args.model, "-n", str(n), prompt],
                             check=True, capture_output=True)
        printed = run.stdout.decode("utf-8")
        head = "<bos>" + prompt
        if not printed.startswith(head):
            sys.exit(f"{name}: llama-simple did not echo the prompt: {printed[:200]!r}")
        if not printed.endswith("\n"):
            sys.exit(f"{name}: llama-simple's output does not end with the newline it prints last")
        continuation = printed[len(head):-1]
        full = tokenize(bin_dir, args.model, prompt + continuation)
        if full[:len(ids)] != ids:
            sys.exit(f"{name}: the prompt's ids are not a prefix of the prompt + continuation's")
        cont_ids = full[len(ids):]
        if len(cont_ids) != n:
            sys.exit(f"{name}: re-tokenized continuation has {len(cont_ids)} ids, llama-simple generated {n}")
        cases.append({"name": name, "prompt": prompt, "prompt_ids": ids, "continuation": continuation,
                      "continuation_ids": cont_ids})
        print(f"{name}: {len(ids)} prompt ids -> {continuation!r}")
    generator_hf = None
    if args.transformers:
        generator_hf = score_with_transformers(args.model, cases)
    out = {"model": os.path.basename(args.model), "model_sha256": sha, "generator": f"llama.cpp {commit} (CPU, "
           "llama-simple greedy, llama-tokenize)", "cases": cases}
    if generator_hf:
        out["generator_transformers"] = generator_hf
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
