#!/usr/bin/env bash
# The server's load targets (issue 33) in one run: writes a random-weights Llama GGUF of the Llama-3-8B
# shape (examples/write_model) unless it is there, runs examples/batch.c on it (every prompt in one
# engine_step_batch, then one call a step: the engine alone doing the same work), then
# examples/decode.c (one stream), then hostembed-server with as many streams as clients, load.py's
# closed loop of CLIENTS clients (one request each, twice: a first wave on the fresh server, the same
# work as batch.c's, then a second with other prompts) and one client alone; prints a table of output
# throughput, TTFT and inter-token latency with the two ratios the targets name.
#
#   scripts/server-load.sh DIR OUT
#
# DIR holds the bundle's layout: examples/{write_model,batch,decode}, server/{hostembed-server,load.py},
# assets/tokenizer.json (scripts/gpu-build.sh packs it); logs, JSON figures and server-load.txt go to
# OUT. The environment overrides the defaults: LOAD_BACKEND (cuda), LOAD_SHAPE (8b; small for a CPU
# run), LOAD_DTYPE (bf16), LOAD_MODEL (the file, default under /tmp), LOAD_CLIENTS (64), LOAD_WORDS
# (186 words: 512 tokens of the repo's tokenizer on average), LOAD_TOKENS (128), LOAD_CTX (768),
# LOAD_ENGINE_RUNS (2: batch.c's best counts), LOAD_PORT (18080), LOAD_SERVER_FLAGS (more server flags).
# Every program runs under a timeout and the server is killed on exit, so the run is bounded (about 4
# minutes on an H100, a minute of it writing the 16 GB file).
set -uo pipefail
B=$(cd "${1:?usage: server-load.sh DIR OUT}" && pwd)
OUT=$(mkdir -p "${2:?usage: server-load.sh DIR OUT}" && cd "$2" && pwd)
backend=${LOAD_BACKEND:-cuda}
shape=${LOAD_SHAPE:-8b}
dtype=${LOAD_DTYPE:-bf16}
model=${LOAD_MODEL:-/tmp/hostembed-load/llama-$shape-$dtype.gguf}
clients=${LOAD_CLIENTS:-64}
words=${LOAD_WORDS:-186}
tokens=${LOAD_TOKENS:-128}
ctx=${LOAD_CTX:-768}
runs=${LOAD_ENGINE_RUNS:-2}
port=${LOAD_PORT:-18080}
base=http://127.0.0.1:$port
load=(python3 "$B/server/load.py" --base "$base" --model load --prompt-tokens "$words" --max-tokens "$tokens")
rc=0
note() { echo "server-load: $*" | tee -a "$OUT/server-load.log"; }

mkdir -p "$(dirname "$model")"
if [ ! -s "$model" ]; then
  note "writing $model"
  timeout 300 "$B/examples/write_model" --shape "$shape" --dtype "$dtype" --tokenizer "$B/assets/tokenizer.json" \
    --out "$model" >> "$OUT/server-load.log" 2>&1 || { note "write_model failed"; exit 1; }
fi

# The prompts of wave 1 (seed 1), which batch.c decodes too, and the one client's (seed 3, not cached).
"${load[@]}" --requests "$clients" --seed 1 --write-prompts "$OUT/prompts.txt" || exit 1
"${load[@]}" --requests 3 --seed 3 --write-prompts "$OUT/prompts-one.txt" || exit 1
mapfile -t prompts < "$OUT/prompts.txt"
pargs=()
for p in "${prompts[@]}"; do pargs+=(-p "$p"); done

for run in $(seq 1 "$runs"); do
  note "batch.c, run $run"
  timeout 240 "$B/examples/batch" "$model" --backend "$backend" --streams "$clients" --context "$ctx" -n "$tokens" \
    --temp 0 "${pargs[@]}" > "$OUT/batch-$run.log" 2>&1 || { note "batch.c failed: rc=$?"; rc=1; }
done
note "decode.c"
timeout 240 "$B/examples/decode" "$model" --backend "$backend" --context "$ctx" -n "$tokens" --temp 0 \
  -p "$(head -1 "$OUT/prompts-one.txt")" > "$OUT/decode.log" 2>&1 || { note "decode.c failed: rc=$?"; rc=1; }

# shellcheck disable=SC2086 # LOAD_SERVER_FLAGS is a list of flags
"$B/server/hostembed-server" -m "$model" --model-name load --backend "$backend" --ctx "$ctx" --streams "$clients" \
  --port "$port" ${LOAD_SERVER_FLAGS:-} > "$OUT/server.log" 2>&1 &
server=$!
stop_server() {
  kill -TERM "$server" 2>/dev/null || return 0
  for _ in $(seq 1 60); do kill -0 "$server" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL "$server" 2>/dev/null
}
trap stop_server EXIT
healthy=0
for _ in $(seq 1 300); do
  kill -0 "$server" 2>/dev/null || break
  if python3 -c "import urllib.request as u; u.urlopen('$base/health', timeout=2)" 2>/dev/null; then healthy=1; break; fi
  sleep 1
done
if [ "$healthy" = 1 ]; then
  note "server up; wave 1"
  timeout 300 "${load[@]}" --clients "$clients" --requests "$clients" --seed 1 --max-seconds 240 \
    --json "$OUT/wave1.json" > "$OUT/load-wave1.log" 2>&1 || { note "wave 1 failed"; rc=1; }
  note "wave 2"
  timeout 300 "${load[@]}" --clients "$clients" --requests "$clients" --seed 2 --max-seconds 240 \
    --json "$OUT/wave2.json" > "$OUT/load-wave2.log" 2>&1 || { note "wave 2 failed"; rc=1; }
  note "one client"
  timeout 300 "${load[@]}" --clients 1 --requests 3 --seed 3 --max-seconds 240 \
    --json "$OUT/one.json" > "$OUT/load-one.log" 2>&1 || { note "one client failed"; rc=1; }
  python3 -c "import urllib.request as u; print(u.urlopen('$base/metrics', timeout=5).read().decode())" > "$OUT/metrics.txt" 2>&1 || true
else
  note "the server did not come up (server.log)"
  rc=1
fi
stop_server
trap - EXIT

python3 - "$OUT" "$shape" "$dtype" "$backend" "$clients" "$tokens" <<'EOF' | tee "$OUT/server-load.txt"
import glob, json, os, re, sys
out, shape, dtype, backend, clients, tokens = sys.argv[1:]

def figures(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None

def engine_rate(path):
    text = open(path, errors="replace").read()
    p = re.search(r"^prompts: (\d+) tokens of (\d+) streams in one call, ([\d.]+) ms", text, re.M)
    d = re.search(r"^batch: \d+ streams, (\d+) tokens in \d+ calls .*?, ([\d.]+) ms", text, re.M)
    if not (p and d):
        return None
    first, decoded = int(p.group(2)), int(d.group(1))  # the prompts' call samples each stream's first token
    return (first + decoded) / ((float(p.group(3)) + float(d.group(2))) / 1e3), int(p.group(1)) / int(p.group(2))

rates = [r for r in (engine_rate(p) for p in sorted(glob.glob(os.path.join(out, "batch-*.log")))) if r]
engine = max((r for r, _ in rates), default=None)
print(f"server load: {shape} {dtype.upper()} on {backend}, {clients} clients, {tokens} tokens each")
if rates:
    print(f"batch.c prompts: {rates[0][1]:.1f} tokens on average")
print(f"{'':34} {'output tok/s':>12} {'vs engine':>9} {'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>16}")
runs = ", ".join(f"{r:.1f}" for r, _ in rates)
print(f"{'engine_step_batch (batch.c, best)':34} {engine or float('nan'):12.1f} {'':9}   runs: {runs or 'none'}")
waves = {}
for label, name in (("server, wave 1 (same work)", "wave1.json"), ("server, wave 2 (warm)", "wave2.json")):
    f = figures(name)
    if f is None:
        print(f"{label:34} no figures")
        continue
    ratio = f["tokens_per_s"] / engine if engine else float("nan")
    waves[name] = ratio
    print(f"{label:34} {f['tokens_per_s']:12.1f} {ratio:9.3f} {f['ttft_p50_ms']:8.1f}/{f['ttft_p99_ms']:<8.1f}"
          f" {f['itl_p50_ms']:7.2f}/{f['itl_p99_ms']:<8.2f} ({f['failed']} failed, prompts {f['prompt_tokens_mean']:.1f} tokens)")
m = re.search(r"^decode: (\d+) tokens in \d+ steps, ([\d.]+) ms", open(os.path.join(out, "decode.log"), errors="replace").read(), re.M) \
    if os.path.exists(os.path.join(out, "decode.log")) else None
alone = float(m.group(2)) / int(m.group(1)) if m and int(m.group(1)) else None
one = figures("one.json")
print(f"one client: decode.c {alone or float('nan'):.3f} ms a token; server mean ITL "
      + (f"{one['itl_mean_ms']:.3f} ms (p50 {one['itl_p50_ms']:.3f}, p99 {one['itl_p99_ms']:.3f}, {one['failed']} failed)" if one else "none"))
itl_ratio = one["itl_mean_ms"] / alone if one and alone else float("nan")
w1 = waves.get("wave1.json", float("nan"))
print(f"targets: aggregate {w1:.3f} of the engine's (>= 0.85: {'met' if w1 >= 0.85 else 'not met'}); "
      f"one client's ITL {itl_ratio:.3f} of decode.c's (<= 1.03: {'met' if itl_ratio <= 1.03 else 'not met'})")
EOF
exit $rc
