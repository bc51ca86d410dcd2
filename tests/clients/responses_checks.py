"""responses_checks.py - POST /v1/responses through the official `openai`
client (client.responses.create / .stream / .parse), the mode "responses"
of openai_checks.py (run by tests/router/test_router_responses.c):

  text            a string input equals the chat completions answer to the
                  same message (greedy): text, usage, the incomplete status
                  a max_output_tokens cut gives
  instructions    instructions + input items with roles (user, assistant
                  output_text, developer) equal chat with those messages
  stream          the event stream: response.created, in_progress, the
                  message item and content part added, text deltas, their
                  done events, response.incomplete last; sequence numbers
                  0..n-1; the deltas equal the non-stream text; the
                  client's responses.stream() helper accumulates the same
                  final response (with a pydantic text_format, whose answer
                  ends by itself: response.completed)
  structured      text.format json_schema through create() and parse() with
                  a pydantic model (output_parsed)
  tools           a forced function call (function_call item, call_id),
                  streamed (function_call_arguments events), and the round
                  trip: the call and a function_call_output item sent back
  errors          unknown field, previous_response_id, an unsupported input
                  item type, an unknown model: the client's exception
                  classes with the status, code and param
"""
import json

import openai

from openai_checks import GRADE_SCHEMA, Grade, check, client, expect_status, run, valid_grade

TIME_FN = {"type": "function", "name": "get_time", "description": "The current time",
           "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}


def chat_text(c, model, messages, max_tokens):
    r = c.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
    return r.choices[0].message.content, r.usage, r.choices[0].finish_reason


def mode_responses(a):
    c = client(a.base)
    m = a.chat_model

    def text():
        want, usage, finish = chat_text(c, m, [{"role": "user", "content": "Hello"}], 8)
        r = c.responses.create(model=m, input="Hello", max_output_tokens=8, temperature=0)
        check("responses_text_equals_chat", r.output_text == want, f"{r.output_text!r} vs chat {want!r}")
        check("responses_shape", r.object == "response" and r.id.startswith("resp_") and r.model == m and
              len(r.output) == 1 and r.output[0].type == "message" and r.output[0].role == "assistant" and
              r.output[0].content[0].type == "output_text", f"{r}")
        check("responses_usage", r.usage.input_tokens == usage.prompt_tokens and
              r.usage.output_tokens == usage.completion_tokens == 8 and
              r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, f"{r.usage} vs chat {usage}")
        check("responses_incomplete_at_max_output_tokens", finish == "length" and r.status == "incomplete" and
              r.incomplete_details.reason == "max_output_tokens", f"{r.status} {r.incomplete_details}")
    run("responses_text", text)

    def instructions():
        msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "system", "content": "Be kind."},
                {"role": "user", "content": "How are you?"}]
        want, _, _ = chat_text(c, m, msgs, 6)
        items = [{"role": "user", "content": "Hi"},
                 {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
                 {"role": "developer", "content": "Be kind."},
                 {"role": "user", "content": [{"type": "input_text", "text": "How are you?"}]}]
        r = c.responses.create(model=m, instructions="Answer briefly.", input=items, max_output_tokens=6, temperature=0)
        check("responses_instructions_and_items_equal_chat", r.output_text == want and
              r.instructions == "Answer briefly.", f"{r.output_text!r} vs chat {want!r}")
    run("responses_instructions", instructions)

    def stream():
        plain = c.responses.create(model=m, input="Tell me a story.", max_output_tokens=10, temperature=0)
        events = list(c.responses.create(model=m, input="Tell me a story.", max_output_tokens=10, temperature=0,
                                         stream=True))
        types = [e.type for e in events]
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        head = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
        tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                "response.incomplete"]
        check("responses_stream_event_order", types[:4] == head and types[-4:] == tail and
              set(types[4:-4]) == {"response.output_text.delta"} and len(types) - 8 >= 2, f"{types}")
        check("responses_stream_sequence_numbers", [e.sequence_number for e in events] == list(range(len(events))),
              f"{[e.sequence_number for e in events]}")
        last = events[-1].response
        check("responses_stream_text_equals_plain", deltas == plain.output_text == last.output_text and
              events[-4].text == deltas and last.usage.output_tokens == plain.usage.output_tokens,
              f"{deltas!r} / {plain.output_text!r} / {last.output_text!r}")
    run("responses_stream", stream)

    def structured():
        fmt = {"format": {"type": "json_schema", "name": "grade", "strict": True, "schema": GRADE_SCHEMA}}
        r = c.responses.create(model=m, input="Grade this submission.", text=fmt, max_output_tokens=64, temperature=0)
        o = json.loads(r.output_text)
        check("responses_json_schema", valid_grade(o) and r.text.format.type == "json_schema", f"{r.output_text!r}")
        p = c.responses.parse(model=m, input="Grade this submission.", text_format=Grade, max_output_tokens=64,
                              temperature=0)
        check("responses_parse_pydantic", isinstance(p.output_parsed, Grade) and
              valid_grade(p.output_parsed.model_dump()), f"{p.output_text!r}")
        # the client's stream helper (it wants response.completed: a schema-bound answer ends by itself)
        with c.responses.stream(model=m, input="Grade this submission.", text_format=Grade, max_output_tokens=64,
                                temperature=0) as s:
            kinds = [e.type for e in s]
            final = s.get_final_response()
        check("responses_stream_helper_parse", final.output_parsed == p.output_parsed and
              final.output_text == p.output_text and kinds[-1] == "response.completed", f"{final.output_text!r}")
    run("responses_structured", structured)

    def tools():
        q = [{"role": "user", "content": "What time is it?"}]
        forced = {"type": "function", "name": "get_time"}
        r = c.responses.create(model=m, input=q, tools=[TIME_FN], tool_choice=forced, max_output_tokens=8,
                               temperature=0)
        calls = [o for o in r.output if o.type == "function_call"]
        check("responses_forced_function_call", len(calls) == 1 and calls[0].name == "get_time" and
              json.loads(calls[0].arguments) == {} and calls[0].call_id.startswith("call_") and
              r.status == "completed", f"{r.output}")
        ev = list(c.responses.create(model=m, input=q, tools=[TIME_FN], tool_choice=forced, max_output_tokens=8,
                                     temperature=0, stream=True))
        added = [e.item for e in ev if e.type == "response.output_item.added"]
        done = [e for e in ev if e.type == "response.function_call_arguments.done"]
        args = "".join(e.delta for e in ev if e.type == "response.function_call_arguments.delta")
        check("responses_function_call_stream", len(added) == 1 and added[0].type == "function_call" and
              added[0].name == "get_time" and len(done) == 1 and json.loads(done[0].arguments) == {} and
              args == done[0].arguments and ev[-1].type == "response.completed", f"{[e.type for e in ev]}")
        back = q + [o.model_dump(exclude_none=True) for o in r.output] + \
            [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00"}]
        r2 = c.responses.create(model=m, input=back, tools=[TIME_FN], tool_choice="none", max_output_tokens=8,
                                temperature=0)
        want, _, _ = chat_text(c, m, [q[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].call_id, "type": "function",
             "function": {"name": "get_time", "arguments": calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "12:00"}], 8)
        check("responses_function_call_round_trip", r2.output_text == want and
              all(o.type == "message" for o in r2.output), f"{r2.output_text!r} vs chat {want!r}")
    run("responses_tools", tools)

    def errors():
        expect_status("responses_unknown_field_400",
                      lambda: c.responses.create(model=m, input="x", extra_body={"frobnicate": 1}),
                      openai.BadRequestError, 400, code="unknown_parameter", param="frobnicate")
        expect_status("responses_previous_response_id_400",
                      lambda: c.responses.create(model=m, input="x", previous_response_id="resp_123"),
                      openai.BadRequestError, 400, code="unsupported_parameter", param="previous_response_id")
        expect_status("responses_reasoning_item_400",
                      lambda: c.responses.create(model=m, input=[{"type": "reasoning", "id": "rs_1", "summary": []}]),
                      openai.BadRequestError, 400, code="unsupported_value", param="input[0].type")
        expect_status("responses_unknown_model_404",
                      lambda: c.responses.create(model="no-such-model", input="x"),
                      openai.NotFoundError, 404, code="model_not_found", param="model")
    run("responses_errors", errors)
