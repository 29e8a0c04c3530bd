#!/usr/bin/env python3
"""Whole-cluster tests: real MPI jobs (router + prefill + decode ranks under
mpirun --oversubscribe) driven over HTTP. Run one suite per process:

    tests/cluster/test_cluster.py {api,identity,preemption,colocated,lifecycle,models,gemma3,...}

Exit 0 = pass, 1 = fail, 77 = skipped (printed why)."""
import concurrent.futures
import json
import os
import signal
import subprocess
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import (BUILD, DEFAULT_MODEL, ROOT, SKIP, Cluster, blocks_all_free, check, completion_text,  # noqa: E402
                     joined_stream, need_default_model, path_of, reference, request_body, run_suite, tiny_model,
                     wait_for)

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "In 1969, astronauts first walked on the Moon.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The mitochondria is the powerhouse of the cell.",
    "Shakespeare wrote many plays, including Hamlet and Macbeth.",
    "A prime number has exactly two divisors.",
    "The Pacific Ocean is the largest ocean on Earth.",
]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "List three colors.",
    "Who wrote Hamlet?",
    "What is 2 + 2?",
    "Give me a short tip for learning to code.",
    "Describe a cat in one sentence.",
]


def mixed_prompts(n):
    """n (endpoint, prompt, max_tokens) of varied prompt and output lengths."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            k = 1 + (i * 7) % len(SENTENCES)
            prompt = " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(k))
            out.append(("completion", prompt, 4 + (i * 5) % 29))
        else:
            out.append(("chat", QUESTIONS[i % len(QUESTIONS)] + (" Answer briefly." * (i % 3)), 4 + (i * 3) % 29))
    return out


def references(model, cases, ignore_eos=False, kv_dtype=None, args=()):
    return reference(model, [{"prompt": p, "chat": e == "chat", "max_tokens": m, "ignore_eos": ignore_eos}
                             for e, p, m in cases], kv_dtype, args)


def run_case(c, endpoint, prompt, max_tokens, stream, **extra):
    """-> (text, completion_tokens, finish_reason) through the cluster."""
    body = request_body(endpoint, prompt, max_tokens, stream, **extra)
    if not stream:
        r = c.post(path_of(endpoint), body)
        check(r.status == 200, "HTTP %d: %s" % (r.status, r.body))
        j = r.json()
        return completion_text(endpoint, j), j["usage"]["completion_tokens"], j["choices"][0]["finish_reason"]
    status, events = c.stream(path_of(endpoint), body)
    check(status == 200, "HTTP %d: %s" % (status, events))
    text, finishes, usage, done = joined_stream(endpoint, events)
    check(len(finishes) == 1, "stream has %d finish_reason chunks (want exactly 1)" % len(finishes))
    check(done == 1 and events[-1] == "[DONE]", "stream must end with exactly one [DONE]")
    check(usage is not None, "include_usage: no usage chunk")
    return text, usage["completion_tokens"], finishes[0]


def expect_same(case, got, ref):
    text, n, finish = got
    check((text, n, finish) == (ref["text"], ref["completion_tokens"], ref["finish_reason"]),
          "cluster output differs from pd-generate for %r:\n  cluster:     %r (%d tokens, %s)\n  pd-generate: %r (%d tokens, %s)"
          % (case, text, n, finish, ref["text"], ref["completion_tokens"], ref["finish_reason"]))


def concurrent_identity(c, model, cases, workers, kv_dtype=None):
    refs = references(model, cases, kv_dtype=kv_dtype)
    before = c.metric('pd_requests_total{outcome="finished"}')
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futs = [pool.submit(run_case, c, e, p, m, i % 3 == 0) for i, (e, p, m) in enumerate(cases)]
        results = [f.result() for f in futs]
    for case, got, ref in zip(cases, results, refs):
        expect_same(case, got, ref)
    after = c.metric('pd_requests_total{outcome="finished"}')
    check(after - before == len(cases), "finished count rose by %d, want %d" % (after - before, len(cases)))
    wait_for(lambda: blocks_all_free(c), 30, "every KV block to return to its pool")


# ------------------------------------------------------------------ suites

def suite_api(tmp):
    """Tiny model, 1 prefill + 1 decode: the HTTP API, its errors, streaming, cancellation."""
    model = tiny_model(os.path.join(tmp, "tiny.gguf"))
    key = {"Authorization": "Bearer sekret"}
    cfg = {"http": {"api_key": "sekret", "max_body_bytes": 4096}}
    with Cluster(1, 1, model=model, config=cfg) as c:
        name = c.get("/v1/models", key).json()["data"][0]["id"]
        check(name == "tiny", "model name %r" % name)
        # Outputs against pd-generate, streaming and not, both endpoints.
        cases = [("completion", "hello world", 12), ("chat", "hi there", 10), ("completion", "abc " * 20, 20)]
        refs = references(model, cases, ignore_eos=True)
        for case, ref in zip(cases, refs):
            for stream in (False, True):
                expect_same(case, run_case_key(c, key, case, stream), ref)
        # logit_bias holds for token 1 (sampled on the prefill rank) and every token after it
        # (the decode rank): the same text as pd-generate given the same bias.
        bias_cases = [("completion", "hello world", 8), ("chat", "hi there", 8)]
        for bias, flags in (({"7": 100}, ["--logit-bias", "7=100"]),
                            ({"7": -100, "11": 4.5}, ["--logit-bias", "7=-100", "--logit-bias", "11=4.5"])):
            refs = references(model, bias_cases, ignore_eos=True, args=flags)
            for case, ref in zip(bias_cases, refs):
                for stream in (False, True):
                    expect_same((case, bias), run_case_key(c, key, case, stream, logit_bias=bias), ref)
        # So does an output constraint (structured output): token 1 is masked on the
        # prefill rank, the rest on the decode rank, as pd-generate masks them all.
        schema = {"type": "object", "properties": {"b": {"enum": ["x", "y"]}, "a": {"type": "integer"}},
                  "required": ["b", "a"]}
        constrained = [("completion", "hello world", 16), ("chat", "hi there", 16)]
        for extra, flags in (({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
                              ["--json-schema", json.dumps(schema)]),
                             ({"structured_outputs": {"regex": "[a-c]{2,6}-[0-9]+"}}, ["--regex", "[a-c]{2,6}-[0-9]+"])):
            refs = references(model, constrained, ignore_eos=True, args=flags)
            for case, ref in zip(constrained, refs):
                for stream in (False, True):
                    expect_same((case, extra), run_case_key(c, key, case, stream, **extra), ref)

        def err(status, method, path, body=None, raw=None, headers=key, param=None):
            r = c.request(method, path, body, headers=headers, raw=raw)
            check(r.status == status, "%s %s: HTTP %d, want %d: %s" % (method, path, r.status, status, r.body))
            e = r.json()["error"]
            check(e["message"] and "type" in e, "error body shape: %s" % r.body)
            if param is not None:
                check(e["param"] == param, "error param %r, want %r (%s)" % (e["param"], param, r.body))
            return r
        comp = "/v1/completions"
        err(400, "POST", comp, raw="{not json")
        err(400, "POST", comp, raw="[1, 2]")
        err(400, "POST", comp, {"max_tokens": 4}, param="prompt")
        err(400, "POST", comp, {"prompt": "x", "max_tokens": "4"}, param="max_tokens")
        err(400, "POST", comp, {"prompt": "x", "temperature": 5}, param="temperature")
        err(400, "POST", comp, {"prompt": "x", "n": 0}, param="n")
        err(400, "POST", comp, {"prompt": "x", "logit_bias": {"999999": 2}}, param="logit_bias")  # past the vocabulary
        err(400, "POST", comp, {"prompt": "x", "logit_bias": {"1": 200}}, param="logit_bias")
        err(400, "POST", comp, {"prompt": "x", "frobnicate": 1}, param="frobnicate")
        err(400, "POST", comp, {"prompt": "x", "max_tokens": 100000}, param="max_tokens")
        err(400, "POST", comp, {"prompt": "x " * 600}, param="prompt")  # over the tiny model's 512 context
        err(400, "POST", "/v1/chat/completions", {"messages": []}, param="messages")
        err(400, "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
        err(404, "POST", comp, {"prompt": "x", "model": "gpt-17"}, param="model")
        # What a client sees of the checks in front of the engine: a grammar that admits
        # nothing, a schema keyword the grammar would not enforce, a prompt array's element,
        # a body that is not JSON by its Content-Type, and GET /v1/models/{id}.
        chat = "/v1/chat/completions"
        go = [{"role": "user", "content": "go"}]
        err(400, "POST", chat, {"messages": go, "max_tokens": 5, "guided_grammar": "root ::= root"},
            param="guided_grammar")
        err(400, "POST", chat, {"messages": go, "max_tokens": 5, "guided_json": {"type": "array", "uniqueItems": True}},
            param="guided_json.uniqueItems")
        err(400, "POST", comp, {"prompt": [""]}, param="prompt[0]")
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            err(415, "POST", comp, {"prompt": "x", "max_tokens": 2}, headers=dict(key, **{"Content-Type": ctype}),
                param="Content-Type")
        listed = c.get("/v1/models", headers=key).json()["data"][0]
        got = c.get("/v1/models/" + listed["id"], headers=key)
        check(got.status == 200 and got.json() == listed, "GET /v1/models/{id}: %d %s" % (got.status, got.body))
        err(404, "GET", "/v1/models/gpt-17", param="model")
        err(413, "POST", comp, raw='{"prompt": "' + "x" * 8000 + '"}')
        err(404, "GET", "/v1/nothing")
        r = err(405, "GET", comp)
        check(r.headers.get("Allow") == "POST", "405 without Allow: POST")
        err(401, "POST", comp, {"prompt": "x"}, headers={})
        err(401, "POST", comp, {"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
        check(c.get("/health").status == 200, "/health")
        # A client that disconnects mid-stream: its request is cancelled and its blocks come back.
        cancelled = c.metric('pd_requests_total{outcome="cancelled"}')
        s = socket.create_connection(("127.0.0.1", c.port))
        body = '{"prompt": "tell me everything", "max_tokens": 400, "ignore_eos": true, "stream": true}'
        s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                   "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)).encode())
        got = b""
        while got.count(b"data: ") < 3:
            chunk = s.recv(4096)
            check(chunk, "stream closed early")
            got += chunk
        s.close()
        wait_for(lambda: c.metric('pd_requests_total{outcome="cancelled"}') == cancelled + 1, 20,
                 "the disconnected request to be cancelled")
        wait_for(lambda: blocks_all_free(c), 20, "the cancelled request's KV blocks to be freed")
        m = c.metrics()
        for key_ in ("pd_time_to_first_token_seconds_count", "pd_inter_token_seconds_count",
                     'pd_stage_seconds_count{stage="transfer"}', "pd_kv_transfer_bytes_total"):
            check(m.get(key_, 0) > 0, "metric %s missing or zero" % key_)
        check_front_door_bounds(c, key)
        rc = c.stop()
        check(rc == 0, "cluster exit code %s after SIGTERM:\n%s" % (rc, c.logs()))


def check_front_door_bounds(c, key):
    """Without http.admin_key the admin endpoints are closed (the API key does not open them);
    stop strings are bounded; a streaming client that stops reading is cut once more than
    http.max_write_buffer_bytes waits for it: each of its choices ends once, none failed, and
    every KV block comes back."""
    for headers in (key, {}):
        r = c.post("/admin/drain", {"rank": 1}, headers=headers)
        check(r.status == 403 and r.json()["error"]["code"] == "admin_disabled" and
              "http.admin_key" in r.json()["error"]["message"], "/admin/drain without an admin key: %d %s" % (r.status, r.body))
    check("draining" not in c.get("/health").body, "a rank drains after a refused /admin/drain")
    r = c.post("/v1/completions", {"prompt": "x", "stop": ["s" * 257]}, headers=key)
    check(r.status == 400 and r.json()["error"]["param"] == "stop", "a 257-byte stop string: %d %s" % (r.status, r.body))
    outcomes = ("finished", "cancelled", "failed", "timeout")
    before = {o: c.metric('pd_requests_total{outcome="%s"}' % o) for o in outcomes}
    n = 64  # x 440 tokens with 20 alternatives each: far more than the socket buffers and the 4 MiB bound
    body = json.dumps({"prompt": "tell me everything", "max_tokens": 440, "ignore_eos": True, "stream": True,
                       "n": n, "logprobs": 20})
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", c.port))
    s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
               "Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)).encode())

    def ended():
        return sum(c.metric('pd_requests_total{outcome="%s"}' % o) - before[o] for o in outcomes)
    wait_for(lambda: ended() >= n, 120, "the slow reader's %d choices to end" % n)
    s.close()
    delta = {o: c.metric('pd_requests_total{outcome="%s"}' % o) - before[o] for o in outcomes}
    check(delta["cancelled"] >= 1 and delta["failed"] == 0 and delta["timeout"] == 0 and
          delta["finished"] + delta["cancelled"] == n, "the slow reader's choices ended as %s" % delta)
    wait_for(lambda: c.metric("pd_requests_in_flight") == 0, 20, "no request left in flight")
    wait_for(lambda: blocks_all_free(c), 30, "the cut stream's KV blocks to be freed")
    print("a streaming client that stopped reading was cut: its %d choices ended %s" % (n, delta))


def run_case_key(c, key, case, stream, **extra):
    endpoint, prompt, max_tokens = case
    # Compared with pd-generate's text, which prints the control tokens a generation past EOS may bring.
    extra.setdefault("skip_special_tokens", False)
    body = request_body(endpoint, prompt, max_tokens, stream, ignore_eos=True, **extra)
    if not stream:
        r = c.post(path_of(endpoint), body, headers=key)
        check(r.status == 200, "HTTP %d: %s" % (r.status, r.body))
        j = r.json()
        return completion_text(endpoint, j), j["usage"]["completion_tokens"], j["choices"][0]["finish_reason"]
    status, events = c.stream(path_of(endpoint), body, headers=key)
    check(status == 200, "HTTP %d: %s" % (status, events))
    text, finishes, usage, done = joined_stream(endpoint, events)
    check(len(finishes) == 1 and done == 1, "stream framing: %s" % events[-3:])
    return text, usage["completion_tokens"], finishes[0]


def suite_identity(tmp):
    """Default model, 2 prefill + 2 decode: greedy output token-identical to pd-generate, alone and under load."""
    need_default_model()
    with Cluster(2, 2) as c:
        cases = [(e, q, 24) for e in ("chat", "completion") for q in QUESTIONS[:4]]
        refs = references(DEFAULT_MODEL, cases)
        for case, ref in zip(cases, refs):
            for stream in (False, True):
                expect_same(case, run_case(c, case[0], case[1], case[2], stream), ref)
        # Stop strings: the text ends before the first match, finish_reason "stop", and the
        # workers drop the request (its blocks come back).
        for case, ref in zip(cases, refs):
            text = ref["text"]
            if len(text) < 16:
                continue
            stop = text[8:12]
            want = text[:text.find(stop)]
            for stream in (False, True):
                got = run_case(c, case[0], case[1], case[2], stream, stop=[stop, "\u0000never"])
                check(got[0] == want and got[2] == "stop",
                      "stop %r on %r: got %r (%s), want %r" % (stop, case, got[0], got[2], want))
            break
        wait_for(lambda: blocks_all_free(c), 30, "blocks of stop-string requests to be freed")
        # Every prompt's KV was built once on a prefill rank, from its prefix cache or computed;
        # the same prompts sent again found some of it cached.
        said = {}

        def prompt_tokens_add_up():
            m = c.metrics()
            # Prefill ranks, and decode ranks for the follow-ups they computed themselves.
            said["cache"] = sum(v for k, v in m.items() if k.startswith("pd_rank_prompt_tokens_total{")
                                and 'source="cache"' in k)
            said["computed"] = sum(v for k, v in m.items() if k.startswith("pd_rank_prompt_tokens_total{")
                                   and 'source="computed"' in k)
            said["dispatched"] = m.get("pd_prompt_tokens_total", 0)
            return said["cache"] + said["computed"] == said["dispatched"]
        try:
            wait_for(prompt_tokens_add_up, 10, "prompt token counts")
        except AssertionError:
            raise AssertionError("pd_rank_prompt_tokens_total %s does not add up to pd_prompt_tokens_total"
                                 % said)
        check(said["cache"] > 0, "the prompts sent again found nothing in a prefix cache: %s" % said)
        print("prompt tokens: %d from prefix caches, %d computed" % (said["cache"], said["computed"]))
        concurrent_identity(c, DEFAULT_MODEL, mixed_prompts(64), 64)
        check(c.stop() == 0, "clean exit after SIGTERM")


def suite_preemption(tmp):
    """Default model, a decode pool too small for the load: preemption, same outputs, no leaks."""
    need_default_model()
    cfg = {"kv": {"decode_budget_mb": 3}}  # ~130 tokens of f16 KV: a few sequences at a time
    with Cluster(1, 1, config=cfg) as c:
        cases = [("completion", " ".join(SENTENCES[:1 + i % 3]), 24 + (i % 4) * 4) for i in range(16)]
        concurrent_identity(c, DEFAULT_MODEL, cases, 16)
        pre = c.metric('pd_preemptions{rank="2"}')
        check(pre > 0, "the decode rank never preempted (pd_preemptions = %s); the test did not exercise it" % pre)
        check(c.stop() == 0, "clean exit")


def suite_kv_types(tmp):
    """Default model, 1 prefill + 1 decode with a q8_0 and then an f32 KV cache: each equals pd-generate
    with the same --kv-dtype token for token (f16, the default, is what every other suite runs);
    the handoff carries that many bytes per token."""
    need_default_model()
    per_token = {"q8_0": 2 * 30 * 3 * 68, "f32": 2 * 30 * 3 * 64 * 4}  # SmolLM2-135M
    for dtype in ("q8_0", "f32"):
        with Cluster(1, 1, config={"kv": {"dtype": dtype}}) as c:
            cases = mixed_prompts(12)
            bytes_before = c.metric("pd_kv_transfer_bytes_total")
            check(c.metric('pd_kv_bytes_per_token{dtype="%s"}' % dtype) == per_token[dtype],
                  "pd_kv_bytes_per_token{dtype=%s} is %s, want %d"
                  % (dtype, c.metric('pd_kv_bytes_per_token{dtype="%s"}' % dtype), per_token[dtype]))
            concurrent_identity(c, DEFAULT_MODEL, cases, 12, kv_dtype=dtype)
            moved = c.metric("pd_kv_transfer_bytes_total") - bytes_before
            check(moved > 0 and moved % per_token[dtype] == 0,
                  "%s: %d KV bytes moved, not a whole number of %d-byte tokens" % (dtype, moved, per_token[dtype]))
            check(c.stop() == 0, "clean exit")


def suite_colocated(tmp):
    """Default model, colocated mode (2 workers doing both phases): same outputs."""
    need_default_model()
    with Cluster(colocated=2) as c:
        concurrent_identity(c, DEFAULT_MODEL, mixed_prompts(16), 16)
        check(c.stop() == 0, "clean exit")


COPY_PROMPTS = [
    "Repeat this text exactly: The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly.",
    "Copy the list: apples, pears, plums, cherries, apples, pears, plums, cherries, apples, pears",
    "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7 8 9 10 1 2 3 4 5",
]


# Requests that use what a verification step must get right beside the tokens: logprobs with
# alternatives, stop strings that cut inside an accepted draft, n seeded samples, a constraint.
SPEC_FEATURES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": COPY_PROMPTS[0]}], "max_tokens": 40,
                              "temperature": 0, "logprobs": True, "top_logprobs": 3}),
    ("/v1/completions", {"prompt": COPY_PROMPTS[2], "max_tokens": 40, "temperature": 0, "logprobs": 2,
                         "stop": [" 9 10 1"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": COPY_PROMPTS[1]}], "max_tokens": 32,
                              "temperature": 0.9, "seed": 5, "n": 3, "stop": ["plums"]}),
    ("/v1/completions", {"prompt": COPY_PROMPTS[1], "max_tokens": 24, "temperature": 0.7, "seed": 11, "n": 2,
                         "logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": COPY_PROMPTS[0]}], "max_tokens": 40,
                              "temperature": 0, "response_format": {"type": "json_object"}}),
]


def feature_answers(c):
    """SPEC_FEATURES' answers, without what differs between runs (ids, times)."""
    out = []
    for path, body in SPEC_FEATURES:
        r = c.post(path, body)
        check(r.status == 200, "HTTP %d: %s" % (r.status, r.body))
        j = r.json()
        out.append((j["choices"], j["usage"]["completion_tokens"]))
    return out


def suite_speculation(tmp):
    """Default model, speculative decoding on the decode pool (decode.speculate 8), 1 prefill + 1 decode
    and colocated: greedy and seeded outputs equal plain decoding's (pd-generate without speculation),
    alone and under load; logprobs, stop strings, n seeded samples and a constraint answer as a
    cluster without speculation does; and drafts were made and accepted."""
    need_default_model()
    cases = [(e, q, 40) for e in ("chat", "completion") for q in COPY_PROMPTS] + mixed_prompts(10)
    refs = references(DEFAULT_MODEL, cases)
    seeded = [{"prompt": q, "chat": True, "max_tokens": 32, "temperature": 0.8, "seed": 21 + i}
              for i, q in enumerate(COPY_PROMPTS)]
    seeded_refs = reference(DEFAULT_MODEL, seeded)
    with Cluster(prefill=1, decode=1) as c:  # the same requests without speculation
        plain = feature_answers(c)
        check(c.stop() == 0, "clean exit")
    spec = {"decode": {"speculate": 8, "speculate_max_batch": 64}}
    for layout in ({"prefill": 1, "decode": 1}, {"colocated": 1}):
        with Cluster(config=spec, **layout) as c:
            got = feature_answers(c)
            for (path, body), a, b in zip(SPEC_FEATURES, got, plain):
                check(a == b, "%s %s: with speculation\n  %r\nwithout\n  %r" % (path, body, a, b))
            for case, ref in zip(cases[:6], refs[:6]):
                for stream in (False, True):
                    expect_same(case, run_case(c, case[0], case[1], case[2], stream), ref)
            for s, ref in zip(seeded, seeded_refs):
                got = run_case(c, "chat", s["prompt"], s["max_tokens"], False, temperature=0.8, seed=s["seed"])
                expect_same(("seeded", s["prompt"]), got, ref)
            concurrent_identity(c, DEFAULT_MODEL, cases, len(cases))
            time.sleep(1.5)  # the decode rank's last load report is in
            m = c.metrics()
            drafted = sum(v for k, v in m.items() if k.startswith("pd_spec_draft_tokens{"))
            accepted = sum(v for k, v in m.items() if k.startswith("pd_spec_accepted_tokens{"))
            steps = sum(v for k, v in m.items() if k.startswith("pd_spec_steps{"))
            print("%s: %d tokens drafted, %d accepted, in %d steps" % (layout, drafted, accepted, steps))
            check(accepted > 0 and drafted >= accepted, "drafted %d, accepted %d: speculation did not run"
                  % (drafted, accepted))
            check(0 < steps <= drafted, "%d speculative steps for %d drafted tokens" % (steps, drafted))
            # "speculative": false: the same text, and nothing drafted for it.
            for case, ref in zip(cases[:3], refs[:3]):
                expect_same(case, run_case(c, case[0], case[1], case[2], False, speculative=False), ref)
            time.sleep(1.5)  # the decode rank's next load reports
            m = c.metrics()
            after = sum(v for k, v in m.items() if k.startswith("pd_spec_draft_tokens{"))
            check(after == drafted, "speculative: false still drafted %d tokens" % (after - drafted))
            check(c.stop() == 0, "clean exit")


def suite_chunked(tmp):
    """Default model, chunked prefill with small chunks (64 tokens) on 1 prefill + 1 decode and on colocated x2:
    prompts of up to a few hundred tokens, concurrent with short ones, give pd-generate's greedy text token for token."""
    need_default_model()
    long_prompts = [("completion", " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(8 + 12 * i)), 12)
                    for i in range(4)]
    cases = long_prompts + mixed_prompts(8)
    cfg = {"prefill": {"chunk_tokens": 64, "token_budget": 256}, "decode": {"step_tokens": 96}}
    for layout in ({"prefill": 1, "decode": 1}, {"colocated": 2}):
        with Cluster(config=cfg, **layout) as c:
            concurrent_identity(c, DEFAULT_MODEL, cases, len(cases))
            check(c.stop() == 0, "clean exit")


def routing(c):
    """{reason: count} of pd_router_routing_decisions_total."""
    return {k.split('reason="')[1].split('"')[0]: v for k, v in c.metrics().items()
            if k.startswith("pd_router_routing_decisions_total{")}


def completion(c, prompt, max_tokens):
    """-> (text, usage) of a greedy completion."""
    r = c.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    check(r.status == 200, "HTTP %d: %s" % (r.status, r.body))
    return r.json()["choices"][0]["text"], r.json()["usage"]


def reused_turn(c, prompt, max_tokens, reason, min_cached):
    """One completion expected to be routed for `reason` with at least min_cached prompt tokens from a
    cache; its text against pd-generate's."""
    # The KV events of the turn before travel after its last token: let them land.
    time.sleep(0.3)
    before = routing(c)
    text, usage = completion(c, prompt, max_tokens)
    after = routing(c)
    grew = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    check(grew == {reason: 1}, "routing decisions grew by %s, want {%r: 1}" % (grew, reason))
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    check(cached >= min_cached, "usage says %d prompt tokens cached, want >= %d (%s)" % (cached, min_cached, usage))
    ref = reference(DEFAULT_MODEL, [{"prompt": prompt, "chat": False, "max_tokens": max_tokens, "ignore_eos": False}])[0]
    check(text == ref["text"], "%s: cluster %r != pd-generate %r" % (reason, text, ref["text"]))
    return text


def conversations(c, n, turns, max_tokens):
    """n conversations of `turns` chat turns each, run concurrently (each turn sends the whole history);
    every answer against pd-generate's for the same history."""
    system = " ".join(SENTENCES)
    hist = [[{"role": "system", "content": system}] for _ in range(n)]
    for turn in range(turns):
        for i in range(n):
            hist[i].append({"role": "user", "content": QUESTIONS[(i + turn) % len(QUESTIONS)]})

        def ask(i):
            body = {"messages": hist[i], "max_tokens": max_tokens, "temperature": 0}
            r = c.post("/v1/chat/completions", body)
            check(r.status == 200, "HTTP %d: %s" % (r.status, r.body))
            return r.json()["choices"][0]["message"]["content"]
        with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
            answers = list(pool.map(ask, range(n)))
        # pd-generate renders one message list per prompt with the model's template.
        refs = reference(DEFAULT_MODEL, [{"messages": h, "max_tokens": max_tokens, "ignore_eos": False} for h in hist])
        for i, (got, ref) in enumerate(zip(answers, refs)):
            check(got == ref["text"], "conversation %d turn %d: cluster %r != pd-generate %r" % (i, turn, got, ref["text"]))
            hist[i].append({"role": "assistant", "content": got})


def suite_kv_reuse(tmp):
    """Default model: a follow-up that extends what a decode rank just generated goes back to that decode
    rank, which computes only the new suffix (decode_reuse); a prompt sharing a long head with one a prefill
    rank computed goes to that prefill rank (cache_aware). Each gives pd-generate's text, and usage counts
    the cached tokens. Then concurrent multi-turn conversations, every answer against pd-generate's. On
    2 prefill + 1 decode (chunked prefill) and on 1 + 1 with whole-prompt prefill, router.warm_prefill off;
    then with it on: the answer is warmed into the prefill rank's cache and the follow-up
    goes there; then with kv.prefix_cache off, nothing cached and nothing routed by a cache."""
    need_default_model()
    head = " ".join(["The history of the printing press begins in the fifteenth century, when movable type "
                     "changed how books were made and shared across Europe."] * 8)  # 200 tokens
    rest = " ".join("Another continuation sentence, number %d, says something new." % i for i in range(28))
    # router.warm_prefill off (the default): the answer's KV is on the decode rank only, so the
    # follow-up goes back there.
    no_warm = {"router": {"warm_prefill": False}}
    for layout, cfg in (({"prefill": 2, "decode": 1}, no_warm),
                        ({"prefill": 1, "decode": 1}, dict(no_warm, prefill={"chunk_tokens": 0}))):
        with Cluster(config=cfg, **layout) as c:
            first, usage = completion(c, head, 32)
            check(usage["prompt_tokens_details"]["cached_tokens"] == 0, "a first prompt found a cache: %s" % usage)
            follow = head + first + " Tell me more about it."
            reused_turn(c, follow, 16, "decode_reuse", 192 + 16)
            reused_turn(c, head + " " + rest, 16, "cache_aware", 192)
            conversations(c, 3, 3, 24)
            print("%s: routing decisions %s" % (layout, routing(c)))
            wait_for(lambda: blocks_all_free(c), 30, "every KV block to return to its pool")
            check(c.stop() == 0, "clean exit")
    # router.warm_prefill on: once the first turn ends, the prefill rank that computed its prompt
    # computes the answer into its cache too, so the follow-up goes to that prefill rank, which then
    # holds as much of it as the decode rank does.
    with Cluster(2, 1, config={"router": {"warm_prefill": True}}) as c:
        first, _ = completion(c, head, 32)
        wait_for(lambda: c.metric('pd_router_warm_prefills_total{outcome="done"}') >= 1, 30, "the warm-up to end")
        reused_turn(c, head + first + " Tell me more about it.", 16, "cache_aware", 192 + 16)
        conversations(c, 3, 3, 24)
        warm = {k.split('"')[1]: v for k, v in c.metrics().items() if k.startswith("pd_router_warm_prefills_total{")}
        print("warm-ups: %s; routing decisions %s" % (warm, routing(c)))
        check(warm.get("sent", 0) >= 2 and warm.get("done", 0) + warm.get("failed", 0) == warm["sent"],
              "warm-ups %s: want several sent, each done or failed" % warm)
        wait_for(lambda: blocks_all_free(c), 30, "every KV block to return to its pool")
        check(c.stop() == 0, "clean exit")
    # kv.prefix_cache false: nothing is cached anywhere, so nothing is routed by it; the text is the same.
    with Cluster(1, 1, config={"kv": {"prefix_cache": False}}) as c:
        ref = reference(DEFAULT_MODEL, [{"prompt": head, "chat": False, "max_tokens": 16, "ignore_eos": False}])[0]
        for _ in range(2):
            text, usage = completion(c, head, 16)
            check(text == ref["text"], "prefix_cache off: cluster %r != pd-generate %r" % (text, ref["text"]))
            check(usage["prompt_tokens_details"]["cached_tokens"] == 0, "prefix_cache off, yet cached: %s" % usage)
            time.sleep(0.3)
        check(routing(c) == {"least_work": 2}, "prefix_cache off: routing decisions %s" % routing(c))
        check(c.metric('pd_router_warm_prefills_total{outcome="sent"}') == 0, "prefix_cache off, yet warm-ups")
        check(c.stop() == 0, "clean exit")


def suite_lifecycle(tmp):
    """Tiny models: SIGTERM drains in-flight requests; a mismatched prefill/decode pair is refused; full queue -> 503."""
    model = tiny_model(os.path.join(tmp, "tiny.gguf"))
    # A router that cannot start (its port taken) ends the whole job at once — its
    # workers are told to stop, not left waiting timeouts.startup_ms — and launch.sh
    # says so and exits 2 (mpirun itself exits 0 under orte_enable_recovery).
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    cfg_path = os.path.join(tmp, "taken.json")
    with open(cfg_path, "w") as f:
        json.dump({"model": model, "http": {"port": holder.getsockname()[1]}}, f)
    t0 = time.time()
    r = subprocess.run([os.path.join(ROOT, "deploy", "launch.sh"), "--config", cfg_path, "--build", BUILD,
                        "--threads", "1"], capture_output=True, text=True, timeout=100,
                       start_new_session=True)
    holder.close()
    out = r.stdout + r.stderr
    check(r.returncode == 2 and "Address already in use" in out and "did not start" in out,
          "a router whose port is taken: launch.sh exit %s, output:\n%s" % (r.returncode, out[-3000:]))
    check(time.time() - t0 < 60, "the job ended %.0f s after a router start-up failure (workers left waiting)"
          % (time.time() - t0))
    check(subprocess.run(["pgrep", "-f", cfg_path], capture_output=True).returncode == 1,
          "no process of the failed job is left")
    # SIGTERM while a request runs: it still finishes, then everything exits 0.
    # (The default model, where present, is slow enough to catch a request mid-flight.)
    slow_model = DEFAULT_MODEL if os.path.exists(DEFAULT_MODEL) else model
    with Cluster(1, 1, model=slow_model) as c:
        result = {}

        def slow():
            result["r"] = c.post("/v1/completions", {"prompt": "abc", "max_tokens": 300, "ignore_eos": True,
                                                     "temperature": 0})
        t = threading.Thread(target=slow)
        t.start()
        wait_for(lambda: c.metric("pd_generation_tokens_total") >= 1, 60, "the request to start")
        rc = c.stop()
        t.join(60)
        check("r" in result and result["r"].status == 200, "in-flight request did not finish during drain: %s" %
              (result.get("r") and result["r"].body))
        check(result["r"].json()["usage"]["completion_tokens"] == 300, "drained request cut short")
        check(rc == 0, "exit code %s after SIGTERM:\n%s" % (rc, c.logs()))
    # Prefill and decode ranks with different models: the handoff is refused with a reason.
    other = tiny_model(os.path.join(tmp, "tiny3.gguf"), layers=3)
    line = ["mpirun", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1", "-x", "OMP_WAIT_POLICY=PASSIVE"]
    if os.geteuid() == 0:
        line.insert(1, "--allow-run-as-root")
    exe = lambda sub, name: os.path.join(BUILD, sub, name)  # noqa: E731
    line += ["-np", "1", exe("router", "pd-router"), "{config}", ":", "-np", "1", exe("prefill_node", "pd-prefill"),
             "{config}", "--threads", "1", ":", "-np", "1", exe("decode_node", "pd-decode"), "{config}", "--model",
             other, "--threads", "1"]
    with Cluster(model=model, mpirun=line) as c:
        r = c.post("/v1/completions", {"prompt": "abc", "max_tokens": 4})
        check(r.status == 503 and "n_layers" in r.json()["error"]["message"],
              "mismatched handoff: HTTP %d %s" % (r.status, r.body))
        check(c.get("/health").status == 200, "health after a refused handoff")
        wait_for(lambda: blocks_all_free(c), 20, "blocks of the refused request to be freed")
    # Ranks started with different KV element types could never hand a cache over:
    # the job refuses to start, every rank naming the two that differ.
    mixed = [a if a != other else model for a in line] + ["--kv-dtype", "q8_0"]  # the decode rank's flags
    try:
        with Cluster(model=model, mpirun=mixed, startup_s=60):
            check(False, "a job whose ranks disagree on kv.dtype started")
    except RuntimeError as e:
        check("disagree on the KV cache's elements" in str(e) and "q8_0" in str(e),
              "mixed kv.dtype: the start-up error names it:\n%s" % str(e)[-3000:])
    # Faults on the KV link (a fault-injection wrapper around the real MPI transport on
    # the prefill rank): a transfer that never completes times out and fails that
    # request alone; a corrupted one is caught by the checksum and, its first token
    # already out, migrates (here to the same pair, whose next send is clean) and
    # gets the text a clean run gives. Both free their blocks, and the next request
    # is served.
    for fault, status, words in (("hang_first_send", 504, "did not complete"),
                                 ("corrupt_first_send", 200, "checksum mismatch at layer 0")):
        with Cluster(1, 1, model=model, config={"timeouts": {"transfer_ms": 2000}},
                     env={"PD_FAULT_INJECT": fault}) as c:
            r = c.post("/v1/completions", {"prompt": "abc", "max_tokens": 4, "temperature": 0})
            said = r.json()["error"]["message"] if r.status != 200 else c.full_logs()
            check(r.status == status and words in said,
                  "%s: HTTP %d %s, want %d and '%s' said" % (fault, r.status, r.body, status, words))
            first = r.json()["choices"][0]["text"] if r.status == 200 else None
            if first is not None:
                check(c.metric("pd_requests_migrated_total") == 1,
                      "%s: pd_requests_migrated_total %s, want 1" % (fault, c.metric("pd_requests_migrated_total")))
            r = c.post("/v1/completions", {"prompt": "abc", "max_tokens": 4, "temperature": 0})
            check(r.status == 200, "%s: the next request failed: HTTP %d %s" % (fault, r.status, r.body))
            check(first is None or r.json()["choices"][0]["text"] == first,
                  "%s: the migrated answer %r differs from a clean run's %r" % (fault, first, r.json()["choices"][0]["text"]))
            wait_for(lambda: blocks_all_free(c), 20, "%s: every block back in its pool" % fault)
            check(c.stop() == 0, "%s: clean exit" % fault)
    # A router whose queue is full answers 503 with Retry-After: a long answer holds the
    # only slot, the next request waits in the one-request queue, a third is refused.
    # /metrics behind the API key when asked; the Bearer scheme is matched in any letter case.
    cfg = {"router": {"max_queued": 1, "max_inflight_per_worker": 1, "retry_after_s": 3},
           "http": {"api_key": "k3y", "metrics_require_key": True}}
    with Cluster(1, 1, model=slow_model, config=cfg) as c:  # slow enough to hold its slot while checked
        key = {"Authorization": "bearer k3y"}

        def gauge(name):
            for line in c.get("/metrics", key).body.splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
            return 0.0

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            long = pool.submit(c.post, "/v1/completions",
                               {"prompt": "abc", "max_tokens": 1500 if slow_model == DEFAULT_MODEL else 400,
                                "ignore_eos": True, "temperature": 0}, key)
            wait_for(lambda: gauge("pd_requests_in_flight") == 1 and gauge("pd_router_queue_length") == 0, 20,
                     "the long request dispatched")
            queued = pool.submit(c.post, "/v1/completions", {"prompt": "abc", "max_tokens": 4}, key)
            wait_for(lambda: gauge("pd_router_queue_length") == 1, 20, "the second request queued")
            r = c.post("/v1/completions", {"prompt": "abc", "max_tokens": 4}, headers=key)
            check(r.status == 503 and r.headers.get("Retry-After") == "3", "queue full: HTTP %d %s" % (r.status, r.headers))
            check(long.result().status == 200 and queued.result().status == 200, "the held and the queued requests end 200")
        check(c.get("/metrics").status == 401, "/metrics without the key when metrics_require_key is set")
        check(c.get("/metrics", {"Authorization": "Bearer k3y"}).status == 200, "/metrics with the key")
        check(c.get("/metrics", {"Authorization": "Bearer k3y2"}).status == 401, "/metrics with a wrong key")
        check(c.get("/health").status == 200, "/health needs no key")


def idle_sockets_crowd_no_one_out(c, most=20000):
    """Up to `most` connections that never send a byte (as many as this process's open-file limit
    allows, less a margin): a new client's GET /health and a completion are still answered at
    once — the idle ones are evicted for it, not it refused."""
    import resource
    import socket
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, most + 1000), hard))
        except (ValueError, OSError):
            pass
    n = min(most, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 500)
    socks = []
    t0 = time.time()
    try:
        for _ in range(n):
            s = socket.socket()
            try:
                s.connect((c.client_host, c.port))
            except OSError:
                s.close()
                break
            socks.append(s)
        opened = time.time() - t0
        time.sleep(0.5)
        for path in ("/health", "/health"):
            t = time.time()
            r = c.get(path)
            took = time.time() - t
            check(r.status == 200 and took < 2.0, "GET %s with %d idle sockets open: HTTP %s after %.2f s" %
                  (path, len(socks), r.status, took))
        t = time.time()
        r = c.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        check(r.status == 200, "a completion with %d idle sockets open: HTTP %d %s" % (len(socks), r.status, r.body))
        print("%d idle sockets (opened in %.1f s): /health and a completion answered in %.2f s" %
              (len(socks), opened, time.time() - t))
        check(len(socks) >= min(n, 2000), "only %d of %d sockets connected" % (len(socks), n))
    finally:
        for s in socks:
            s.close()


def suite_limits(tmp):
    """Tiny models: a prompt longer than the prefill KV budget but within the context is
    served (the pool is raised to one context); with thousands of idle sockets open (up to
    20,000), a new client is still answered; launch.sh with an API key comes up, stays
    up, and drains on SIGTERM (its own /v1/models lookup sends the key)."""
    model = tiny_model(os.path.join(tmp, "tiny8k.gguf"), context=8192)
    # 1 MiB holds ~2,000 tokens of this model's KV: a ~3,000-token prompt needs more.
    with Cluster(1, 1, model=model, config={"kv": {"prefill_budget_mb": 1}}) as c:
        prompt = " ".join(["lorem ipsum dolor sit amet"] * 220)
        r = c.post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
        check(r.status == 200, "a prompt within the context but over the prefill budget: HTTP %d %s" %
              (r.status, r.body))
        check(r.json()["usage"]["prompt_tokens"] > 2100, "prompt too short to test: %s" % r.json()["usage"])
        idle_sockets_crowd_no_one_out(c)
        check(c.stop() == 0, "clean exit")
    # launch.sh as a user runs it (waits for /health, prints the URL), on any free port.
    small = tiny_model(os.path.join(tmp, "tiny.gguf"))
    cfg_path = os.path.join(tmp, "key.json")
    with open(cfg_path, "w") as f:
        json.dump({"model": small, "http": {"port": 0, "api_key": "sekret"}}, f)
    out_path = os.path.join(tmp, "launch.out")
    with open(out_path, "w") as out:
        proc = subprocess.Popen([os.path.join(ROOT, "deploy", "launch.sh"), "--config", cfg_path, "--build", BUILD,
                                 "--threads", "1", "--prefill", "1", "--decode", "1"], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        text = lambda: open(out_path).read()  # noqa: E731
        wait_for(lambda: "pdcluster is up" in text() or proc.poll() is not None, 120, "launch.sh to report the cluster up")
        time.sleep(1.0)
        check(proc.poll() is None, "launch.sh exited after start-up (rc %s):\n%s" % (proc.returncode, text()))
        check('"model": "tiny"' in text(), "launch.sh's example lacks the model name (its /v1/models lookup "
              "failed):\n" + text())
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        check(rc == 0, "launch.sh exit code %s after SIGTERM:\n%s" % (rc, text()))
    finally:
        if proc.poll() is None:
            proc.kill()
    left = subprocess.run(["pgrep", "-f", cfg_path], capture_output=True, text=True).stdout.split()
    check(not left, "processes of the launched cluster still running: %s" % left)


ARCH_DATA = os.path.join(ROOT, "tests", "data", "arch")
GEMMA3_MODEL = os.path.join(ROOT, "models", "gemma-3-270m-q4_k_m.gguf")
MODEL_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
                 "def fibonacci(n):", "Les fleurs du jardin sont"]


def model_identity(model, prompts, max_tokens, ignore_eos):
    """1 prefill + 1 decode serving `model`: each completion (streamed and not) is pd-generate's greedy text."""
    cases = [("completion", p, max_tokens) for p in prompts]
    refs = references(model, cases, ignore_eos=ignore_eos)
    with Cluster(1, 1, model=model) as c:
        for i, (case, ref) in enumerate(zip(cases, refs)):
            expect_same(case, run_case(c, case[0], case[1], case[2], i % 2 == 1, ignore_eos=ignore_eos), ref)
        check(c.stop() == 0, "clean exit")
    return refs


def suite_models(tmp):
    """Every architecture and weight type through a 1P+1D cluster, each equal to pd-generate: the random-weight
    Llama 3 / Qwen2 / Qwen3 / Gemma 3 reference files and the K-quant and Q5 files of tests/data/arch."""
    for name in ("llama3.q8_0", "qwen2.q8_0", "qwen3.q8_0", "gemma3.q8_0", "llama-quant.q4_k_m",
                 "llama-quant.q5_k_m", "llama-quant.q6_k", "llama-quant.q5_0", "llama-quant.q5_1"):
        model_identity(os.path.join(ARCH_DATA, name + ".gguf"), MODEL_PROMPTS[:2], 12, ignore_eos=True)
        print("%s: cluster == pd-generate" % name)


def suite_gemma3(tmp):
    """Gemma 3 270M (real weights, Q4_K_M, SentencePiece vocabulary of 262k) through 1P+1D: completions equal
    pd-generate; the file has no chat template, so a chat gets a 400 naming messages; with cluster.json's
    "chat_template": "gemma" chats work and equal pd-generate --chat-template gemma, and prompts past the
    512-token sliding window, chunked, equal pd-generate too."""
    if not os.path.exists(GEMMA3_MODEL):
        print("SKIP: %s missing; run scripts/fetch_model.sh gemma3-270m" % GEMMA3_MODEL)
        sys.exit(SKIP)
    refs = model_identity(GEMMA3_MODEL, MODEL_PROMPTS, 16, ignore_eos=False)
    print("gemma-3-270m: " + " | ".join(repr(r["text"]) for r in refs))
    with Cluster(1, 1, model=GEMMA3_MODEL) as c:
        r = c.post("/v1/chat/completions", request_body("chat", "Hello", 8))
        check(r.status == 400, "a chat to a model without a chat template: HTTP %d %s" % (r.status, r.body))
        err = r.json()["error"]
        check(err.get("param") == "messages" and "chat template" in err.get("message", ""),
              "the 400 must name messages and the missing template: %s" % r.body)
        check(c.stop() == 0, "clean exit")
    long_prompts = [("completion", " ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(50 + 12 * i)), 8)
                    for i in range(2)]  # ~550 and ~680 tokens: past the local layers' 512-token window
    chats = [("chat", q, 16) for q in QUESTIONS[:3]]
    cases = long_prompts + chats
    refs = references(GEMMA3_MODEL, cases, args=("--chat-template", "gemma"))
    check(all(r["prompt_tokens"] > 512 for r in refs[:2]), "the long prompts must pass the 512-token window: %s"
          % [r["prompt_tokens"] for r in refs[:2]])
    cfg = {"chat_template": "gemma", "prefill": {"chunk_tokens": 256, "token_budget": 512}}
    with Cluster(1, 1, model=GEMMA3_MODEL, config=cfg) as c:
        for i, (case, ref) in enumerate(zip(cases, refs)):
            expect_same(case, run_case(c, case[0], case[1], case[2], i % 2 == 0), ref)
        check(c.stop() == 0, "clean exit")
    print("gemma-3-270m chat: " + " | ".join(repr(r["text"]) for r in refs[2:]))


SUITES = {"limits": suite_limits, "models": suite_models, "gemma3": suite_gemma3, "api": suite_api, "identity": suite_identity, "preemption": suite_preemption,
          "kv_types": suite_kv_types,
          "colocated": suite_colocated, "chunked": suite_chunked, "kv_reuse": suite_kv_reuse, "lifecycle": suite_lifecycle,
          "speculation": suite_speculation}

if __name__ == "__main__":
    run_suite(SUITES, "test_cluster.py")
