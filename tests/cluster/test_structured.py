#!/usr/bin/env python3
"""Structured output and tool calls, end to end through the unmodified `openai` client
(the acceptance test of response_format json_object / json_schema, vLLM's
structured_outputs, and tools with tool_choice required / a named function), on the
default model (SmolLM2-135M-Instruct).

    tests/cluster/test_structured.py {structured_1p1d,structured_colocated,structured_migrate}

structured_1p1d:      1 prefill + 1 decode rank, cluster.json "chat_template": "hermes" (a
                      template with a tool format): 200 requests over 20 JSON schemas
                      (Pydantic models and hand-written schema dicts), 8 at a time,
                      half greedy, half sampled (temperature 0.8, seeded): chat.completions.parse
                      with a Pydantic model (json_schema strict), chat.completions.create with
                      json_schema strict, json_object, the completions endpoint
                      (response_format in extra_body), streamed chat and completions, the
                      client's chat.completions.stream helper, vLLM's structured_outputs
                      {json}, and tool calls (tool_choice "required" and a named function,
                      streamed and not). Then vLLM's regex / choice / grammar constraints
                      and the bad inputs (an invalid schema, json_schema without its
                      object, ...): 400 naming the field.
structured_colocated: one colocated rank with the model's own template (SmolLM2's ChatML:
                      no tool format): the same 200 requests with the tool kinds replaced by
                      constrained ones, and a tool request is refused (400, param "tools").
structured_migrate:   1 prefill + 2 decode ranks (hermes): 16 streamed constrained requests
                      (json_schema on chat and completions, tool calls); the busiest decode
                      rank is killed (kill -9) once most have started: every request ends in
                      exactly one final state, none with an error, every completed one
                      validates, and pd_requests_migrated_total moved.

Every answer that ends with finish_reason "stop" (or "tool_calls") parses with json.loads
and validates with jsonschema against the schema sent (a tool call's arguments against that
tool's parameters); "length" (a 135M model can ramble inside a string) is counted and may
be at most 2% of a suite's schema-constrained requests (json_object, which bounds nothing,
has its own bound: 20% of those). About 45 s (1p1d), 25 s (colocated), 15 s (migrate) on 2 cores.

Exit 0 = pass, 1 = fail, 77 = skipped (printed why: the openai package, jsonschema or
pydantic missing, the model missing, or mpirun missing)."""
import enum
import http.client
import json
import os
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, List, Literal, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import SKIP, Cluster, check, need_default_model, per_rank, run_suite, wait_for  # noqa: E402

try:
    import jsonschema
    import openai
    import pydantic
    from pydantic import BaseModel, Field, conlist
except ImportError as e:  # scripts/setup.sh installs them
    print("SKIP: %s (python3 -m pip install openai pydantic jsonschema)" % e)
    sys.exit(SKIP)

from openai.lib._pydantic import to_strict_json_schema  # noqa: E402  (what parse() sends)

TOOL_TEMPLATE = "hermes"      # cluster.json "chat_template" with a tool-call format
N_REQUESTS = 200
CONCURRENCY = 8
MAX_TOKENS = 300
LENGTH_LIMIT = 0.02           # share of a suite's schema-constrained requests that may end with "length"
JSON_OBJECT_LENGTH_LIMIT = 0.2  # of its json_object requests (nothing bounds those)


def s(n=40, **kw):
    return Field(min_length=1, max_length=n, **kw)


def Str(n):  # noqa: N802 -- a bounded string type, for list items
    return Annotated[str, Field(min_length=1, max_length=n)]


# ------------------------------------------------------------------ the 20 schemas
# Pydantic models: the client derives strict schemas from them (every property required,
# additionalProperties false, Optional = nullable). Strings are bounded (maxLength <= 40) and
# arrays hold at most 4 items: a 135M model finishes each well within MAX_TOKENS.

class Person(BaseModel):
    """A person."""
    name: str = s()
    age: int = Field(ge=0, le=120)
    email_verified: bool


class Address(BaseModel):
    """A postal address."""
    street: str = s()
    city: str = s(30)
    zip: str = Field(pattern=r"^[0-9]{5}$")
    country: Literal["US", "CA", "MX"]


class Employee(BaseModel):
    name: str = s(30)
    role: Literal["engineer", "designer", "manager", "sales"]


class Company(BaseModel):
    """A company and some of its staff."""
    name: str = s()
    founded: int = Field(ge=1800, le=2025)
    employees: List[Employee] = Field(min_length=1, max_length=3)


class Condition(str, enum.Enum):
    sunny = "sunny"
    cloudy = "cloudy"
    rain = "rain"
    snow = "snow"


class Weather(BaseModel):
    """The weather in a city."""
    city: str = s(30)
    temperature_c: float = Field(ge=-50, le=60)
    condition: Condition


class LineItem(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}[0-9]{2}$")
    quantity: int = Field(ge=1, le=10)


class Order(BaseModel):
    """A shop order."""
    order_id: str = Field(pattern=r"^ORD-[0-9]{4}$")
    items: List[LineItem] = Field(min_length=1, max_length=4)
    express: bool


class Book(BaseModel):
    """A book."""
    title: str = s()
    author: str = s(30)
    year: int = Field(ge=1450, le=2025)
    genres: List[Literal["fiction", "history", "science", "poetry", "travel"]] = Field(min_length=1, max_length=3)
    rating: Optional[int] = Field(default=None, ge=1, le=5)


class Recipe(BaseModel):
    """A recipe."""
    name: str = s()
    servings: int = Field(ge=1, le=12)
    ingredients: conlist(Str(30), min_length=1, max_length=4)
    vegetarian: bool


class Event(BaseModel):
    """A calendar event."""
    title: str = s()
    day: str = Field(pattern=r"^2024-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$")
    attendees: List[Str(20)] = Field(max_length=4)
    location: Optional[str] = Field(default=None, max_length=30)


class Color(BaseModel):
    """A colour."""
    name: str = s(20)
    rgb: conlist(int, min_length=3, max_length=3)
    hex: str = Field(pattern=r"^#[0-9a-f]{6}$")


class Task(BaseModel):
    title: str = s(30)
    done: bool
    priority: Literal["low", "medium", "high"]


class TaskList(BaseModel):
    """A to-do list."""
    owner: str = s(20)
    tasks: List[Task] = Field(min_length=1, max_length=4)


class Sentiment(str, enum.Enum):
    positive = "positive"
    neutral = "neutral"
    negative = "negative"


class Review(BaseModel):
    """A movie review."""
    movie: str = s()
    score: int = Field(ge=0, le=10)
    sentiment: Sentiment
    summary: str = s()


class GeoPoint(BaseModel):
    """A place on the map."""
    label: str = s(30)
    lat: float = Field(ge=-90, le=90)
    lon: float = Field(ge=-180, le=180)


class Manager(BaseModel):
    name: str = s(30)
    title: str = s(30)


class Team(BaseModel):
    name: str = s(20)
    size: int = Field(ge=1, le=20)


class Department(BaseModel):
    """A department of a company."""
    name: str = s(30)
    manager: Manager
    teams: List[Team] = Field(min_length=1, max_length=3)


class Product(BaseModel):
    """A product in a catalogue."""
    name: str = s()
    price_cents: int = Field(ge=0, le=100000)
    tags: List[Str(15)] = Field(max_length=4)
    in_stock: bool
    discount_percent: Optional[int] = Field(default=None, ge=0, le=90)


def obj(props, **extra):
    """A strict-shaped object schema: every property required, no others."""
    return dict({"type": "object", "properties": props, "required": list(props), "additionalProperties": False},
                **extra)


STR40 = {"type": "string", "minLength": 1, "maxLength": 40}
DICT_SCHEMAS = {
    "verdict": obj({"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                    "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}),
    "grid": obj({"rows": {"type": "array", "minItems": 2, "maxItems": 3,
                          "items": {"type": "array", "minItems": 2, "maxItems": 3,
                                    "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}),
    "flight": obj({"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                   "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                   "seats": {"type": "integer", "minimum": 1, "maximum": 9},
                   "cabin": {"type": "string", "enum": ["economy", "business", "first"]}}),
    "contact": obj({"kind": {"type": "string", "const": "contact"},
                    "name": STR40,
                    "phone": {"type": "string", "pattern": "^\\+1-[0-9]{3}-[0-9]{4}$"}}),
    "shape": obj({"shape": {"anyOf": [
        obj({"type": {"type": "string", "const": "circle"},
             "radius": {"type": "integer", "minimum": 1, "maximum": 100}}),
        obj({"type": {"type": "string", "const": "rect"}, "width": {"type": "integer", "minimum": 1, "maximum": 100},
             "height": {"type": "integer", "minimum": 1, "maximum": 100}})]}}),
    "inventory": obj({"warehouse": {"type": "string", "minLength": 1, "maxLength": 30},
                      "bins": {"type": "array", "maxItems": 3,
                               "items": obj({"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                             "items": {"type": "array", "maxItems": 2,
                                                       "items": {"type": "string", "maxLength": 20}}})},
                      "audited": {"type": "boolean"},
                      "note": {"type": ["string", "null"], "maxLength": 30}}),
}


class Schema:
    """One of the 20: a name, the JSON schema sent, the Pydantic model (or None), a prompt, and a
    hand-written instance it accepts (the test's own check of the schema)."""

    def __init__(self, name, schema, model, prompt, sample):
        self.name, self.schema, self.model, self.prompt, self.sample = name, schema, model, prompt, sample
        self.fields = ", ".join(schema["properties"])

    def messages(self):
        return [{"role": "system", "content": "You answer with one JSON object and nothing else."},
                {"role": "user", "content": "%s Give the fields %s." % (self.prompt, self.fields)}]

    def example_messages(self):
        """For json_object, which bounds nothing: an example keeps a small model's object short."""
        return [{"role": "system", "content": "You answer with one short JSON object and nothing else."},
                {"role": "user", "content": "%s Reply with a short JSON object like %s" % (self.prompt,
                                                                                       json.dumps(self.sample))}]

    def completion_prompt(self):
        return "%s\nAs a JSON object with the fields %s:\n" % (self.prompt, self.fields)

    def tool(self):
        if self.model is not None:
            return openai.pydantic_function_tool(self.model, name=self.tool_name())
        return {"type": "function", "function": {"name": self.tool_name(), "description": self.prompt,
                                                 "parameters": self.schema, "strict": True}}

    def tool_name(self):
        return "record_" + self.name


def pyd(model, prompt, sample):
    return Schema(model.__name__.lower(), to_strict_json_schema(model), model, prompt, sample)


def raw(name, prompt, sample):
    return Schema(name, DICT_SCHEMAS[name], None, prompt, sample)


SCHEMAS = [
    pyd(Person, "Describe a fictional person.", {"name": "Ada", "age": 36, "email_verified": True}),
    pyd(Address, "Give the address of a post office.",
        {"street": "1 Main St", "city": "Springfield", "zip": "12345", "country": "US"}),
    pyd(Company, "Describe a small software company.",
        {"name": "Acme", "founded": 1999, "employees": [{"name": "Bo", "role": "engineer"}]}),
    pyd(Weather, "Report today's weather in Paris.", {"city": "Paris", "temperature_c": 18.5, "condition": "cloudy"}),
    pyd(Order, "Write a shop order for two products.",
        {"order_id": "ORD-0042", "items": [{"sku": "ABC12", "quantity": 2}], "express": False}),
    pyd(Book, "Describe a famous novel.",
        {"title": "Emma", "author": "Jane Austen", "year": 1815, "genres": ["fiction"], "rating": None}),
    pyd(Recipe, "Give a simple pancake recipe.",
        {"name": "Pancakes", "servings": 4, "ingredients": ["flour", "milk", "eggs"], "vegetarian": True}),
    pyd(Event, "Plan a team meeting in 2024.",
        {"title": "Sync", "day": "2024-03-14", "attendees": ["Ann", "Bob"], "location": None}),
    pyd(Color, "Describe the colour orange.", {"name": "orange", "rgb": [255, 165, 0], "hex": "#ffa500"}),
    pyd(TaskList, "Write a short to-do list for a weekend.",
        {"owner": "Sam", "tasks": [{"title": "Shop", "done": False, "priority": "high"}]}),
    pyd(Review, "Review a film you liked.",
        {"movie": "Up", "score": 9, "sentiment": "positive", "summary": "Moving and funny."}),
    pyd(GeoPoint, "Give the location of the Eiffel Tower.", {"label": "Eiffel Tower", "lat": 48.858, "lon": 2.294}),
    pyd(Department, "Describe the research department of a company.",
        {"name": "Research", "manager": {"name": "Kim", "title": "Director"}, "teams": [{"name": "ML", "size": 5}]}),
    pyd(Product, "Describe a coffee mug for sale.",
        {"name": "Mug", "price_cents": 1299, "tags": ["kitchen"], "in_stock": True, "discount_percent": 10}),
    raw("verdict", "Is the sky blue on a clear day?", {"answer": "yes", "confidence": 95}),
    raw("grid", "Write a small grid of digits.", {"rows": [[1, 2], [3, 4]]}),
    raw("flight", "Book a flight from Boston to Denver.",
        {"origin": "BOS", "destination": "DEN", "seats": 2, "cabin": "economy"}),
    raw("contact", "Give a contact card for a plumber.", {"kind": "contact", "name": "Joe", "phone": "+1-555-0199"}),
    raw("shape", "Describe a circle or a rectangle.", {"shape": {"type": "circle", "radius": 3}}),
    raw("inventory", "Describe a warehouse inventory.",
        {"warehouse": "North", "bins": [{"id": 7, "items": ["bolts"]}], "audited": True, "note": None}),
]
assert len(SCHEMAS) == 20 and len({x.name for x in SCHEMAS}) == 20


def self_check():
    """The test's own schemas: each is valid JSON Schema and accepts its sample (and the Pydantic
    model its instance); the strict shape (every object: additionalProperties false, all required)."""
    def strict_shape(node, where):
        if isinstance(node, dict):
            if node.get("type") == "string" or "string" in (node.get("type") or []):
                check(any(k in node for k in ("maxLength", "pattern", "enum", "const")),
                      "schema %s: an unbounded string (a small model may never end it)" % where)
            if node.get("type") == "object" or "properties" in node:
                check(node.get("additionalProperties") is False and
                      sorted(node.get("required", [])) == sorted(node.get("properties", {})),
                      "schema %s is not strict-shaped" % where)
            for k, v in node.items():
                strict_shape(v, where + "." + k)
        elif isinstance(node, list):
            for k, v in enumerate(node):
                strict_shape(v, "%s[%d]" % (where, k))
    for sc in SCHEMAS:
        jsonschema.validators.validator_for(sc.schema).check_schema(sc.schema)
        jsonschema.validate(sc.sample, sc.schema)
        if sc.model is not None:
            sc.model.model_validate(sc.sample)
        strict_shape(sc.schema, sc.name)
        check(re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", sc.tool_name()), "tool name %s" % sc.tool_name())


# ------------------------------------------------------------------ one request

KINDS = ["parse", "schema", "completions", "stream", "stream_helper", "json_object",
         "tool_required", "tool_named", "tool_stream", "structured_outputs"]
# Without a tool format (the model's own template) the tool kinds become these.
NO_TOOLS = {"tool_required": "stream_completions", "tool_named": "parse", "tool_stream": "stream"}


class Result:
    def __init__(self, i, kind, schema):
        self.i, self.kind, self.schema = i, kind, schema
        self.finish = None        # finish_reason, or None when the request failed
        self.valid = False
        self.problem = ""         # why it is bad (empty: good)
        self.text = ""            # the answer's text (what a length-cut rambled on with)
        self.request = {}
        self.response = ""

    def bad(self, why):
        self.problem = why
        return self

    def describe(self):
        return ("request %d (%s, %s): %s\n    request: %s\n    response: %s"
                % (self.i, self.kind, self.schema, self.problem, json.dumps(self.request, default=str)[:1500],
                   str(self.response)[:1500]))


def sampling(i):
    """Half greedy, half sampled (seeded); every schema and every kind gets both (i // 20: the
    round over the schemas)."""
    return {"temperature": 0} if (i // len(SCHEMAS)) % 2 == 0 else {"temperature": 0.8, "seed": 1000 + i}


def plan(i, tools):
    sc = SCHEMAS[i % len(SCHEMAS)]
    kind = KINDS[(i + i // len(SCHEMAS)) % len(KINDS)]  # each schema meets each kind once per 200
    if not tools:
        kind = NO_TOOLS.get(kind, kind)
    if kind in ("parse", "stream_helper") and sc.model is None:
        kind = {"parse": "schema", "stream_helper": "stream_completions"}[kind]
    return sc, kind


def json_schema_format(sc, strict=True):
    return {"type": "json_schema", "json_schema": {"name": sc.name, "schema": sc.schema, "strict": strict}}


def validate(res, text, schema):
    """res finished with `text`: it must be JSON valid against `schema`."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return res.bad("finish_reason %r but not JSON (%s): %r" % (res.finish, e, text[:400]))
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return res.bad("finish_reason %r but invalid against the schema: %s at %s: %r"
                       % (res.finish, e.message, list(e.absolute_path), text[:400]))
    res.valid = True
    return res


def check_tool_call(res, message_tool_calls, tools, want_name):
    """One tool call of one of `tools` (want_name: that one), its arguments valid JSON per its parameters."""
    if not message_tool_calls:
        return res.bad("finish_reason tool_calls without tool_calls")
    call = message_tool_calls[0]
    name, args = call["name"], call["arguments"]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if name not in params or (want_name and name != want_name):
        return res.bad("tool call names %r, want %s" % (name, want_name or sorted(params)))
    if not call.get("id"):
        return res.bad("tool call without an id: %s" % call)
    return validate(res, args, params[name])


def run_one(client, model, i, tools_ok):
    sc, kind = plan(i, tools_ok)
    res = Result(i, kind, sc.name)
    samp = sampling(i)
    common = dict(model=model, max_tokens=MAX_TOKENS, **samp)
    try:
        if kind == "parse":
            res.request = dict(common, messages=sc.messages(), response_format="Pydantic " + sc.model.__name__)
            raw = client.chat.completions.with_raw_response.parse(messages=sc.messages(), response_format=sc.model,
                                                                  **common)
            res.response = raw.http_response.text
            body = json.loads(res.response)
            choice = body["choices"][0]
            res.finish, res.text = choice["finish_reason"], choice["message"].get("content") or ""
            try:
                done = raw.parse()
            except openai.LengthFinishReasonError:
                return res if res.finish == "length" else res.bad("LengthFinishReasonError on %r" % res.finish)
            except pydantic.ValidationError as e:
                return res.bad("the client's Pydantic validation failed: %s" % str(e)[:600])
            msg = done.choices[0].message
            if res.finish != "stop" or not isinstance(msg.parsed, sc.model) or msg.refusal:
                return res.bad("finish %r, parsed %r, refusal %r" % (res.finish, msg.parsed, msg.refusal))
            return validate(res, msg.content, sc.schema)

        on_completions = kind == "structured_outputs" and i % 4 == 3  # vLLM's field on both endpoints
        if kind in ("schema", "json_object", "structured_outputs") and not on_completions:
            extra, messages = {}, sc.messages()
            if kind == "schema":
                fmt = {"response_format": json_schema_format(sc)}
                want = sc.schema
            elif kind == "json_object":
                fmt = {"response_format": {"type": "json_object"}}
                want, messages = {"type": "object"}, sc.example_messages()
            else:  # vLLM's field: the schema as an object, or as its JSON text
                extra = {"structured_outputs": {"json": sc.schema if i % 2 else json.dumps(sc.schema)}}
                fmt, want = {}, sc.schema
            res.request = dict(common, messages=messages, **fmt, extra_body=extra)
            r = client.chat.completions.create(messages=messages, extra_body=extra or None, **fmt, **common)
            res.response = r.model_dump_json()
            ch = r.choices[0]
            res.finish, res.text = ch.finish_reason, ch.message.content or ""
            if res.finish == "length":
                return res
            if res.finish != "stop" or ch.message.tool_calls:
                return res.bad("finish_reason %r, tool_calls %s" % (res.finish, ch.message.tool_calls))
            if r.usage is None or r.usage.completion_tokens > MAX_TOKENS:
                return res.bad("usage %s" % r.usage)
            return validate(res, ch.message.content or "", want)

        if kind in ("completions", "stream_completions", "structured_outputs"):
            stream = kind == "stream_completions"
            if kind == "structured_outputs":
                extra = {"structured_outputs": {"json": sc.schema}}
            else:
                extra = {"response_format": json_schema_format(sc, strict=bool(i % 3))}
            res.request = dict(common, prompt=sc.completion_prompt(), stream=stream, extra_body=extra)
            if not stream:
                r = client.completions.create(prompt=sc.completion_prompt(), extra_body=extra, **common)
                res.response = r.model_dump_json()
                res.finish, text = r.choices[0].finish_reason, r.choices[0].text
                res.text = text
            else:
                text, finishes, chunks = "", [], []
                for chunk in client.completions.create(prompt=sc.completion_prompt(), extra_body=extra, stream=True,
                                                       stream_options={"include_usage": True}, **common):
                    chunks.append(chunk.model_dump(exclude_none=True))
                    for ch in chunk.choices:
                        if finishes and ch.text:
                            return res.bad("text after the finish_reason")
                        text += ch.text or ""
                        if ch.finish_reason:
                            finishes.append(ch.finish_reason)
                res.response = json.dumps(chunks[-6:])
                if len(finishes) != 1:
                    return res.bad("%d chunks with a finish_reason: %s" % (len(finishes), finishes))
                res.finish, res.text = finishes[0], text
            if res.finish == "length":
                return res
            if res.finish != "stop":
                return res.bad("finish_reason %r" % res.finish)
            return validate(res, text, sc.schema)

        if kind == "stream":
            fmt = json_schema_format(sc)
            res.request = dict(common, messages=sc.messages(), response_format=fmt, stream=True)
            text, finishes, chunks = "", [], []
            for chunk in client.chat.completions.create(messages=sc.messages(), response_format=fmt, stream=True,
                                                        stream_options={"include_usage": True}, **common):
                chunks.append(chunk.model_dump(exclude_none=True))
                for ch in chunk.choices:
                    piece = ch.delta.content or ""
                    if finishes and piece:
                        return res.bad("content after the finish_reason")
                    if ch.delta.tool_calls:
                        return res.bad("tool_calls in a stream without tools")
                    text += piece
                    if ch.finish_reason:
                        finishes.append(ch.finish_reason)
            res.response = json.dumps(chunks[-6:])
            if len(finishes) != 1:
                return res.bad("%d chunks with a finish_reason: %s" % (len(finishes), finishes))
            res.finish, res.text = finishes[0], text
            if res.finish == "length":
                return res
            if res.finish != "stop":
                return res.bad("finish_reason %r" % res.finish)
            return validate(res, text, sc.schema)

        if kind == "stream_helper":  # the client's own streaming parser
            res.request = dict(common, messages=sc.messages(), response_format="Pydantic " + sc.model.__name__,
                               helper="chat.completions.stream")
            try:
                with client.chat.completions.stream(messages=sc.messages(), response_format=sc.model, **common) as st:
                    for _ in st:
                        pass
                    done = st.get_final_completion()
            except openai.LengthFinishReasonError as e:
                res.finish = "length"
                res.text = (e.completion.choices[0].message.content or "") if e.completion else ""
                res.response = e.completion.model_dump_json(warnings=False) if e.completion else ""
                return res
            except pydantic.ValidationError as e:
                return res.bad("the client's Pydantic validation failed: %s" % str(e)[:600])
            res.response = done.model_dump_json(warnings=False)
            msg = done.choices[0].message
            res.finish = done.choices[0].finish_reason
            if res.finish != "stop" or not isinstance(msg.parsed, sc.model):
                return res.bad("finish %r, parsed %r" % (res.finish, msg.parsed))
            return validate(res, msg.content, sc.schema)

        if kind in ("tool_required", "tool_named", "tool_stream"):
            other = SCHEMAS[(i * 7 + 3) % len(SCHEMAS)]
            if other is sc:
                other = SCHEMAS[(i + 1) % len(SCHEMAS)]
            tools = [sc.tool(), other.tool()] if i % 3 else [sc.tool()]
            if kind == "tool_required":
                choice, want_name = "required", (None if len(tools) > 1 else sc.tool_name())
            else:
                choice, want_name = {"type": "function", "function": {"name": sc.tool_name()}}, sc.tool_name()
            messages = [{"role": "system", "content": "You are an assistant that uses the given functions."},
                        {"role": "user", "content": sc.prompt + " Record it with a function call."}]
            res.request = dict(common, messages=messages, tools=tools, tool_choice=choice, stream=kind == "tool_stream")
            if kind != "tool_stream":
                r = client.chat.completions.create(messages=messages, tools=tools, tool_choice=choice, **common)
                res.response = r.model_dump_json()
                ch = r.choices[0]
                res.finish, res.text = ch.finish_reason, ch.message.content or ""
                if res.finish == "length":
                    return res
                if res.finish != "tool_calls":
                    return res.bad("finish_reason %r, want tool_calls" % res.finish)
                calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                         for t in ch.message.tool_calls or [] if t.type == "function"]
                return check_tool_call(res, calls, tools, want_name)
            calls, finishes, chunks = {}, [], []
            for chunk in client.chat.completions.create(messages=messages, tools=tools, tool_choice=choice,
                                                        stream=True, **common):
                chunks.append(chunk.model_dump(exclude_none=True))
                for ch in chunk.choices:
                    if finishes and (ch.delta.tool_calls or ch.delta.content):
                        return res.bad("a delta after the finish_reason")
                    for tc in ch.delta.tool_calls or []:
                        c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                        c["id"] += tc.id or ""
                        if tc.function is not None:
                            c["name"] += tc.function.name or ""
                            c["arguments"] += tc.function.arguments or ""
                    if ch.finish_reason:
                        finishes.append(ch.finish_reason)
            res.response = json.dumps(chunks[:3] + ["..."] + chunks[-4:])
            if len(finishes) != 1:
                return res.bad("%d chunks with a finish_reason: %s" % (len(finishes), finishes))
            res.finish = finishes[0]
            res.text = " | ".join(calls[k]["name"] + " " + calls[k]["arguments"] for k in sorted(calls))
            if res.finish == "length":
                return res
            if res.finish != "tool_calls":
                return res.bad("finish_reason %r, want tool_calls" % res.finish)
            return check_tool_call(res, [calls[k] for k in sorted(calls)], tools, want_name)
        raise AssertionError("unknown kind " + kind)
    except openai.APIStatusError as e:
        res.response = "HTTP %d %s" % (e.status_code, e.response.text[:1000])
        return res.bad("HTTP %d" % e.status_code)
    except (openai.APIError, OSError, ValueError) as e:
        return res.bad("%s: %s" % (type(e).__name__, e))


# ------------------------------------------------------------------ suites

def make_client(c, timeout=120):
    # No retries: a 5xx or a dropped connection is a failure here, not something to paper over.
    return openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % c.port, api_key="none", max_retries=0, timeout=timeout)


def model_name(c):
    return c.get("/v1/models").json()["data"][0]["id"]


def run_mix(c, label, tools_ok, n=N_REQUESTS):
    """n requests over the 20 schemas, CONCURRENCY at a time; the checks and the one-line summary."""
    client, model = make_client(c), model_name(c)
    t0 = time.time()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(lambda i: run_one(client, model, i, tools_ok), range(n)))
    took = time.time() - t0
    bad = [r for r in results if r.problem]
    cut = [r for r in results if not r.problem and r.finish == "length"]
    valid = sum(r.valid for r in results)
    kinds = {}
    for r in results:
        k = kinds.setdefault(r.kind, [0, 0, 0])
        k[0] += 1
        k[1] += r.valid
        k[2] += (not r.problem and r.finish == "length")
    print("%s: %d requests, %d validated, %d length-cut, %d bad, %.1f s" % (label, n, valid, len(cut), len(bad), took))
    print("%s: by kind (requests/validated/length-cut): %s" % (
        label, ", ".join("%s %d/%d/%d" % (k, *v) for k, v in sorted(kinds.items()))))
    for r in cut[:8]:
        print("length-cut: request %d (%s, %s, %s): %r ... %r" % (r.i, r.kind, r.schema, sampling(r.i), r.text[:120],
                                                                  r.text[-120:]))
    check(not bad, "%s: %d of %d requests bad:\n%s" % (label, len(bad), n, "\n".join(r.describe() for r in bad[:6])))
    # A schema bounds every string and array: at most 2% may ramble to max_tokens. json_object
    # bounds nothing (the model may write an endless array): its cuts have their own bound.
    cut_free = [r for r in cut if r.kind == "json_object"]
    n_free = sum(r.kind == "json_object" for r in results)
    check(len(cut) - len(cut_free) <= LENGTH_LIMIT * (n - n_free),
          "%s: %d of %d schema-constrained requests hit max_tokens %d (at most %d%%)"
          % (label, len(cut) - len(cut_free), n - n_free, MAX_TOKENS, LENGTH_LIMIT * 100))
    check(len(cut_free) <= JSON_OBJECT_LENGTH_LIMIT * n_free, "%s: %d of %d json_object requests hit max_tokens %d"
          % (label, len(cut_free), n_free, MAX_TOKENS))
    check(valid + len(cut) == n, "%s: %d validated + %d cut != %d" % (label, valid, len(cut), n))
    return took


def expect_400(client, what, params, call):
    """call() must raise a 400 whose error.param is one of `params` (None: any param starting
    with 'response_format')."""
    try:
        r = call()
    except openai.BadRequestError as e:
        ok = e.param in params if params else (e.param or "").startswith("response_format")
        check(ok, "%s: 400 names param %r, want %s: %s" % (what, e.param, params or "response_format...",
                                                           e.response.text[:400]))
        return
    except openai.APIStatusError as e:
        raise AssertionError("%s: HTTP %d, want 400: %s" % (what, e.status_code, e.response.text[:400]))
    raise AssertionError("%s: accepted, want 400: %s" % (what, str(r)[:400]))


def check_bad_inputs(c):
    client, model = make_client(c), model_name(c)
    msgs = [{"role": "user", "content": "Hi"}]
    bad_schema = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    expect_400(client, "an invalid schema", ("response_format", "response_format.json_schema.schema"),
               lambda: client.chat.completions.create(model=model, messages=msgs, max_tokens=8, response_format={
                   "type": "json_schema", "json_schema": {"name": "bad", "schema": bad_schema}}))
    expect_400(client, "an invalid schema on completions", ("response_format", "response_format.json_schema.schema"),
               lambda: client.completions.create(model=model, prompt="Hi", max_tokens=8, extra_body={
                   "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": bad_schema}}}))
    expect_400(client, "json_schema without its object", None,
               lambda: client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                                      response_format={"type": "json_schema"}))
    expect_400(client, "an unknown response_format type", None,
               lambda: client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                                      response_format={"type": "yaml"}))
    expect_400(client, "an invalid regex", ("structured_outputs.regex", "structured_outputs"),
               lambda: client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                                      extra_body={"structured_outputs": {"regex": "([a-z"}}))
    expect_400(client, "two constraints", ("structured_outputs", "structured_outputs.json", "structured_outputs.regex",
                                           "response_format"),
               lambda: client.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                                      response_format={"type": "json_object"},
                                                      extra_body={"structured_outputs": {"regex": "[a-z]+"}}))
    print("bad inputs: 6 requests refused with 400 naming the field")


def check_vllm_constraints(c):
    """vLLM's structured_outputs regex / choice / grammar on chat and completions."""
    client, model = make_client(c), model_name(c)
    cases = [
        ({"regex": "[A-Z][a-z]{2,8}-[0-9]{3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}-[0-9]{3}", t)),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"grammar": 'root ::= ("hello" | "hi") " " ("world" | "there")'},
         lambda t: re.fullmatch(r"(hello|hi) (world|there)", t)),
        ({"json": SCHEMAS[0].schema}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[0].schema) is None),
    ]
    n = 0
    for so, ok in cases:
        for endpoint in ("chat", "completions"):
            for samp in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
                if endpoint == "chat":
                    r = client.chat.completions.create(
                        model=model, max_tokens=64, extra_body={"structured_outputs": so},
                        messages=[{"role": "user", "content": "Name a colour or a code."}], **samp)
                    text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
                else:
                    r = client.completions.create(model=model, max_tokens=64, prompt="Name a colour or a code:",
                                                  extra_body={"structured_outputs": so}, **samp)
                    text, finish = r.choices[0].text, r.choices[0].finish_reason
                try:
                    good = finish == "stop" and ok(text)
                except (ValueError, jsonschema.ValidationError):
                    good = False
                check(good, "structured_outputs %s on %s (%s): finish %r, text %r" % (so, endpoint, samp, finish, text))
                n += 1
    print("structured_outputs regex/choice/grammar/json: %d requests matched" % n)


def check_tools_refused(c):
    """The model's own template (SmolLM2's) has no tool format: tools are refused, naming them."""
    client, model = make_client(c), model_name(c)
    tool = SCHEMAS[16].tool()
    expect_400(client, "tools without a tool-call template", ("tools",),
               lambda: client.chat.completions.create(model=model, max_tokens=16, tools=[tool], tool_choice="required",
                                                      messages=[{"role": "user", "content": "Book a flight."}]))
    r = c.post("/tokenize", {"messages": [{"role": "user", "content": "Book a flight."}], "tools": [tool]})
    check(r.status == 400 and r.json()["error"]["param"] == "tools", "/tokenize with tools: %s %s" % (r.status, r.body))
    print("tools on the model's own template: 400 naming tools (chat and /tokenize)")


def check_tool_choice_none(c):
    """tool_choice "none" with tools: a plain answer, no tool call."""
    client, model = make_client(c), model_name(c)
    tools = [SCHEMAS[16].tool(), SCHEMAS[3].tool()]
    for samp in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
        r = client.chat.completions.create(model=model, max_tokens=24, tools=tools, tool_choice="none",
                                           messages=[{"role": "user", "content": "Say hello."}], **samp)
        ch = r.choices[0]
        check(ch.finish_reason in ("stop", "length") and not ch.message.tool_calls and ch.message.content,
              "tool_choice none: %s" % r.model_dump_json()[:600])
    # A call, its result sent back (the assistant turn with tool_calls, then a "tool" turn), and
    # the answer constrained by a schema.
    messages = [{"role": "user", "content": "Book a flight from Boston to Denver, then confirm it."}]
    r = client.chat.completions.create(model=model, max_tokens=MAX_TOKENS, temperature=0, tools=tools,
                                       tool_choice={"type": "function", "function": {"name": SCHEMAS[16].tool_name()}},
                                       messages=messages)
    ch = r.choices[0]
    check(ch.finish_reason == "tool_calls" and ch.message.tool_calls, "the first turn: %s" % r.model_dump_json()[:600])
    # /tokenize renders the tools as the chat endpoint does (vLLM's tokenize takes tools too).
    named = {"type": "function", "function": {"name": SCHEMAS[16].tool_name()}}
    tok = c.post("/tokenize", {"messages": messages, "tools": tools, "tool_choice": named})
    bare = c.post("/tokenize", {"messages": messages})
    check(tok.status == 200 and len(tok.json()["tokens"]) == r.usage.prompt_tokens
          and len(tok.json()["tokens"]) > len(bare.json()["tokens"]),
          "/tokenize with tools: %s %s against usage %s" % (tok.status, tok.body[:200], r.usage))
    call = ch.message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"confirmation": "BOS123"})}]
    want = DICT_SCHEMAS["verdict"]
    r = client.chat.completions.create(model=model, max_tokens=MAX_TOKENS, temperature=0, tools=tools,
                                       tool_choice="none", messages=messages,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "verdict", "schema": want}})
    ch = r.choices[0]
    check(ch.finish_reason == "stop" and not ch.message.tool_calls, "the turn after the tool result: %s"
          % r.model_dump_json()[:600])
    res = validate(Result(0, "tool_result", "verdict"), ch.message.content or "", want)
    check(not res.problem, "the turn after the tool result: " + res.problem)
    print("tool_choice none: plain answers; a tool result sent back, then a constrained answer")


def suite_structured_1p1d(tmp):
    need_default_model()
    self_check()
    t0 = time.time()
    with Cluster(1, 1, config={"chat_template": TOOL_TEMPLATE}, threads=1) as c:
        check_bad_inputs(c)
        run_mix(c, "structured_1p1d (1P+1D, %s template)" % TOOL_TEMPLATE, tools_ok=True)
        check_vllm_constraints(c)
        check_tool_choice_none(c)
    print("structured_1p1d: %.1f s in all" % (time.time() - t0))


def suite_structured_colocated(tmp):
    need_default_model()
    self_check()
    t0 = time.time()
    with Cluster(colocated=1, threads=1) as c:
        check_tools_refused(c)
        check_bad_inputs(c)
        run_mix(c, "structured_colocated (colocated x1, the model's template)", tools_ok=False)
    print("structured_colocated: %.1f s in all" % (time.time() - t0))


# ------------------------------------------------------------------ migration

MIGRATE_N = 16
MIGRATE_CONFIG = {"chat_template": TOOL_TEMPLATE,
                  "timeouts": {"heartbeat_ms": 4000, "request_ms": 60000, "stop_grace_ms": 10000}}
MIGRATE_BOUND_S = 40
# The schemas with the longest answers: the streams are still running when the rank dies.
LONG = ["inventory", "department", "tasklist", "company", "order", "book", "product", "event"]


class MigrateStream:
    """One streamed constrained request; the raw SSE is read (completions: exactly one terminal
    chunk, then usage, then one [DONE]) or the openai client's stream (chat, tool calls)."""

    def __init__(self, i, client, model, port):
        self.i, self.client, self.model, self.port = i, client, model, port
        self.sc = next(x for x in SCHEMAS if x.name == LONG[i % len(LONG)])
        self.kind = ["raw_completions", "chat", "raw_completions", "tool"][i % 4]
        self.samp = {"temperature": 0} if (i // 4) % 2 == 0 else {"temperature": 0.8, "seed": 2000 + i}
        self.text, self.finishes, self.problem, self.errors = "", [], "", []
        self.done, self.started, self.request = False, False, {}
        self.tool, self.names = None, ""

    def run(self, on_text):
        try:
            if self.kind == "raw_completions":
                self.raw(on_text)
            else:
                self.client_stream(on_text)
        except Exception as e:  # noqa: BLE001 -- every way a stream can end is recorded
            self.problem = "%s: %s" % (type(e).__name__, e)
        finally:
            self.done = True

    def raw(self, on_text):
        body = dict(model=self.model, prompt=self.sc.completion_prompt(), max_tokens=MAX_TOKENS, stream=True,
                    stream_options={"include_usage": True}, response_format=json_schema_format(self.sc), **self.samp)
        self.request = body
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=MIGRATE_BOUND_S + 60)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                self.problem = "HTTP %d %s" % (r.status, r.read()[:400])
                return
            events = []
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.decode("utf-8", "replace").rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                ev = events[-1]
                if ev == "[DONE]":
                    continue
                if "error" in ev:
                    self.errors.append(ev["error"])
                for ch in ev.get("choices", []):
                    if self.finishes and ch.get("text"):
                        self.problem = "text after the finish_reason"
                    self.text += ch.get("text") or ""
                    if ch.get("text") and not self.started:
                        self.started = True
                        on_text()
                    if ch.get("finish_reason"):
                        self.finishes.append(ch["finish_reason"])
            if events.count("[DONE]") != 1 or events[-1] != "[DONE]":
                self.problem = self.problem or "[DONE] %d times, last event %s" % (events.count("[DONE]"), events[-1:])
        finally:
            conn.close()

    def client_stream(self, on_text):
        messages = self.sc.messages()
        kw = dict(model=self.model, max_tokens=MAX_TOKENS, stream=True, **self.samp)
        if self.kind == "tool":
            self.tool = self.sc.tool()
            kw.update(tools=[self.tool], tool_choice={"type": "function", "function": {"name": self.sc.tool_name()}})
            messages = [{"role": "user", "content": self.sc.prompt + " Record it with a function call."}]
        else:
            kw.update(response_format=json_schema_format(self.sc))
        self.request = dict(kw, messages=messages)
        for chunk in self.client.chat.completions.create(messages=messages, **kw):
            for ch in chunk.choices:
                piece = ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    if tc.function is not None:
                        self.names += tc.function.name or ""
                        piece += tc.function.arguments or ""
                if self.finishes and piece:
                    self.problem = "a delta after the finish_reason"
                self.text += piece
                if piece and not self.started:
                    self.started = True
                    on_text()
                if ch.finish_reason:
                    self.finishes.append(ch.finish_reason)

    def verdict(self):
        """('finished' | 'length' | 'bad', detail)."""
        if not self.done:
            return "bad", "still running"
        if self.problem:
            return "bad", self.problem
        if self.errors:
            return "bad", "an error event (should have migrated): %s" % self.errors[:2]
        if len(self.finishes) != 1:
            return "bad", "%d finish_reasons: %s" % (len(self.finishes), self.finishes)
        f = self.finishes[0]
        if f == "length":
            return "length", ""
        want = "tool_calls" if self.kind == "tool" else "stop"
        if f != want:
            return "bad", "finish_reason %r, want %r" % (f, want)
        if self.kind == "tool" and self.names != self.sc.tool_name():
            return "bad", "tool name %r" % self.names
        res = validate(Result(self.i, self.kind, self.sc.name), self.text, self.sc.schema)
        return ("finished", "") if not res.problem else ("bad", res.problem)


def suite_structured_migrate(tmp):
    need_default_model()
    self_check()
    from test_chaos import busiest, workers  # noqa: E402  (same fault tooling)
    c = Cluster(prefill=1, decode=2, config=MIGRATE_CONFIG, threads=1)
    try:
        with c:
            ranks = workers(c)
            check(sorted(ranks.values()) == ["decode", "decode", "prefill"], "worker ranks: %s" % ranks)
            client, model = make_client(c, timeout=MIGRATE_BOUND_S + 60), model_name(c)
            migrated0 = c.metric("pd_requests_migrated_total")
            lock, started = threading.Lock(), [0]

            def on_text():
                with lock:
                    started[0] += 1
            streams = [MigrateStream(i, client, model, c.port) for i in range(MIGRATE_N)]
            threads = [threading.Thread(target=st.run, args=(on_text,), daemon=True) for st in streams]
            t0 = time.time()
            for t in threads:
                t.start()
            wait_for(lambda: started[0] >= MIGRATE_N * 3 // 4 or all(st.done for st in streams), 120,
                     "most streams to start")
            running = sum(not st.done for st in streams)
            check(running > 0, "every stream ended before the fault point (too fast a machine?)")
            victim, seen = busiest(c, "decode", ranks, ("pd_running_sequences",))
            pid = c.rank_pids()[victim][1]
            os.kill(pid, signal.SIGKILL)
            t_fault = time.time()
            print("kill -9 decode rank %d (pid %d) %.1f s in, %d of %d streams started, %d running; running per "
                  "decode rank: %s" % (victim, pid, t_fault - t0, started[0], MIGRATE_N, running, seen))
            for t in threads:
                t.join(max(0.0, t_fault + MIGRATE_BOUND_S - time.time()))
            verdicts = [(st, *st.verdict()) for st in streams]
            bad = [(st, d) for st, k, d in verdicts if k == "bad"]
            finished = sum(k == "finished" for _, k, _ in verdicts)
            cut = sum(k == "length" for _, k, _ in verdicts)
            migrated = c.metric("pd_requests_migrated_total") - migrated0
            print("structured_migrate: %d requests, %d validated, %d length-cut, %d bad, %d migrated, last ended "
                  "%.1f s after the kill, %.1f s" % (MIGRATE_N, finished, cut, len(bad), migrated,
                                                     time.time() - t_fault, time.time() - t0))
            check(not bad, "after the kill: %d of %d streams bad:\n%s" % (len(bad), MIGRATE_N, "\n".join(
                "stream %d (%s, %s): %s\n    request: %s\n    text: %r" % (st.i, st.kind, st.sc.name, d,
                                                                          json.dumps(st.request)[:800], st.text[:600])
                for st, d in bad[:6])))
            check(seen.get(victim, 0) >= 1, "the killed rank ran no sequences (%s): nothing could migrate" % seen)
            check(migrated >= 1, "rank %d ran %d sequences, pd_requests_migrated_total moved by %d"
                  % (victim, seen[victim], migrated))
            # The decode rank left serves new constrained requests.
            for i in (1, 7):
                r = run_one(client, model, i, True)  # json_schema, and a named tool call
                check(not r.problem, "after the kill: " + r.describe())
            print("structured_migrate: 2 new constrained requests served by the decode rank left")
            c.stop(timeout=30)
    finally:
        left = c.kill_session()
        if left:
            print("killed %d processes left of the job: %s" % (len(left), left))


SUITES = {"structured_1p1d": suite_structured_1p1d, "structured_colocated": suite_structured_colocated,
          "structured_migrate": suite_structured_migrate}

if __name__ == "__main__":
    if sys.argv[1:] == ["self_check"]:  # the schemas and their samples only: no cluster
        self_check()
        print("PASS: self_check (%d schemas)" % len(SCHEMAS))
        sys.exit(0)
    run_suite(SUITES, "test_structured.py")
