#!/usr/bin/env python3
"""Reference renderings of the chat templates pdcluster recognizes -> tests/data/reference_chat/chat.json.

Run (from the repository root):

    /opt/pdref-venv/bin/python scripts/make_tokenizer_reference_chat.py \\
        --templates <llama.cpp source>/models/templates --out tests/data/reference_chat

Renders every conversation below through each model's own Jinja chat template with transformers'
`render_jinja_template` (the function `apply_chat_template` uses: a sandboxed jinja2 environment with
trim_blocks / lstrip_blocks, raise_exception, strftime_now), bos_token "" (pdcluster adds BOS as a
token, not as text), add_generation_prompt true, and Llama 3.1/3.3's default date. Nothing here uses
pdcluster code. Templates come from the models' tokenizer_config.json files as llama.cpp keeps copies of
them (models/templates/*.jinja); Gemma 3's is not among those and is written out below as Google ships
it in google/gemma-3-*-it (tokenizer_config.json "chat_template"). Conversations a template refuses
(raise_exception) are stored with "error" set instead of "rendered".
"""
from __future__ import annotations

import argparse
import json
import os

GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# name -> (file in llama.cpp's models/templates or None for the inline one, the format pdcluster must detect)
TEMPLATES = {
    "gemma-3-it": (None, "gemma"),
    "gemma-2-it": ("google-gemma-2-2b-it.jinja", "gemma"),
    "qwen2.5-instruct": ("Qwen-Qwen2.5-7B-Instruct.jinja", "chatml"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "qwen3"),
    "llama-3.1-instruct": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"),
    "llama-3.2-instruct": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"),
    "llama-3.3-instruct": ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3"),
    "deepseek-r1-distill-llama": ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", None),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "  Padded system.  "}, {"role": "user", "content": "  padded user \n"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "one"},
     {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}],
    [{"role": "user", "content": "Solve it"},
     {"role": "assistant", "content": "<think>\nlet me think\n</think>\n\nThe answer is 7."},
     {"role": "user", "content": "Again"}],
    [{"role": "user", "content": "Continue"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nPartial"}],
    [{"role": "user", "content": "Unicode: caf\u00e9 \u65e5\u672c \U0001f600\u3000"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    [{"role": "assistant", "content": "I start"}],
]

# Llama 3.2's template puts today's date (strftime_now) in its system turn: rendered with this fixed date
# instead, which the C++ test passes too.
FIXED_DATE = "26 Jul 2024"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--templates", required=True, help="llama.cpp's models/templates directory")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import transformers
    from transformers.utils.chat_template_utils import render_jinja_template

    templates, cases = {}, []
    for name, (fname, fmt) in TEMPLATES.items():
        if fname is None:
            tpl = GEMMA3
        else:
            with open(os.path.join(args.templates, fname), encoding="utf-8") as f:
                tpl = f.read()
        templates[name] = {"template": tpl, "format": fmt, "source": fname or "google/gemma-3-it tokenizer_config.json"}
        if fmt is None:
            continue
        for conv in CONVERSATIONS:
            case = {"template": name, "messages": conv}
            kwargs = {"bos_token": ""}
            if "strftime_now" in tpl:
                kwargs["date_string"] = FIXED_DATE
                case["date"] = FIXED_DATE
            try:
                rendered = render_jinja_template(conversations=[conv], chat_template=tpl,
                                                 add_generation_prompt=True, **kwargs)
                case["rendered"] = rendered[0] if isinstance(rendered, tuple) else rendered
                if isinstance(case["rendered"], list):
                    case["rendered"] = case["rendered"][0]
            except Exception as e:  # the template's raise_exception
                case["error"] = str(e)
            cases.append(case)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "chat.json"), "w", encoding="utf-8") as f:
        head = {"generator": f"transformers {transformers.__version__} render_jinja_template",
                "bos_token": "", "add_generation_prompt": True, "templates": templates}
        f.write(json.dumps(head, ensure_ascii=False, indent=1)[:-2] + ',\n "cases": [\n')
        f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
        f.write("\n]}\n")
    print(f"{len(cases)} cases, {sum('error' in c for c in cases)} refused by their template")


if __name__ == "__main__":
    main()
