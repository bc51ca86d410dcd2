#!/usr/bin/env python3
"""render_chat.py - the oracle for tandem's chat rendering (tests/api/test_tools.c).

    python3 tests/render_chat.py TEMPLATE_FILE CONVERSATION_JSON

Renders a model's own tokenizer.chat_template with Jinja2 the way Hugging Face
transformers' apply_chat_template does (trim_blocks, lstrip_blocks, loop
controls, a tojson that is json.dumps with ensure_ascii=False), with
add_generation_prompt true. CONVERSATION_JSON is {"messages": [...],
"tools": [...] or absent}. Writes the prompt to stdout, nothing else.
Exit status 3 when Jinja2 is not installed.
"""
import json
import sys

try:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    sys.exit(3)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        template = f.read()
    with open(sys.argv[2], encoding="utf-8") as f:
        conv = json.load(f)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    args = {"messages": conv["messages"], "add_generation_prompt": True}
    if conv.get("tools"):
        args["tools"] = conv["tools"]
    sys.stdout.write(env.from_string(template).render(**args))


if __name__ == "__main__":
    main()
