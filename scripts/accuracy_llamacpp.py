#!/usr/bin/env python3
"""llama.cpp's accuracy against pdcluster's fp32 reference, on the same tokens.

What it does (everything outside the repository goes under --work, default
/tmp/pd-llamacpp; nothing is committed):

 1. llama.cpp from source: `pip download --no-binary :all: --no-deps
    llama-cpp-python==0.3.7` (PyPI's sdist vendors llama.cpp), unpack, and
    `cmake -DGGML_NATIVE=ON -DLLAMA_CURL=OFF` + build the llama-perplexity
    target alone (skipped when already built there).
 2. Our reference: `pd-perplexity --save-base ours.kld` (its fp32 reference:
    fp32 activations, f32 KV; plus our default int8 path, exact KL) writes
    the reference's log-probs in llama.cpp's --kl-divergence-base format
    (skipped when --base names an existing file).
 3. Token check: `llama-perplexity -f TEXT --kl-divergence-base llama_own.kld`
    (llama.cpp tokenizes the text itself and saves its own default path's
    log-probs); its token list must equal ours, token for token.
 4. llama.cpp against our reference: `llama-perplexity --kl-divergence-base
    ours.kld --kl-divergence` with its default KV cache (f16), with flash
    attention (-fa, f16 KV) and with a q8_0 KV cache (-fa -ctk q8_0 -ctv q8_0);
    the script reads Mean PPL(Q), Mean KLD, 99.0% KLD, Maximum KLD and
    Same top p off each run.
 5. Optionally (--hf-python PYTHON: a Python with torch + transformers +
    gguf, see scripts/requirements-reference.txt), Hugging Face transformers'
    fp32 forward pass on the same chunks, written as a base file of its own
    (`hf.kld`, same encoding), and `pd-perplexity --base hf.kld`: our fp32
    paths (sgemm and batch-invariant) and int8 paths against transformers;
    the fp32 ones should be KL ~ 0.

Prints one table and writes --json. Usage (from the repository root, after
building pd-perplexity):

    python3 scripts/accuracy_llamacpp.py --pd-build build \\
        --text tests/data/text/pride_and_prejudice_ch1-11.txt --threads 2

Figures are deterministic for a given machine's ISA (KL from llama.cpp's
ggml kernels depends on which SIMD paths ggml picked).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile

LLAMA_CPP_PYTHON = "0.3.7"


def run(cmd, log=None, cwd=None, env=None):
    print("+ " + " ".join(str(c) for c in cmd), file=sys.stderr, flush=True)
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, errors="replace")
    if log:
        with open(log, "w") as f:
            f.write(p.stdout)
    if p.returncode != 0:
        sys.exit(f"accuracy_llamacpp.py: command failed ({p.returncode}): {' '.join(map(str, cmd))}\n"
                 f"{p.stdout[-3000:]}")
    return p.stdout


def build_llama_cpp(work, jobs, target):
    """llama.cpp's `target` (llama-perplexity, llama-server, ...) built from the source
    PyPI's llama-cpp-python sdist vendors, under `work`; (executable, source dir).
    Skipped when already built there."""
    src = os.path.join(work, f"llama_cpp_python-{LLAMA_CPP_PYTHON}", "vendor", "llama.cpp")
    exe = os.path.join(src, "build", "bin", target)
    if os.path.exists(exe):
        return exe, src
    os.makedirs(work, exist_ok=True)
    sdist = os.path.join(work, f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz")
    if not os.path.exists(sdist):
        run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", work])
    if not os.path.exists(os.path.join(src, "CMakeLists.txt")):
        with tarfile.open(sdist) as t:
            t.extractall(work)
    run(["cmake", "-S", src, "-B", os.path.join(src, "build"), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
         "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"])
    run(["cmake", "--build", os.path.join(src, "build"), "-j", str(jobs), "--target", target])
    return exe, src


def read_base_header(path):
    """(n_ctx, n_vocab, n_chunk, tokens) of a llama.cpp --kl-divergence-base file."""
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            sys.exit(f"accuracy_llamacpp.py: {path} is not a llama.cpp log-probability file")
        n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", f.read(12))
        tokens = list(struct.unpack(f"<{n_ctx * n_chunk}i", f.read(4 * n_ctx * n_chunk)))
    return n_ctx, n_vocab, n_chunk, tokens


def parse_llama_kld(out):
    """The summary lines of llama-perplexity --kl-divergence."""
    def grab(pattern):
        m = re.search(pattern, out)
        return float(m.group(1)) if m else None
    r = {
        "ppl": grab(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)"),
        "ppl_err": grab(r"Mean PPL\(Q\)\s*:\s*[0-9.]+\s*±\s*([0-9.]+)"),
        "ppl_base": grab(r"Mean PPL\(base\)\s*:\s*([0-9.]+)"),
        "kl_mean": grab(r"Mean\s+KLD:\s*(-?[0-9.]+)"),
        "kl_mean_err": grab(r"Mean\s+KLD:\s*-?[0-9.]+\s*±\s*([0-9.]+)"),
        "kl_p99": grab(r"99\.0%\s+KLD:\s*(-?[0-9.]+)"),
        "kl_max": grab(r"Maximum KLD:\s*(-?[0-9.]+)"),
        "top1": grab(r"Same top p:\s*([0-9.]+)"),
        "top1_err": grab(r"Same top p:\s*[0-9.]+\s*±\s*([0-9.]+)"),
    }
    if r["kl_mean"] is None:
        sys.exit("accuracy_llamacpp.py: no KL summary in llama-perplexity's output:\n" + out[-3000:])
    for k in ("top1", "top1_err"):
        if r[k] is not None:
            r[k] /= 100.0
    return r


# ---- transformers' reference, written as a base file (runs under --hf-python)

def hf_base(args):
    """Subcommand: transformers' fp32 logits for every chunk of --base, encoded as llama.cpp does."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    n_ctx, n_vocab, n_chunk, tokens = read_base_header(args.base)
    n_chunk = min(n_chunk, args.chunks) if args.chunks > 0 else n_chunk
    model_dir, gguf_name = os.path.split(os.path.abspath(args.model))
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_name, dtype=torch.float32)
    model.eval()
    first = n_ctx // 2
    nv = 2 * ((n_vocab + 1) // 2) + 4
    with open(args.out, "wb") as f:
        f.write(b"_logits_")
        f.write(struct.pack("<Iii", n_ctx, n_vocab, n_chunk))
        f.write(struct.pack(f"<{n_ctx * n_chunk}i", *tokens[:n_ctx * n_chunk]))
        for c in range(n_chunk):
            ids = torch.tensor([tokens[c * n_ctx:(c + 1) * n_ctx]])
            with torch.no_grad():
                logits = model(ids).logits[0, first:n_ctx - 1].float().numpy()
            rows = np.zeros((logits.shape[0], nv), dtype=np.uint16)
            for i, lg in enumerate(logits):
                mx, mn = np.float32(lg.max()), np.float32(lg.min())
                mn = max(mn, np.float32(mx - 16))
                lse = np.float32(np.log(np.exp((lg - mx).astype(np.float64)).sum()))
                min_lp = np.float32(mn - mx - lse)
                scale = np.float32((mx - mn) / np.float32(65535))
                head = np.array([scale, min_lp], dtype=np.float32).view(np.uint16)
                rows[i, :4] = [head[0], head[1], head[2], head[3]]
                q = np.where(lg > mn, np.rint((lg - mn) * np.float32(1 / scale)), 0)
                rows[i, 4:4 + n_vocab] = q.astype(np.uint16)
            f.write(rows.tobytes())
            print(f"hf chunk {c + 1}/{n_chunk}", file=sys.stderr, flush=True)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    h = sub.add_parser("hf-base", help="(internal) transformers' log-probs as a base file")
    h.add_argument("--model", required=True)
    h.add_argument("--base", required=True)
    h.add_argument("--out", required=True)
    h.add_argument("--chunks", type=int, default=-1)
    h.add_argument("--threads", type=int, default=2)
    ap.add_argument("-m", "--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--text", default="tests/data/text/pride_and_prejudice_ch1-11.txt")
    ap.add_argument("--pd-build", default="build", help="pdcluster build directory (tools/pd-perplexity)")
    ap.add_argument("--work", default="/tmp/pd-llamacpp", help="where llama.cpp is built and files are written")
    ap.add_argument("--base", help="our reference base file (default WORK/ours.kld; made when absent)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=-1, help="score at most this many chunks")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for llama.cpp")
    ap.add_argument("--hf-python", help="a Python with torch/transformers/gguf: adds the transformers row")
    ap.add_argument("--hf-chunks", type=int, default=-1, help="chunks for the transformers row (default all)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.cmd == "hf-base":
        return hf_base(args)

    for path, flag in ((args.model, "--model"), (args.text, "--text")):
        if not os.path.exists(path):
            sys.exit(f"accuracy_llamacpp.py: {flag} file not found: {path}")
    pd_ppl = os.path.join(args.pd_build, "tools", "pd-perplexity")
    if not os.path.exists(pd_ppl):
        sys.exit(f"accuracy_llamacpp.py: {pd_ppl} not found (--pd-build; build the pd-perplexity target)")
    os.makedirs(args.work, exist_ok=True)
    exe, _ = build_llama_cpp(args.work, args.jobs, "llama-perplexity")
    chunk_args = ["--chunks", str(args.chunks)] if args.chunks > 0 else []

    # 2. our fp32 reference as a llama.cpp base file
    base = args.base or os.path.join(args.work, "ours.kld")
    if not os.path.exists(base):
        run([pd_ppl, "-m", args.model, "-f", args.text, "--ctx", args.ctx, "-t", args.threads, "--path", "int8",
             "--save-base", base, "--json", os.path.join(args.work, "ours_ref.json")] + chunk_args,
            log=os.path.join(args.work, "ours_ref.log"))
    n_ctx, n_vocab, n_chunk, ours = read_base_header(base)

    # 3. llama.cpp's own tokens (and its own default path's log-probs)
    own = os.path.join(args.work, "llama_own.kld")
    llama_chunks = ["--chunks", str(n_chunk)]
    run([exe, "-m", args.model, "-f", args.text, "-c", n_ctx, "-t", args.threads, "--kl-divergence-base", own]
        + llama_chunks, log=os.path.join(args.work, "llama_own.log"))
    _, lv, lc, theirs = read_base_header(own)
    n = min(len(ours), len(theirs))
    mismatch = [i for i in range(n) if ours[i] != theirs[i]]
    tokens_match = not mismatch and len(ours) == len(theirs) and lv == n_vocab
    print(f"tokens: ours {len(ours)}, llama.cpp {len(theirs)}, "
          f"{'identical' if tokens_match else f'{len(mismatch)} differ, first at {mismatch[:1]}'}", file=sys.stderr)

    # 4. llama.cpp against our reference
    rows = []
    runs = [("llama.cpp default (kv f16)", []),
            ("llama.cpp -fa (kv f16)", ["-fa"]),
            ("llama.cpp -fa kv q8_0", ["-fa", "-ctk", "q8_0", "-ctv", "q8_0"])]
    for label, extra in runs:
        log = os.path.join(args.work, "llama_" + re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_") + ".log")
        out = run([exe, "-m", args.model, "-c", n_ctx, "-t", args.threads, "--kl-divergence-base", base,
                   "--kl-divergence"] + extra, log=log)
        r = parse_llama_kld(out)
        r["path"] = label
        r["command"] = " ".join(map(str, [exe, "-m", args.model, "-c", n_ctx, "-t", args.threads,
                                          "--kl-divergence-base", base, "--kl-divergence"] + extra))
        rows.append(r)

    # 5. transformers against our reference (our fp32 path against transformers' base file)
    hf = None
    if args.hf_python:
        hf_file = os.path.join(args.work, "hf.kld")
        hf_chunks = ["--chunks", str(args.hf_chunks)] if args.hf_chunks > 0 else []
        run([args.hf_python, os.path.abspath(__file__), "hf-base", "--model", args.model, "--base", base, "--out",
             hf_file, "--threads", args.threads] + hf_chunks, log=os.path.join(args.work, "hf.log"))
        hf_json = os.path.join(args.work, "ours_vs_hf.json")
        run([pd_ppl, "-m", args.model, "--base", hf_file, "-t", args.threads, "--path", "fp32:sgemm", "--path",
             "fp32", "--path", "int8", "--path", "int8:x2=none", "--json", hf_json],
            log=os.path.join(args.work, "ours_vs_hf.log"))
        with open(hf_json) as f:
            hf = json.load(f)

    print(f"\nllama.cpp (llama-cpp-python {LLAMA_CPP_PYTHON} sdist) against our fp32 reference {base}: "
          f"{n_chunk} chunks x {n_ctx}, tokens {'identical' if tokens_match else 'DIFFER'}")
    print(f"{'path':<30} {'PPL':<20} {'mean KL':<22} {'p99 KL':<10} {'max KL':<10} {'top-1 same'}")
    for r in rows:
        print(f"{r['path']:<30} {r['ppl']:8.4f} ± {r['ppl_err']:<8.4f} {r['kl_mean']:9.6f} ± {r['kl_mean_err']:<9.6f} "
              f"{r['kl_p99']:<10.6f} {r['kl_max']:<10.6f} {100 * r['top1']:6.3f} ± {100 * r['top1_err']:.3f} %")
    if hf:
        print(f"\nour paths against transformers' fp32 logits ({hf['chunks']} chunks; KL by llama.cpp's formula "
              f"from the base file):")
        for p in hf["paths"]:
            if "skipped" in p:
                continue
            print(f"{p['path']:<30} {p['ppl']:8.4f}   KL {p['kl_mean']:.6f} ± {p['kl_mean_err']:.6f}  "
                  f"p99 {p['kl_p99']:.6f}  top-1 {100 * p['top1']:.3f} %")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"base": base, "ctx": n_ctx, "chunks": n_chunk, "tokens_match": tokens_match,
                       "tokens_mismatch_first": mismatch[:1], "llama_cpp": rows, "transformers": hf}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
