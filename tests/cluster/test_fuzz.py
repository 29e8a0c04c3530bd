#!/usr/bin/env python3
"""API fuzzing: Schemathesis, driven by docs/openapi.yaml, against a live
cluster (router + 1 prefill + 1 decode rank on a tiny model, API key set).

    tests/cluster/test_fuzz.py

Passes when, for every generated request (schema-valid and schema-invalid
bodies, boundary values, wrong methods, missing credentials):
  - no answer is a 5xx;
  - every answer's status, content type, headers and JSON body conform to the
    spec (so the spec is checked against the router as much as the reverse);
  - the router process stays alive, and GET /health answers 200 throughout
    (polled every second during the run) and afterwards.
Bounded: at most MAX_EXAMPLES generated cases per operation (about 2,600
requests in all, /tokenize and /detokenize included), Hypothesis' deterministic
mode (derandomized: the same requests every run, no seed involved), one worker,
generated max_tokens cut to at most 16 and n to at most 4 (see map_body below).
On 2 busy cores a run of the Release build took about 90 s (before the tokenizer
endpoints: about 30 s; about 70 s on the ASan build); it is killed at RUN_TIMEOUT_S.

Exit 0 = pass, 1 = fail, 77 = skipped (printed why: no mpirun, Schemathesis not
importable; scripts/setup.sh installs it).

The same file is also Schemathesis' hooks module (SCHEMATHESIS_HOOKS, with
PD_FUZZ_HOOKS=1 in its environment): it keeps generation cheap and logs every
response's status for the counts printed at the end."""
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import ROOT, SKIP, Cluster, tiny_model  # noqa: E402

SPEC = os.path.join(ROOT, "docs", "openapi.yaml")
API_KEY = "fuzz-key"
MAX_EXAMPLES = 400
RUN_TIMEOUT_S = 420        # the whole Schemathesis run; ctest's TIMEOUT is 600
MAX_GENERATED_TOKENS = 16  # generated max_tokens above this are cut (tiny model, 2 cores)
MAX_GENERATED_CHOICES = 4  # and n above this (a batch of prompts x n choices each generate)
# What is checked on every response. Not here: positive_data_acceptance (a
# schema-valid request may still be refused: an unknown model name is a 404, a
# prompt over the context a 400), negative_data_rejection (the spec cannot say
# "stream_options only with stream: true"), the stateful ones (no links).
CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance", "ignored_auth",
          "unsupported_method", "allow_header_conformance", "missing_required_header",
          "sse_stream_conformance"]  # ours, below


# ---------------------------------------------------------------- hooks (in Schemathesis' process)

def _register_hooks():
    import schemathesis

    served_model = os.environ.get("PD_FUZZ_MODEL", "")
    log_path = os.environ["PD_FUZZ_LOG"]

    @schemathesis.hook
    def map_body(context, body):
        """Keeps generation cheap and reaching the interesting paths:
          - generated max_tokens above MAX_GENERATED_TOKENS are cut, and so is
            n above MAX_GENERATED_CHOICES;
          - two thirds of the string `model` values become the served model's
            name, so most requests get past the 404 and actually generate;
          - half of the bodies that leave `stream` unset ask for a stream (half
            of those with usage), since the schema's null default would make
            streams rare.
        Only schema-valid values are put in, and only where the schema allows
        them whatever else the body holds, so an invalid body stays invalid.
        The choices hash the body: the same body is always changed the same way."""
        if not isinstance(body, dict):
            return body
        h = zlib.crc32(json.dumps(body, sort_keys=True, default=repr).encode("utf-8", "replace"))
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and MAX_GENERATED_TOKENS < v < 2**63:
                body[key] = 1 + v % MAX_GENERATED_TOKENS
        n = body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and MAX_GENERATED_CHOICES < n <= 128:
            body["n"] = 1 + n % MAX_GENERATED_CHOICES
        if isinstance(body.get("model"), str) and served_model and h % 3:
            body["model"] = served_model
        if body.get("stream") is None and body.get("stream_options") is None and (h >> 8) % 2:
            body["stream"] = True
            if (h >> 9) % 2:
                body["stream_options"] = {"include_usage": True}
        return body

    @schemathesis.hook
    def after_call(context, case, response):
        ctype = next((v[0] for k, v in response.headers.items() if k.lower() == "content-type" and v), "-")
        with open(log_path, "a") as f:
            f.write("%s %s %d %s\n" % (case.method.upper(), case.path, response.status_code,
                                       "stream" if ctype.startswith("text/event-stream") else "-"))

    import jsonschema_rs  # a dependency of schemathesis
    import yaml

    with open(SPEC) as f:
        schemas = to_json_schema(yaml.safe_load(f)["components"]["schemas"])

    def validator(name):
        return jsonschema_rs.Draft202012Validator({"$ref": "#/components/schemas/" + name,
                                                   "components": {"schemas": schemas}})

    chunk_validators = {"/v1/completions": validator("CompletionChunk"),
                        "/v1/chat/completions": validator("ChatCompletionChunk")}
    error_validator = validator("Error")

    @schemathesis.check
    def sse_stream_conformance(ctx, response, case):
        """A text/event-stream answer: every payload a CompletionChunk /
        ChatCompletionChunk (or an Error) of the spec, then exactly one [DONE]
        at the end; exactly one finish_reason per choice (index); the usage
        chunk iff asked for; a chat choice's first chunk carries the role.
        (With OpenAPI 3.0, Schemathesis itself only sees each event's `data` as
        a string.)"""
        ctype = next((v[0] for k, v in response.headers.items() if k.lower() == "content-type" and v), "")
        if not ctype.startswith("text/event-stream") or case.path not in chunk_validators:
            return None
        events = [line[len("data: "):] for line in response.content.decode("utf-8").split("\n")
                  if line.startswith("data: ")]
        problems = []
        complete = not response.stream_cut_short
        if complete and (not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1):
            problems.append("the stream must end with exactly one [DONE] (got %d)" % events.count("[DONE]"))
        payloads = [json.loads(e) for e in events if e != "[DONE]"]
        errored = False
        for i, p in enumerate(payloads):
            if "error" in p:
                errored = True
                problems += ["event %d: %s" % (i, e) for e in error_validator.iter_errors(p)]
            else:
                problems += ["event %d: %s" % (i, e) for e in chunk_validators[case.path].iter_errors(p)]
        chunks = [p for p in payloads if "error" not in p and p.get("choices")]
        by_choice = collections.defaultdict(list)
        for c in chunks:
            by_choice[c["choices"][0]["index"]].append(c["choices"][0])
        if case.path == "/v1/chat/completions":
            for index, choice_chunks in by_choice.items():
                if choice_chunks[0]["delta"].get("role") != "assistant":
                    problems.append("the first chunk of chat choice %d has no delta.role" % index)
        if complete and not errored:
            for index, choice_chunks in by_choice.items():
                finishes = [c for c in choice_chunks if c["finish_reason"] is not None]
                if len(finishes) != 1:
                    problems.append("choice %d: %d chunks with a finish_reason (want 1)" % (index, len(finishes)))
            body = case.body if isinstance(case.body, dict) else {}
            prompt = body.get("prompt")
            n_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
            want = n_prompts * (body.get("n") or 1)  # one choice per prompt and n, indices 0..want-1
            if sorted(by_choice) != list(range(want)):
                problems.append("chunks for choices %s, want 0..%d" % (sorted(by_choice), want - 1))
            want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            usage = [p for p in payloads if "usage" in p]
            if len(usage) != int(want_usage) or (usage and payloads[-1] is not usage[0]):
                problems.append("%d usage chunks, include_usage %s (want it last, iff asked)" % (len(usage), want_usage))
        if problems:
            raise AssertionError("; ".join(problems[:5]))
        return None


def to_json_schema(x):
    """An OpenAPI 3.0 schema object as JSON Schema 2020-12: `nullable: true`
    becomes anyOf [..., null], boolean exclusiveMinimum/Maximum numeric."""
    if isinstance(x, list):
        return [to_json_schema(v) for v in x]
    if not isinstance(x, dict):
        return x
    x = {k: to_json_schema(v) for k, v in x.items()}
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if x.get(bound) is True:
            x[bound] = x.pop(limit)
        elif x.get(bound) is False:
            del x[bound]
    if x.pop("nullable", False) is True:
        x = {"anyOf": [x, {"type": "null"}]}
    return x


if os.environ.get("PD_FUZZ_HOOKS") == "1":
    _register_hooks()


# ---------------------------------------------------------------- the test (ctest's process)

class HealthWatch(threading.Thread):
    """Polls GET /health every second until stopped; remembers every non-200."""

    def __init__(self, cluster):
        super().__init__(daemon=True)
        self.cluster, self.polls, self.bad = cluster, 0, []
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(1.0):
            try:
                status = self.cluster.request("GET", "/health").status
            except OSError as e:
                status = "error: %s" % e
            self.polls += 1
            if status != 200:
                self.bad.append((time.strftime("%H:%M:%S"), status))


def schemathesis_version():
    """The installed version, or None when `import schemathesis` fails."""
    r = subprocess.run([sys.executable, "-c", "import schemathesis; print(schemathesis.__version__)"],
                       capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def run_schemathesis(c, tmp, log_path):
    """-> (exit code, output) of `schemathesis run` against the cluster."""
    cmd = [sys.executable, "-m", "schemathesis.cli", "--no-color", "run", SPEC,
           "--url", "http://127.0.0.1:%d" % c.port,
           "--header", "Authorization: Bearer " + API_KEY,
           "--checks", ",".join(CHECKS),
           "--mode", "all",
           "--phases", "examples,coverage,fuzzing",
           "--max-examples", str(MAX_EXAMPLES),
           "--generation-deterministic",
           "--workers", "1",
           "--request-timeout", "60",
           "--suppress-health-check", "all",
           "--continue-on-failure"]
    env = dict(os.environ, PD_FUZZ_HOOKS="1", SCHEMATHESIS_HOOKS=os.path.abspath(__file__),
               PD_FUZZ_LOG=log_path, PD_FUZZ_MODEL=c.get("/v1/models", {"Authorization": "Bearer " + API_KEY})
               .json()["data"][0]["id"])
    try:
        p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode("utf-8", "replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out


def print_counts(log_path):
    by_status, by_op, streams = collections.Counter(), collections.Counter(), 0
    if os.path.exists(log_path):
        with open(log_path) as f:
            for line in f:
                method, path, status, kind = line.split()
                by_status[status] += 1
                by_op["%s %s" % (method, path)] += 1
                streams += kind == "stream"
    print("requests sent: %d" % sum(by_status.values()))
    print("  by status: " + ", ".join("%s: %d" % kv for kv in sorted(by_status.items())))
    print("  streamed answers (text/event-stream): %d" % streams)
    for op, n in sorted(by_op.items()):
        print("  %-28s %d" % (op, n))
    return by_status


def main():
    if not shutil.which("mpirun"):
        print("SKIP: mpirun not found (apt-get install openmpi-bin)")
        return SKIP
    version = schemathesis_version()
    if version is None:
        print("SKIP: schemathesis is not importable by %s (bash scripts/setup.sh installs it)" % sys.executable)
        return SKIP
    print("schemathesis %s, spec %s, at most %d examples per operation, deterministic"
          % (version, os.path.relpath(SPEC, ROOT), MAX_EXAMPLES))
    tmp = tempfile.mkdtemp(prefix="pdcluster-fuzz-")
    failures = []
    try:
        model = tiny_model(os.path.join(tmp, "tiny.gguf"))
        # A template with a tool-call format, so generated tool requests reach the
        # grammar engine and the ranks instead of stopping at the router's 400.
        cfg = {"http": {"api_key": API_KEY}, "router": {"max_queued": 64}, "chat_template": "hermes"}
        with Cluster(1, 1, model=model, config=cfg, threads=1) as c:
            print("cluster up on port %d" % c.port)
            log_path = os.path.join(tmp, "responses.log")
            watch = HealthWatch(c)
            watch.start()
            started = time.time()
            rc, out = run_schemathesis(c, tmp, log_path)
            elapsed = time.time() - started
            watch.done.set()
            watch.join()
            print(out[-12000:])
            print("schemathesis ran %.0f s, exit code %s" % (elapsed, rc))
            by_status = print_counts(log_path)
            print("health polls during the run: %d, not 200: %d" % (watch.polls, len(watch.bad)))

            if rc is None:
                failures.append("schemathesis did not finish within %d s" % RUN_TIMEOUT_S)
            elif rc != 0:
                failures.append("schemathesis reported failures (exit code %d; see above)" % rc)
            server_errors = {s: n for s, n in by_status.items() if s.startswith("5")}
            if server_errors:
                failures.append("5xx answers: %s" % server_errors)
            if not by_status:
                failures.append("no request was sent")
            if watch.bad:
                failures.append("GET /health was not 200 during the run: %s" % watch.bad[:10])
            if c.proc.poll() is not None or c.router_pid() is None:
                failures.append("the router died during the run")
            else:
                try:
                    h = c.get("/health")
                    if h.status != 200:
                        failures.append("GET /health after the run: %d %s" % (h.status, h.body))
                except OSError as e:
                    failures.append("GET /health after the run failed: %s" % e)
            if failures:
                print("cluster log (tail):\n" + c.logs())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        for f in failures:
            print("FAIL:", f)
        return 1
    print("PASS: fuzz_api")
    return 0


if __name__ == "__main__":
    sys.exit(main())
