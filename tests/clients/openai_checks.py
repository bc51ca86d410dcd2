#!/usr/bin/env python3
"""openai_checks.py - the official `openai` Python client and langchain-openai
against a running tandem router.

    build/pyenv/bin/python tests/clients/openai_checks.py MODE [options]

Each check prints one line, "ok NAME" or "FAIL NAME: why"; the C test that
started the router (tests/proc.h py_clients_run) counts the lines as its own
checks and fails when fewer than it expects ran. The clients come from
build/pyenv, where py_clients_ready installs pinned versions.

MODE router   (test_router)  chat and completions, streamed and not, the
              golden texts, the include_usage chunk, max_completion_tokens,
              logprobs, stop strings, penalties, logit_bias, /v1/models, error
              statuses and bodies as the client's exception classes, the API
              key; guided_choice and an unknown field through extra_body, a
              refused schema keyword in param/code, context_length_exceeded,
              X-Request-Id echoed, system_fingerprint in replies and chunks.
MODE n        (test_router_n)  n = 2, completions not streamed (through the
              split path: the router splits every stories prompt) and chat
              streamed with the usage chunk.
MODE prompts  (test_router_prompts)  two prompts in one completions request,
              split.
MODE tools    (test_router_tools)  forced tool calls and their round trips
              (the openai client, its pydantic_function_tool with parse(),
              langchain's bind_tools), response_format json_schema through
              the client, its parse() with a pydantic model and langchain's
              with_structured_output, langchain invoke and stream, and the
              client's retries on the router's 503 and 429.
MODE responses  (test_router_responses)  POST /v1/responses through
              client.responses (tests/clients/responses_checks.py).
"""
import argparse
import json
import sys
import threading
import time
import traceback
from typing import List, Literal

import openai
from pydantic import BaseModel, Field, conint

TIMEOUT = 120.0   # seconds a request may take: the fixture nodes are slow under ASan

RESULTS = {"ok": 0, "fail": 0}


# ==== Checks ====

def check(name, cond, why=""):
    if cond:
        print(f"ok {name}", flush=True)
        RESULTS["ok"] += 1
    else:
        print(f"FAIL {name}: {why}", flush=True)
        RESULTS["fail"] += 1


def run(name, fn):
    """Runs fn, which makes its own checks; an exception is one failed check named name."""
    try:
        fn()
    except Exception as e:  # the failure is the report: print it and go on
        traceback.print_exc(file=sys.stdout)
        check(name, False, f"{type(e).__name__}: {e}")


def client(base, key="no-key", retries=0, hooks=None):
    kw = {}
    if hooks is not None:
        kw["http_client"] = openai.DefaultHttpxClient(event_hooks={"response": hooks})
    return openai.OpenAI(base_url=base, api_key=key, max_retries=retries, timeout=TIMEOUT, **kw)


def error_body(e):
    """The error object of an APIStatusError, whichever shape the client keeps."""
    b = e.body if isinstance(e.body, dict) else {}
    return b.get("error", b) if isinstance(b.get("error", b), dict) else {}


def expect_status(name, fn, cls, status, code=None, param=None):
    """fn must raise the client's exception class cls with this status (and error code/param)."""
    try:
        fn()
    except cls as e:
        b = error_body(e)
        check(name, e.status_code == status and (code is None or b.get("code") == code) and
              (param is None or b.get("param") == param),
              f"{type(e).__name__} {e.status_code} body {e.body}")
        return e
    except Exception as e:
        check(name, False, f"{type(e).__name__}: {e}")
        return None
    check(name, False, f"no {cls.__name__} raised")
    return None


def gather(stream, chat):
    """A stream's text per choice, finish reasons, roles, chunk count, and the usage chunk."""
    out = {"texts": {}, "finish": {}, "roles": {}, "chunks": 0, "usage": None, "usage_choices": None,
           "after_usage": 0}
    for c in stream:
        out["chunks"] += 1
        if out["usage"] is not None:
            out["after_usage"] += 1
        if c.usage is not None:
            out["usage"] = c.usage
            out["usage_choices"] = len(c.choices)
        for ch in c.choices:
            i = ch.index
            piece = (ch.delta.content or "") if chat else (ch.text or "")
            out["texts"][i] = out["texts"].get(i, "") + piece
            if chat and ch.delta.role:
                out["roles"][i] = ch.delta.role
            if ch.finish_reason:
                out["finish"][i] = ch.finish_reason
    return out


def usage_chunk_ok(g, completion_tokens, at_most=False):
    """stream_options.include_usage: one last chunk with no choices and the usage
    (completion_tokens exactly, or at most that many with at_most)."""
    u = g["usage"]
    return (u is not None and g["usage_choices"] == 0 and g["after_usage"] == 0 and
            (0 < u.completion_tokens <= completion_tokens if at_most else u.completion_tokens == completion_tokens) and
            u.prompt_tokens > 0 and
            u.total_tokens == u.prompt_tokens + u.completion_tokens)


def router_root(base):
    return base[:-3] if base.endswith("/v1") else base


def post_root(base, path, body):
    """A router endpoint outside /v1 (/tokenize, /detokenize) through the client's own HTTP client."""
    import httpx2
    r = httpx2.post(router_root(base) + path, json=body, timeout=TIMEOUT)
    r.raise_for_status()
    return r.json()


# ==== router: test_router ====

def mode_router(a):
    c = client(a.base)
    chat_msgs = [{"role": "user", "content": "Hello"}]

    def chat_stream():
        s = c.chat.completions.create(model="qwen3-mini", stream=True, temperature=0, max_tokens=8, seed=1,
                                      messages=chat_msgs, stream_options={"include_usage": True})
        g = gather(s, True)
        check("chat_stream_golden", g["texts"].get(0) == a.chat_want, f"{g['texts']!r} want {a.chat_want!r}")
        check("chat_stream_role_finish", g["roles"].get(0) == "assistant" and g["finish"].get(0) in ("length", "stop"),
              f"roles {g['roles']} finish {g['finish']}")
        check("chat_stream_usage_chunk", usage_chunk_ok(g, 8, at_most=g["finish"].get(0) == "stop"),
              f"usage {g['usage']} in a chunk with {g['usage_choices']} choices, {g['after_usage']} chunks after")
    run("chat_stream", chat_stream)

    def chat_stream_no_usage():
        s = c.chat.completions.create(model="qwen3-mini", stream=True, temperature=0, max_tokens=8, messages=chat_msgs)
        g = gather(s, True)
        check("chat_stream_without_usage", g["usage"] is None and g["texts"].get(0) == a.chat_want,
              f"usage {g['usage']} text {g['texts']!r}")
    run("chat_stream_without_usage", chat_stream_no_usage)

    def chat_plain():
        r = c.chat.completions.create(model="qwen3-mini", temperature=0, max_tokens=8, messages=chat_msgs)
        ch = r.choices[0]
        check("chat_plain_golden", ch.message.content == a.chat_want and ch.message.role == "assistant" and
              r.object == "chat.completion" and r.id.startswith("chatcmpl"), f"{r}")
        check("chat_plain_usage", r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0, f"{r.usage}")
    run("chat_plain", chat_plain)

    def max_completion_tokens():
        r = c.chat.completions.create(model="qwen3-mini", temperature=0, max_completion_tokens=3, messages=chat_msgs)
        check("max_completion_tokens", r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length" and
              a.chat_want.startswith(r.choices[0].message.content), f"{r.usage} {r.choices[0]}")
        s = c.chat.completions.create(model="qwen3-mini", temperature=0, max_completion_tokens=3, messages=chat_msgs,
                                      stream=True, stream_options={"include_usage": True})
        g = gather(s, True)
        check("max_completion_tokens_stream", usage_chunk_ok(g, 3) and g["finish"].get(0) == "length", f"{g}")
    run("max_completion_tokens", max_completion_tokens)

    def completions():
        r = c.completions.create(model="stories", prompt="Once upon a time", temperature=0, max_tokens=12)
        check("completion_plain_golden", r.choices[0].text == a.completion_want and r.usage.completion_tokens == 12 and
              r.object == "text_completion", f"{r}")
        s = c.completions.create(model="stories", prompt="Once upon a time", temperature=0, max_tokens=12,
                                  stream=True, stream_options={"include_usage": True})
        g = gather(s, False)
        check("completion_stream_golden", g["texts"].get(0) == a.completion_want and g["finish"].get(0) == "length",
              f"{g['texts']!r} want {a.completion_want!r}")
        check("completion_stream_usage_chunk", usage_chunk_ok(g, 12), f"{g['usage']} {g['usage_choices']}")
    run("completions", completions)

    def models():
        ids = [m.id for m in c.models.list()]
        check("models_list", "stories" in ids and "qwen3-mini" in ids, f"{ids}")
        m = c.models.retrieve("stories")
        check("models_retrieve", m.id == "stories" and m.object == "model", f"{m}")
    run("models", models)

    def logprobs():
        r = c.chat.completions.create(model="qwen3-mini", temperature=0, max_tokens=8, messages=chat_msgs,
                                      logprobs=True, top_logprobs=3)
        lp = r.choices[0].logprobs.content
        greedy = all(len(t.top_logprobs) == 3 and t.logprob <= 0 and
                     t.logprob >= max(x.logprob for x in t.top_logprobs) - 1e-4 for t in lp)
        check("chat_logprobs", len(lp) == r.usage.completion_tokens and greedy and
              "".join(t.token for t in lp) == r.choices[0].message.content, f"{r.choices[0].logprobs}")
        r = c.completions.create(model="stories", prompt="Once upon a time", temperature=0, max_tokens=12, logprobs=2)
        l2 = r.choices[0].logprobs
        check("completion_logprobs", len(l2.tokens) == 12 and len(l2.token_logprobs) == 12 and
              "".join(l2.tokens) == r.choices[0].text and all(len(t) <= 2 and len(t) >= 1 for t in l2.top_logprobs) and
              all(x <= 0 for x in l2.token_logprobs), f"{l2}")
    run("logprobs", logprobs)

    def stop():
        w = a.completion_want
        s = w[len(w) // 2:len(w) // 2 + 3]
        cut = w.find(s)
        r = c.completions.create(model="stories", prompt="Once upon a time", temperature=0, max_tokens=12, stop=[s])
        check("stop_string", cut > 0 and r.choices[0].text == w[:cut] and r.choices[0].finish_reason == "stop",
              f"stop {s!r}: {r.choices[0].text!r} ({r.choices[0].finish_reason}) want {w[:cut]!r}")
        st = c.completions.create(model="stories", prompt="Once upon a time", temperature=0, max_tokens=12,
                                  stop=[s, "zzzz"], stream=True)
        g = gather(st, False)
        check("stop_string_stream", g["texts"].get(0) == w[:cut] and g["finish"].get(0) == "stop", f"{g}")
    run("stop", stop)

    def penalties():
        kw = dict(model="stories", prompt="Once upon a time", temperature=0, max_tokens=48)
        plain = c.completions.create(**kw).choices[0].text
        pen = c.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kw).choices[0].text
        check("penalties_change_greedy_text", pen != plain and len(pen) > 0, f"{pen!r} vs {plain!r}")
        expect_status("penalty_out_of_range", lambda: c.completions.create(frequency_penalty=3.0, **kw),
                      openai.BadRequestError, 400, param="frequency_penalty")
    run("penalties", penalties)

    def logit_bias():
        tok = post_root(a.base, "/tokenize", {"model": "stories", "content": "Once upon a time"})["tokens"]
        x = tok[-1]
        r = c.completions.create(model="stories", prompt="Once upon a time", temperature=0, max_tokens=3,
                                 logit_bias={str(x): 100}, logprobs=1)
        toks = r.choices[0].logprobs.tokens
        piece = post_root(a.base, "/detokenize", {"model": "stories", "tokens": [x]})["content"]
        check("logit_bias_forces_token", len(toks) == 3 and all(t == toks[0] for t in toks) and
              toks[0].strip() == piece.strip(), f"token {x} ({piece!r}): {toks}")
        full = post_root(a.base, "/tokenize", {"model": "stories", "content": "Once upon a time" + a.completion_want})["tokens"]
        first = full[len(tok)] if full[:len(tok)] == tok and len(full) > len(tok) else None
        r = c.completions.create(model="stories", prompt="Once upon a time", temperature=0, max_tokens=12,
                                 logit_bias={str(first): -100} if first is not None else {})
        check("logit_bias_bans_token", first is not None and r.choices[0].text != a.completion_want,
              f"banned {first}: {r.choices[0].text!r}")
    run("logit_bias", logit_bias)

    def errors():
        expect_status("error_unknown_model", lambda: c.completions.create(model="nope", prompt="x"),
                      openai.NotFoundError, 404, code="model_not_found")
        expect_status("error_max_tokens_over_limit",
                      lambda: c.completions.create(model="stories", prompt="x", max_tokens=65),
                      openai.BadRequestError, 400, param="max_tokens")
        expect_status("error_prompt_over_limit",
                      lambda: c.completions.create(model="stories", prompt="a" * 5000, max_tokens=4),
                      openai.BadRequestError, 400)
        expect_status("error_bad_messages",
                      lambda: c.chat.completions.create(model="qwen3-mini", messages=[{"role": "nobody", "content": "x"}]),
                      openai.BadRequestError, 400)
        ck = client(a.keyed, key="sk-wrong")
        expect_status("error_wrong_api_key", lambda: ck.completions.create(model="stories", prompt="x", max_tokens=2),
                      openai.AuthenticationError, 401)
        ok = client(a.keyed, key=a.key).completions.create(model="stories", prompt="Once upon a time", max_tokens=2,
                                                           temperature=0)
        check("right_api_key", ok.usage.completion_tokens == 2, f"{ok}")
    run("errors", errors)

    def extensions():
        # vLLM's and llama-server's fields through the client's extra_body
        outs = set()
        for seed in (1, 2, 3):
            r = c.completions.create(model="stories", prompt="Once upon a time", max_tokens=10, temperature=1, seed=seed,
                                     extra_body={"guided_choice": ["yes", "no", "maybe"]})
            outs.add(r.choices[0].text)
        check("ext_guided_choice", outs <= {"yes", "no", "maybe"} and outs, f"{outs}")
        expect_status("ext_unknown_field_refused",
                      lambda: c.completions.create(model="stories", prompt="x", max_tokens=2, extra_body={"frobnicate": 1}),
                      openai.BadRequestError, 400, code="unknown_parameter", param="frobnicate")
        expect_status("ext_schema_keyword_named",
                      lambda: c.chat.completions.create(model="qwen3-mini", messages=[{"role": "user", "content": "x"}],
                                                        max_tokens=4, response_format={"type": "json_schema", "json_schema": {
                                                            "name": "h", "schema": {"type": "string", "format": "hostname"}}}),
                      openai.BadRequestError, 400, code="unsupported_schema_keyword",
                      param="response_format.json_schema.schema#/format")
        # a prompt plus max_tokens beyond the context: 400 context_length_exceeded (stories: 512 positions)
        ok = c.completions.create(model="stories", prompt="a " * 400, max_tokens=64, temperature=0)
        expect_status("context_length_exceeded",
                      lambda: c.completions.create(model="stories", prompt="a " * 480, max_tokens=64),
                      openai.BadRequestError, 400, code="context_length_exceeded")
        raw = c.with_options(default_headers={"X-Request-Id": "client-trace-1"}).completions.with_raw_response.create(
            model="stories", prompt="Once upon a time", max_tokens=2, temperature=0)
        r = raw.parse()
        check("x_request_id_echoed_fingerprint", raw.headers.get("x-request-id") == "client-trace-1" and
              (r.system_fingerprint or "").startswith("fp_tandem_") and ok.usage.completion_tokens > 0,
              f"{raw.headers.get('x-request-id')} {r.system_fingerprint}")
        fps = [ch.system_fingerprint for ch in c.chat.completions.create(
            model="qwen3-mini", messages=[{"role": "user", "content": "Hello"}], max_tokens=3, stream=True)]
        check("stream_chunks_fingerprint", fps and all((f or "").startswith("fp_tandem_") for f in fps), f"{fps}")
    run("extensions", extensions)


# ==== n: test_router_n ====

def mode_n(a):
    c = client(a.base)

    def plain():
        r = c.completions.create(model=a.completion_model, n=2, temperature=0, max_tokens=8, prompt="Once upon a time")
        t = [ch.text for ch in r.choices]
        check("completions_n2", len(t) == 2 and t[0] == t[1] and t[0] and [ch.index for ch in r.choices] == [0, 1] and
              r.usage.completion_tokens == 16 and all(ch.finish_reason == "length" for ch in r.choices), f"{r}")
    run("completions_n2", plain)

    def streamed():
        s = c.chat.completions.create(model=a.chat_model, n=2, stream=True, temperature=0, max_tokens=8,
                                      messages=[{"role": "user", "content": "Hello"}],
                                      stream_options={"include_usage": True})
        g = gather(s, True)
        t = g["texts"]
        check("chat_stream_n2", sorted(t) == [0, 1] and t[0] and t[0] == t[1] and
              g["roles"] == {0: "assistant", 1: "assistant"} and sorted(g["finish"]) == [0, 1], f"{g}")
        check("chat_stream_n2_usage_chunk", usage_chunk_ok(g, 16), f"{g['usage']} {g['usage_choices']}")
    run("chat_stream_n2", streamed)


# ==== prompts: test_router_prompts ====

def mode_prompts(a):
    c = client(a.base)
    prompt = ["Once upon a time", "The little dog"]

    def both():
        r = c.completions.create(model=a.model, prompt=prompt, temperature=0, max_tokens=6)
        pt = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
        check("two_prompts_plain", len(pt) == 2 and pt[0] and pt[0] != pt[1] and
              [ch.index for ch in r.choices] == [0, 1] and r.usage.completion_tokens == 12, f"{r}")
        s = c.completions.create(model=a.model, prompt=prompt, temperature=0, max_tokens=6, stream=True,
                                 stream_options={"include_usage": True})
        g = gather(s, False)
        check("two_prompts_stream", [g["texts"].get(0), g["texts"].get(1)] == pt, f"{g['texts']} vs {pt}")
        check("two_prompts_usage_chunk", usage_chunk_ok(g, 12), f"{g['usage']} {g['usage_choices']}")
    run("two_prompts", both)


# ==== tools: test_router_tools ====

TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The current time",
             "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}

# The grade schema's strings are enums: random-weight models close a
# free-form string only by chance, while a grammar-forced enum or number
# always ends.
GRADE_SCHEMA = {
    "type": "object",
    "properties": {
        "verdict": {"type": "string", "enum": ["pass", "fail", "partial"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "late": {"type": "boolean"},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5}, "minItems": 1, "maxItems": 3},
    },
    "required": ["verdict", "score", "late", "items"],
    "additionalProperties": False,
}


class Grade(BaseModel):
    verdict: Literal["pass", "fail", "partial"]
    score: int = Field(ge=0, le=10)
    late: bool
    items: List[conint(ge=1, le=5)] = Field(min_length=1, max_length=3)


class Weather(BaseModel):
    """The weather in a city."""
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)


def valid_grade(o):
    return (isinstance(o, dict) and set(o) == {"verdict", "score", "late", "items"} and
            o["verdict"] in ("pass", "fail", "partial") and type(o["score"]) is int and 0 <= o["score"] <= 10 and
            type(o["late"]) is bool and isinstance(o["items"], list) and 1 <= len(o["items"]) <= 3 and
            all(type(x) is int and 1 <= x <= 5 for x in o["items"]))


def mode_tools(a):
    c = client(a.base)
    q = [{"role": "user", "content": "What time is it?"}]
    forced = {"type": "function", "function": {"name": "get_time"}}

    def openai_tools():
        r = c.chat.completions.create(model=a.model, messages=q, tools=[TIME_TOOL], tool_choice=forced,
                                      temperature=0, max_tokens=8)
        m = r.choices[0].message
        tc = m.tool_calls or []
        check("openai_forced_tool_call", len(tc) == 1 and tc[0].function.name == "get_time" and
              json.loads(tc[0].function.arguments) == {} and tc[0].id.startswith("call_") and
              r.choices[0].finish_reason == "tool_calls", f"{r.choices[0]}")
        s = c.chat.completions.create(model=a.model, messages=q, tools=[TIME_TOOL], tool_choice=forced,
                                      temperature=0, max_tokens=8, stream=True)
        name, args, ids, finish = "", "", set(), None
        for ch in s:
            for cc in ch.choices:
                for d in cc.delta.tool_calls or []:
                    if d.id:
                        ids.add(d.id)
                    if d.function and d.function.name:
                        name += d.function.name
                    if d.function and d.function.arguments:
                        args += d.function.arguments
                finish = cc.finish_reason or finish
        check("openai_forced_tool_call_stream", name == "get_time" and json.loads(args or "null") == {} and
              len(ids) == 1 and next(iter(ids)).startswith("call_") and finish == "tool_calls",
              f"{name!r} {args!r} {ids} {finish}")
        hist = q + [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tc[0].id, "content": "12:00"}]
        r2 = c.chat.completions.create(model=a.model, messages=hist, tools=[TIME_TOOL], temperature=0, max_tokens=8,
                                       tool_choice="none")
        check("openai_tool_round_trip", isinstance(r2.choices[0].message.content, str) and
              r2.choices[0].finish_reason in ("length", "stop") and not r2.choices[0].message.tool_calls,
              f"{r2.choices[0]}")
    run("openai_tools", openai_tools)

    def openai_parse_tool():
        tool = openai.pydantic_function_tool(Weather)
        r = c.chat.completions.parse(model=a.model, messages=[{"role": "user", "content": "Weather?"}],
                                     tools=[tool], tool_choice={"type": "function", "function": {"name": "Weather"}},
                                     temperature=0, max_tokens=64)   # random weights write whitespace: 45 tokens
        tc = r.choices[0].message.tool_calls or []
        p = tc[0].function.parsed_arguments if tc else None
        check("openai_pydantic_tool_parse", isinstance(p, Weather) and 1 <= p.days <= 7, f"{r.choices[0]}")
    run("openai_pydantic_tool_parse", openai_parse_tool)

    def langchain_tools():
        from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
        from langchain_openai import ChatOpenAI
        llm = ChatOpenAI(model=a.model, base_url=a.base, api_key="no-key", temperature=0, max_tokens=8, max_retries=0,
                         timeout=TIMEOUT)
        bound = llm.bind_tools([TIME_TOOL], tool_choice="get_time")
        question = HumanMessage("What time is it?")
        ai = bound.invoke([question])
        calls = ai.tool_calls
        check("langchain_bind_tools_invoke", isinstance(ai, AIMessage) and len(calls) == 1 and
              calls[0]["name"] == "get_time" and calls[0]["args"] == {} and calls[0]["id"].startswith("call_"),
              f"{ai}")
        agg = None
        for ch in bound.stream([question]):
            agg = ch if agg is None else agg + ch
        sc = agg.tool_calls if agg is not None else []
        check("langchain_bind_tools_stream", len(sc) == 1 and sc[0]["name"] == "get_time" and
              sc[0]["id"].startswith("call_"), f"{agg}")
        results = [ToolMessage(content="12:00", tool_call_id=t["id"], name=t["name"]) for t in calls]
        answer = llm.invoke([question, ai, *results])
        check("langchain_tool_round_trip", isinstance(answer.content, str) and
              answer.response_metadata.get("finish_reason") in ("length", "stop"), f"{answer}")
        text = "".join(ch.content for ch in llm.stream("Hello"))
        plain = llm.invoke("Hello").content
        check("langchain_invoke_equals_stream", text == plain, f"{text!r} vs {plain!r}")
    run("langchain_tools", langchain_tools)

    def structured():
        r = c.chat.completions.create(
            model=a.model, max_tokens=64, temperature=0, messages=[{"role": "user", "content": "Grade this submission."}],
            response_format={"type": "json_schema", "json_schema": {"name": "grade", "strict": True, "schema": GRADE_SCHEMA}})
        o = json.loads(r.choices[0].message.content)
        check("openai_response_format_json_schema", valid_grade(o), f"{r.choices[0].message.content!r}")
        p = c.chat.completions.parse(model=a.model, max_tokens=64, temperature=0, response_format=Grade,
                                     messages=[{"role": "user", "content": "Grade this submission."}])
        g = p.choices[0].message.parsed
        check("openai_parse_pydantic", isinstance(g, Grade) and valid_grade(g.model_dump()), f"{p.choices[0]}")
        from langchain_openai import ChatOpenAI
        llm = ChatOpenAI(model=a.model, base_url=a.base, api_key="no-key", temperature=0, max_tokens=64,
                         max_retries=0, timeout=TIMEOUT)
        lc = llm.with_structured_output(GRADE_SCHEMA | {"title": "grade"}, method="json_schema").invoke(
            "Grade this submission.")
        check("langchain_structured_dict", valid_grade(lc), f"{lc!r}")
        lp = llm.with_structured_output(Grade, method="json_schema").invoke("Grade this submission.")
        check("langchain_structured_pydantic", isinstance(lp, Grade) and valid_grade(lp.model_dump()), f"{lp!r}")
    run("structured", structured)

    def retries_503():
        seen = []
        hook = [lambda resp: seen.append(resp.status_code)]
        q1 = [{"role": "user", "content": "x"}]
        e = expect_status("no_node_503_no_retry",
                          lambda: client(a.base, retries=0, hooks=hook).chat.completions.create(
                              model=a.dead_model, messages=q1, max_tokens=2),
                          openai.InternalServerError, 503, code="no_healthy_node")
        check("no_node_503_one_attempt", e is not None and seen == [503], f"attempts {seen}")
        check("no_node_503_retry_after", e is not None and e.response.headers.get("retry-after") == "1",
              f"{e.response.headers if e is not None else None}")
        seen.clear()
        t0 = time.monotonic()
        expect_status("no_node_503_retried",
                      lambda: client(a.base, retries=2, hooks=hook).chat.completions.create(
                          model=a.dead_model, messages=q1, max_tokens=2),
                      openai.InternalServerError, 503)
        check("no_node_503_three_attempts", seen == [503, 503, 503] and time.monotonic() - t0 > 0.5,
              f"attempts {seen} in {time.monotonic() - t0:.2f} s")
    run("retries_503", retries_503)

    def retries_429():
        # The limited router takes one request at a time: a held stream fills it.
        cl = client(a.limited)
        q1 = [{"role": "user", "content": "Tell me a story."}]
        hold = cl.chat.completions.create(model=a.model, messages=q1, stream=True, temperature=0)
        it = iter(hold)
        next(it)   # the request is running on the node
        seen = []
        hook = [lambda resp: seen.append((resp.status_code, resp.headers.get("retry-after")))]
        e = expect_status("full_router_429_no_retry",
                          lambda: client(a.limited, retries=0, hooks=hook).chat.completions.create(
                              model=a.model, messages=q1, max_tokens=2),
                          openai.RateLimitError, 429, code="too_many_requests")
        check("full_router_429_retry_after", e is not None and e.response.headers.get("retry-after") == "1" and
              seen == [(429, "1")], f"attempts {seen}")
        # With retries on, the client waits the Retry-After second and tries
        # again; the held stream is closed meanwhile, so the retry gets in.
        # A fresh hold (the first may be near its end; its own client waits
        # out a 429 while the first one's slot is being freed).
        hold.close()
        hold = client(a.limited, retries=5).chat.completions.create(model=a.model, messages=q1, stream=True,
                                                                    temperature=0)
        next(iter(hold))
        seen.clear()
        closer = threading.Timer(0.3, hold.close)
        closer.start()
        t0 = time.monotonic()
        r = client(a.limited, retries=2, hooks=hook).chat.completions.create(model=a.model, messages=q1, max_tokens=2,
                                                                          temperature=0)
        dt = time.monotonic() - t0
        closer.join()
        check("full_router_429_retried_then_served", seen[0] == (429, "1") and seen[-1][0] == 200 and
              r.usage.completion_tokens <= 2 and dt >= 0.9, f"attempts {seen} in {dt:.2f} s")
    run("retries_429", retries_429)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["router", "n", "prompts", "tools", "responses"])
    ap.add_argument("--base", required=True, help="the router's /v1 URL")
    ap.add_argument("--keyed", help="router: a router with an API key")
    ap.add_argument("--key", help="router: that key")
    ap.add_argument("--chat-want", help="router: qwen3-mini's greedy 8 tokens after 'Hello' (chat)")
    ap.add_argument("--completion-want", help="router: stories' greedy 12 tokens after 'Once upon a time'")
    ap.add_argument("--completion-model", default="stories")
    ap.add_argument("--chat-model", default="qwen3")
    ap.add_argument("--model", default="stories")
    ap.add_argument("--dead-model", help="tools: a model whose only node is down")
    ap.add_argument("--limited", help="tools: a router with max_concurrent 1")
    a = ap.parse_args()
    if a.mode == "responses":   # /v1/responses: tests/clients/responses_checks.py, with this module's helpers
        sys.modules.setdefault("openai_checks", sys.modules[__name__])
        from responses_checks import mode_responses
        mode_responses(a)
    else:
        {"router": mode_router, "n": mode_n, "prompts": mode_prompts, "tools": mode_tools}[a.mode](a)
    print(f"# {a.mode}: {RESULTS['ok']} ok, {RESULTS['fail']} failed (openai {openai.__version__})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
