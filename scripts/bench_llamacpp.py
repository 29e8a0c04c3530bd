#!/usr/bin/env python3
"""llama.cpp on this machine, measured the way pd-bench-engine measures pdcluster.

Runs llama.cpp through its Python bindings (llama-cpp-python, which builds
llama.cpp from source; not a dependency of the project — install it in a
virtual environment of your own, e.g.

    python3 -m venv /tmp/llvenv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llvenv/bin/pip install llama-cpp-python==0.3.7
    /tmp/llvenv/bin/python scripts/bench_llamacpp.py --threads 1,2

) and prints, per thread count, what `llama-bench -p 512 -n 128` reports:
prefill tok/s for a 512-token prompt in one batch, and batch-1 decode tok/s
over 128 tokens fed one at a time (no sampling), medians of --reps runs.
Token ids are random: speed does not depend on the text.
"""
import argparse
import random
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--prompt", type=int, default=512, help="prefill tokens")
    ap.add_argument("--gen", type=int, default=128, help="decode tokens")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("bench_llamacpp.py: llama-cpp-python is not installed (see the header of this script)", file=sys.stderr)
        return 2

    print(f"# llama-cpp-python {llama_cpp.__version__}; model {args.model}")
    print(f"# {llama_cpp.llama_print_system_info().decode().strip()}")
    print(f"{'threads':<8} {'prefill tok/s':<15} {'decode b=1 tok/s':<18}")
    rng = random.Random(7)
    for t in [int(x) for x in args.threads.split(",")]:
        llm = llama_cpp.Llama(model_path=args.model, n_ctx=args.prompt + args.gen + 16, n_batch=args.prompt,
                              n_ubatch=args.prompt, n_threads=t, n_threads_batch=t, verbose=False)
        vocab = llm.n_vocab()
        pre, dec = [], []
        for _ in range(args.reps + 1):  # the first round warms up
            prompt = [rng.randrange(vocab) for _ in range(args.prompt)]
            llm.reset()
            llm._ctx.kv_cache_clear()
            t0 = time.perf_counter()
            llm.eval(prompt)
            pre.append(args.prompt / (time.perf_counter() - t0))
            llm.reset()
            llm._ctx.kv_cache_clear()
            llm.eval(prompt[:1])
            t0 = time.perf_counter()
            for i in range(args.gen):
                llm.eval([prompt[1 + i % (args.prompt - 1)]])
            dec.append(args.gen / (time.perf_counter() - t0))
        print(f"{t:<8} {statistics.median(pre[1:]):<15.1f} {statistics.median(dec[1:]):<18.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
