#!/usr/bin/env python3
"""Reference token ids for a SentencePiece-style GGUF vocabulary (Gemma 3) -> tests/data/reference_gemma3/.

Run (from the repository root):

    /opt/pdref-venv/bin/python scripts/make_tokenizer_reference_gemma3.py \\
        --model models/gemma-3-270m-q4_k_m.gguf --out tests/data/reference_gemma3 \\
        [--llama-tokenize PATH/TO/llama-tokenize]

The venv is scripts/requirements-reference.txt's. No network is used (HF_HUB_OFFLINE is forced on);
about 3 minutes on 2 cores, most of it transformers building 514,906 merges. Deterministic.

Nothing here uses pdcluster code. The reference is Hugging Face `tokenizers`, as built by transformers'
GGUF loader, `AutoTokenizer.from_pretrained(dir, gguf_file=...)`: for architecture gemma3 it makes a
`GemmaTokenizer` (BPE with byte fallback, normalizer Replace(" ", "\u2581"), no prefix space) whose
merges it derives from the vocabulary -- every split of a token into two tokens, ordered by the token's
position in the file (not by its score), longer left part first -- after respelling the
whitespace-run tokens that the GGUF stores as real spaces ("  ") as "\u2581\u2581". Control tokens
(token_type 3) become special added tokens and user-defined ones (4, e.g. "\\n", "\\t\\t", "<b>") plain
added tokens. The script checks that the converted merge list is ordered by exactly that rule (the rule
the C++ tokenizer implements), so a change in transformers' converter fails here loudly.

Outputs:
  tokenizer.json  the cases: {"text", "ids"} (encode(text, add_special_tokens=False); special-token text
                  IS matched), "hex" instead of "text" for byte strings that are not UTF-8, "decoded"
                  where HF's decode differs from the text, "llama_cpp_ids" where llama.cpp differs.
  vocab.json      the part of the vocabulary these cases can ever reach (every token that is a
                  substring of a case, before or after the space -> "\u2581" replacement, all byte
                  tokens, the special ids), with ids, token types and scores as the GGUF has them, so a
                  unit test can rebuild an equivalent tokenizer without the 250 MB model file. BPE only
                  ever forms tokens that are substrings of the text, so the subset encodes these cases
                  exactly as the full vocabulary does (the script checks this too, with `tokenizers`).

Byte strings that are not UTF-8 cannot be handed to HF (it takes str). For them the reference is
composed: each ill-formed byte becomes its byte token <0xXX> -- what HF's byte fallback does for a
character with no token -- and each run of valid text in between is encoded by HF. This is exact
because a byte token never merges (the script checks that no token of the vocabulary starts or ends with
a byte token's text, so no merge can involve one) and no added token contains an ill-formed byte.

llama.cpp (optional, --llama-tokenize): its SPM tokenizer is run on every case (--no-bos, special
tokens parsed) and differences are recorded; see the README for what they are and why.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SP = "\u2581"

# (text or bytes). Bytes are used only where the input is not valid UTF-8.
CASES: list = [
    "",
    " ",
    "  ",
    "a",
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "trailing space ",
    "two  spaces and   three",
    "a" + " " * 31 + "b",
    "a" + " " * 32 + "b",
    " " * 40 + "x",
    " " * 64,
    "tab\tseparated\tvalues",
    "\t\tindented with tabs",
    "\t" * 35 + "deep",
    "line one\nline two\n\nline four\n\n\n\nend",
    "\n" * 40,
    "windows\r\nline\r\nendings\r\n",
    "mixed \t \n whitespace \n\t ",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade",
    "cafe\u0301 decomposed",
    "\u00dcber Stra\u00dfe gr\u00f6\u00dfer \u00c4rger",
    "Vi\u1ec7t Nam xin ch\u00e0o",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002",
    "\u4e2d\u6587\u5206\u8bcd\u6d4b\u8bd5\uff0c\u6807\u70b9\u7b26\u53f7\u3002",
    "\u7e41\u9ad4\u4e2d\u6587\u8207\u7c21\u9ad4\u4e2d\u6587",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8\uc785\ub2c8\ub2e4.",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u042d\u0442\u043e \u0442\u0435\u0441\u0442.",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u0936\u0941\u092d \u092a\u094d\u0930\u092d\u093e\u0924, \u0906\u092a \u0915\u0948\u0938\u0947 \u0939\u0948\u0902?",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a \u0e22\u0e34\u0e19\u0e14\u0e35\u0e15\u0e49\u0e2d\u0e19\u0e23\u0e31\u0e1a",
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u10d2\u10d0\u10db\u10d0\u10e0\u10ef\u10dd\u10d1\u10d0",
    "\u0bb5\u0ba3\u0b95\u0bcd\u0b95\u0bae\u0bcd",
    "emoji \U0001f600\U0001f602\U0001f44d\U0001f3fd",
    "family \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 flag \U0001f3f3\ufe0f\u200d\U0001f308",
    "flags \U0001f1ef\U0001f1f5\U0001f1fa\U0001f1f8",
    "rare \U0001d518\U0001d52b\U0001d526 \U00010348 \U0001f9ec\U0001fae0",
    "private use \ue000\uf8ff and \U000f0000",
    "12345 3.14159 1,000,000 v2.0.1",
    "full-width \uff11\uff12\uff13 roman \u216b \u00bd \u00b2",
    "2024-01-15T10:30:00Z",
    "0x1F 0b1010 1e-9",
    "def f(x):\n    return x ** 2  # square\n",
    "int main() {\n\treturn 0;\n}\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    "https://example.com/path?query=1&x=y#frag",
    "<div class=\"x\"><b>bold</b> and <i>italic</i></div>",
    "| a | b |\n|---|---|\n| 1 | 2 |",
    "**Markdown** _emphasis_ `code` > quote",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "text<eos>more<bos>text<pad>",
    "<unused0><unused123> inside",
    "<start_of_turn",
    "almost <end_of_turn special",
    "<0x41> is literal text",
    "\u2581 already a metaspace \u2581\u2581",
    "I'm can't won't they'll we've",
    "ALL CAPS TEXT AND lower case",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "a\u00a0non-breaking\u2003em\u3000ideographic space",
    "zero\u200bwidth\u200cjoiner\u200d",
    "control \x01\x02\x7f chars",
    "\x00null byte",
    "The quick brown fox jumps over the lazy dog. " * 6,
    b"invalid \xff byte",
    b"\xc3\x28 bad continuation",
    b"truncated \xe6\x97",
    b"\xf0\x9f\x98 cut emoji then ok \xf0\x9f\x98\x80",
    b"\xed\xa0\x80 surrogate half",
    b"\x80\x81\x82\xfe",
]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def read_meta(path):
    from gguf import GGUFReader
    r = GGUFReader(path)

    def scalar(key, default=None):
        f = r.fields.get(key)
        return f.contents() if f is not None else default

    return {
        "tokens": r.fields["tokenizer.ggml.tokens"].contents(),
        "types": [int(t) for t in r.fields["tokenizer.ggml.token_type"].contents()],
        "scores": [float(s) for s in r.fields["tokenizer.ggml.scores"].contents()],
        "model": scalar("tokenizer.ggml.model"),
        "pre": scalar("tokenizer.ggml.pre"),
        "arch": scalar("general.architecture"),
        "bos": scalar("tokenizer.ggml.bos_token_id"),
        "eos": scalar("tokenizer.ggml.eos_token_id"),
        "unk": scalar("tokenizer.ggml.unknown_token_id"),
        "pad": scalar("tokenizer.ggml.padding_token_id"),
        "add_bos": scalar("tokenizer.ggml.add_bos_token"),
        "add_space_prefix": scalar("tokenizer.ggml.add_space_prefix"),
    }


def valid_runs(data: bytes):
    """Splits bytes into ("text", str) runs of valid UTF-8 and ("byte", int) ill-formed bytes
    (each byte of a maximal ill-formed subpart on its own, as Python's decoder reports them)."""
    out, i = [], 0
    while i < len(data):
        try:
            out.append(("text", data[i:].decode("utf-8")))
            break
        except UnicodeDecodeError as e:
            if e.start > 0:
                out.append(("text", data[i:i + e.start].decode("utf-8")))
            for b in data[i + e.start:i + e.end]:
                out.append(("byte", b))
            i += e.end
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--llama-tokenize", default="")
    args = ap.parse_args()

    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    meta = read_meta(args.model)
    assert meta["model"] == "llama", meta["model"]
    tokens, types = meta["tokens"], meta["types"]
    model_dir, gguf_name = os.path.split(os.path.abspath(args.model))
    log("loading transformers' tokenizer from the GGUF (slow: it derives the merges)...")
    hf = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_name)
    backend = hf.backend_tokenizer
    conv = json.loads(backend.to_str())
    vocab = conv["model"]["vocab"]
    merges = conv["model"]["merges"]

    # The converted merges are ordered by (position of the merged token in the file, longer left part
    # first): the rule the C++ tokenizer applies without materialising the list.
    def cp_len(s):
        return len(s)
    keys = [(vocab[l + r], -cp_len(l)) for l, r in merges]
    assert keys == sorted(keys), "transformers' merge order is not (token id, longer left first)"
    assert len(set(keys)) == len(keys)
    log(f"merges: {len(merges)}, ordered by (merged token id, longer left first): ok")

    # Byte tokens never take part in a merge.
    byte_texts = [f"<0x{b:02X}>" for b in range(256)]
    byte_set = set(byte_texts)
    for t in vocab:
        if t in byte_set:
            continue
        assert not any(t.startswith(b) or t.endswith(b) for b in byte_texts if b in t), t

    added = {a["content"]: a for a in conv["added_tokens"]}

    def hf_encode(text):
        return hf.encode(text, add_special_tokens=False)

    def hf_decode(ids):
        return hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    cases = []
    for c in CASES:
        if isinstance(c, bytes):
            ids = []
            for kind, v in valid_runs(c):
                ids += hf_encode(v) if kind == "text" else [vocab[f"<0x{v:02X}>"]]
            case = {"hex": c.hex(), "ids": ids,
                    "note": "not UTF-8: ill-formed bytes as their byte tokens, valid runs encoded by HF"}
        else:
            ids = hf_encode(c)
            case = {"text": c, "ids": ids}
            dec = hf_decode(ids)
            if dec != c:
                case["decoded"] = dec
        cases.append(case)

    # Long text: the first 8 KB of the evaluation novel (the whole file is checked by the C++ model test
    # against its own result's length only; ids this long are not worth storing).
    novel_path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "text",
                              "pride_and_prejudice_ch1-11.txt")
    with open(novel_path, encoding="utf-8") as f:
        novel = f.read()[:8192]
    cases.append({"text": novel, "ids": hf_encode(novel), "name": "pride_and_prejudice_ch1-11.txt[:8192]"})

    # llama.cpp, for the record.
    n_llama_diff = 0
    if args.llama_tokenize:
        for case in cases:
            data = bytes.fromhex(case["hex"]) if "hex" in case else case["text"].encode("utf-8")
            with tempfile.NamedTemporaryFile(delete=False) as f:
                f.write(data)
                p = f.name
            try:
                out = subprocess.run([args.llama_tokenize, "-m", args.model, "-f", p, "--ids", "--no-bos",
                                      "--log-disable", "--no-escape"], capture_output=True, check=True).stdout
            finally:
                os.unlink(p)
            line = [ln for ln in out.decode("utf-8", "replace").splitlines() if ln.startswith("[")][-1]
            ll = json.loads(line)
            if ll != case["ids"]:
                case["llama_cpp_ids"] = ll
                n_llama_diff += 1
        log(f"llama.cpp differs on {n_llama_diff} of {len(cases)} cases")

    # The vocabulary subset: every token these cases can reach.
    hf_vocab_by_id = {i: t for t, i in vocab.items()}
    max_len = max(len(t) for t in vocab)
    need = {i for i in (meta["bos"], meta["eos"], meta["unk"], meta["pad"]) if i is not None}
    need |= {i for i, t in enumerate(tokens) if t in ("<start_of_turn>", "<end_of_turn>")}
    for case in cases:
        data = bytes.fromhex(case["hex"]) if "hex" in case else case["text"].encode("utf-8")
        text = data.decode("utf-8", "replace")
        for s in (text, text.replace(" ", SP)):
            for i in range(len(s)):
                for j in range(i + 1, min(len(s), i + max_len) + 1):
                    tid = vocab.get(s[i:j])
                    if tid is not None:
                        need.add(tid)
    for b in byte_texts:
        need.add(vocab[b])
    subset = sorted(need)
    log(f"vocabulary subset: {len(subset)} tokens")

    # The subset must encode every case as the full vocabulary does: rebuild the same BPE from it.
    sub_vocab = {hf_vocab_by_id[i]: i for i in subset}
    sub_merges = [(l, r) for l, r in merges if l in sub_vocab and r in sub_vocab and (l + r) in sub_vocab]
    sub = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=sub_vocab, merges=sub_merges, unk_token="<unk>",
                                                     fuse_unk=True, byte_fallback=True))
    sub.normalizer = backend.normalizer
    sub.pre_tokenizer = backend.pre_tokenizer
    sub.add_tokens([tokenizers.AddedToken(a["content"], normalized=False, special=a["special"])
                    for a in conv["added_tokens"] if a["content"] in sub_vocab])
    for case in cases:
        if "text" in case:
            got = sub.encode(case["text"], add_special_tokens=False).ids
            assert got == case["ids"], (case["text"][:60], got[:20], case["ids"][:20])
    log("subset tokenizer agrees on every text case: ok")

    os.makedirs(args.out, exist_ok=True)
    gen = (f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, "
           f"gguf-py (reader)")
    common = {"model": os.path.basename(args.model), "generator": gen}
    with open(os.path.join(args.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        head = dict(common, **{
            "encode_call": "encode(text, add_special_tokens=False); special-token text is matched",
            "n_vocab": len(tokens),
            "llama_cpp_compared": bool(args.llama_tokenize),
            "llama_cpp_differs_on": n_llama_diff})
        f.write(json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [\n')
        f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
        f.write("\n]}\n")
    with open(os.path.join(args.out, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(dict(common, **{
            "n_vocab": len(tokens), "architecture": meta["arch"], "tokenizer_model": meta["model"],
            "pre": meta["pre"], "bos_token_id": meta["bos"], "eos_token_id": meta["eos"],
            "unknown_token_id": meta["unk"], "padding_token_id": meta["pad"],
            "add_bos_token": bool(meta["add_bos"]), "add_space_prefix": bool(meta["add_space_prefix"]),
            "tokens": [[i, tokens[i], types[i], meta["scores"][i]] for i in subset]}),
            f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    log("written", args.out)


if __name__ == "__main__":
    main()
