"""The server tests of requests a client got wrong: each refused with OpenAI's error shape and a 4xx,
nothing else lost; and raw malformed or hostile bytes on the socket."""

import json
import socket
import time

from harness import MODEL_NAME, check, chat

def bad_requests():
    """(description, bytes) pairs, each of which must get a 4xx in OpenAI's error shape."""
    good = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    out = []

    def post(path, payload, extra=b""):
        return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n").encode() + extra + b"\r\n" + payload

    text = json.dumps(good).encode()
    rich = json.dumps(dict(good, stop=["a", "b"], temperature=0.5, stream=True,
                           response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})).encode()
    for cut in range(1, len(rich), 2):
        out.append((f"truncated JSON at {cut}", post("/v1/chat/completions", rich[:cut])))
    wrong = {
        "model": [None, 5, "other-model", [], {}],
        "messages": [None, "hi", [], [1], [{"role": "user"}], [{"role": "tool", "content": "x"}], [{"content": "x"}],
                     [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
                     [{"role": "user", "content": "x", "tool_calls": []}], [{"role": 7, "content": "x"}]],
        "max_tokens": ["5", -1, 0, 1.5, 10 ** 30, 2 ** 63, 4096, True, [], 1e308],
        "temperature": ["hot", -1, 3, 10 ** 400, [], {}],
        "top_p": [-0.1, 1.5, "x"],
        "n": [0, -1, 1000, "2", 2.5],
        "stop": [5, [1], [""], ["a"] * 20, {"a": 1}, "x" * 1000],
        "seed": ["x", 1.5, 10 ** 30],
        "stream": ["yes", 1],
        "stream_options": ["x", {"bogus": True}, {"include_usage": "yes"}],
        "logprobs": ["yes", 3],
        "top_logprobs": [50, -1, "x"],
        "response_format": ["json", {"type": "bogus"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 5}}],
        "frequency_penalty": [5, -2.5, "x", [0]],
        "presence_penalty": [-5, True],
        "repetition_penalty": [0, 100, "x"],
        "tools": [5, [5], [{"type": "function"}], [{"type": "other", "function": {"name": "f"}}],
                  [{"type": "function", "function": {"name": "f", "parameters": []}}],
                  [{"type": "function", "function": {"name": "a b"}}], [{"type": "function", "function": {"name": "f", "bogus": 1}}],
                  [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]],
        "tool_choice": ["sometimes", "required", {"type": "function", "function": {"name": "f"}}, 5],
        "parallel_tool_calls": ["yes"],
        "functions": [[{"name": "f"}]],
        "logit_bias": ["x", [1], {"x": 5}, {"1": 500}, {"-1": 1}, {"99999999": 1}, {"1": "a"}, {"1": None},
                       {str(k): 1 for k in range(1025)}],
        "bogus_field": [1],
    }
    for name, values in wrong.items():
        for v in values:
            body = dict(good)
            if v is None:
                body.pop(name, None)
            else:
                body[name] = v
            out.append((f"{name}={json.dumps(v)[:40]}", post("/v1/chat/completions", json.dumps(body).encode())))
    completion = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    for name, v in [("prompt", 5), ("prompt", [-1]), ("prompt", [10 ** 9]), ("prompt", []), ("prompt", [[]]),
                    ("prompt", [["a"]]), ("prompt", ["a", 5]), ("prompt", [1, "a"]), ("prompt", [[1, -1]]), ("prompt", ["a", ""]),
                    ("prompt", ["a"] * 65), ("prompt", ["a", "word " * 3000]), ("prompt", [{"a": 1}]),
                    ("prompt", ""), ("echo", "yes"), ("best_of", 3), ("suffix", "x"), ("suffix", 5), ("logprobs", 9),
                    ("prompt", "word " * 3000), ("n", 3)]:
        body = dict(completion, **{name: v})
        if name == "n":
            body["prompt"] = ["a"] * 60  # 180 choices
        out.append((f"completions {name}={json.dumps(v)[:40]}", post("/v1/completions", json.dumps(body).encode())))
    out.append(("completions echo with logprobs 1", post("/v1/completions", json.dumps(dict(completion, echo=True, logprobs=1)).encode())))
    out += [
        ("not an object", post("/v1/chat/completions", b"[1,2,3]")),
        ("empty body", post("/v1/chat/completions", b"")),
        ("deep nesting", post("/v1/chat/completions", b"[" * 200000 + b"]" * 200000)),
        ("deep nesting in a field", post("/v1/chat/completions", b'{"model":"' + MODEL_NAME.encode() + b'","x":' + b"{\"a\":" * 50000 + b"1" + b"}" * 50000 + b"}")),
        ("deep schema", post("/v1/chat/completions", json.dumps(dict(good, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads('{"a":' * 100 + "1" + "}" * 100)}})).encode())),
        ("invalid UTF-8", post("/v1/chat/completions", text.replace(b"hi", b"h\xff\xfei"))),
        ("overlong UTF-8", post("/v1/chat/completions", text.replace(b"hi", b"\xc0\xaf"))),
        ("NUL in content", post("/v1/chat/completions", text.replace(b"hi", b"h\\u0000i"))),
        ("lone surrogate escape", post("/v1/chat/completions", text.replace(b"hi", b"\\ud800"))),
        ("a million values", post("/v1/chat/completions", b'{"model":"' + MODEL_NAME.encode() + b'","x":[' + b"1," * 1000000 + b'1]}')),
        ("huge number", post("/v1/chat/completions", text.replace(b'"max_tokens": 2', b'"max_tokens": ' + b"9" * 5000))),
        ("oversized body", post("/v1/chat/completions", b'{"model":"x","pad":"' + b"a" * (5 << 20) + b'"}')),
        ("oversized Content-Length", b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n"),
        ("negative Content-Length", b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n"),
        ("conflicting Content-Length", b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello"),
        ("chunked body", b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
        ("garbage", b"GARBAGE\r\n\r\n"),
        ("binary garbage", bytes(range(256)) * 4 + b"\r\n\r\n"),
        ("no version", b"GET /health\r\n\r\n"),
        ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        ("relative target", b"GET health HTTP/1.1\r\n\r\n"),
        ("header without colon", b"GET /health HTTP/1.1\r\nnocolon\r\n\r\n"),
        ("header flood", b"GET /health HTTP/1.1\r\n" + b"X-Flood: " + b"a" * 100 + b"\r\n" * 1 + b"".join(b"X-%d: y\r\n" % i for i in range(2000)) + b"\r\n"),
        ("huge header line", b"GET /health HTTP/1.1\r\nX: " + b"a" * 40000 + b"\r\n\r\n"),
        ("unknown path", b"GET /v2/nothing HTTP/1.1\r\n\r\n"),
        ("wrong method", b"DELETE /v1/chat/completions HTTP/1.1\r\n\r\n"),
        ("GET on a POST endpoint", b"GET /v1/completions HTTP/1.1\r\n\r\n"),
        ("bad Expect", b"POST /v1/completions HTTP/1.1\r\nExpect: 200-ok\r\nContent-Length: 2\r\n\r\n{}"),
        ("unknown model", post("/v1/chat/completions", json.dumps(dict(good, model="gpt-4")).encode())),
    ]
    return out


def test_malformed(srv):
    cases = bad_requests()
    bad = []
    for what, data in cases:
        status, reply = srv.raw(data, timeout=20)
        ok = status is not None and 400 <= status < 500
        if status is not None and ok:
            body = reply.partition(b"\r\n\r\n")[2]
            try:
                err = json.loads(body)["error"]
                ok = isinstance(err["message"], str) and "type" in err and "param" in err and "code" in err
            except (ValueError, KeyError, TypeError):
                ok = False
        if not ok:
            bad.append(f"{what}: {reply[:200]!r}")
    for line in bad:
        print("      ", line)
    check(not bad and len(cases) >= 200, f"{len(cases)} malformed requests each got a 4xx in OpenAI's error shape")
    status, reply = srv.post("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
    check(status == 404 and b"model_not_found" in reply, "an unknown model is 404 model_not_found")
    status, reply = srv.post("/v1/completions", {"model": MODEL_NAME, "prompt": "word " * 3000, "max_tokens": 2})
    check(status == 400 and b"context_length_exceeded" in reply, "a prompt past the window is 400 context_length_exceeded")
    status, _ = srv.post("/v1/chat/completions", b'{"model":"x","pad":"' + b"a" * (5 << 20) + b'"}')
    check(status == 413, f"a body over 4 MiB is 413 ({status})")

    # Slow senders: a header or body that never completes is cut off at the server's bounds.
    t = time.time()
    status, _ = srv.raw(None, timeout=20, chunks=[b"POST /v1/completions HTTP/1.1\r\nContent-Le"])
    slow_header = time.time() - t
    t = time.time()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        reply = s.recv(4096)
    slow_body = time.time() - t
    check(slow_header < 6 and slow_body < 6 and b" 408 " in reply, f"slow senders are cut off ({slow_header:.1f} s, {slow_body:.1f} s)")

    # Keep-alive: two requests on one connection.
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    check(reply.count(b"HTTP/1.1 200 OK") == 2, "keep-alive serves two pipelined requests on one connection")

    check(srv.proc.poll() is None, "the server is still running")
    r = chat(srv.client(), "What is the capital of France? Answer in one word.", max_tokens=16)
    check("Paris" in r.choices[0].message.content, "a well-formed request right after is served")
