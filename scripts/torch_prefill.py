"""The peer for examples/bench_prefill.rs: the same Llama-3-8B-shape prompt through PyTorch eager
(cuBLAS matrix products, SDPA flash attention with GQA, bf16 weights and activations), median tokens per
second of a whole prompt, the output head on the last token only, as the engine runs it.

    python3 scripts/torch_prefill.py [--lengths 512,4096,16384,65536] [--runs 5] [--layers 32]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, EPS, THETA = 4096, 32, 8, 128, 14336, 128256, 1e-5, 500000.0


def rmsnorm(x, w):
    v = x.float()
    return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="512,4096,16384,65536")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--layers", type=int, default=32)
    a = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)

    def mat(rows, cols):
        return (torch.rand(rows, cols, device=dev, dtype=dt) * 2 - 1) / cols**0.5

    layers = [
        dict(
            norm1=torch.ones(HIDDEN, device=dev, dtype=dt),
            qkv=mat((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
            o=mat(HIDDEN, HEADS * HEAD_DIM),
            norm2=torch.ones(HIDDEN, device=dev, dtype=dt),
            gate=mat(INTER, HIDDEN),
            up=mat(INTER, HIDDEN),
            down=mat(HIDDEN, INTER),
        )
        for _ in range(a.layers)
    ]
    embed = mat(VOCAB, HIDDEN)
    head = mat(VOCAB, HIDDEN)
    final_norm = torch.ones(HIDDEN, device=dev, dtype=dt)
    inv_freq = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, device=dev, dtype=torch.float32) / HEAD_DIM))

    @torch.inference_mode()
    def prompt(ids):
        n = ids.shape[0]
        ang = torch.outer(torch.arange(n, device=dev, dtype=torch.float32), inv_freq)
        ang = torch.cat((ang, ang), dim=-1)
        cos, sin = ang.cos().to(dt)[None], ang.sin().to(dt)[None]
        x = embed[ids]
        for w in layers:
            h = rmsnorm(x, w["norm1"]) @ w["qkv"].T
            q, k, v = h.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            q = rope(q.view(n, HEADS, HEAD_DIM).transpose(0, 1), cos, sin)
            k = rope(k.view(n, KV_HEADS, HEAD_DIM).transpose(0, 1), cos, sin)
            v = v.view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
            att = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)
            x = x + att[0].transpose(0, 1).reshape(n, HEADS * HEAD_DIM) @ w["o"].T
            h = rmsnorm(x, w["norm2"])
            x = x + (F.silu(h @ w["gate"].T) * (h @ w["up"].T)) @ w["down"].T
        return (rmsnorm(x[-1:], final_norm) @ head.T).argmax()

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {a.layers} layers")
    print("| prompt tokens | PyTorch eager tok/s | seconds |")
    print("| --- | --- | --- |")
    for n in [int(v) for v in a.lengths.split(",")]:
        ids = (torch.arange(n, device=dev) * 7919 + 13) % VOCAB
        rates = []
        for run in range(a.runs + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            prompt(ids).item()
            s = time.perf_counter() - t
            if run > 0:
                rates.append(n / s)
        r = statistics.median(rates)
        print(f"| {n} | {r:.0f} | {n / r:.2f} |", flush=True)


if __name__ == "__main__":
    main()
