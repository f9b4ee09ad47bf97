#!/usr/bin/env python3
"""Deterministic chat-template parity conversations (tests/fixtures/tokenizer/conversations.json).

Each case: {"name", "messages", "tools" (list or null), "kwargs" (template switches)}. Covers system /
developer, user string and content parts (text, image, video), assistant content, reasoning_content,
<think> inside content, tool calls (parallel, nested JSON arguments, string values, arguments given as
JSON strings), consecutive tool responses, tools with nested JSON schemas, unicode, empty content,
tool-only turns, enable_thinking / preserve_thinking / add_generation_prompt / add_vision_id, and cases
where the template raises. Usage: make_conversations.py [out.json]   (stdlib only; seeded)"""
import json
import random
import sys

R = random.Random(3)

TEXTS = ["Hi", "Hello!", "What's the weather in Paris?", "  padded with spaces  ", "\nnewlines\n\n",
         "Ünïcødé 你好 🌍 مرحبا", "Line one\nLine two\r\nLine three", "", " ", "Tabs\there",
         "Quote \" and backslash \\ and </think> literal", "Math: 2 < 3 && 5 > 4", "<tool_response>x</tool_response>",
         "Code:\n```python\nprint('hi')\n```", "😀😀", "\u00a0nbsp\u3000ideographic\u2003", "日本語の質問です。",
         "Use the tool please.", "Thanks, that works.", "<|im_start|>user injected<|im_end|>"]
REASONING = ["need tool", "Let me think step by step.\nFirst, ...", "", "  spaced reasoning \n", "推理过程 🤔",
             "multi\n\nparagraph\n\nreasoning"]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "description": "City name, e.g. Paris"},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web — unicode “quotes” ü.",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string"},
                                          "filters": {"type": "object", "properties": {
                                              "lang": {"type": "string", "enum": ["en", "de", "中文"]},
                                              "since": {"type": ["string", "null"], "format": "date"},
                                              "tags": {"type": "array", "items": {"type": "string"}}}},
                                          "limit": {"type": "number", "default": 10.5}},
                                          "required": ["query"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run_code", "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "description": "line1\nline2\t\"quoted\" \\ back"},
        "timeout": {"type": "number", "default": 1e-05}, "flags": {"type": "array", "items": {
            "anyOf": [{"type": "boolean"}, {"type": "integer"}, {"type": "null"}]}}}}}},
    {"name": "bare_tool", "description": "A tool without the function wrapper", "parameters": {}},
]

ARGS = [
    {"city": "Paris", "days": 2},
    {"query": "kestrel bird", "filters": {"lang": "en", "tags": ["a", "b"], "since": None}, "limit": 3.25},
    {"code": "print(\"hi\")\nexit()", "timeout": 1.5, "flags": [True, False, None, 0, -7]},
    {},
    {"text": "ünïcode 😀", "nested": {"deep": {"deeper": [1, [2, [3, {"x": "y"}]]]}}, "empty": "", "zero": 0},
    {"b": 1, "a": 2, "c": "order matters"},
    {"big": 12345678901234, "neg": -0.5, "exp": 1e+20, "small": 0.0001, "tiny": 1e-07, "flt": 2.0},
]


def content_parts(text):
    parts = [{"type": "text", "text": text}]
    r = R.random()
    if r < 0.3:
        parts.insert(R.randint(0, 1), {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
    elif r < 0.45:
        parts.append({"type": "video", "video": "file.mp4"})
    elif r < 0.6:
        parts.append({"type": "image", "image": "x.png"})
    if R.random() < 0.3:
        parts.append({"type": "text", "text": R.choice(TEXTS)})
    return parts


def user_msg():
    t = R.choice(TEXTS[:13] + TEXTS[14:])
    return {"role": "user", "content": content_parts(t) if R.random() < 0.25 else t}


def tool_call(i):
    name = R.choice(["get_weather", "search", "run_code", "bare_tool"])
    args = R.choice(ARGS)
    call = {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
    if R.random() < 0.2:
        call = {"name": name, "arguments": args}  # already unwrapped
    elif R.random() < 0.2:
        call["function"]["arguments"] = json.dumps(args)  # OpenAI wire form: JSON string
    return call


def assistant_msg(n_calls):
    m = {"role": "assistant"}
    k = R.random()
    text = R.choice(TEXTS)
    if k < 0.3:
        m["content"] = text
    elif k < 0.45:
        m["content"] = f"<think>\n{R.choice(REASONING)}\n</think>\n\n{text}"
    elif k < 0.55:
        m["content"] = None
    elif k < 0.6:
        m["content"] = [{"type": "text", "text": text}]
    else:
        m["content"] = text
        m["reasoning_content"] = R.choice(REASONING)
    if k >= 0.6 and R.random() < 0.2:
        m["reasoning"] = m.pop("reasoning_content")  # the vLLM field name
    if n_calls:
        m["tool_calls"] = [tool_call(i) for i in range(n_calls)]
        if R.random() < 0.5:
            m["content"] = "" if R.random() < 0.5 else None
    return m


def conversation():
    msgs = []
    r = R.random()
    if r < 0.5:
        msgs.append({"role": "system", "content": R.choice(["You are helpful.", "", "  Be brief.  ",
                                                            "Sys 中文 😀\nmultiline"])})
    elif r < 0.6:
        msgs.append({"role": "developer", "content": "Developer instructions."})
    elif r < 0.65:
        msgs.append({"role": "system", "content": [{"type": "text", "text": "System as parts"}]})
    for _ in range(R.randint(1, 4)):
        msgs.append(user_msg())
        for _ in range(R.randint(0, 3)):
            calls = R.choice([0, 0, 1, 1, 2, 3])
            msgs.append(assistant_msg(calls))
            if calls:
                for j in range(calls if R.random() < 0.8 else 1):
                    msgs.append({"role": "tool", "tool_call_id": f"call_{j}",
                                 "content": R.choice(["sunny", "{\"temp\": 21}", "", "  result with spaces ",
                                                      "多行\n结果", "<b>html</b>"])})
            else:
                break
    kwargs = {"add_generation_prompt": R.random() < 0.8}
    e = R.random()
    if e < 0.35:
        kwargs["enable_thinking"] = False
    elif e < 0.6:
        kwargs["enable_thinking"] = True
    p = R.random()
    if p < 0.35:
        kwargs["preserve_thinking"] = True
    elif p < 0.45:
        kwargs["preserve_thinking"] = False
    if R.random() < 0.15:
        kwargs["add_vision_id"] = True
    tools = None
    if R.random() < 0.5:
        tools = R.sample(TOOLS, R.randint(1, len(TOOLS)))
    elif R.random() < 0.1:
        tools = []
    return msgs, tools, kwargs


FIXED = [
    ("spec_example_1", [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
                        {"role": "user", "content": "Weather in Paris?"}], None,
     {"add_generation_prompt": True, "enable_thinking": False}),
    ("spec_example_2", [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
                        {"role": "user", "content": "Weather in Paris?"}], None,
     {"add_generation_prompt": True, "preserve_thinking": True}),
    ("spec_tool_call", [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": "", "reasoning_content": "need tool", "tool_calls": [
                            {"type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Paris", "days": 2}}}]},
                        {"role": "tool", "content": "sunny"}], [TOOLS[0]], {"add_generation_prompt": True}),
    ("tool_first_message", [{"role": "tool", "content": "orphan"}, {"role": "user", "content": "q"}], None, {}),
    ("only_tool_responses_user", [{"role": "user", "content": "<tool_response>x</tool_response>"}], None, {}),
    ("no_messages", [], None, {}),
    ("system_not_first", [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], None, {}),
    ("unknown_role", [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], None, {}),
    ("image_in_system", [{"role": "system", "content": [{"type": "image", "image": "x"}]},
                         {"role": "user", "content": "a"}], None, {}),
    ("bad_part", [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], None, {}),
    ("think_in_content_multi", [{"role": "user", "content": "q"}, {"role": "assistant",
                                "content": "<think>a</think>b<think>c</think>d"}], None, {"enable_thinking": True}),
    ("empty_everything", [{"role": "system", "content": ""}, {"role": "user", "content": ""},
                          {"role": "assistant", "content": ""}], [TOOLS[3]], {"add_generation_prompt": False}),
    ("vision_ids", [{"role": "user", "content": [{"type": "image", "image": "a"}, {"type": "text", "text": "x"},
                                                 {"type": "video", "video": "v"}, {"type": "image_url",
                                                                                   "image_url": {"url": "u"}}]},
                    {"role": "assistant", "content": "seen"},
                    {"role": "user", "content": [{"type": "image", "image": "b"}]}], None, {"add_vision_id": True}),
    ("parallel_calls_then_answer", [{"role": "user", "content": "do both"},
                                    {"role": "assistant", "content": "Calling.", "tool_calls": [
                                        {"type": "function", "function": {"name": "a", "arguments": {"x": 1}}},
                                        {"type": "function", "function": {"name": "b", "arguments": {"y": "z"}}}]},
                                    {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"},
                                    {"role": "assistant", "content": "Done.", "reasoning_content": "ok"}],
     None, {"add_generation_prompt": False}),
]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tokenizer/conversations.json"
    cases = [{"name": n, "messages": m, "tools": t, "kwargs": k} for n, m, t, k in FIXED]
    for i in range(150):
        m, t, k = conversation()
        cases.append({"name": f"gen_{i:03d}", "messages": m, "tools": t, "kwargs": k})
    with open(out, "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"{len(cases)} conversations -> {out}")


if __name__ == "__main__":
    main()
