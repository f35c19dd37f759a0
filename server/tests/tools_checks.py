"""The server tests of tool calling: calls read from the output, a required or named call held to the
tools' schemas, streamed calls, and a model whose chat template prints the tools."""

import json
import os
import struct

import jsonschema
import openai

from harness import MODEL_NAME, check, Server, chat, complete

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now in a time zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def valid_call(name, arguments):
    try:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        return True
    except (KeyError, ValueError, jsonschema.ValidationError) as err:
        print("      ", err)
        return False


def stream_tool_calls(client, messages, **kw):
    """A streamed chat's tool calls put together as a client does: by index, the id and name from the
    first delta of each, the arguments from every fragment; the content and the finish_reason."""
    calls, content, finish, order = {}, "", None, []
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True, temperature=0, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                    order.append(("open", tc.index, bool(tc.id and tc.function.name)))
                calls[tc.index]["arguments"] += tc.function.arguments or ""
                calls[tc.index]["pieces"] = calls[tc.index].get("pieces", 0) + bool(tc.function.arguments)
            if choice.finish_reason:
                finish = choice.finish_reason
    return [calls[k] for k in sorted(calls)], content, finish, order


def test_tools(srv):
    """Tool calling: a named tool_choice and "required" are held to the tools' schemas by the constraint
    (SmolLM2's template prints no tools: the server shows them in the system message), streamed and
    not; a conversation with a tool's result renders and is answered; bad tools are 400."""
    client = srv.client()
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=ask, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0)
    m = r.choices[0].message
    call = m.tool_calls[0] if m.tool_calls else None
    check(call is not None and len(m.tool_calls) == 1 and m.content is None and r.choices[0].finish_reason == "tool_calls" and
          call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather" and
          valid_call("get_weather", call.function.arguments),
          f"a named tool_choice gives a call whose arguments validate: {m}")
    calls, content, finish, order = stream_tool_calls(client, ask, tools=TOOLS, tool_choice=named, max_tokens=60)
    check(len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_") and
          calls[0]["arguments"] == (call.function.arguments if call else None) and finish == "tool_calls" and not content and
          order == [("open", 0, True)] and calls[0]["pieces"] > 2,
          f"streamed: the id and name first, then the arguments in pieces, equal to the whole response: {calls} {finish} {content!r}")

    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
                                       tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0, n=2)
    ok = [c.finish_reason == "tool_calls" and c.message.tool_calls and len(c.message.tool_calls) == 1 and
          valid_call(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments) for c in r.choices]
    check(len(ok) == 2 and all(ok), f"required with two tools, n=2: each choice one valid call: {[c.message for c in r.choices]}")
    calls, _, finish, _ = stream_tool_calls(client, [{"role": "user", "content": "What time is it in Tokyo?"}], tools=TOOLS,
                                            tool_choice="required", max_tokens=60, parallel_tool_calls=False)
    check(len(calls) == 1 and finish == "tool_calls" and valid_call(calls[0]["name"], calls[0]["arguments"]),
          f"required, streamed: {calls}")

    # The call and its result sent back: both render, and the model answers in text.
    args = call.function.arguments if call else '{"city": "Paris", "unit": "celsius"}'
    convo = ask + [{"role": "assistant", "content": None,
                    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=MODEL_NAME, messages=convo, tools=TOOLS, tool_choice=choice, max_tokens=24, temperature=0)
        c0 = r.choices[0]
        check(r.usage.prompt_tokens > 60 and c0.finish_reason in ("stop", "length", "tool_calls") and
              (bool(c0.message.content) or bool(c0.message.tool_calls)) and (choice == "auto" or not c0.message.tool_calls),
              f"a conversation with a tool's result, tool_choice {choice}: answered ({c0.finish_reason}): {c0.message.content!r}")
    r = client.chat.completions.create(model=MODEL_NAME, messages=convo, max_tokens=8, temperature=0)
    check(bool(r.choices[0].message.content), "tool messages without tools in the request render too")

    # No tools, or "none": the same prompt and answer as before tools existed.
    plain = chat(client, "Name a color.", max_tokens=8)
    none = chat(client, "Name a color.", max_tokens=8, tools=TOOLS, tool_choice="none")
    check(none.choices[0].message.content == plain.choices[0].message.content and not none.choices[0].message.tool_calls and
          none.usage.prompt_tokens == plain.usage.prompt_tokens and plain.choices[0].message.tool_calls is None,
          f"tool_choice none leaves the prompt and the reply as without tools: {none.choices[0].message.content!r}")
    auto = chat(client, "What is the weather in Paris right now?", max_tokens=40, tools=TOOLS)
    a = auto.choices[0]
    check(auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50 and
          (a.finish_reason != "tool_calls" or all(valid_call(t.function.name, t.function.arguments) for t in a.message.tool_calls)),
          f"auto shows the tools in the prompt and reads the reply: {a.finish_reason} {a.message}")

    for bad, param in [({"tool_choice": {"type": "function", "function": {"name": "get_mail"}}}, "tool_choice"),
                       ({"tool_choice": "sometimes"}, "tool_choice"),
                       ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]}, "tools"),
                       ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
                       ({"response_format": {"type": "json_object"}, "tool_choice": "required"}, "response_format")]:
        kw = dict({"tools": TOOLS}, **bad)
        try:
            chat(client, "hi", **kw)
            check(False, f"{bad} is refused")
        except openai.BadRequestError as err:
            body = err.body if isinstance(err.body, dict) else {}
            check(err.status_code == 400 and body.get("param") == param and body.get("type") == "invalid_request_error",
                  f"{json.dumps(bad)[:70]} is 400: {body.get('message')}")


def with_chat_template(src, dst, template):
    """Copies a GGUF file with its tokenizer.chat_template replaced, the tensors' bytes as they are."""
    data = open(src, "rb").read()
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, data, pos)[0]
        pos += struct.calcsize("<" + fmt)
        return v

    def string():
        n = take("Q")
        return take(f"{n}s")

    scalars = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(kind):
        if kind == 8:
            return string()
        if kind == 9:
            inner, count = take("I"), take("Q")
            for _ in range(count):
                value(inner)
            return None
        return take(scalars[kind])

    assert data[:4] == b"GGUF"
    pos = 4
    version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    kvs, alignment = [], 32
    for _ in range(n_kv):
        start = pos
        key = string()
        v = value(take("I"))
        if key == b"general.alignment":
            alignment = v
        kvs.append((key, data[start:pos]))
    infos_start = pos
    for _ in range(n_tensors):
        string()
        dims = take("I")
        pos += 8 * dims + 4 + 8  # the dims, the type, the offset
    infos = data[infos_start:pos]
    data_start = -(-pos // alignment) * alignment
    key, text = b"tokenizer.chat_template", template.encode()
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(text)) + text
    head = struct.pack("<4sIQQ", b"GGUF", version, n_tensors, n_kv) + b"".join(
        entry if k == key else raw for k, raw in kvs) + infos
    with open(dst, "wb") as f:
        f.write(head + b"\0" * (-len(head) % alignment))
        f.write(memoryview(data)[data_start:])


def test_tools_template(binary, model):
    """On a template that prints tools (SmolLM2's weights with Qwen2.5's template), the prompt is what
    transformers renders: the tools' JSON, an assistant's call with its arguments object and the tool's
    result; the greedy answer equals the completion of that text."""
    qwen = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../tests/data/tokenizer/templates/qwen2.5.jinja")
    copy = f"/tmp/hostembed-tools-{os.getpid()}.gguf"
    with_chat_template(model, copy, open(qwen).read())
    srv = None
    try:
        srv = Server(binary, copy, "--ctx", "1024", "--streams", "4")
        client = srv.client()
        ask = "What is the weather in Paris right now?"
        args = '{"city": "Paris", "unit": "celsius"}'
        result = '{"temperature": 21, "sky": "clear"}'
        convo = [{"role": "user", "content": ask},
                 {"role": "assistant", "content": None,
                  "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": result}]
        want = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
                "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
                "signatures within <tools></tools> XML tags:\n<tools>" + "".join("\n" + json.dumps(t) for t in TOOLS) +
                "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
                "\n</tool_call><|im_end|>\n<|im_start|>user\n" + ask + "<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
                '{"name": "get_weather", "arguments": ' + json.dumps(json.loads(args)) + "}\n</tool_call><|im_end|>\n"
                "<|im_start|>user\n<tool_response>\n" + result + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        r = client.chat.completions.create(model=MODEL_NAME, messages=convo, tools=TOOLS, max_tokens=12, temperature=0)
        c = complete(client, want, max_tokens=12)
        check(r.usage.prompt_tokens == c.usage.prompt_tokens and (r.choices[0].message.content or "") == c.choices[0].text,
              f"Qwen2.5's template gets the tools, the call and its result as transformers gives them "
              f"({r.usage.prompt_tokens} == {c.usage.prompt_tokens} tokens): {r.choices[0].message.content!r}")
        r = client.chat.completions.create(model=MODEL_NAME, messages=convo[:1], tools=TOOLS, max_tokens=60, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        calls = r.choices[0].message.tool_calls or []
        check(len(calls) == 1 and valid_call(calls[0].function.name, calls[0].function.arguments),
              f"a named call through a template that prints tools: {calls}")
    finally:
        if srv:
            srv.stop()
        os.unlink(copy)
