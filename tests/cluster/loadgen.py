"""A small load generator for the whole-cluster tests (standard library only).

Each request is one of: a completion or a chat completion, streamed or not, and
either read to its end or abandoned by its client after a delay (the socket is
closed, as a client that gives up does). `run_load` sends a list of such
requests with bounded concurrency and returns one Outcome per request, so a
test can check that every request ended exactly once and how."""
import concurrent.futures
import http.client
import json
import random
import socket
import time

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly mix "
         "potions beside old stone walls and rivers run toward distant silver hills").split()


def words(n, rng):
    """About n tokens of plain English-like text."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Spec:
    """One request: endpoint ('completion' | 'chat'), prompt text, max_tokens, stream,
    and abandon_after (seconds after the request was sent; None = read to the end)."""

    def __init__(self, endpoint, prompt, max_tokens, stream, abandon_after=None, ignore_eos=True):
        self.endpoint, self.prompt, self.max_tokens = endpoint, prompt, max_tokens
        self.stream, self.abandon_after, self.ignore_eos = stream, abandon_after, ignore_eos

    def path(self):
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def body(self):
        b = {"max_tokens": self.max_tokens, "temperature": 0, "stream": self.stream, "ignore_eos": self.ignore_eos}
        if self.endpoint == "chat":
            b["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            b["prompt"] = self.prompt
        return b


class Outcome:
    """kind: 'ok' (a complete answer), 'abandoned' (the client left), 'error' (an HTTP
    error or a broken answer; detail says which). tokens: completion tokens of an ok answer."""

    def __init__(self, kind, status=0, detail="", tokens=0, seconds=0.0):
        self.kind, self.status, self.detail, self.tokens, self.seconds = kind, status, detail, tokens, seconds

    def __repr__(self):
        return "Outcome(%s, %s, %r)" % (self.kind, self.status, self.detail[:200])


def _read_stream(resp, spec):
    """-> (completion_tokens, problem or '') for an SSE answer read to its end."""
    finishes, done, usage = 0, 0, None
    for raw in resp.read().decode("utf-8", "replace").split("\n"):
        if not raw.startswith("data: "):
            continue
        payload = raw[len("data: "):]
        if payload == "[DONE]":
            done += 1
            continue
        ev = json.loads(payload)
        if "error" in ev:
            return 0, "stream error: %s" % ev["error"].get("message")
        if ev.get("usage"):
            usage = ev["usage"]
        finishes += sum(1 for ch in ev.get("choices", []) if ch.get("finish_reason"))
    if finishes != 1 or done != 1:
        return 0, "stream framing: %d finish_reason chunks, %d [DONE]" % (finishes, done)
    return (usage or {}).get("completion_tokens", 0), ""


def send(port, spec, timeout=600, headers=None):
    """Sends one request; -> Outcome."""
    t0 = time.time()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        body = spec.body()
        if spec.stream:
            body["stream_options"] = {"include_usage": True}
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        c.request("POST", spec.path(), body=json.dumps(body), headers=h)
        if spec.abandon_after is not None:
            # Wait, then leave without reading (or after reading part of the answer).
            c.sock.settimeout(spec.abandon_after)
            try:
                c.sock.recv(1)
                time.sleep(spec.abandon_after / 2)
            except (socket.timeout, OSError):
                pass
            c.sock.shutdown(socket.SHUT_RDWR)
            return Outcome("abandoned", seconds=time.time() - t0)
        r = c.getresponse()
        if r.status != 200:
            return Outcome("error", r.status, r.read().decode("utf-8", "replace"), seconds=time.time() - t0)
        if spec.stream:
            n, problem = _read_stream(r, spec)
            if problem:
                return Outcome("error", 200, problem, seconds=time.time() - t0)
        else:
            j = json.loads(r.read())
            n = j["usage"]["completion_tokens"]
            if j["choices"][0]["finish_reason"] not in ("stop", "length"):
                return Outcome("error", 200, "finish_reason %r" % j["choices"][0]["finish_reason"])
        if spec.ignore_eos and n != spec.max_tokens:
            return Outcome("error", 200, "%d completion tokens, want %d" % (n, spec.max_tokens), n)
        return Outcome("ok", 200, tokens=n, seconds=time.time() - t0)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return Outcome("error", 0, "%s: %s" % (type(e).__name__, e), seconds=time.time() - t0)
    finally:
        c.close()


def run_load(port, specs, concurrency, timeout=600, headers=None, deadline_s=None):
    """Sends every spec with at most `concurrency` in flight; -> [Outcome] in spec order.
    deadline_s bounds the whole run: requests not started by then are not sent
    (their Outcome is 'error', 'not sent: deadline')."""
    end = time.time() + deadline_s if deadline_s else None

    def one(spec):
        if end is not None and time.time() > end:
            return Outcome("error", 0, "not sent: deadline")
        return send(port, spec, timeout=timeout, headers=headers)

    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, specs))


def mixed_specs(n, seed, prompt_tokens=(4, 200), max_tokens=(1, 24), abandon_share=0.2, abandon_s=(0.0, 0.3)):
    """n varied requests: both endpoints, stream and not, a share abandoned at random moments."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        abandon = rng.uniform(*abandon_s) if rng.random() < abandon_share else None
        out.append(Spec(rng.choice(("completion", "chat")), words(rng.randint(*prompt_tokens), rng),
                        rng.randint(*max_tokens), rng.random() < 0.5, abandon))
    return out


def summary(outcomes):
    counts = {}
    for o in outcomes:
        counts[o.kind] = counts.get(o.kind, 0) + 1
    return counts
