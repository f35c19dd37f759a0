"""The server tests' harness: a server process on a free port, its clients, and the checks' tally."""

import json
import re
import signal
import socket
import subprocess
import time
import urllib.request

import openai


MODEL_NAME = "test-model"
failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what, flush=True)
    if not cond:
        failures.append(what)
    return cond


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, binary, model, *extra):
        self.port = free_port()
        self.log = open(f"/tmp/hostembed-server-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [binary, "-m", model, "--model-name", MODEL_NAME, "--port", str(self.port), "--backend", "cpu", *extra],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if json.load(r).get("status") == "ok":
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit("the server did not become healthy in 120 s")

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def raw(self, data, timeout=10, chunks=None):
        """Sends bytes on a fresh connection; the status (None when the server closed without a
        response) and the whole reply."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            try:
                for piece in chunks or [data]:
                    s.sendall(piece)
            except OSError:
                pass
            reply = b""
            try:
                # Until the server closes, or one whole response has come (a kept-alive connection stays open).
                while True:
                    got = s.recv(65536)
                    if not got:
                        break
                    reply += got
                    head, sep, body = reply.partition(b"\r\n\r\n")
                    length = re.search(rb"\r\nContent-Length: (\d+)", head)
                    if sep and length and len(body) >= int(length.group(1)):
                        break
            except (ConnectionResetError, socket.timeout):
                pass
        m = re.match(rb"HTTP/1\.1 (\d{3}) ", reply)
        return (int(m.group(1)) if m else None), reply

    def post(self, path, body, extra_headers=b""):
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n").encode() + extra_headers + b"\r\n"
        return self.raw(head + payload)

    def metrics(self):
        return self.metrics_with_key(None)

    def metrics_with_key(self, key):
        request = urllib.request.Request(self.base + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
        with urllib.request.urlopen(request, timeout=5) as r:
            values = {}
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    name, _, value = line.rpartition(" ")
                    values[name] = float(value)
            return values


def chat(client, text, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": text}], **kw)


def complete(client, prompt, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL_NAME, prompt=prompt, **kw)


def stream_chat_text(client, text, **kw):
    pieces, finish, usage = [], None, None
    for chunk in chat(client, text, stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    return "".join(pieces), finish, usage
