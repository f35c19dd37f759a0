#!/usr/bin/env python3
"""Tests hostembed-server with real clients: the official `openai` package, curl for the raw event
stream, raw sockets for malformed and hostile requests. Starts the server on the model it is given (CI:
SmolLM2-135M-Instruct on the CPU backend), every request greedy and a few tokens long.

usage: test_server.py SERVER_BINARY MODEL [--only NAME]
Exits 1 when any check failed; prints one line per check."""

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import jsonschema
import openai

from harness import MODEL_NAME, failures, check, Server, chat, complete, stream_chat_text
from tools_checks import test_tools, test_tools_template
from malformed import test_malformed


def test_basics(srv):
    with urllib.request.urlopen(srv.base + "/v1/models", timeout=5) as r:
        models = json.load(r)
    check([m["id"] for m in models["data"]] == [MODEL_NAME], "GET /v1/models lists the served model")
    client = srv.client()
    check([m.id for m in client.models.list()] == [MODEL_NAME], "openai: models.list")
    status, reply = srv.raw(b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=5)
    check(status == 200 and reply.endswith(b"\r\n\r\n"), "HEAD /health: the header alone")

    r = complete(client, "The capital of France is", max_tokens=6)
    text = r.choices[0].text
    check("Paris" in text, f"completion continues with Paris: {text!r}")
    check(r.usage.prompt_tokens > 0 and r.usage.completion_tokens == 6 and
          r.usage.total_tokens == r.usage.prompt_tokens + 6, f"completion usage: {r.usage}")
    check(r.choices[0].finish_reason == "length", "max_tokens ends with finish_reason length")

    r = chat(client, "What is the capital of France? Answer in one word.", max_tokens=16)
    content = r.choices[0].message.content
    check(r.choices[0].message.role == "assistant" and "Paris" in content, f"chat answers Paris: {content!r}")
    check(r.choices[0].finish_reason in ("stop", "length"), "chat finish_reason")
    check(r.usage.completion_tokens <= 16, "chat usage within max_tokens")
    r2 = chat(client, "What is the capital of France? Answer in one word.", max_completion_tokens=16)
    check(r2.choices[0].message.content == content, "max_completion_tokens is max_tokens")

    text, finish, usage = stream_chat_text(client, "What is the capital of France? Answer in one word.",
                                           max_tokens=16, stream_options={"include_usage": True})
    check(text == content, f"streamed chat equals the whole response: {text!r}")
    check(finish == r.choices[0].finish_reason, "streamed finish_reason")
    check(usage is not None and usage.completion_tokens == r.usage.completion_tokens, f"stream usage chunk: {usage}")


def test_stop(srv):
    client = srv.client()
    prompt = "List the days of the week: Monday, Tuesday,"
    full = complete(client, prompt, max_tokens=12).choices[0].text
    check(len(full) > 6, f"a text to cut: {full!r}")
    # A stop string straddling whatever tokens cover the middle of the text.
    at = len(full) // 2
    stop = full[at - 2: at + 2]
    want = full[: full.index(stop)]
    r = complete(client, prompt, max_tokens=12, stop=[stop, "zzzz-not-there"])
    check(r.choices[0].text == want and r.choices[0].finish_reason == "stop",
          f"stop {stop!r}: {r.choices[0].text!r} == {want!r}, {r.choices[0].finish_reason}")
    pieces = []
    for chunk in complete(client, prompt, max_tokens=12, stop=stop, stream=True):
        pieces.extend(ch.text for ch in chunk.choices)
    check("".join(pieces) == want, f"streamed stop never emits the stop string: {''.join(pieces)!r}")


def test_n_and_sampling(srv):
    client = srv.client()
    alone = chat(client, "Name a color.", max_tokens=6).choices[0].message.content
    r = chat(client, "Name a color.", max_tokens=6, n=2)
    check([c.index for c in r.choices] == [0, 1], "n=2 gives two choices")
    check(all(c.message.content == alone for c in r.choices), "greedy n=2 choices equal the single greedy answer")
    a = chat(client, "Write a word.", max_tokens=8, n=2, temperature=1.0, seed=7)
    b = chat(client, "Write a word.", max_tokens=8, n=2, temperature=1.0, seed=7)
    check([c.message.content for c in a.choices] == [c.message.content for c in b.choices], "a seed repeats sampled output")
    check(a.usage.completion_tokens == sum(1 for _ in []) or a.usage.completion_tokens > 0, "n=2 usage counts tokens")
    r = chat(client, "Write a word.", max_tokens=8, temperature=0.8, top_p=0.9, extra_body={"repetition_penalty": 1.1})
    check(bool(r.choices[0].message.content), "temperature, top_p and repetition_penalty accepted")


def test_penalties(srv):
    """frequency_penalty and presence_penalty: the server samples from the logits itself."""
    client = srv.client()
    prompt = "one two three, one two three, one two three, one two three,"
    plain = complete(client, prompt, max_tokens=16).choices[0].text
    tiny = complete(client, prompt, max_tokens=16, frequency_penalty=0.0001).choices[0].text
    check(tiny == plain, f"greedy with a negligible penalty is the engine's greedy output: {tiny!r}")
    heavy = complete(client, prompt, max_tokens=16, frequency_penalty=2.0, presence_penalty=2.0).choices[0].text
    most = lambda t: max(t.split().count(w) for w in set(t.split())) if t.split() else 0
    check(heavy != plain and most(heavy) < most(plain), f"penalties stop the repetition: {plain!r} -> {heavy!r}")
    a = complete(client, prompt, max_tokens=8, temperature=1.0, seed=3, n=2, presence_penalty=0.5)
    b = complete(client, prompt, max_tokens=8, temperature=1.0, seed=3, n=2, presence_penalty=0.5)
    check([c.text for c in a.choices] == [c.text for c in b.choices], "penalized sampling repeats with its seed")

    # With response_format the server's draw keeps to the constraint's mask (engine_allowed_tokens): a
    # negligible penalty gives the engine's own constrained greedy output, heavy ones still valid JSON.
    schema = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                         "maxItems": 6}},
              "required": ["words"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "words", "schema": schema}}
    ask = "List some words as JSON."
    plain = chat(client, ask, max_tokens=60, response_format=fmt).choices[0].message.content
    tiny = chat(client, ask, max_tokens=60, response_format=fmt, frequency_penalty=0.0001).choices[0].message.content
    check(tiny == plain, f"a negligible penalty with json_schema gives the engine's constrained greedy output: {tiny!r}")
    outs = [chat(client, ask, max_tokens=60, response_format=fmt, **kw)
            for kw in ({"frequency_penalty": 2.0, "presence_penalty": 2.0},
                       {"presence_penalty": 1.0, "temperature": 1.0, "seed": 9},
                       {"logit_bias": {str(ROME): 5}, "temperature": 0.7, "seed": 4})]
    valid = []
    for r in outs:
        try:
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
            valid.append(r.choices[0].finish_reason == "stop")
        except (ValueError, jsonschema.ValidationError):
            valid.append(False)
    check(all(valid), f"penalties and logit_bias with json_schema still validate: {[r.choices[0].message.content for r in outs]}")
    r = chat(client, 'Reply with JSON: {"ok": true}', max_tokens=60, presence_penalty=1.5, n=2, temperature=0.8, seed=2,
             response_format={"type": "json_object"})
    try:
        parsed = all(json.loads(c.message.content) is not None for c in r.choices)
    except ValueError:
        parsed = False
    check(parsed, f"penalties with json_object, n=2: {[c.message.content for c in r.choices]}")


# SmolLM2's ids of three words, for requests that name tokens (the tests check that they are these words).
PARIS, LONDON, ROME = 7042, 4528, 7268
PATTERN = [PARIS, LONDON] * 4 + [PARIS]


def test_logit_bias(srv):
    """logit_bias: -100 bans the greedy token, +100 forces one, a negligible bias changes nothing."""
    client = srv.client()
    tokens = lambda r: r.choices[0].logprobs.tokens
    prompt = "The capital of France is"
    base = tokens(complete(client, prompt, max_tokens=4, logprobs=0))
    paris = tokens(complete(client, prompt, max_tokens=1, logprobs=0, logit_bias={str(PARIS): 100}))[0]
    check(paris == " Paris" and base[0] == paris, f"the greedy token is ' Paris' ({base})")
    forced = tokens(complete(client, prompt, max_tokens=3, logprobs=0, logit_bias={str(ROME): 100}))
    check(forced == [" Rome"] * 3, f"+100 forces its token at every step: {forced}")
    banned = tokens(complete(client, prompt, max_tokens=4, logprobs=0, logit_bias={str(PARIS): -100}))
    check(banned[0] != base[0] and paris not in banned, f"-100 bans the greedy token: {base} -> {banned}")
    tiny = complete(client, prompt, max_tokens=4, logit_bias={str(ROME): 0.001}).choices[0].text
    check(tiny == "".join(base), f"a negligible bias keeps the greedy output: {tiny!r}")
    r = chat(client, "Name a city.", max_tokens=3, logit_bias={str(ROME): 100})
    check(r.choices[0].message.content == " Rome" * 3, f"chat takes logit_bias: {r.choices[0].message.content!r}")
    a = complete(client, "Pick a word:", max_tokens=6, temperature=1.0, seed=5, logit_bias={str(ROME): 2})
    b = complete(client, "Pick a word:", max_tokens=6, temperature=1.0, seed=5, logit_bias={str(ROME): 2})
    check(a.choices[0].text == b.choices[0].text, "biased sampling repeats with its seed")


def test_completion_prompts(srv):
    """Several prompts in one body (a choice each, n each, in order), echo, echo with logprobs, suffix."""
    client = srv.client()
    prompts = ["The capital of France is", "One, two, three,", "The capital of France is"]
    alone = [complete(client, p, max_tokens=5) for p in prompts]
    r = complete(client, prompts, max_tokens=5)
    check([c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == [a.choices[0].text for a in alone],
          f"three prompts: a choice each, in order, each equal to its prompt alone: {[c.text for c in r.choices]}")
    check(r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) and r.usage.completion_tokens == 15,
          f"usage sums the prompts: {r.usage}")
    r = complete(client, prompts[:2], max_tokens=5, n=2)
    want = [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    check([c.index for c in r.choices] == [0, 1, 2, 3] and [c.text for c in r.choices] == want,
          "n=2 for two prompts: indexes 0-1 the first prompt's, 2-3 the second's")
    ids = [PATTERN, [ROME, ROME, ROME]]
    r = complete(client, ids, max_tokens=3)
    check([c.text for c in r.choices] == [complete(client, p, max_tokens=3).choices[0].text for p in ids],
          "prompts as arrays of token ids")
    got = {}
    for chunk in complete(client, prompts, max_tokens=5, stream=True):
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + c.text
    check(got == {k: a.choices[0].text for k, a in enumerate(alone)}, f"several prompts streamed: {got}")

    r = complete(client, prompts[0], max_tokens=5, echo=True)
    check(r.choices[0].text == prompts[0] + alone[0].choices[0].text, f"echo puts the prompt first: {r.choices[0].text!r}")
    r = complete(client, PATTERN, max_tokens=2, echo=True)
    check(r.choices[0].text.startswith(" Paris London Paris London"), f"echo of token ids is their text: {r.choices[0].text!r}")
    streamed = "".join(c.text for chunk in complete(client, prompts[0], max_tokens=5, echo=True, stream=True) for c in chunk.choices)
    check(streamed == prompts[0] + alone[0].choices[0].text, f"streamed echo: {streamed!r}")

    # echo with logprobs: the prompt's tokens scored. " Paris" generated after the prompt and " Paris" as
    # the last token of a longer prompt have the same log-probability.
    r = complete(client, prompts[0], max_tokens=1, echo=True, logprobs=0)
    lp = r.choices[0].logprobs
    n = alone[0].usage.prompt_tokens
    check(len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and
          all(x <= 0 for x in lp.token_logprobs[1:]) and "".join(lp.tokens) == r.choices[0].text,
          f"echo with logprobs 0 scores the prompt's tokens: {lp.tokens} {lp.token_logprobs}")
    longer = complete(client, prompts[0] + " Paris", max_tokens=1, echo=True, logprobs=0).choices[0].logprobs
    check(lp.tokens[-1] == " Paris" and longer.tokens[:n + 1] == lp.tokens and
          abs(longer.token_logprobs[n] - lp.token_logprobs[n]) < 1e-4,
          f"a prompt token's score is its logprob when generated: {longer.token_logprobs[n]} vs {lp.token_logprobs[n]}")
    r = complete(client, PATTERN, max_tokens=2, echo=True, logprobs=0)
    lp = r.choices[0].logprobs
    plain = complete(client, PATTERN, max_tokens=2, logprobs=0).choices[0].logprobs
    check(lp.tokens[-2:] == plain.tokens and all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs[-2:], plain.token_logprobs)),
          "echo keeps the generated tokens and their logprobs")
    r = complete(client, [ROME], max_tokens=2, echo=True, logprobs=0, n=2)
    check(all(c.logprobs.token_logprobs[0] is None and c.text.startswith(" Rome") for c in r.choices),
          "echo with logprobs of a one-token prompt, n=2")

    status, reply = srv.post("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "echo": True, "logprobs": 2})
    check(status == 400 and b"echo" in reply, f"echo with logprobs above 0 is refused: {reply[-160:]!r}")
    status, reply = srv.post("/v1/completions", {"model": MODEL_NAME, "prompt": "def f(", "suffix": "return x", "max_tokens": 2})
    check(status == 400 and b"fill-in-the-middle" in reply, f"suffix on a model with no fill-in-the-middle tokens: {reply[-160:]!r}")


def test_prefix_cache(srv):
    """A prompt sent again takes its whole KV pages from the prefix cache: /metrics counts the prompt
    tokens cached and computed, and usage.prompt_tokens_details.cached_tokens says it per request."""
    client = srv.client()
    prompt = "A note about the prefix cache, repeated to fill pages: " + " ".join(f"item {k}," for k in range(40))
    before = srv.metrics()
    first = complete(client, prompt, max_tokens=2)
    mid = srv.metrics()
    second = complete(client, prompt, max_tokens=2)
    after = srv.metrics()
    n = first.usage.prompt_tokens
    cached = lambda m: m.get("hostembed_prompt_tokens_cached_total", -1)
    computed = lambda m: m.get("hostembed_prompt_tokens_computed_total", -1)
    check(n >= 96 and cached(mid) - cached(before) == 0 and computed(mid) - computed(before) == n,
          f"a new {n}-token prompt is computed: cached +{cached(mid) - cached(before)}, computed +{computed(mid) - computed(before)}")
    got = cached(after) - cached(mid)
    check(got >= 64 and got + computed(after) - computed(mid) == n,
          f"the same prompt again takes whole pages from the cache: cached +{got}, computed +{computed(after) - computed(mid)}")
    details = lambda r: r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else None
    check(details(first) == 0 and details(second) == got, f"usage cached_tokens: {details(first)}, then {details(second)}")
    check(second.choices[0].text == first.choices[0].text, "the cached prompt gives the same greedy output")


def test_logprobs(srv):
    client = srv.client()
    r = chat(client, "Say hello.", max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    check(len(content) == r.usage.completion_tokens, f"one logprob entry a token ({len(content)})")
    ok = all(len(e.top_logprobs) == 3 and e.logprob <= 0 and abs(e.logprob - e.top_logprobs[0].logprob) < 1e-4
             and e.token == e.top_logprobs[0].token for e in content)
    check(ok, "greedy tokens are their top alternative, with log-probabilities <= 0")
    check("".join(e.token for e in content) == r.choices[0].message.content, "logprob tokens spell the content")
    r = complete(client, "One, two, three,", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    check(len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(len(t) <= 2 for t in lp.top_logprobs),
          "completions logprobs: tokens, token_logprobs, top_logprobs")


def test_response_format(srv):
    client = srv.client()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = chat(client, "Give a person's name and age as JSON.", max_tokens=40,
             response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    text = r.choices[0].message.content
    try:
        jsonschema.validate(json.loads(text), schema)
        valid = True
    except (ValueError, jsonschema.ValidationError) as err:
        valid = False
        print("      ", err)
    check(valid and r.choices[0].finish_reason == "stop", f"json_schema output validates: {text!r}")
    r = chat(client, 'Reply with JSON: {"ok": true}', max_tokens=40,
             response_format={"type": "json_object"})
    try:
        json.loads(r.choices[0].message.content)
        parsed = True
    except ValueError:
        parsed = False
    check(parsed, f"json_object output parses: {r.choices[0].message.content!r}")
    status, _ = srv.post("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                                                  "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    check(status == 400, f"a schema the engine refuses is 400 ({status})")


def test_raw_sse(srv):
    body = json.dumps({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    out = subprocess.run(["curl", "-sS", "-N", "-i", "-H", "Content-Type: application/json", "-d", body,
                          srv.base + "/v1/completions"], capture_output=True, timeout=60)
    head, _, events = out.stdout.decode().partition("\r\n\r\n")
    check("content-type: text/event-stream" in head.lower(), "curl: text/event-stream")
    lines = [ln for ln in events.split("\n") if ln]
    check(all(ln.startswith("data: ") for ln in lines), "curl: every event line is data:")
    check(lines and lines[-1] == "data: [DONE]", "curl: the stream ends with data: [DONE]")
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    check(all(ch["object"] == "text_completion" for ch in chunks), "curl: chunks are text_completion objects")
    check(chunks and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4, "curl: the usage chunk comes last")
    check(events.count("\n\n") == len(lines), "curl: events are separated by blank lines")


def test_utf8(srv):
    """Emoji take several byte tokens each: every event must still be whole UTF-8, the same text as whole."""
    body = {"model": MODEL_NAME, "prompt": "Emojis: \U0001F600\U0001F603\U0001F604\U0001F601\U0001F606", "max_tokens": 12,
            "temperature": 0, "logprobs": 0}
    status, reply = srv.post("/v1/completions", body)
    whole = json.loads(reply.partition(b"\r\n\r\n")[2])["choices"][0]
    tokens = whole["logprobs"]["tokens"]
    check(any("\ufffd" in t for t in tokens), f"the model's tokens split characters: {tokens[:6]}")
    status, reply = srv.post("/v1/completions", dict(body, stream=True))
    pieces, strict = [], True
    for line in reply.partition(b"\r\n\r\n")[2].split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                event = json.loads(line[6:].decode("utf-8", errors="strict"))
            except UnicodeDecodeError:
                strict = False
                continue
            pieces += [c["text"] for c in event["choices"]]
    text = "".join(pieces)
    check(strict and "\ufffd" not in text and any(ord(ch) > 0xFFFF for ch in text) and text == whole["text"],
          f"streamed events hold whole characters only, equal to the whole response: {text!r}")


def test_concurrent(srv, clients):
    client = srv.client()
    prompts = [f"Count from {k} to {k + 5}:" for k in range(clients)]
    alone = [complete(client, p, max_tokens=6).choices[0].text for p in prompts]

    def streamed(p):
        return "".join(ch.text for chunk in complete(srv.client(), p, max_tokens=6, stream=True) for ch in chunk.choices)

    t = time.time()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        together = list(pool.map(streamed, prompts))
    same = sum(a == b for a, b in zip(alone, together))
    check(same == clients, f"{clients} concurrent streaming clients each equal the request alone ({same} same, {time.time() - t:.1f} s)")
    m = srv.metrics()
    check(m.get("hostembed_step_items_total", 0) > m.get("hostembed_steps_total", 1), "steps batched several items")


def test_interleave(srv):
    """A long prompt is read in chunks beside a running stream's decode steps, not in one stall: the
    stream keeps getting tokens while the prompt is read (the server runs with --chunk 64)."""
    stamps, started = [], threading.Event()

    def running():
        for chunk in complete(srv.client(), "Once upon a time", max_tokens=60, stream=True):
            if any(c.text for c in chunk.choices):
                stamps.append(time.time())
                started.set()

    t = threading.Thread(target=running)
    t.start()
    started.wait(30)
    long_prompt = " ".join(["alpha beta gamma delta"] * 100)  # about 400 tokens, 7 chunks
    sent = time.time()
    r = complete(srv.client(), long_prompt, max_tokens=1)
    answered = time.time()
    t.join(60)
    during = sum(sent <= x <= answered for x in stamps)
    check(r.usage.prompt_tokens >= 320 and during >= 4,
          f"a running stream got {during} tokens while a {r.usage.prompt_tokens}-token prompt was read")


def test_disconnect(srv):
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        body = json.dumps({"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 400, "stream": True}).encode()
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while got.count(b"data: ") < 2:
            got += s.recv(4096)
    deadline = time.time() + 10
    while time.time() < deadline and srv.metrics().get("hostembed_requests_running", 1) > 0:
        time.sleep(0.1)
    check(srv.metrics().get("hostembed_requests_running", 1) == 0, "a disconnected stream is freed")


def test_load(srv, requests):
    """load.py's bounded Poisson run: no failure, and the server's memory within 50 MB of before."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "load.py")
    out = subprocess.run([sys.executable, script, "--base", srv.base, "--model", MODEL_NAME, "--requests", str(requests),
                          "--rate", "20", "--max-tokens", "4", "--prompt-tokens", "8", "--max-in-flight", "32",
                          "--max-seconds", "120", "--pid", str(srv.proc.pid), "--rss-limit-mb", "50"],
                         capture_output=True, text=True, timeout=300)
    print(out.stdout + out.stderr, end="")
    check(out.returncode == 0, f"{requests} Poisson requests: none failed, memory within 50 MB")


def test_metrics(srv):
    m = srv.metrics()
    check(m.get('hostembed_requests_total{endpoint="chat"}', 0) > 0 and m.get("hostembed_completion_tokens_total", 0) > 0,
          "metrics count requests and tokens")
    check(m.get('hostembed_time_to_first_token_seconds_bucket{le="+Inf"}', 0) > 0 and
          m.get("hostembed_inter_token_seconds_count", 0) > 0, "metrics hold TTFT and inter-token histograms")
    check(m.get("hostembed_kv_tokens_total", 0) > 0, "metrics report the KV pool")


def test_drafter(binary, model, reference):
    """A server with a drafter (the model itself, so every proposal is the target's own greedy token):
    the greedy output is the output without it, and the metrics count the drafter's proposals accepted."""
    srv = Server(binary, model, "--ctx", "512", "--streams", "2", "--draft", model, "--draft-tokens", "3")
    try:
        r = complete(srv.client(), reference[0], max_tokens=24)
        check(r.choices[0].text == reference[1], f"greedy output with --draft equals the output without: {r.choices[0].text!r}")
        m = srv.metrics()
        proposed, accepted = m.get("hostembed_speculation_proposed_total", 0), m.get("hostembed_speculation_accepted_total", 0)
        check(proposed > 0 and accepted == proposed, f"the model drafting for itself is always accepted: {accepted} of {proposed}")
    finally:
        srv.stop()


def test_limits_key_and_drain(binary, model, reference):
    """A second server: one stream, prompt lookup, an API key, a 1 s queue timeout; then SIGTERM while
    streaming."""
    srv = Server(binary, model, "--ctx", "512", "--streams", "1", "--api-key", "sekrit", "--queue-timeout", "1",
                 "--lookup", "4")
    try:
        # Prompt lookup proposes tokens from the stream's own history; the output stays the greedy one.
        r = complete(srv.client("sekrit"), reference[0], max_tokens=24)
        check(r.choices[0].text == reference[1], f"greedy output with --lookup equals the output without: {r.choices[0].text!r}")
        check(srv.metrics_with_key("sekrit").get("hostembed_speculation_accepted_total", 0) > 0, "prompt lookup accepted proposals")

        try:
            chat(srv.client("wrong"), "hi", max_tokens=2)
            check(False, "a wrong API key is refused")
        except openai.AuthenticationError:
            check(True, "a wrong API key is refused with 401")
        status, _ = srv.post("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        check(status == 401, "no API key is 401")
        check(bool(chat(srv.client("sekrit"), "hi", max_tokens=2).choices), "the right API key is served")

        # The one stream busy with a long request: the next cannot fit, waits its second, gets 503.
        long_stream = chat(srv.client("sekrit"), "Tell a long story.", max_tokens=300, stream=True)
        first = next(iter(long_stream))
        status, reply = srv.post("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
                                 b"Authorization: Bearer sekrit\r\n")
        check(status == 503 and b"Retry-After: 1" in reply, f"a request that cannot fit gets 503 with Retry-After ({status})")
        long_stream.close()

        # SIGTERM while a stream runs: it finishes, new requests are refused, the server exits 0. The
        # stream is long enough (a story of 96 tokens, seconds on two cores) that the drain is still on
        # when the request comes: a server that had already exited would refuse the connection instead.
        got = []
        done = threading.Event()

        def consume():
            for chunk in chat(srv.client("sekrit"), "Tell a long story.", max_tokens=96, stream=True):
                got.extend(c.delta.content or "" for c in chunk.choices)
            done.set()

        t = threading.Thread(target=consume)
        t.start()
        time.sleep(0.5)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        check(not done.is_set(), "the stream was still running when the drain began")
        status, _ = srv.post("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
                             b"Authorization: Bearer sekrit\r\n")
        check(status in (503, None), f"a request during the drain is refused ({status})")
        t.join(60)
        check(done.is_set() and got, "the running stream finished during the drain")
        check(srv.proc.wait(30) == 0, "the server exited 0 after draining")
    finally:
        srv.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("server")
    ap.add_argument("model")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--only", default=None)
    ap.add_argument("--load-requests", type=int, default=200)
    args = ap.parse_args()
    t0 = time.time()
    srv = Server(args.server, args.model, "--ctx", "512", "--streams", str(args.clients), "--kv-type", "f16",
                 "--header-timeout", "2", "--body-timeout", "2", "--chunk", "64", "--batch-tokens", "256")
    tests = [("basics", lambda: test_basics(srv)), ("stop", lambda: test_stop(srv)),
             ("n", lambda: test_n_and_sampling(srv)), ("penalties", lambda: test_penalties(srv)),
             ("prefix_cache", lambda: test_prefix_cache(srv)), ("logit_bias", lambda: test_logit_bias(srv)),
             ("prompts", lambda: test_completion_prompts(srv)), ("logprobs", lambda: test_logprobs(srv)),
             ("response_format", lambda: test_response_format(srv)), ("tools", lambda: test_tools(srv)), ("sse", lambda: test_raw_sse(srv)),
             ("utf8", lambda: test_utf8(srv)),
             ("concurrent", lambda: test_concurrent(srv, args.clients)), ("interleave", lambda: test_interleave(srv)),
             ("disconnect", lambda: test_disconnect(srv)),
             ("malformed", lambda: test_malformed(srv)), ("load", lambda: test_load(srv, args.load_requests)),
             ("metrics", lambda: test_metrics(srv))]
    # A repetitive text, where prompt lookup finds proposals, decoded here without it.
    lookup_prompt = "one two three four, one two three four, one two three four, one two three four,"
    reference = (lookup_prompt, complete(srv.client(), lookup_prompt, max_tokens=24).choices[0].text)
    try:
        for name, fn in tests:
            if args.only in (None, name):
                t = time.time()
                print(f"--- {name}", flush=True)
                try:
                    fn()
                except Exception as err:  # a crash of one test is its failure, the others still run
                    check(False, f"{name} raised {type(err).__name__}: {err}")
                print(f"    ({time.time() - t:.1f} s)", flush=True)
        check(srv.proc.poll() is None, "the server survived every test")
    finally:
        srv.stop()
    if args.only in (None, "tools_template"):
        print("--- tools through a template that prints them", flush=True)
        try:
            test_tools_template(args.server, args.model)
        except Exception as err:
            check(False, f"tools_template raised {type(err).__name__}: {err}")
    if args.only in (None, "drafter"):
        print("--- a drafter", flush=True)
        try:
            test_drafter(args.server, args.model, reference)
        except Exception as err:
            check(False, f"drafter raised {type(err).__name__}: {err}")
    if args.only in (None, "drain"):
        print("--- limits, API key, drain", flush=True)
        test_limits_key_and_drain(args.server, args.model, reference)
    print(f"server tests: {len(failures)} failed ({time.time() - t0:.1f} s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
