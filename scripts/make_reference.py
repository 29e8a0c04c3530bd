#!/usr/bin/env python3
"""Regenerate the independent reference data under tests/data/reference/.

Run (from the repository root):

    /opt/pdref-venv/bin/python scripts/make_reference.py \\
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/data/reference

The virtualenv is made with `python3 -m venv /opt/pdref-venv` and
`pip install -r scripts/requirements-reference.txt` (torch's CUDA wheels come along,
about 5 GB; everything runs on CPU).  No network access is needed at run time:
everything is read from the GGUF file (HF_HUB_OFFLINE is forced on).  About 15 minutes
on 2 cores; the output is deterministic.

Nothing here uses pdcluster code. Which library produced what:

* tokenizer.json -- token ids from a `tokenizers` (Rust, HF) fast tokenizer built in
  this script from the GGUF's own vocabulary (tokenizer.ggml.tokens), merges
  (tokenizer.ggml.merges) and token types (CONTROL=3 / USER_DEFINED=4 become added
  special tokens), with the pre-tokenizer SmolLM2 really uses:
      Sequence[Digits(individual_digits=True),
               ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]
  a ByteLevel decoder, no normalizer and no BOS/EOS post-processing.

  Why not just `transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...)`?
  transformers' GGUF converter (GGUFGPTConverter) maps every `gpt2`-model GGUF to a
  plain ByteLevel pre-tokenizer and ignores tokenizer.ggml.pre (= "smollm"), so the
  Digits(individual_digits=True) split is lost.  Because the SmolLM2 vocabulary has
  no multi-digit tokens and no "<space>digit" tokens this matters only where
  whitespace directly precedes a digit: e.g. "  42" is [216(" "),216(" "),...] in the
  converted tokenizer but [256("  "),...] in the real one, and "\\n\\n7" differs the
  same way.  The converter also sets no unk token, so the 21 bytes that have no
  byte-level token in this vocabulary (0x04 0x06 0x13 0x14 0x16 0x1d 0xc0 0xc1 0xf1
  0xf2 0xf5-0xff) are silently dropped; the built tokenizer uses the GGUF's
  tokenizer.ggml.unknown_token_id (0, <|endoftext|>) as BPE unk_token, one id per such
  byte.  The script builds both, checks that the converted tokenizer with its
  pre-tokenizer and unk token patched agrees with the built one on every case (so
  vocab and merges were converted correctly), and writes the cases where the
  unpatched converted tokenizer differs into tokenizer.json ("converted_hf_ids") and
  the README.  The patched transformers tokenizer is then used for chat templating
  and its ids are asserted equal to the built one's for every model input below.

* logits.json / logits_<i>.f32 and greedy.json -- `transformers`
  AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32): the
  weights are dequantized with the `gguf` package's numpy dequantizers (Q4_1, Q8_0
  -> fp32) and transformers undoes llama.cpp's Q/K row permutation; the forward pass
  is torch fp32 on CPU ("sdpa" attention).  The script also checks independently
  (with `gguf`) that the embedding equals the dequantized Q8_0 token_embd, that the
  lm_head is tied to it, and that q_proj/k_proj equal the inverse-permuted GGUF rows.

* greedy.json is a manual argmax loop over the KV cache that never stops at EOS; it is
  cross-checked against model.generate(do_sample=False, max_new_tokens=32) with EOS
  stopping disabled (must match exactly, or the script fails; results are kept in
  greedy.json's "generate_crosscheck"), and with min_new_tokens=32, which masks <|im_end|> and so
  differs from the first step where the model picks it.

* Chat prompts are rendered by transformers' apply_chat_template with the GGUF's
  tokenizer.chat_template (also re-rendered here with plain jinja2 and compared).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

N_GREEDY = 32

LONG_PARAGRAPH = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels and flipping switches, and every program was tied to the exact hardware it "
    "ran on. Assembly languages gave names to instructions, and compilers later translated "
    "high-level languages such as FORTRAN and COBOL into machine code, so that a scientist could "
    "describe a calculation without knowing how many registers the processor had. Operating "
    "systems hid the details of disks, terminals and memory behind files and processes. Networks "
    "then connected those machines, and protocols like TCP/IP let programs on different continents "
    "exchange data as if they were neighbours. Today a developer can rent thousands of processors "
    "for an hour, train a language model with billions of parameters, and serve it to millions of "
    "people, all while writing only a few hundred lines of code."
)

LONG_PARAGRAPH_2 = (
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light "
    "energy into chemical energy. In the light-dependent reactions, which take place in the "
    "thylakoid membranes of the chloroplast, chlorophyll absorbs photons and uses their energy to "
    "split water molecules, releasing oxygen as a by-product and producing ATP and NADPH. In the "
    "light-independent reactions, also called the Calvin cycle, the enzyme RuBisCO fixes carbon "
    "dioxide from the air into a five-carbon sugar, and the ATP and NADPH made earlier are spent "
    "to turn the result into glucose and other carbohydrates. Almost all life on Earth depends on "
    "this process, either directly or indirectly, because it supplies both the oxygen animals "
    "breathe and the organic matter at the base of nearly every food chain. Scientists study it "
    "closely in the hope of improving crop yields and designing artificial systems that turn "
    "sunlight into fuel."
)

PY_CODE = (
    "def fibonacci(n: int) -> list[int]:\n"
    "    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n"
    "    seq = [0, 1]\n"
    "    while len(seq) < n:\n"
    "        seq.append(seq[-1] + seq[-2])\n"
    "    return seq[:n]\n"
    "\n"
    "if __name__ == '__main__':\n"
    "\tprint(fibonacci(10))  # tab-indented\n"
)

CPP_CODE = (
    "#include <vector>\n"
    "template <typename T>\n"
    "T sum(const std::vector<T>& v) {\n"
    "  T acc{};\n"
    "  for (auto it = v.begin(); it != v.end(); ++it) { acc += *it; }\n"
    "  return acc >= 0 ? acc : -acc;  // abs\n"
    "}\n"
)

# At least 60 varied strings; order is stable (tests may index by position or text).
TOKENIZER_CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "  leading two spaces",
    " leading one space",
    "trailing spaces   ",
    "multiple    internal     spaces",
    "\ttab\tseparated\tvalues\t",
    "\n",
    "\n\n\n",
    " \n  \n",
    "line one\nline two\n\nline four\n",
    "\r\nWindows line endings\r\n",
    "   \t  \n\t\n  x",
    "café",
    "naïve résumé coöperate",
    "Ångström",
    "e\u0301 (decomposed e-acute) vs \u00e9",
    "Grüße aus München! Die Straße ist schön.",
    "L'été dernier, nous sommes allés à la plage.",
    "¿Dónde está la biblioteca? ¡Mañana será otro día!",
    "Tiếng Việt có dấu",
    "中文是一种语言。我喜欢学习中文。",
    "日本語のテキストです。カタカナとひらがな。",
    "한국어 문장입니다.",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "Γειά σου Κόσμε",
    "שלום עולם",
    "สวัสดีครับ",
    "I love pizza 🍕🍕!",
    "Family: 👨\u200d👩\u200d👧\u200d👦 and rainbow flag 🏳\ufe0f\u200d🌈",
    "Flags: 🇫🇷🇩🇪🇯🇵",
    "👍🏽 thumbs up",
    "12345",
    "3.14159",
    "1,000,000",
    "v2.0.1",
    "The year 2024 had 366 days.",
    "  42",
    "\n\n7 items",
    "x = 10\ny = 20",
    "Full-width ＡＢＣ１２３, roman Ⅻ, fractions ½ ¾, superscript x²",
    "$100.50 and €20 and £5 and ¥1000",
    "2023-10-05T14:30:00Z",
    "don't",
    "I'LL be there, we're ready, you've got it, she'd say, it's mine, I'm sure",
    "O'Reilly's book",
    PY_CODE,
    CPP_CODE,
    "x+=1; y=x**2 // 3 != 4 && z->w || !q; a<<=2;",
    "https://example.com/path/to/page?query=1&foo=bar#fragment",
    "contact: john.doe@example.org",
    "Wait... what?!? (yes) [no] {maybe} <tag> \"quoted\" 'single' — em-dash – en-dash",
    "∑_{i=1}^{n} i² = n(n+1)/2 ≈ ∞ ≠ √2",
    "ALL CAPS SHOUTING AND MiXeD cAsE",
    "# Title\n\n- item 1\n- item 2\n\n**bold** _italic_ `code`",
    '{"key": "value", "num": 12, "arr": [1, 2, 3], "nested": {"a": null}}',
    '<div class="main"><p>Hello &amp; welcome</p></div>',
    "Hello\u00a0world (no-break space)",
    "a\u200bb (zero-width space)",
    "ﬁ ligature",
    "@@@@@!!!!!?????",
    "a",
    "a" * 100,
    LONG_PARAGRAPH,
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>assistant\n",
    "text before <|endoftext|> text after",
    "<|endoftext|><|endoftext|>",
    "<filename>main.py<file_sep>print('x')",
    "not special: <|im_start and im_end|>",
    "ctrl\x04chars\x13in\x1dtext",
    "plane-5 code point \U00050000 (UTF-8 lead byte 0xF1)",
]

LOGIT_CASES = [
    {"name": "capital_france", "text": "The capital of France is"},
    {"name": "paragraph", "text": LONG_PARAGRAPH},
    {"name": "chat_question",
     "messages": [{"role": "user", "content": "What is the boiling point of water in Celsius?"}]},
    {"name": "code", "text": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n"},
]

GREEDY_CASES = [
    {"name": "chat_capital",
     "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"name": "chat_one_word_system",
     "messages": [{"role": "system", "content": "You answer with a single word."},
                  {"role": "user", "content": "What color is a clear daytime sky?"}]},
    {"name": "chat_hello",
     "messages": [{"role": "user", "content": "Say hello."}]},
    {"name": "chat_multi_turn",
     "messages": [{"role": "user", "content": "Hi! My name is Ada."},
                  {"role": "assistant", "content": "Hello Ada! How can I help you today?"},
                  {"role": "user", "content": "What is my name?"}]},
    {"name": "chat_long_summary",
     "messages": [{"role": "user",
                   "content": LONG_PARAGRAPH_2 + "\n\n" + LONG_PARAGRAPH
                   + "\n\nSummarize the two paragraphs above in one sentence."}]},
    {"name": "chat_list",
     "messages": [{"role": "user", "content": "List three fruits."}]},
    {"name": "capital_france", "text": "The capital of France is"},
    {"name": "once_upon", "text": "Once upon a time,"},
    {"name": "hello_single_token", "text": "Hello"},
    {"name": "counting", "text": "1, 2, 3, 4, 5,"},
    {"name": "code_fib", "text": "def fibonacci(n):\n"},
    {"name": "long_raw_paragraph", "text": LONG_PARAGRAPH_2 + " " + LONG_PARAGRAPH + " In short,"},
    # two more meant to have large top-1/top-2 gaps (usable by low-precision engines)
    {"name": "alphabet", "text": "a, b, c, d, e, f, g,"},
    {"name": "chat_count",
     "messages": [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]},
]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- GGUF

def read_gguf_meta(path):
    import gguf
    r = gguf.GGUFReader(path)
    f = r.fields
    meta = {
        "tokens": f["tokenizer.ggml.tokens"].contents(),
        "merges": f["tokenizer.ggml.merges"].contents(),
        "token_type": [int(x) for x in f["tokenizer.ggml.token_type"].contents()],
        "pre": f["tokenizer.ggml.pre"].contents(),
        "model": f["tokenizer.ggml.model"].contents(),
        "chat_template": f["tokenizer.chat_template"].contents(),
        "add_bos": bool(f["tokenizer.ggml.add_bos_token"].contents())
        if "tokenizer.ggml.add_bos_token" in f else None,
        "n_head": int(f["llama.attention.head_count"].contents()),
        "n_head_kv": int(f["llama.attention.head_count_kv"].contents()),
        "rope_theta": float(f["llama.rope.freq_base"].contents()),
        "eos_id": int(f["tokenizer.ggml.eos_token_id"].contents()),
        "unk_id": int(f["tokenizer.ggml.unknown_token_id"].contents())
        if "tokenizer.ggml.unknown_token_id" in f else None,
    }
    return r, meta


# --------------------------------------------------------------------------- tokenizer

SMOLLM_PRE_TOKENIZER_DOC = (
    "Sequence[Digits(individual_digits=True), "
    "ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]"
)


def smollm_pre_tokenizer():
    from tokenizers import pre_tokenizers
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def build_reference_tokenizer(meta):
    from tokenizers import AddedToken, Tokenizer, decoders, models
    assert meta["model"] == "gpt2", meta["model"]
    tokens = meta["tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate tokens in GGUF vocab"
    merges = []
    for m in meta["merges"]:
        a, b = m.split(" ")
        merges.append((a, b))
    unk = tokens[meta["unk_id"]] if meta["unk_id"] is not None else None
    bpe = models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=unk,
                     fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.normalizer = None
    tok.pre_tokenizer = smollm_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = None
    specials = [AddedToken(tokens[i], special=True, normalized=False, lstrip=False,
                           rstrip=False, single_word=False)
                for i, tt in enumerate(meta["token_type"]) if tt in (3, 4)]
    tok.add_special_tokens(specials)
    for s in specials:
        assert tok.token_to_id(s.content) == vocab[s.content]
    return tok


def missing_bytes(meta):
    """Byte values whose byte-level character is not a token (they encode as unk)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    vocab = set(meta["tokens"])
    return sorted(b for b, u in bytes_to_unicode().items() if u not in vocab)


def load_hf_tokenizer(model_dir, gguf_name):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_name)


def backend_of(hf_tok):
    return hf_tok.backend_tokenizer


# --------------------------------------------------------------------------- model

def load_model(model_dir, gguf_name, attn="sdpa"):
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_name,
                                             dtype=torch.float32, attn_implementation=attn)
    m.eval()
    return m


def check_model_weights(model, reader, meta):
    """Independent checks of the GGUF -> torch conversion; returns notes."""
    import gguf
    notes = {}
    tensors = {t.name: t for t in reader.tensors}

    def deq(name):
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)

    emb = model.model.embed_tokens.weight.detach().numpy()
    e_ref = deq("token_embd.weight")
    notes["token_embd_type"] = tensors["token_embd.weight"].tensor_type.name
    notes["embed_max_abs_diff_vs_gguf_dequant"] = float(np.abs(emb - e_ref).max())
    notes["has_output_weight_in_gguf"] = "output.weight" in tensors
    notes["lm_head_tied_to_embedding"] = bool(
        model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr())
    notes["config_tie_word_embeddings"] = bool(model.config.tie_word_embeddings)
    rp = getattr(model.config, "rope_parameters", None) or {}
    notes["config_rope_theta"] = float(rp.get("rope_theta", getattr(model.config, "rope_theta", 0.0)))
    notes["gguf_rope_theta"] = meta["rope_theta"]
    notes["config_rms_norm_eps"] = float(model.config.rms_norm_eps)

    def unpermute(w, n_head):
        # inverse of llama.cpp convert_hf_to_gguf.py LlamaModel.permute
        return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
                .swapaxes(1, 2).reshape(w.shape))

    worst = 0.0
    for li in (0, len(model.model.layers) - 1):
        layer = model.model.layers[li].self_attn
        q = unpermute(deq(f"blk.{li}.attn_q.weight"), meta["n_head"])
        k = unpermute(deq(f"blk.{li}.attn_k.weight"), meta["n_head_kv"])
        worst = max(worst, float(np.abs(layer.q_proj.weight.detach().numpy() - q).max()),
                    float(np.abs(layer.k_proj.weight.detach().numpy() - k).max()))
        v = deq(f"blk.{li}.attn_v.weight")
        worst = max(worst, float(np.abs(layer.v_proj.weight.detach().numpy() - v).max()))
    notes["qkv_max_abs_diff_vs_unpermuted_gguf"] = worst
    return notes


def greedy_manual(model, prompt_ids, n):
    import torch
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out_ids, gaps = [], []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1]
        for step in range(n):
            top = torch.topk(logits, 2)
            tok = int(top.indices[0])
            out_ids.append(tok)
            gaps.append(float(top.values[0] - top.values[1]))
            if step == n - 1:
                break
            out = model(input_ids=torch.tensor([[tok]], dtype=torch.long),
                        past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
    return out_ids, gaps


def greedy_generate(model, prompt_ids, n, suppress_eos):
    """model.generate cross-check.  suppress_eos=False: EOS stopping disabled (no eos id)
    so generate must reproduce the manual loop; True: the brief's
    min_new_tokens=n with the model's eos id, which masks <|im_end|> for all n steps."""
    import torch
    from transformers import GenerationConfig
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    if suppress_eos:
        gc = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n,
                              eos_token_id=model.config.eos_token_id,
                              pad_token_id=model.config.pad_token_id)
    else:
        gc = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None,
                              pad_token_id=model.config.pad_token_id)
    # generate() fills an unset eos_token_id from model.generation_config (eos=2 from the
    # GGUF), so it has to be cleared there too to really disable EOS stopping.
    saved = model.generation_config.eos_token_id
    if not suppress_eos:
        model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    finally:
        model.generation_config.eos_token_id = saved
    return [int(x) for x in out[0, len(prompt_ids):]]


# --------------------------------------------------------------------------- main

def versions():
    import gguf  # noqa: F401
    import importlib.metadata as md
    import tokenizers
    import torch
    import transformers
    return {
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "torch": torch.__version__,
        "gguf": md.version("gguf"),
        "numpy": np.__version__,
        "python": sys.version.split()[0],
    }


def generator_string(v):
    return ", ".join(f"{k} {v[k]}" for k in ("transformers", "tokenizers", "torch", "gguf", "numpy"))


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default="tests/data/reference")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--skip-model", action="store_true", help="only write tokenizer.json")
    args = ap.parse_args()

    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model_path = os.path.abspath(args.model)
    model_dir, gguf_name = os.path.split(model_path)
    os.makedirs(args.out, exist_ok=True)
    ver = versions()
    gen = generator_string(ver)
    log("versions:", gen)

    reader, meta = read_gguf_meta(model_path)
    log(f"gguf: tokenizer model={meta['model']} pre={meta['pre']} add_bos={meta['add_bos']} "
        f"n_tokens={len(meta['tokens'])} n_merges={len(meta['merges'])}")

    # ---------------- tokenizer
    ref_tok = build_reference_tokenizer(meta)
    hf_tok = load_hf_tokenizer(model_dir, gguf_name)
    backend = backend_of(hf_tok)
    conv = json.loads(backend.to_str())
    want_pre = json.loads(ref_tok.to_str())["pre_tokenizer"]
    conv_pre = conv["pre_tokenizer"]
    pre_matches = conv_pre == want_pre
    log("converted pre_tokenizer:", json.dumps(conv_pre))
    log("reference pre_tokenizer:", json.dumps(want_pre))
    conv_summary = {
        "pre_tokenizer": conv_pre,
        "normalizer": conv["normalizer"],
        "decoder": conv["decoder"],
        "added_tokens": [a["content"] for a in conv["added_tokens"]],
        "vocab_size": len(conv["model"]["vocab"]),
        "n_merges": len(conv["model"]["merges"]),
    }

    def hf_encode(text):
        return hf_tok.encode(text, add_special_tokens=False)

    miss = missing_bytes(meta)
    miss_chars = set()
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    b2u = bytes_to_unicode()

    def has_missing_byte(text):
        return any(b in miss for b in text.encode("utf-8"))

    # 1) the unpatched transformers-converted tokenizer (a second, untouched copy: the BPE
    #    word cache would otherwise hide the unk patch below)
    hf_conv = load_hf_tokenizer(model_dir, gguf_name)
    unpatched = {t: hf_conv.encode(t, add_special_tokens=False) for t in TOKENIZER_CORPUS}
    del hf_conv
    # 2) patch it (pre-tokenizer, unk) and require full agreement with the built one
    conv_unk = conv["model"].get("unk_token")
    if not pre_matches:
        backend.pre_tokenizer = smollm_pre_tokenizer()
    ref_unk = meta["tokens"][meta["unk_id"]] if meta["unk_id"] is not None else None
    if conv_unk != ref_unk:
        backend.model.unk_token = ref_unk
    cases = []
    conv_diffs = []
    for text in TOKENIZER_CORPUS:
        ids = ref_tok.encode(text, add_special_tokens=False).ids
        patched = hf_encode(text)
        if patched != ids:
            raise SystemExit(f"patched transformers tokenizer disagrees with reference on {text!r}:\n"
                             f"  ref {ids}\n  hf  {patched}")
        case = {"text": text, "ids": ids}
        decoded = ref_tok.decode(ids, skip_special_tokens=False)
        hf_decoded = hf_tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert decoded == hf_decoded, (text, decoded, hf_decoded)
        if decoded != text:
            case["decoded"] = decoded
            log(f"note: decode differs from text for {text!r}: {decoded!r}")
        if has_missing_byte(text):
            case["note"] = ("contains UTF-8 bytes with no byte token "
                            f"({sorted(set(hex(b) for b in text.encode('utf-8') if b in miss))}); "
                            f"each such byte encodes as unk id {meta['unk_id']}")
        if unpatched[text] != ids:
            case["converted_hf_ids"] = unpatched[text]
            conv_diffs.append(text)
        cases.append(case)
    log(f"tokenizer: {len(cases)} cases; unpatched transformers-converted tokenizer differs on "
        f"{len(conv_diffs)}: {conv_diffs!r}")
    conv_summary["unk_token"] = conv_unk

    tok_json = {
        "model": gguf_name,
        "generator": gen,
        "tokenizer": {
            "built_with": "tokenizers.Tokenizer(models.BPE(GGUF tokens, GGUF merges))",
            "pre_tokenizer": SMOLLM_PRE_TOKENIZER_DOC,
            "normalizer": None,
            "decoder": "ByteLevel",
            "special_tokens": [meta["tokens"][i] for i, tt in enumerate(meta["token_type"])
                               if tt in (3, 4)],
            "add_bos": False,
            "unk_token": meta["tokens"][meta["unk_id"]] if meta["unk_id"] is not None else None,
            "unk_id": meta["unk_id"],
            "bytes_without_token": [f"0x{b:02x}" for b in missing_bytes(meta)],
            "encode_call": "encode(text, add_special_tokens=False); special-token text is matched",
        },
        "transformers_converted_pre_tokenizer_matches": pre_matches,
        "transformers_converted_summary": conv_summary,
        "transformers_converted_differs_on": conv_diffs,
        "cases": cases,
    }
    write_json(os.path.join(args.out, "tokenizer.json"), tok_json)
    if args.skip_model:
        return

    # ---------------- chat template
    import jinja2
    gguf_tpl = meta["chat_template"]
    assert hf_tok.chat_template == gguf_tpl, "transformers did not carry the GGUF chat template"
    j2 = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(gguf_tpl)

    def render_chat(messages):
        s = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        s2 = j2.render(messages=messages, add_generation_prompt=True)
        assert s == s2, (s, s2)
        return s

    def encode(text):
        ids = ref_tok.encode(text, add_special_tokens=False).ids
        assert ids == hf_encode(text)
        return ids

    # ---------------- model
    t0 = time.time()
    model = load_model(model_dir, gguf_name)
    log(f"model loaded in {time.time() - t0:.1f}s")
    weight_notes = check_model_weights(model, reader, meta)
    log("weights:", weight_notes)
    assert weight_notes["embed_max_abs_diff_vs_gguf_dequant"] == 0.0
    assert weight_notes["qkv_max_abs_diff_vs_unpermuted_gguf"] == 0.0
    assert weight_notes["lm_head_tied_to_embedding"]
    assert weight_notes["config_rope_theta"] == meta["rope_theta"]
    model_eager = load_model(model_dir, gguf_name, attn="eager")

    # ---------------- logits
    logit_cases = []
    for i, c in enumerate(LOGIT_CASES):
        if "messages" in c:
            text = render_chat(c["messages"])
        else:
            text = c["text"]
        ids = encode(text)
        with torch.no_grad():
            lg = model(input_ids=torch.tensor([ids])).logits[0, -1].float().numpy()
            lg_eager = model_eager(input_ids=torch.tensor([ids])).logits[0, -1].float().numpy()
            # full-prefix pass vs KV-cache pass of the last token (same model)
            pre = model(input_ids=torch.tensor([ids[:-1]]), use_cache=True) if len(ids) > 1 else None
            if pre is not None:
                lg_kv = model(input_ids=torch.tensor([ids[-1:]]), past_key_values=pre.past_key_values,
                              use_cache=True).logits[0, -1].float().numpy()
            else:
                lg_kv = lg
        assert lg.shape == (len(meta["tokens"]),)
        fname = f"logits_{i}.f32"
        lg.astype("<f4").tofile(os.path.join(args.out, fname))
        order = np.argsort(-lg, kind="stable")
        entry = {
            "name": c["name"],
            "text": text,
            "ids": ids,
            "file": fname,
            "argmax": int(order[0]),
            "top5": [[int(t), float(lg[t])] for t in order[:5]],
            "top2_gap": float(lg[order[0]] - lg[order[1]]),
            "argmax_text": ref_tok.decode([int(order[0])]),
            "stats": {"min": float(lg.min()), "max": float(lg.max()), "mean": float(lg.mean()),
                      "std": float(lg.std())},
            "noise": {
                "max_abs_diff_sdpa_vs_eager": float(np.abs(lg - lg_eager).max()),
                "max_abs_diff_full_vs_kvcache": float(np.abs(lg - lg_kv).max()),
            },
        }
        if "messages" in c:
            entry["messages"] = c["messages"]
        logit_cases.append(entry)
        log(f"logits[{i}] {c['name']}: n_prompt={len(ids)} argmax={entry['argmax']} "
            f"({entry['argmax_text']!r}) gap={entry['top2_gap']:.4f} noise={entry['noise']}")
    del model_eager
    write_json(os.path.join(args.out, "logits.json"), {
        "model": gguf_name,
        "generator": gen,
        "vocab": len(meta["tokens"]),
        "dtype": "float32 little-endian, last prompt position only",
        "weights": weight_notes,
        "cases": logit_cases,
    })

    # ---------------- greedy
    greedy_cases = []
    crosscheck = []
    for gi, c in enumerate(GREEDY_CASES):
        chat = "messages" in c
        prompt = render_chat(c["messages"]) if chat else c["text"]
        ids = encode(prompt)
        t1 = time.time()
        out_ids, gaps = greedy_manual(model, ids, N_GREEDY)
        entry = {"name": c["name"], "chat": chat}
        if chat:
            entry["messages"] = c["messages"]
        eos_pos = out_ids.index(meta["eos_id"]) if meta["eos_id"] in out_ids else None
        entry.update({
            "prompt": prompt,
            "prompt_ids": ids,
            "output_ids": out_ids,
            "top2_gap": gaps,
            "text": ref_tok.decode(out_ids, skip_special_tokens=False),
            "first_eos_step": eos_pos,
            "min_top2_gap": min(gaps),
            # number of leading steps whose top-1/top-2 gap is >= tau: output_ids[:n] are safe
            # to compare for an engine whose logit error stays below tau/2
            "stable_prefix": {str(tau): next((k for k, g in enumerate(gaps) if g < tau), N_GREEDY)
                              for tau in (0.05, 0.5, 1.0)},
        })
        # generate() cross-checks on the first two chat and first two plain cases
        if gi in (0, 1, 6, 7):
            g_noeos = greedy_generate(model, ids, N_GREEDY, suppress_eos=False)
            g_min = greedy_generate(model, ids, N_GREEDY, suppress_eos=True)
            first_diff = next((k for k in range(N_GREEDY) if g_min[k] != out_ids[k]), None)
            cc = {"name": c["name"],
                  "generate_eos_disabled_matches": g_noeos == out_ids,
                  "generate_min_new_tokens_matches": g_min == out_ids,
                  "generate_min_new_tokens_first_diff_step": first_diff,
                  "manual_first_eos_step": eos_pos}
            if not cc["generate_eos_disabled_matches"]:
                raise SystemExit(f"generate() disagrees with the manual greedy loop: {cc}")
            crosscheck.append(cc)
            log("crosscheck:", cc)
        greedy_cases.append(entry)
        log(f"greedy[{gi}] {c['name']}: n_prompt={len(ids)} eos_step={eos_pos} "
            f"min_gap={min(gaps):.4f} ({time.time() - t1:.1f}s) text={entry['text'][:80]!r}")

    write_json(os.path.join(args.out, "greedy.json"), {
        "model": gguf_name,
        "generator": gen,
        "n_tokens": N_GREEDY,
        "eos_id": meta["eos_id"],
        "note": "manual argmax loop with transformers' KV cache; EOS is NOT a stop: the chosen id "
                "(even <|im_end|>) is fed back and the loop always runs n_tokens steps. "
                "top2_gap = top-1 minus top-2 logit at that step; compare output_ids only "
                "up to stable_prefix[tau] (see README.md).",
        "generate_crosscheck": crosscheck,
        "cases": greedy_cases,
    })
    log("done")


if __name__ == "__main__":
    main()
