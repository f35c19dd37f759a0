#!/usr/bin/env python3
"""A bounded load run against an OpenAI-compatible server: requests arrive as a Poisson process at
--rate a second (at most --max-in-flight at once, the whole run cut at --max-seconds), or with
--clients N from N clients each sending its next request when the last is answered; each a streamed
text completion of --max-tokens greedy tokens. Prints time to first token and inter-token latency
(p50, p99), output throughput, the prompts' mean length in the server's tokens, errors, and with --pid
the server's resident memory before and after; --json FILE writes those figures as JSON too.
--write-prompts FILE writes the prompts the same flags would send, one a line, and exits (another
program can then do the same work). Loopback only: --base must name 127.0.0.1 or localhost.

usage: load.py --model NAME [--base http://127.0.0.1:8080] [--requests 200] [--rate 20 | --clients N] [--max-tokens 16]
               [--prompt-tokens 32] [--seed 1] [--pid PID] [--rss-limit-mb 50] [--json FILE] [--write-prompts FILE]
Exits 1 when a request failed or the memory grew past --rss-limit-mb."""

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old oak tree".split()


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def one_request(host, port, model, prompt, max_tokens, out, lock):
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    stamps, tokens, prompt_tokens, error = [], 0, 0, None
    try:
        conn = http.client.HTTPConnection(host, port, timeout=300)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            error = f"status {resp.status}: {resp.read()[:200]!r}"
        else:
            done = False
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    break
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                    prompt_tokens = chunk["usage"]["prompt_tokens"]
                if any(c.get("text") for c in chunk["choices"]):
                    stamps.append(time.perf_counter())
            if not done and error is None:
                error = "the stream ended without [DONE]"
        conn.close()
    except Exception as err:  # a failed request is counted, the run goes on
        error = f"{type(err).__name__}: {err}"
    with lock:
        out.append((t0, stamps, tokens, error, prompt_tokens))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="http://127.0.0.1:8080")
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=20.0, help="mean arrivals a second")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32, help="about this many words a prompt")
    ap.add_argument("--clients", type=int, default=0, help="closed loop: this many clients instead of Poisson arrivals")
    ap.add_argument("--max-in-flight", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pid", type=int, default=None, help="the server's process, for its memory")
    ap.add_argument("--rss-limit-mb", type=float, default=50)
    ap.add_argument("--json", default=None, help="also write the figures to this file as JSON")
    ap.add_argument("--write-prompts", default=None, help="write the prompts to this file, one a line, and exit")
    args = ap.parse_args()
    url = urllib.parse.urlparse(args.base)
    if url.hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit("load.py only runs against a server on loopback")
    args.rate = min(args.rate, 1000.0)

    rng = random.Random(args.seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(args.prompt_tokens)) for _ in range(args.requests)]
    if args.write_prompts:
        with open(args.write_prompts, "w") as f:
            f.writelines(p + "\n" for p in prompts)
        return
    rss_before = rss_kib(args.pid) if args.pid else None
    out, lock, threads = [], threading.Lock(), []
    slots = threading.Semaphore(args.max_in_flight)
    start = time.perf_counter()
    next_at = start
    if args.clients > 0:
        queue = list(reversed(prompts))

        def client():
            while time.perf_counter() - start < args.max_seconds:
                with lock:
                    if not queue:
                        return
                    p = queue.pop()
                one_request(url.hostname, url.port or 80, args.model, p, args.max_tokens, out, lock)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
        for t in threads:
            t.start()
        prompts = []
    for prompt in prompts:
        next_at += rng.expovariate(args.rate)
        time.sleep(max(0.0, next_at - time.perf_counter()))
        if time.perf_counter() - start > args.max_seconds:
            break
        slots.acquire()

        def run(p=prompt):
            try:
                one_request(url.hostname, url.port or 80, args.model, p, args.max_tokens, out, lock)
            finally:
                slots.release()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(max(1.0, args.max_seconds - (time.perf_counter() - start)))
    wall = time.perf_counter() - start

    errors = [e for _, _, _, e, _ in out if e]
    ttft = [(s[0] - t0) * 1000 for t0, s, _, e, _ in out if s and not e]
    itl = [(b - a) * 1000 for _, s, _, e, _ in out if not e for a, b in zip(s, s[1:])]
    tokens = sum(n for _, _, n, e, _ in out if not e)
    prompt_lengths = [p for _, _, _, e, p in out if not e]
    sent = len(out) if args.clients > 0 else len(threads)
    how = f"from {args.clients} clients" if args.clients > 0 else f"at {args.rate:g}/s offered"
    print(f"load: {len(out)} requests ({sent} sent, {len(errors)} failed) in {wall:.1f} s {how}, "
          f"{args.max_tokens} tokens each")
    print(f"load: TTFT p50 {percentile(ttft, 50):.1f} ms, p99 {percentile(ttft, 99):.1f} ms; "
          f"inter-token p50 {percentile(itl, 50):.1f} ms, p99 {percentile(itl, 99):.1f} ms")
    mean_itl = statistics.fmean(itl) if itl else float("nan")
    mean_prompt = statistics.fmean(prompt_lengths) if prompt_lengths else float("nan")
    print(f"load: output {tokens / wall:.1f} tokens/s ({tokens} tokens), mean ITL {mean_itl:.2f} ms, "
          f"prompts {mean_prompt:.1f} tokens on average")
    for e in errors[:5]:
        print(f"load: error: {e}")
    ok = not errors and len(out) == sent
    if args.pid:
        rss_after = rss_kib(args.pid)
        grew = (rss_after - rss_before) / 1024
        print(f"load: server RSS {rss_before / 1024:.1f} MB before, {rss_after / 1024:.1f} MB after ({grew:+.1f} MB)")
        ok = ok and grew <= args.rss_limit_mb
    if args.json:
        figures = {"requests": len(out), "failed": len(errors), "wall_s": wall, "tokens": tokens,
                   "tokens_per_s": tokens / wall, "prompt_tokens_mean": mean_prompt,
                   "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                   "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99), "itl_mean_ms": mean_itl}
        with open(args.json, "w") as f:
            json.dump(figures, f)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
