#!/usr/bin/env python3
"""Draws a roofline plot from `pd-plan roofline --json` output.

    pd-plan roofline --model llama-3.1-70b --hardware h100-sxm --json > roofline.json
    python3 scripts/plot_roofline.py roofline.json -o roofline.png

Needs matplotlib (PyPI: `python3 -m pip install matplotlib`); pd-plan itself
does not. The roof is the hardware's per-device peak FLOP/s and memory
bandwidth; each phase is placed at its arithmetic intensity (FLOP per byte) and
the performance the roof allows there. Prefill (linear layers at prompt length
P) lands right of the ridge, decode (linear layers at batch B, and attention
over the KV cache at 2G/S) left of it.
"""
import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", help="JSON from `pd-plan roofline --json` ('-' for stdin)")
    ap.add_argument("-o", "--output", default="roofline.png", help="PNG to write")
    ap.add_argument("--dpi", type=int, default=100)
    args = ap.parse_args()

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_roofline.py: error: matplotlib is not installed (python3 -m pip install matplotlib)",
              file=sys.stderr)
        return 2

    with (sys.stdin if args.input == "-" else open(args.input)) as f:
        data = json.load(f)
    hw = data["hardware"]
    peak, bw = hw["peak_flops"], hw["mem_bandwidth"]
    ridge = peak / bw
    phases = data["phases"]

    points = []  # (label, intensity, marker, colour)
    for ph in phases:
        if ph["phase"] == "prefill":
            points.append((f"prefill P={ph['prompt_tokens']}", ph["linear"]["intensity"], "o", "tab:red"))
        else:
            points.append((f"decode B={ph['batch']}", ph["linear"]["intensity"], "s", "tab:blue"))
    decode_attn = data["decode_attention_intensity"]
    points.append((f"decode attention (2G/S = {decode_attn:.3g})", decode_attn, "^", "tab:green"))

    xs = [p[1] for p in points] + [ridge]
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    ax.plot(grid, [min(peak, x * bw) for x in grid], color="black", linewidth=1.5, label="roof")
    ax.axvline(ridge, color="grey", linestyle=":", linewidth=1)
    ax.text(ridge * 1.08, peak * 0.02, f"ridge {ridge:.0f} FLOP/B", color="grey", fontsize=8, rotation=90)
    for label, x, marker, colour in points:
        y = min(peak, x * bw)
        ax.scatter([x], [y], marker=marker, color=colour, zorder=3)
        above = label.startswith("prefill")  # prefill labels above the roof, decode below
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(-4, 7) if above else (5, -11),
                    fontsize=7, color=colour, rotation=35 if above else 0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(bottom=lo * bw / 2, top=peak * 10)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable FLOP/s per device")
    model = data["model"]["name"]
    prec = data["precision"]
    ax.set_title(f"{model} on {hw['name']} (weights {prec['weights']}, KV {prec['kv']}; "
                 f"decode at context {data['context']})", fontsize=9)
    ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
    fig.tight_layout()
    fig.savefig(args.output, dpi=args.dpi)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
