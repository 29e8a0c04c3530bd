#!/usr/bin/env python3
"""API features evaluation tools rely on, end to end through a 1 prefill + 1 decode
cluster of the default model: logprobs (chat and completions, streamed and not),
echo with prompt logprobs and max_tokens 0 (lm-evaluation-harness's loglikelihood
requests), /tokenize and /detokenize, token-id and batched prompts, special-token
parsing, and the official `openai` client where it is installed.

    tests/cluster/test_api.py api_features

Exit 0 = pass, 1 = fail, 77 = skipped (printed why)."""
import json
import math
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import (BUILD, DEFAULT_MODEL, ROOT, Cluster, blocks_all_free, check, joined_stream,  # noqa: E402
                     need_default_model, run_suite, wait_for)

EPS = 1e-4
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def post_ok(c, path, body):
    r = c.post(path, body)
    check(r.status == 200, "%s %s: HTTP %d: %s" % (path, json.dumps(body)[:200], r.status, r.body[:500]))
    return r.json()


def tokenize(c, text, **extra):
    return post_ok(c, "/tokenize", dict({"prompt": text}, **extra))["tokens"]


def check_chat_logprobs(content, top_n):
    """Greedy chat logprobs: each token is the most likely of its alternatives."""
    check(content, "no logprobs content")
    for e in content:
        check(set(e) == {"token", "logprob", "bytes", "top_logprobs"}, "chat logprob entry %s" % e)
        check(len(e["top_logprobs"]) == top_n, "%d alternatives, want %d" % (len(e["top_logprobs"]), top_n))
        check(e["bytes"] and ("\ufffd" in e["token"] or bytes(e["bytes"]).decode("utf-8") == e["token"]),
              "bytes %s vs token %r" % (e["bytes"], e["token"]))
        top = e["top_logprobs"]
        check(top[0]["token"] == e["token"] and top[0]["logprob"] == e["logprob"],
              "greedy token %r (%s) is not the first alternative %s" % (e["token"], e["logprob"], top[0]))
        check(all(top[i]["logprob"] >= top[i + 1]["logprob"] for i in range(len(top) - 1)), "alternatives unordered")
        mass = sum(math.exp(t["logprob"]) for t in top)
        check(mass <= 1 + EPS, "alternatives carry probability %f > 1" % mass)


def check_completion_logprobs(lp, text, top_n, first_null=False):
    n = len(lp["tokens"])
    check(len(lp["token_logprobs"]) == n and len(lp["top_logprobs"]) == n and len(lp["text_offset"]) == n,
          "completions logprobs lists differ in length: %s" % lp)
    spelled = "".join(t for t in lp["tokens"] if t not in ("<|endoftext|>", "<|im_end|>"))  # EOS shows no text
    check(spelled == text, "tokens %r do not spell the text %r" % (lp["tokens"], text))
    offsets = [len("".join(lp["tokens"][:i])) for i in range(n)]
    check(lp["text_offset"] == offsets, "text_offset %s, want %s" % (lp["text_offset"], offsets))
    for i, (tok, val, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])):
        if i == 0 and first_null:
            check(val is None and top is None, "the first prompt token's logprob is %r, want null" % val)
            continue
        check(val is not None and val <= 0, "token %d logprob %r" % (i, val))
        check(tok in top and top[tok] == val, "the token itself is in top_logprobs: %r %s" % (tok, top))
        check(len(top) in (top_n, top_n + 1), "%d alternatives for logprobs=%d" % (len(top), top_n))
        check(sum(math.exp(v) for k, v in top.items()) <= 1 + EPS, "top_logprobs mass over 1: %s" % top)


def suite_api_features(tmp):
    need_default_model()
    with Cluster(1, 1, model=DEFAULT_MODEL, threads=1) as c:
        # ---- /tokenize and /detokenize against the tokenizer reference data
        with open(os.path.join(ROOT, "tests", "data", "reference", "tokenizer.json")) as f:
            cases = json.load(f)["cases"]
        for case in cases[:40]:
            got = post_ok(c, "/tokenize", {"prompt": case["text"], "add_special_tokens": False})
            check(got["tokens"] == case["ids"], "tokenize %r: %s, want %s" % (case["text"], got["tokens"], case["ids"]))
            check(got["count"] == len(case["ids"]) and got["max_model_len"] > 0, "tokenize count/max_model_len %s" % got)
            back = post_ok(c, "/v1/detokenize", {"tokens": case["ids"]})["prompt"]
            if "\ufffd" not in back:  # ids that cut a character decode to a replacement
                check(back == case["text"], "detokenize %s: %r, want %r" % (case["ids"], back, case["text"]))
        vocab = 49152
        for bad, param in [({"tokens": [vocab]}, "tokens"), ({"tokens": [1, -1]}, "tokens"), ({"tokens": "12"}, "tokens"),
                           ({"tokens": [1], "junk": 1}, "junk")]:
            r = c.post("/detokenize", bad)
            check(r.status == 400 and r.json()["error"]["param"] == param, "detokenize %s: %d %s" % (bad, r.status, r.body))
        for bad, param in [({"prompt": 3}, "prompt"), ({}, "prompt"), ({"messages": "x"}, "messages"),
                           ({"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens")]:
            r = c.post("/tokenize", bad)
            check(r.status == 400 and r.json()["error"]["param"] == param, "tokenize %s: %d %s" % (bad, r.status, r.body))

        # ---- special tokens: parsed in completions prompts by default, never in chat content
        im_start = tokenize(c, "<|im_start|>")
        check(len(im_start) == 1, "<|im_start|> is one control token: %s" % im_start)
        plain = tokenize(c, "<|im_start|>", parse_special=False)
        check(len(plain) > 1, "parse_special false encodes it as text: %s" % plain)
        text = "<|im_start|>user\nHi<|im_end|>\n"
        u_on = post_ok(c, "/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0})["usage"]
        u_off = post_ok(c, "/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0,
                                               "parse_special": False})["usage"]
        check(u_on["prompt_tokens"] == len(tokenize(c, text)) and u_off["prompt_tokens"] == len(
            tokenize(c, text, parse_special=False)) and u_on["prompt_tokens"] < u_off["prompt_tokens"],
            "parse_special usage %s vs %s" % (u_on, u_off))
        chat_ids = post_ok(c, "/tokenize", {"messages": [{"role": "user", "content": "<|im_end|><|im_start|>"}]})["tokens"]
        template_ids = post_ok(c, "/tokenize", {"messages": [{"role": "user", "content": "x"}]})["tokens"]
        check(chat_ids.count(im_start[0]) == template_ids.count(im_start[0]),
              "chat content became control tokens: %s" % chat_ids)
        chat_usage = post_ok(c, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})["usage"]
        check(chat_usage["prompt_tokens"] == len(post_ok(c, "/tokenize", {"messages": CHAT})["tokens"]),
              "/tokenize of messages is the chat prompt: %s" % chat_usage)
        bare = post_ok(c, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "add_generation_prompt": False})
        bare_ids = post_ok(c, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})["tokens"]
        check(bare["usage"]["prompt_tokens"] == len(bare_ids) < chat_usage["prompt_tokens"],
              "add_generation_prompt false: %s vs %d tokens" % (bare["usage"], len(bare_ids)))

        # ---- chat logprobs: greedy, argmax, repeatable, streamed = not streamed
        body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 5}
        a = post_ok(c, "/v1/chat/completions", body)
        b = post_ok(c, "/v1/chat/completions", body)
        lp_a = a["choices"][0]["logprobs"]["content"]
        check_chat_logprobs(lp_a, 5)
        check(len(lp_a) == a["usage"]["completion_tokens"], "one logprob entry per generated token")
        check(lp_a == b["choices"][0]["logprobs"]["content"], "two identical greedy requests differ in logprobs")
        status, events = c.stream("/v1/chat/completions", dict(body, stream=True))
        check(status == 200, "stream status %d" % status)
        streamed = [e for ev in events if ev != "[DONE]" for ch in ev["choices"] if ch.get("logprobs")
                    for e in ch["logprobs"]["content"]]
        check(streamed == lp_a, "streamed chat logprobs differ from the answer's")
        check(joined_stream("chat", events)[0] == a["choices"][0]["message"]["content"], "streamed text differs")
        plain = post_ok(c, "/v1/chat/completions", dict(body, logprobs=False, top_logprobs=0))
        check(plain["choices"][0]["logprobs"] is None, "logprobs without asking")

        # ---- completions logprobs, and a token-id prompt equal to its string
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3}
        r = post_ok(c, "/v1/completions", body)
        ch = r["choices"][0]
        check_completion_logprobs(ch["logprobs"], ch["text"], 3)
        for tok, val, top in zip(ch["logprobs"]["tokens"], ch["logprobs"]["token_logprobs"], ch["logprobs"]["top_logprobs"]):
            check(val == max(top.values()), "greedy token %r is not the argmax of %s" % (tok, top))
        ids = tokenize(c, PROMPT)
        r_ids = post_ok(c, "/v1/completions", dict(body, prompt=ids))
        check(r_ids["choices"][0]["text"] == ch["text"] and r_ids["choices"][0]["logprobs"] == ch["logprobs"],
              "token-id prompt answers differently from its string")
        status, events = c.stream("/v1/completions", dict(body, stream=True))
        toks = [t for ev in events if ev != "[DONE]" for x in ev["choices"] if x.get("logprobs")
                for t in x["logprobs"]["tokens"]]
        offs = [t for ev in events if ev != "[DONE]" for x in ev["choices"] if x.get("logprobs")
                for t in x["logprobs"]["text_offset"]]
        check(toks == ch["logprobs"]["tokens"] and offs == ch["logprobs"]["text_offset"],
              "streamed completions logprobs differ: %s / %s" % (toks, offs))

        # ---- echo with max_tokens 0 (lm-evaluation-harness loglikelihood): prompt logprobs
        sentence = "The quick brown fox jumps over the lazy dog"
        sids = tokenize(c, sentence)
        e = post_ok(c, "/v1/completions", {"prompt": [sids], "echo": True, "max_tokens": 0, "logprobs": 1,
                                           "temperature": 0})
        ech = e["choices"][0]
        check(ech["text"] == sentence, "echo text %r" % ech["text"])
        check(e["usage"]["completion_tokens"] == 0 and e["usage"]["prompt_tokens"] == len(sids), "usage %s" % e["usage"])
        lp = ech["logprobs"]
        check(len(lp["tokens"]) == len(sids), "echo shows %d tokens, the prompt has %d" % (len(lp["tokens"]), len(sids)))
        check_completion_logprobs(lp, sentence, 1, first_null=True)
        # Prompt position p's distribution is the one generating after the first p tokens.
        for p in (1, len(sids) // 2, len(sids) - 1):
            g = post_ok(c, "/v1/completions", {"prompt": sids[:p], "max_tokens": 1, "temperature": 0, "logprobs": 1})
            gtop = g["choices"][0]["logprobs"]["top_logprobs"][0]
            best = max(gtop, key=gtop.get)
            check(best in lp["top_logprobs"][p] and abs(lp["top_logprobs"][p][best] - gtop[best]) < 1e-3,
                  "prompt position %d: %s vs generation %s" % (p, lp["top_logprobs"][p], gtop))
        # echo + max_tokens 1, streamed: the prompt first, then one token.
        status, events = c.stream("/v1/completions", {"prompt": sentence, "echo": True, "max_tokens": 1, "temperature": 0,
                                                      "logprobs": 0, "stream": True})
        text, finishes, _, done = joined_stream("completion", events)
        check(text.startswith(sentence) and len(text) > len(sentence) and finishes == ["length"] and done == 1,
              "streamed echo %r %s" % (text, finishes))

        # ---- batched prompts (lm-eval sends token-id batches), with n
        prompts = ["Paris is", "One, two, three,", "Hello"]
        singles = [post_ok(c, "/v1/completions", {"prompt": p, "max_tokens": 5, "temperature": 0})["choices"][0]["text"]
                   for p in prompts]
        r = post_ok(c, "/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0})
        check([x["index"] for x in r["choices"]] == list(range(6)), "choice indices %s" % [x["index"] for x in r["choices"]])
        for x in r["choices"]:
            check(x["text"] == singles[x["index"] // 2], "choice %d: %r, alone %r" % (x["index"], x["text"],
                                                                                     singles[x["index"] // 2]))
        want_prompt = sum(len(tokenize(c, p)) for p in prompts)
        check(r["usage"]["prompt_tokens"] == want_prompt and r["usage"]["completion_tokens"] == 30,
              "batch usage %s (prompt tokens %d)" % (r["usage"], want_prompt))
        batch = post_ok(c, "/v1/completions", {"prompt": [tokenize(c, p) for p in prompts], "echo": True,
                                               "max_tokens": 0, "logprobs": 1, "temperature": 0})
        for x, p in zip(sorted(batch["choices"], key=lambda x: x["index"]), prompts):
            check(x["text"] == p and len(x["logprobs"]["tokens"]) == len(tokenize(c, p)), "batched echo %s" % x)
        status, events = c.stream("/v1/completions", {"prompt": prompts, "max_tokens": 5, "temperature": 0,
                                                      "stream": True, "stream_options": {"include_usage": True}})
        texts, ends = {}, {}
        for ev in events:
            if ev == "[DONE]":
                continue
            for x in ev["choices"]:
                texts[x["index"]] = texts.get(x["index"], "") + x["text"]
                if x["finish_reason"]:
                    ends[x["index"]] = ends.get(x["index"], 0) + 1
        check(texts == dict(enumerate(singles)) and ends == {0: 1, 1: 1, 2: 1} and events.count("[DONE]") == 1,
              "streamed batch %s %s" % (texts, ends))
        check(events[-2]["usage"]["completion_tokens"] == 15, "streamed batch usage %s" % events[-2])
        r = c.post("/v1/completions", {"prompt": [[1, 2], [vocab + 5]]})
        check(r.status == 400 and r.json()["error"]["param"] == "prompt[1][0]" and "prompt[1]" in r.json()["error"]["message"],
              "out-of-vocabulary id: %d %s" % (r.status, r.body))
        # A client that leaves a streamed batch cancels every choice; all KV blocks come back.
        cancelled = c.metric('pd_requests_total{outcome="cancelled"}')
        s = socket.create_connection(("127.0.0.1", c.port))
        body = json.dumps({"prompt": prompts, "n": 2, "max_tokens": 400, "ignore_eos": True, "stream": True})
        s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   "Content-Length: %d\r\n\r\n%s" % (len(body), body)).encode())
        got = b""
        while got.count(b"data: ") < 8:
            chunk = s.recv(4096)
            check(chunk, "stream closed early")
            got += chunk
        s.close()
        wait_for(lambda: c.metric('pd_requests_total{outcome="cancelled"}') == cancelled + 6, 30,
                 "the 6 choices of the disconnected request to be cancelled")
        wait_for(lambda: blocks_all_free(c), 30, "the cancelled choices' KV blocks to be freed")

        check_vllm_sampling(c)
        check_openai_client(c, sids, lp, lp_a)
    # Colocated (one rank prefills and decodes): the same logprobs, prompt and generated.
    with Cluster(colocated=1, model=DEFAULT_MODEL, threads=1) as c:
        co = post_ok(c, "/v1/completions", {"prompt": [sids], "echo": True, "max_tokens": 0, "logprobs": 1,
                                            "temperature": 0})["choices"][0]["logprobs"]
        check(co["tokens"] == lp["tokens"] and all(
            a is None and b is None or abs(a - b) < 1e-3 for a, b in zip(co["token_logprobs"], lp["token_logprobs"])),
            "colocated prompt logprobs differ: %s vs %s" % (co["token_logprobs"], lp["token_logprobs"]))
        co = post_ok(c, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True,
                                                 "top_logprobs": 5})["choices"][0]["logprobs"]["content"]
        check([e["token"] for e in co] == [e["token"] for e in lp_a] and
              all(abs(a["logprob"] - b["logprob"]) < 1e-3 for a, b in zip(co, lp_a)),
              "colocated chat logprobs differ")


def offline(prompt, *flags):
    """pd-generate's greedy text for a completions prompt."""
    cmd = [os.path.join(BUILD, "tools", "pd-generate"), "-m", DEFAULT_MODEL, "-p", prompt, "-t", "2"] + list(flags)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return out[:-1] if out.endswith("\n") else out  # the line pd-generate ends its output with


def check_vllm_sampling(c):
    """vLLM's repetition_penalty, min_tokens, stop_token_ids and include_stop_str_in_output, through the
    cluster: the same greedy text as pd-generate with the same settings, and different from without them."""
    rep = "Colors: red, green, blue, red, green, blue, red,"
    base = post_ok(c, "/v1/completions", {"prompt": rep, "max_tokens": 24, "temperature": 0})["choices"][0]["text"]
    pen = post_ok(c, "/v1/completions", {"prompt": rep, "max_tokens": 24, "temperature": 0,
                                         "repetition_penalty": 1.5})["choices"][0]["text"]
    check(pen != base, "repetition_penalty 1.5 changed nothing: %r" % pen)
    want = offline(rep, "-n", "24", "--repetition-penalty", "1.5")
    check(pen == want, "repetition_penalty through the cluster %r, pd-generate %r" % (pen, want))
    # min_tokens: past where the answer ends by itself.
    short = post_ok(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "stop": ["\n"]})
    natural = short["usage"]["completion_tokens"]
    longer = post_ok(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "stop": ["\n"],
                                            "min_tokens": natural + 6})
    check(longer["usage"]["completion_tokens"] >= natural + 6 and longer["choices"][0]["text"].startswith(
        short["choices"][0]["text"]), "min_tokens %d: %s after %s" % (natural + 6, longer, short))
    # stop_token_ids: the answer ends before the third generated token, which prints only when asked.
    r = post_ok(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0})
    toks = r["choices"][0]["logprobs"]["tokens"]
    third = tokenize(c, toks[2])
    if len(third) == 1 and len(toks) > 3 and toks[2] not in toks[:2]:
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop_token_ids": third}
        cut = post_ok(c, "/v1/completions", body)["choices"][0]
        check(cut["text"] == "".join(toks[:2]) and cut["finish_reason"] == "stop", "stop_token_ids %s: %s" % (third, cut))
        kept = post_ok(c, "/v1/completions", dict(body, include_stop_str_in_output=True))["choices"][0]
        check(kept["text"] == "".join(toks[:3]), "include_stop_str_in_output: %s" % kept)
    else:
        print("note: the third greedy token %r is not one token alone; stop_token_ids not checked" % toks[2])
    r = c.post("/v1/completions", {"prompt": PROMPT, "min_tokens": 40})  # completions' default max_tokens is 16
    check(r.status == 400 and r.json()["error"]["param"] == "min_tokens", "min_tokens over max_tokens: %s" % r.body)


def check_openai_client(c, sids, lp, lp_a):
    """The official client reads what was served: chat logprobs, completions echo logprobs."""
    try:
        import openai
    except ImportError:
        print("note: the openai package is not installed; its checks were skipped")
        return
    client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % c.port, api_key="none")
    name = c.get("/v1/models").json()["data"][0]["id"]
    cc = client.chat.completions.create(model=name, messages=CHAT, max_tokens=8,
                                        temperature=0, logprobs=True, top_logprobs=5)
    content = cc.choices[0].logprobs.content
    check([(t.token, t.logprob) for t in content] == [(t["token"], t["logprob"]) for t in lp_a],
          "openai client chat logprobs differ")
    check(all(t.top_logprobs[0].logprob == t.logprob for t in content), "client: greedy != top alternative")
    cp = client.completions.create(model=name, prompt=[sids], echo=True, max_tokens=0,
                                   logprobs=1, temperature=0)
    check(cp.choices[0].logprobs.token_logprobs[0] is None and
          cp.choices[0].logprobs.token_logprobs[1:] == lp["token_logprobs"][1:], "client: echo logprobs differ")
    print("openai client %s: chat logprobs and echo logprobs as served" % openai.__version__)


SUITES = {"api_features": suite_api_features}

if __name__ == "__main__":
    run_suite(SUITES, "test_api.py")
