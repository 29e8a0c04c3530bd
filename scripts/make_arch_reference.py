#!/usr/bin/env python3
"""Regenerate the architecture and quant-type reference data under tests/data/arch/.

Run (from the repository root):

    /opt/pdref-venv/bin/python scripts/make_arch_reference.py \\
        --llama-cpp /path/to/llama.cpp --out tests/data/arch

--llama-cpp is a llama.cpp source tree with a CMake build in `build/` that has libllama
and llama-quantize (`cmake --build build --target llama llama-quantize`). The venv is
scripts/requirements-reference.txt plus sentencepiece (gemma's tokenizer.model). No
network; a few minutes on 2 cores. tests/data/arch/README.md says what comes out and why.

Nothing here uses pdcluster code. Which library produced what:

* The models: random-weight Llama 3 (LlamaForCausalLM with rope_type "llama3"),
  Qwen2 (Qwen2ForCausalLM, q/k/v biases), Qwen3 (Qwen3ForCausalLM, q/k norms, head dim
  != hidden / heads) and Gemma 3 (Gemma3ForCausalLM, five sliding-window layers and a
  global one, head dim != hidden / heads), built by `transformers` from configs (seeded),
  with tokenizers trained here on tests/data/text (`tokenizers` byte-level BPE, a
  `sentencepiece` model for Gemma) so that llama.cpp's converter accepts them. Only the
  tensors matter for the logits; the tests feed token ids.
* GGUF files: llama.cpp's convert_hf_to_gguf.py (copied with its gguf-py to a temp dir)
  writes F32; llama.cpp's llama-quantize makes every stored file from it.
* The architecture files are Q8_0 with the weights rounded beforehand to values Q8_0
  holds exactly (every 32-block's largest magnitude is 127 steps of an fp16 scale), so the
  file holds transformers' weights bit for bit (checked: gguf-py's dequantization of the
  Q8_0 file equals the F32 file). transformers' fp32 logits are then the exact reference
  for the file.
* The quant-type files (Q4_K_M, Q5_K_M, Q6_K, Q5_0, Q5_1, from a plain Llama model with
  hidden 256 so K-quant rows fit): their tensors dequantized by gguf-py (numpy, not
  llama.cpp's C) and loaded back into transformers (inverse of the converter's Q/K row
  permutation) give transformers' logits on exactly the file's weights; llama.cpp's own
  logits on the file come from scripts/arch_reference/llama_logits.cpp (compiled here
  against libllama).
* (The refusals of an unsupported architecture and weight type are checked on files
  the test writes itself: no file here for them.)
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests/data/text/pride_and_prejudice_ch1-11.txt"
SEED = 20260101

# Prompts: seeded random token ids (the tests feed ids, so any ids do). Two prompts each,
# evaluated as separate sequences; the architecture ones longer than Gemma's 16-token
# window. Few positions keep the committed logits small (all positions are stored).
ARCH_PROMPT_LENGTHS = [20, 36]
QUANT_PROMPT_LENGTHS = [16, 24]
GEMMA_WINDOW = 16

# Llama 3's and Qwen2's pre-tokenizer regexes (their tokenizer.json files): used for the
# trained BPE tokenizers so the converter's metadata looks like the real models'.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# The models. hidden sizes are small to keep the committed files small (README): the
# architecture files only need rows that are multiples of 32 (Q8_0); the quant-type model
# has hidden 256 (K-quant super-blocks).
MODELS = {
    "llama3": dict(
        hf_class="LlamaForCausalLM", gguf_arch="llama", tokenizer="bpe-llama3",
        config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                    # Llama 3.1's scaling with a short original context, so that the smooth band
                    # of frequencies falls inside this head dim (every factor class is used).
                    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=256))),
    "qwen2": dict(
        hf_class="Qwen2ForCausalLM", gguf_arch="qwen2", tokenizer="bpe-qwen2",
        config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, max_position_embeddings=4096, rms_norm_eps=1e-6,
                    tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    "qwen3": dict(
        hf_class="Qwen3ForCausalLM", gguf_arch="qwen3", tokenizer="bpe-qwen2",
        config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    # llama.cpp (and GGUF files) have no per-layer pattern key for Gemma 3: every 6th layer
    # is global, the rest use the sliding window with rope base 10000. So 6 layers, and the
    # transformers config says the same in layer_types.
    "gemma3": dict(
        hf_class="Gemma3ForCausalLM", gguf_arch="gemma3", tokenizer="spm",
        config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=128, query_pre_attn_scalar=128, max_position_embeddings=4096,
                    rms_norm_eps=1e-6, sliding_window=GEMMA_WINDOW,
                    layer_types=["sliding_attention"] * 5 + ["full_attention"],
                    rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                     "full_attention": dict(rope_type="default", rope_theta=1000000.0)},
                    tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2)),
    # The quant-type model: plain Llama (no RoPE scaling, as Llama 2 or SmolLM2: these files
    # test the weight types, independently of the Llama 3 support), every matrix row a
    # multiple of 256.
    "llama-quant": dict(
        hf_class="LlamaForCausalLM", gguf_arch="llama", tokenizer="bpe-llama3",
        config=dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                    rope_parameters=dict(rope_type="default", rope_theta=100000.0))),
}
ARCH_MODELS = ["llama3", "qwen2", "qwen3", "gemma3"]
# llama-quantize file types for the quant-type checks, and the tensor types each file must
# hold (checked with gguf-py here and by the C++ test). The _M mixes are llama.cpp's own
# (Q6_K for the embedding/LM head and some attn_v/ffn_down); Q5_0/Q5_1 are --pure.
QUANTS = [
    ("Q4_K_M", [], {"Q4_K", "Q6_K"}),
    ("Q5_K_M", [], {"Q5_K", "Q6_K"}),
    ("Q6_K", ["--pure"], {"Q6_K"}),
    ("Q5_0", ["--pure"], {"Q5_0"}),
    ("Q5_1", ["--pure"], {"Q5_1"}),
]


def log(*a):
    print(*a, flush=True)


def run(cmd, **kw):
    log("+", " ".join(str(c) for c in cmd))
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, errors="replace", **kw)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        raise SystemExit(f"command failed ({r.returncode}): {cmd[0]}")
    return r.stdout


# ---------------------------------------------------------------- tokenizers


def train_bpe(kind: str, out_dir: Path, vocab_size: int) -> int:
    """A byte-level BPE trained on the test text, saved as tokenizer.json + config."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "bpe-llama3":
        specials, split = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], LLAMA3_SPLIT
        bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    else:
        specials, split = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], QWEN2_SPLIT
        bos, eos = None, "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(TEXT)], trainer)
    tok.add_special_tokens(specials)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    fast.save_pretrained(out_dir)
    return tok.get_vocab_size()


def train_spm(out_dir: Path, vocab_size: int) -> int:
    """A SentencePiece BPE model (Gemma's id layout: pad 0, eos 1, bos 2, unk 3)."""
    import sentencepiece as spm

    prefix = out_dir / "tokenizer"
    spm.SentencePieceTrainer.train(input=str(TEXT), model_prefix=str(prefix), vocab_size=vocab_size, model_type="bpe",
                                   character_coverage=1.0, pad_id=0, eos_id=1, bos_id=2, unk_id=3, num_threads=1,
                                   minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")
    (prefix.parent / "tokenizer.vocab").unlink()
    return sp.vocab_size()


# ---------------------------------------------------------------- weights


def round_to_q8_0(w):
    """w (torch, [..., in]) rounded to values Q8_0 stores exactly, block by block of 32
    along the last dim: d = fp16(max|x| / 127), q = round(x / d) in [-127, 127] with the
    largest-magnitude element at exactly +-127 (so ggml's quantizer finds the same d)."""
    import torch

    x = w.detach().double().numpy()
    shape = x.shape
    b = x.reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    d = (amax / 127.0).astype(np.float16).astype(np.float64)
    d[d == 0] = 2.0 ** -14
    q = np.clip(np.round(b / d), -127, 127)
    i = np.abs(b).argmax(axis=1)
    rows = np.arange(b.shape[0])
    q[rows, i] = np.sign(b[rows, i]) * 127
    out = (q * d).astype(np.float32).reshape(shape)
    assert np.array_equal(out.astype(np.float64), (q * d).reshape(shape)), "Q8_0 products must be exact in fp32"
    return torch.from_numpy(out)


def init_weights(model, arch: str, gen):
    """Deterministic random weights with a useful spread of logits: every linear layer
    variance-preserving (std 1/sqrt(fan_in), q/k twice that so attention is not uniform),
    norms 1 + N(0, 0.1), biases N(0, 0.2), the LM head scaled for logits of std ~4.
    Gemma stores norm weights as offsets from 1; its embedding, scaled by sqrt(hidden) on
    input and tied to the LM head, would otherwise dominate the residual stream (the
    argmax would be the input token everywhere), so it is smaller and the sublayer
    post-norms and the final norm larger (offsets 0.5 and 1)."""
    import torch

    hidden = model.config.hidden_size
    tied = model.config.tie_word_embeddings
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            base = 1.0
            if arch.startswith("gemma"):
                base = 1.0 if name == "model.norm.weight" else 0.5 if ".post_" in name else 0.0
            v = base + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith(".bias"):
            v = 0.2 * torch.randn(p.shape, generator=gen)
        elif "embed_tokens" in name:
            # tied: the same matrix is the LM head; gemma scales the input by sqrt(hidden)
            std = 2.0 / math.sqrt(hidden) if arch.startswith("gemma") else 4.0 / math.sqrt(hidden) if tied else 1.0
            v = std * torch.randn(p.shape, generator=gen)
        elif name == "lm_head.weight":
            v = 4.0 / math.sqrt(hidden) * torch.randn(p.shape, generator=gen)
        elif p.dim() == 2:
            fan_in = p.shape[1]
            s = 2.0 if ("q_proj" in name or "k_proj" in name) else 1.0
            v = s / math.sqrt(fan_in) * torch.randn(p.shape, generator=gen)
        else:
            raise SystemExit(f"no init rule for {name} {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(v)


def build_model(arch: str, spec: dict, vocab: int, work: Path, q8_exact: bool):
    import torch
    import transformers

    cls = getattr(transformers, spec["hf_class"])
    cfg_cls = cls.config_class
    config = cfg_cls(vocab_size=vocab, **spec["config"])
    torch.manual_seed(SEED)
    model = cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(SEED + sum(map(ord, arch)))
    init_weights(model, arch, gen)
    if q8_exact:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.copy_(round_to_q8_0(p))
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(work, safe_serialization=True)
    return model


# ---------------------------------------------------------------- llama.cpp


CONVERT_SHIM = r'''
# Runs llama.cpp's convert_hf_to_gguf.py (copied beside this file) with three adaptations,
# neither touching tensors:
# 1. transformers 5 writes RoPE settings as `rope_parameters`; this converter predates it
#    and reads `rope_theta` / `rope_scaling` (and, for Llama 3's rope factors, a top-level
#    `original_max_position_embeddings`), so they are filled in from rope_parameters
#    (Gemma: the global layers' theta; llama.cpp fixes the local layers' at 10000).
# 2. The BPE pre-tokenizer check hashes the tokenizer's output on a fixed text and knows
#    only real models' vocabularies; the tiny trained tokenizers get the pre-tokenizer name
#    of the model family they imitate (metadata only).
# 3. The converter imports mistral_common at the top for Mistral-format checkpoints only
#    (llama.cpp's requirements install it; gguf-py itself treats it as optional). Where it
#    is not installed, empty stand-ins satisfy the imports; nothing here reaches them.
import importlib.util, sys, types
import transformers  # noqa: F401  (its own availability check must see no stand-ins)
if importlib.util.find_spec("mistral_common") is None:
    names = {"base": ["TokenizerVersion"], "multimodal": ["DATASET_MEAN", "DATASET_STD"], "tekken": ["Tekkenizer"],
             "sentencepiece": ["SentencePieceTokenizer"]}
    for mod in ["mistral_common", "mistral_common.tokens", "mistral_common.tokens.tokenizers"]:
        sys.modules[mod] = types.ModuleType(mod)
    for leaf, attrs in names.items():
        m = types.ModuleType("mistral_common.tokens.tokenizers." + leaf)
        for a in attrs:
            setattr(m, a, None)
        sys.modules[m.__name__] = m
sys.argv = [sys.argv[0]] + sys.argv[2:]
pre = __import__("os").environ["SHIM_TOKENIZER_PRE"]
import convert_hf_to_gguf as c
orig = c.ModelBase.load_hparams
def load_hparams(dir_model, is_mistral_format):
    h = orig(dir_model, is_mistral_format)
    rp = h.get("rope_parameters")
    if rp is not None:
        if "full_attention" in rp:
            assert rp["sliding_attention"]["rope_theta"] == 10000.0, rp
            rp = rp["full_attention"]
        h["rope_theta"] = rp["rope_theta"]
        if rp.get("rope_type", "default") != "default":
            h["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
            # LlamaModel's llama3 rope factors read the original context from the top level
            # (default 8192, Llama 3.1's value), transformers from the scaling parameters.
            if "original_max_position_embeddings" in rp:
                h["original_max_position_embeddings"] = rp["original_max_position_embeddings"]
    return h
c.ModelBase.load_hparams = staticmethod(load_hparams)
if pre:
    c.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
c.main()
'''


class LlamaCpp:
    def __init__(self, root: Path, tmp: Path):
        self.root = root
        self.quantize = root / "build/bin/llama-quantize"
        lib = root / "build/bin/libllama.so"
        for p in (self.quantize, lib, root / "convert_hf_to_gguf.py", root / "gguf-py"):
            if not p.exists():
                raise SystemExit(f"{p} is missing (build llama.cpp with the llama and llama-quantize targets)")
        self.conv = tmp / "convert"
        self.conv.mkdir()
        shutil.copy(root / "convert_hf_to_gguf.py", self.conv)
        shutil.copytree(root / "gguf-py", self.conv / "gguf-py")
        (self.conv / "shim.py").write_text(CONVERT_SHIM)
        self.logits_bin = tmp / "llama_logits"
        run(["g++", "-std=c++17", "-O2", f"-I{root}/include", f"-I{root}/ggml/include",
             ROOT / "scripts/arch_reference/llama_logits.cpp", f"-L{lib.parent}", "-lllama",
             f"-Wl,-rpath,{lib.parent}", "-o", self.logits_bin])
        self.commit = "unknown"
        with contextlib.suppress(Exception):
            self.commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                         text=True, check=True).stdout.strip()

    def convert(self, hf_dir: Path, out: Path, pre: str):
        env = dict(os.environ, SHIM_TOKENIZER_PRE=pre, PYTHONPATH=str(self.conv))
        run([sys.executable, self.conv / "shim.py", "convert_hf_to_gguf.py", hf_dir, "--outtype", "f32",
             "--outfile", out], env=env, cwd=self.conv)

    def quantize_to(self, src: Path, dst: Path, ftype: str, extra=()):
        run([self.quantize, *extra, src, dst, ftype, "2"])

    def logits(self, gguf: Path, prompts, vocab: int, tmp: Path):
        ids = tmp / "ids.txt"
        ids.write_text("".join(" ".join(map(str, p)) + "\n" for p in prompts))
        out = tmp / "llama_logits.f32"
        run([self.logits_bin, gguf, ids, out, "2"])
        x = np.fromfile(out, dtype="<f4")
        n = sum(len(p) for p in prompts)
        assert x.size == n * vocab, (x.size, n, vocab)
        return x.reshape(n, vocab)


# ---------------------------------------------------------------- gguf-py checks


def gguf_tensors(path: Path):
    import gguf

    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = (t.tensor_type.name, np.asarray(arr, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)]))
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("tokenizer.ggml.") and k not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
            continue
        with contextlib.suppress(Exception):
            meta[k] = f.contents()
    return out, meta


def type_counts(tensors) -> dict:
    c: dict = {}
    for ty, _ in tensors.values():
        c[ty] = c.get(ty, 0) + 1
    return dict(sorted(c.items()))


def unpermute(w, n_head):
    """Inverse of convert_hf_to_gguf's LlamaModel.permute (q/k rows for interleaved RoPE)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_state_from_gguf(tensors, config) -> dict:
    """The llama GGUF tensors (dequantized) under transformers' names."""
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    sd = {"model.embed_tokens.weight": tensors["token_embd.weight"][1], "model.norm.weight": tensors["output_norm.weight"][1]}
    if "output.weight" in tensors:
        sd["lm_head.weight"] = tensors["output.weight"][1]
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(config.num_hidden_layers):
        for g, h in names.items():
            w = tensors[f"blk.{i}.{g}.weight"][1]
            if g == "attn_q":
                w = unpermute(w, nh)
            elif g == "attn_k":
                w = unpermute(w, nkv)
            sd[f"model.layers.{i}.{h}.weight"] = w
    return sd


# ---------------------------------------------------------------- logits and metrics


def hf_logits(model, prompts, attn: str):
    import torch

    model.config._attn_implementation = attn
    for m in model.modules():
        if hasattr(m, "config") and m is not model:
            with contextlib.suppress(Exception):
                m.config._attn_implementation = attn
    rows = []
    with torch.no_grad():
        for p in prompts:
            out = model(input_ids=torch.tensor([p]), use_cache=False)
            rows.append(out.logits[0].float().numpy())
    return np.concatenate(rows, axis=0)


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(ref, got) -> dict:
    """KL(ref || got) per position (nats), |diff|, argmax agreement."""
    lr, lg = log_softmax(ref), log_softmax(got)
    kl = (np.exp(lr) * (lr - lg)).sum(axis=-1)
    d = np.abs(ref.astype(np.float64) - got)
    return {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()), "max_kl": float(kl.max()),
            "mean_kl": float(kl.mean()), "argmax_same": int((ref.argmax(-1) == got.argmax(-1)).sum()),
            "positions": int(ref.shape[0])}


def per_position(logits, prompts) -> dict:
    top2 = np.sort(logits, axis=-1)[:, -2:]
    gap, am, k = top2[:, 1] - top2[:, 0], logits.argmax(-1), 0
    out = {"argmax": [], "top2_gap": []}
    for p in prompts:
        out["argmax"].append([int(v) for v in am[k:k + len(p)]])
        out["top2_gap"].append([round(float(v), 5) for v in gap[k:k + len(p)]])
        k += len(p)
    return out


def write_f32(path: Path, x):
    np.ascontiguousarray(x, dtype="<f4").tofile(path)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree with build/")
    ap.add_argument("--out", type=Path, default=ROOT / "tests/data/arch")
    ap.add_argument("--keep", type=Path, help="keep the work directory here (HF models, F32 GGUFs)")
    args = ap.parse_args()

    import gguf
    import sentencepiece
    import tokenizers
    import torch
    import transformers

    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    generator = {"transformers": transformers.__version__, "torch": torch.__version__,
                 "tokenizers": tokenizers.__version__, "sentencepiece": sentencepiece.__version__,
                 "gguf (reading, dequantizing)": importlib.metadata.version("gguf"),
                 "numpy": np.__version__}

    tmp_ctx = tempfile.TemporaryDirectory(prefix="pd-archref-")
    tmp = Path(tmp_ctx.name) if args.keep is None else args.keep
    tmp.mkdir(parents=True, exist_ok=True)
    lc = LlamaCpp(args.llama_cpp.resolve(), tmp)
    generator["llama.cpp"] = lc.commit
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.gguf"):
        old.unlink()
    for old in out.glob("*.f32"):
        old.unlink()

    rng = np.random.default_rng(SEED)
    result = {"generator": generator, "layout": "every .f32 file: prompts one after another, each position's logits "
                                                "(n_tokens x vocab little-endian float32)",
              "models": [], "quant": []}

    def tokenizer_into(arch: str, d: Path) -> int:
        kind = MODELS[arch]["tokenizer"]
        return train_spm(d, 256) if kind == "spm" else train_bpe(kind, d, 288)

    hf = {}
    for arch in ARCH_MODELS + ["llama-quant"]:
        spec = MODELS[arch]
        d = tmp / arch
        d.mkdir(exist_ok=True)
        vocab = tokenizer_into(arch, d)
        q8_exact = arch != "llama-quant"
        model = build_model(arch, spec, vocab, d, q8_exact)
        hf[arch] = model
        pre = {"bpe-llama3": "llama-bpe", "bpe-qwen2": "qwen2"}.get(spec["tokenizer"], "")
        f32 = tmp / f"{arch}.f32.gguf"
        lc.convert(d, f32, pre)
        t32, meta = gguf_tensors(f32)
        assert meta["general.architecture"] == spec["gguf_arch"], meta["general.architecture"]
        log(f"{arch}: {sum(v[1].size for v in t32.values())} parameters in the F32 file, vocab {vocab}")

        if arch in ARCH_MODELS:
            dst = out / f"{arch}.q8_0.gguf"
            lc.quantize_to(f32, dst, "Q8_0", ["--pure"])
            tq, meta = gguf_tensors(dst)
            # The Q8_0 file must hold the F32 file's values exactly.
            for name, (ty, w) in t32.items():
                assert name in tq, name
                assert np.array_equal(tq[name][1], w), f"{arch}: {name} ({tq[name][0]}) differs from the F32 file"
            types = type_counts(tq)
            assert set(types) <= {"Q8_0", "F32"}, types
            prompts = [[int(v) for v in rng.integers(0, vocab, n)] for n in ARCH_PROMPT_LENGTHS]
            ref = hf_logits(model, prompts, "sdpa")
            eager = hf_logits(model, prompts, "eager")
            noise = float(np.abs(ref - eager).max())
            lcl = lc.logits(dst, prompts, vocab, tmp)
            # llama.cpp on the F32 file (the same values) multiplies in fp32 without quantizing
            # activations: it must agree with transformers closely, or the file and the
            # reference do not describe the same model.
            lc32 = compare(ref, lc.logits(f32, prompts, vocab, tmp))
            assert lc32["max_abs_diff"] < 1e-2 and lc32["argmax_same"] == lc32["positions"], (arch, lc32)
            ref_file = f"{arch}.transformers.f32"
            write_f32(out / ref_file, ref)
            entry = {"name": arch, "file": dst.name, "sha256_16": sha(dst), "architecture": spec["gguf_arch"],
                     "hf_class": spec["hf_class"], "vocab": vocab,
                     "config": {k: v for k, v in spec["config"].items()},
                     "gguf_metadata": {k: v for k, v in meta.items() if k.startswith(spec["gguf_arch"] + ".")},
                     "tensor_types": types, "has_rope_freqs": "rope_freqs.weight" in tq,
                     "prompts": prompts, "transformers": {"file": ref_file, **per_position(ref, prompts)},
                     "transformers_sdpa_vs_eager_max_abs_diff": noise,
                     "llamacpp_f32_file_vs_transformers": lc32,
                     "llamacpp_vs_transformers": compare(ref, lcl)}
            result["models"].append(entry)
            log(f"{arch}: llama.cpp on F32 {lc32}\n  on Q8_0 {entry['llamacpp_vs_transformers']}, sdpa/eager {noise:.2e}")
            continue

        # llama-quant: the quant types.
        sd32 = llama_state_from_gguf(t32, model.config)
        for k, v in sd32.items():  # the inverse mapping is right: the F32 file maps back exactly
            assert np.array_equal(v, model.state_dict()[k].numpy()), k
        prompts = [[int(v) for v in rng.integers(0, vocab, n)] for n in QUANT_PROMPT_LENGTHS]
        for ftype, extra, want_types in QUANTS:
            dst = out / f"llama-quant.{ftype.lower()}.gguf"
            lc.quantize_to(f32, dst, ftype, extra)
            tq, meta = gguf_tensors(dst)
            types = type_counts(tq)
            assert want_types <= set(types) <= want_types | {"F32"}, (ftype, types)
            qmodel = build_model_copy(model)
            sd = llama_state_from_gguf(tq, model.config)
            missing, unexpected = qmodel.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in sd.items()},
                                                         strict=False)
            assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
            if model.config.tie_word_embeddings:
                assert qmodel.lm_head.weight.data_ptr() == qmodel.model.embed_tokens.weight.data_ptr()
            ref = hf_logits(qmodel, prompts, "sdpa")
            lcl = lc.logits(dst, prompts, vocab, tmp)
            stem = f"llama-quant.{ftype.lower()}"
            write_f32(out / f"{stem}.transformers.f32", ref)
            write_f32(out / f"{stem}.llamacpp.f32", lcl)
            entry = {"name": stem, "file": dst.name, "sha256_16": sha(dst), "ftype": ftype,
                     "llama_quantize_args": extra + [ftype], "architecture": "llama", "vocab": vocab,
                     "config": spec["config"], "tensor_types": types, "must_contain": sorted(want_types),
                     "prompts": prompts,
                     "transformers": {"file": f"{stem}.transformers.f32", **per_position(ref, prompts)},
                     "llamacpp": {"file": f"{stem}.llamacpp.f32", **per_position(lcl, prompts)},
                     "llamacpp_vs_transformers": compare(ref, lcl)}
            # llama.cpp (its C dequantization, its int8 arithmetic) and transformers (gguf-py's
            # numpy dequantization, fp32) must describe the same model: they differ only by
            # llama.cpp's 8-bit activations, small on average.
            lv = entry["llamacpp_vs_transformers"]
            assert lv["mean_kl"] < 0.02 and lv["argmax_same"] >= 0.9 * lv["positions"], (stem, lv)
            result["quant"].append(entry)
            log(f"{stem}: {types}; llama.cpp vs transformers {entry['llamacpp_vs_transformers']}")

    (out / "arch.json").write_text(json.dumps(result, indent=1) + "\n")
    total = sum(p.stat().st_size for p in out.iterdir() if p.suffix in (".gguf", ".f32"))
    log(f"wrote {out} ({total / 1e6:.2f} MB of binary data)")


def build_model_copy(model):
    import copy

    return copy.deepcopy(model)


if __name__ == "__main__":
    main()
