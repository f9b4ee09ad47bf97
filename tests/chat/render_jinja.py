#!/usr/bin/env python3
"""Renders chat-template parity conversations with Python jinja2 configured exactly as transformers'
apply_chat_template configures it (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loopcontrols, transformers' tojson and raise_exception), or with transformers itself (--transformers,
used on the GPU machine). Before rendering, messages get the request normalisation kestrel applies too
(openai-api.md §0.9): role developer -> system, `reasoning` -> `reasoning_content` when the latter is
absent, tool-call `arguments` given as a JSON string -> parsed object.
Usage: render_jinja.py TEMPLATE conversations.json OUT.json [--transformers TOKENIZER_DIR]
OUT: [{"name", "ok": true, "text"} | {"name", "ok": false, "error"}] in input order."""
import gzip
import json
import sys


def normalise(messages):
    out = []
    for m in messages:
        m = json.loads(json.dumps(m))
        if m.get("role") == "developer":
            m["role"] = "system"
        if "reasoning_content" not in m and isinstance(m.get("reasoning"), str):
            m["reasoning_content"] = m.pop("reasoning")
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function", tc) if isinstance(tc, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"])
        out.append(m)
    return out


def jinja_renderer(template_text):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    tmpl = env.from_string(template_text)

    def render(messages, tools, kwargs):
        return tmpl.render(messages=messages, tools=tools, **kwargs)
    return render


def transformers_renderer(tok_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir)

    def render(messages, tools, kwargs):
        kw = dict(kwargs)
        agp = kw.pop("add_generation_prompt", False)
        return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, tokenize=False, **kw)
    return render


def main():
    template, conv, out = sys.argv[1:4]
    if len(sys.argv) > 5 and sys.argv[4] == "--transformers":
        render = transformers_renderer(sys.argv[5])
    else:
        with open(template, encoding="utf-8") as f:
            render = jinja_renderer(f.read())
    with open(conv, encoding="utf-8") as f:
        cases = json.load(f)
    results = []
    for c in cases:
        try:
            text = render(normalise(c["messages"]), c["tools"], c["kwargs"])
            results.append({"name": c["name"], "ok": True, "text": text})
        except Exception as e:  # the template's raise_exception and jinja type errors
            results.append({"name": c["name"], "ok": False, "error": f"{type(e).__name__}: {e}"})
    opener = gzip.open if out.endswith(".gz") else open
    with opener(out, "wt", encoding="utf-8") as f:
        json.dump(results, f, ensure_ascii=False, indent=0)
    print(f"rendered {sum(r['ok'] for r in results)} ok, {sum(not r['ok'] for r in results)} raised -> {out}")


if __name__ == "__main__":
    main()
