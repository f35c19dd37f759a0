//! hostembed-server: an OpenAI-compatible HTTP server over hostembed's batch API. One scheduler thread
//! steps every running request in one engine_step_batch per step; a thread per connection reads the
//! request, submits it and writes what its choices produce.
const std = @import("std");
const posix = std.posix;
const c = @import("hostembed");
const http = @import("http.zig");
const sched = @import("sched.zig");
const text = @import("text.zig");
const metrics = @import("metrics.zig");
const api = @import("api.zig");

const gpa = std.heap.c_allocator;

const usage =
    \\usage: hostembed-server -m MODEL [options]
    \\
    \\Serves MODEL (an HF folder or a .gguf file) over OpenAI's HTTP API: POST /v1/chat/completions,
    \\POST /v1/completions, GET /v1/models, GET /health, GET /metrics.
    \\
    \\  -m, --model PATH          the checkpoint to serve (required)
    \\  --model-name NAME         the id clients name it by (default: the file's name without .gguf)
    \\  --host ADDR               address to listen on (default 127.0.0.1)
    \\  --port N                  port (default 8080)
    \\  --backend auto|cuda|cpu   which backend decodes (default auto: CUDA when present)
    \\  --device N                CUDA device index (default 0)
    \\  --ctx N                   each stream's window in tokens (default 4096; 0 = the model's own)
    \\  --streams N               most concurrent streams (default 16; each choice of a request is one)
    \\  --kv-type TYPE            K and V cache type: default, bf16, f16, f32, q8_0, fp8 (default: the backend's)
    \\  --no-prefix-cache         do not reuse KV pages of prompts that start the same
    \\  --batch-tensor-cores      CUDA: shared tensor-core products for batches of 16+ (not batch invariant)
    \\  --batch-tokens N          token budget of one step: decode tokens plus prompt chunks (default 2048)
    \\  --chunk N                 most tokens of one prompt in one step (default 512)
    \\  --lookup N                prompt-lookup speculation proposing up to N tokens a step (default 0: off)
    \\  --draft MODEL             a drafter checkpoint (the target's vocabulary) proposing for every stream
    \\  --draft-tokens N          most tokens the drafter proposes a step (default 4)
    \\  --api-key KEY             require "Authorization: Bearer KEY" (compared in constant time)
    \\  --max-connections N       connections served at once; more get 503 (default 256)
    \\  --max-body BYTES          largest request body (default 4194304)
    \\  --header-timeout S        seconds a request's header may take to arrive (default 10)
    \\  --body-timeout S          seconds a request's body may take to arrive (default 30)
    \\  --idle-timeout S          seconds a keep-alive connection may wait between requests (default 30)
    \\  --queue-timeout S         seconds a request may wait for room before 503 (default 30)
    \\  --max-waiting N           requests waiting for room; more get 503 (default 1024)
    \\  -h, --help                this text
    \\
    \\SIGTERM or SIGINT drains: running requests finish, new ones get 503, then the server exits 0.
    \\
;

pub const Config = struct {
    model: ?[:0]const u8 = null,
    model_name: ?[]const u8 = null,
    host: []const u8 = "127.0.0.1",
    port: u16 = 8080,
    backend: c.engine_backend = c.ENGINE_BACKEND_AUTO,
    device: i32 = 0,
    ctx: u32 = 4096,
    streams: u32 = 16,
    kv_type: c.engine_kv_type = c.ENGINE_KV_DEFAULT,
    prefix_cache: bool = true,
    batch_tensor_cores: bool = false,
    // 64 clients' 512-token prompts on the H100's 8B shape: 0.75 of engine_step_batch's aggregate at 512 /
    // 256, 0.90 at 2048 / 512 (0.97 at 4096 / 1024, with inter-token p99 155 ms against 113).
    batch_tokens: u32 = 2048,
    chunk: u32 = 512,
    lookup: u32 = 0,
    draft: ?[:0]const u8 = null,
    draft_tokens: u32 = 4,
    api_key: ?[]const u8 = null,
    max_connections: u32 = 256,
    max_body: usize = 4 * 1024 * 1024,
    header_timeout_s: u32 = 10,
    body_timeout_s: u32 = 30,
    idle_timeout_s: u32 = 30,
    queue_timeout_s: u32 = 30,
    max_waiting: usize = 1024,
};

fn die(comptime fmt: []const u8, args: anytype) noreturn {
    std.debug.print("hostembed-server: " ++ fmt ++ "\n", args);
    std.process.exit(2);
}

fn parseArgs(args: []const [:0]const u8) Config {
    var cfg: Config = .{};
    var i: usize = 1;
    while (i < args.len) : (i += 1) {
        const a = args[i];
        if (std.mem.eql(u8, a, "-h") or std.mem.eql(u8, a, "--help")) {
            std.fs.File.stdout().writeAll(usage) catch {};
            std.process.exit(0);
        }
        if (std.mem.eql(u8, a, "--no-prefix-cache")) {
            cfg.prefix_cache = false;
            continue;
        }
        if (std.mem.eql(u8, a, "--batch-tensor-cores")) {
            cfg.batch_tensor_cores = true;
            continue;
        }
        if (i + 1 >= args.len) die("{s} needs a value (or is unknown); see --help", .{a});
        i += 1;
        const v = args[i];
        if (std.mem.eql(u8, a, "-m") or std.mem.eql(u8, a, "--model")) {
            cfg.model = v;
        } else if (std.mem.eql(u8, a, "--model-name")) {
            cfg.model_name = v;
        } else if (std.mem.eql(u8, a, "--host")) {
            cfg.host = v;
        } else if (std.mem.eql(u8, a, "--port")) {
            cfg.port = number(u16, a, v);
        } else if (std.mem.eql(u8, a, "--backend")) {
            cfg.backend = if (std.mem.eql(u8, v, "auto")) c.ENGINE_BACKEND_AUTO else if (std.mem.eql(u8, v, "cuda")) c.ENGINE_BACKEND_CUDA else if (std.mem.eql(u8, v, "cpu")) c.ENGINE_BACKEND_CPU else die("--backend is auto, cuda or cpu, not {s}", .{v});
        } else if (std.mem.eql(u8, a, "--device")) {
            cfg.device = number(i32, a, v);
        } else if (std.mem.eql(u8, a, "--ctx")) {
            cfg.ctx = number(u32, a, v);
        } else if (std.mem.eql(u8, a, "--streams")) {
            cfg.streams = number(u32, a, v);
        } else if (std.mem.eql(u8, a, "--kv-type")) {
            const names = [_][]const u8{ "default", "bf16", "f16", "f32", "q8_0", "fp8" };
            const kinds = [_]c.engine_kv_type{ c.ENGINE_KV_DEFAULT, c.ENGINE_KV_BF16, c.ENGINE_KV_F16, c.ENGINE_KV_F32, c.ENGINE_KV_Q8_0, c.ENGINE_KV_FP8_E4M3 };
            for (names, kinds) |name, kind| {
                if (std.mem.eql(u8, v, name)) {
                    cfg.kv_type = kind;
                    break;
                }
            } else die("--kv-type is one of default, bf16, f16, f32, q8_0, fp8, not {s}", .{v});
        } else if (std.mem.eql(u8, a, "--batch-tokens")) {
            cfg.batch_tokens = @max(1, number(u32, a, v));
        } else if (std.mem.eql(u8, a, "--chunk")) {
            cfg.chunk = @max(1, number(u32, a, v));
        } else if (std.mem.eql(u8, a, "--lookup")) {
            cfg.lookup = number(u32, a, v);
            if (cfg.lookup > c.ENGINE_SPECULATION_MAX_TOKENS) die("--lookup is at most {d}", .{c.ENGINE_SPECULATION_MAX_TOKENS});
        } else if (std.mem.eql(u8, a, "--draft")) {
            cfg.draft = v;
        } else if (std.mem.eql(u8, a, "--draft-tokens")) {
            cfg.draft_tokens = number(u32, a, v);
            if (cfg.draft_tokens == 0 or cfg.draft_tokens > c.ENGINE_SPECULATION_MAX_TOKENS) die("--draft-tokens is 1 to {d}", .{c.ENGINE_SPECULATION_MAX_TOKENS});
        } else if (std.mem.eql(u8, a, "--api-key")) {
            cfg.api_key = v;
        } else if (std.mem.eql(u8, a, "--max-connections")) {
            cfg.max_connections = @max(1, number(u32, a, v));
        } else if (std.mem.eql(u8, a, "--max-body")) {
            cfg.max_body = number(usize, a, v);
        } else if (std.mem.eql(u8, a, "--header-timeout")) {
            cfg.header_timeout_s = number(u32, a, v);
        } else if (std.mem.eql(u8, a, "--body-timeout")) {
            cfg.body_timeout_s = number(u32, a, v);
        } else if (std.mem.eql(u8, a, "--idle-timeout")) {
            cfg.idle_timeout_s = number(u32, a, v);
        } else if (std.mem.eql(u8, a, "--queue-timeout")) {
            cfg.queue_timeout_s = number(u32, a, v);
        } else if (std.mem.eql(u8, a, "--max-waiting")) {
            cfg.max_waiting = @max(1, number(usize, a, v));
        } else die("unknown option {s}; see --help", .{a});
    }
    if (cfg.model == null) die("-m MODEL is required; see --help", .{});
    return cfg;
}

fn number(comptime T: type, flag: []const u8, v: []const u8) T {
    return std.fmt.parseInt(T, v, 10) catch die("{s} takes a number, not {s}", .{ flag, v });
}

/// What the handlers share.
pub const Server = struct {
    cfg: Config,
    name: []const u8,
    limits: http.Limits,
    engine: ?*c.engine = null,
    scheduler: sched.Scheduler = undefined,
    info: c.struct_engine_model_info = undefined,
    ready: std.atomic.Value(bool) = .init(false),
    draining: std.atomic.Value(bool) = .init(false),
    connections: std.atomic.Value(u32) = .init(0),
    /// Generation handlers between submitting and their last write: draining waits for them.
    busy: std.atomic.Value(u32) = .init(0),
    key_digest: ?[32]u8 = null,
    created: i64,
    /// The model's fill-in-the-middle tokens (prefix, suffix, middle), for a completion's `suffix`.
    fim: ?[3]i32 = null,
    /// The chat template prints the tools it is given (else the server shows them in the system message).
    template_tools: bool = false,

    pub fn authorized(s: *Server, header: ?[]const u8) bool {
        const want = s.key_digest orelse return true;
        const h = header orelse return false;
        const prefix = "Bearer ";
        if (h.len < prefix.len or !std.ascii.eqlIgnoreCase(h[0..prefix.len], prefix)) return false;
        // Digests of equal length compared in constant time: neither the key's length nor its bytes leak.
        var got: [32]u8 = undefined;
        std.crypto.hash.sha2.Sha256.hash(h[prefix.len..], &got, .{});
        return std.crypto.timing_safe.eql([32]u8, got, want);
    }
};

var sigterm: std.atomic.Value(bool) = .init(false);

fn onSignal(_: i32) callconv(.c) void {
    sigterm.store(true, .release);
}

pub fn main() !void {
    const args = try std.process.argsAlloc(gpa);
    const cfg = parseArgs(args);

    if (c.engine_abi_version() != c.HOSTEMBED_ABI_VERSION)
        die("libhostembed ABI {d}, header {d}", .{ c.engine_abi_version(), c.HOSTEMBED_ABI_VERSION });

    var ignore = posix.Sigaction{ .handler = .{ .handler = posix.SIG.IGN }, .mask = posix.sigemptyset(), .flags = 0 };
    posix.sigaction(posix.SIG.PIPE, &ignore, null);
    var term = posix.Sigaction{ .handler = .{ .handler = onSignal }, .mask = posix.sigemptyset(), .flags = 0 };
    posix.sigaction(posix.SIG.TERM, &term, null);
    posix.sigaction(posix.SIG.INT, &term, null);

    const base = std.fs.path.basename(cfg.model.?);
    var server = Server{
        .cfg = cfg,
        .name = cfg.model_name orelse if (std.mem.endsWith(u8, base, ".gguf")) base[0 .. base.len - 5] else base,
        .limits = .{
            .max_body = cfg.max_body,
            .header_timeout_ms = @as(i64, cfg.header_timeout_s) * 1000,
            .body_timeout_ms = @as(i64, cfg.body_timeout_s) * 1000,
            .idle_timeout_ms = @as(i64, cfg.idle_timeout_s) * 1000,
        },
        .created = std.time.timestamp(),
    };
    if (cfg.api_key) |key| {
        var d: [32]u8 = undefined;
        std.crypto.hash.sha2.Sha256.hash(key, &d, .{});
        server.key_digest = d;
    }

    // Listening before the load lets /health say "loading" while the weights are read.
    const address = std.net.Address.resolveIp(cfg.host, cfg.port) catch die("cannot use --host {s}", .{cfg.host});
    var listener = address.listen(.{ .reuse_address = true, .kernel_backlog = 1024 }) catch |err| die("cannot listen on {s}:{d}: {s}", .{ cfg.host, cfg.port, @errorName(err) });
    const acceptor = try std.Thread.spawn(.{}, acceptLoop, .{ &server, &listener });
    acceptor.detach();

    var opts = c.engine_default_options();
    opts.backend = cfg.backend;
    opts.device = cfg.device;
    opts.context = cfg.ctx;
    opts.max_streams = cfg.streams;
    opts.max_batch = @min(cfg.batch_tokens, 4096);
    opts.kv_type_k = cfg.kv_type;
    opts.kv_type_v = cfg.kv_type;
    opts.prefix_cache = if (cfg.prefix_cache) c.ENGINE_TRISTATE_YES else c.ENGINE_TRISTATE_NO;
    opts.batch_tensor_cores = if (cfg.batch_tensor_cores) c.ENGINE_TRISTATE_YES else c.ENGINE_TRISTATE_NO;
    if (cfg.draft) |d| opts.draft_model = d.ptr;
    var engine: ?*c.engine = null;
    const st = c.engine_init_fit(cfg.model.?.ptr, &opts, &engine);
    if (st != c.ENGINE_STATUS_OK) die("cannot load {s}: {s}: {s}", .{ cfg.model.?, c.engine_status_str(@intCast(st)), c.engine_last_error() });
    server.engine = engine.?;
    _ = c.engine_model_info(engine.?, &server.info);
    server.fim = api.fimTokens(engine.?);
    server.template_tools = api.templateShowsTools(engine.?);
    try server.scheduler.init(engine.?, .{
        .batch_tokens = cfg.batch_tokens,
        .chunk_tokens = cfg.chunk,
        // With a drafter every stream drafts (up to --draft-tokens a step) in place of prompt lookup.
        .lookup = if (cfg.draft != null) cfg.draft_tokens else cfg.lookup,
        .drafter = cfg.draft != null,
        .queue_timeout_ms = @as(u64, cfg.queue_timeout_s) * 1000,
        .max_waiting = cfg.max_waiting,
    });
    const stepper = try std.Thread.spawn(.{}, sched.Scheduler.run, .{&server.scheduler});
    stepper.detach();
    server.ready.store(true, .release);
    std.debug.print("hostembed-server: serving {s} as \"{s}\" on http://{s}:{d} ({s}, {d} streams of {d} tokens)\n", .{
        cfg.model.?, server.name, cfg.host, cfg.port, if (server.info.cuda) "cuda" else "cpu", server.info.streams, server.info.window,
    });

    while (!sigterm.load(.acquire)) std.Thread.sleep(50 * std.time.ns_per_ms);
    std.debug.print("hostembed-server: draining\n", .{});
    server.draining.store(true, .release);
    server.scheduler.drain();
    while (server.scheduler.live.load(.acquire) > 0 or server.busy.load(.acquire) > 0) std.Thread.sleep(20 * std.time.ns_per_ms);
    std.debug.print("hostembed-server: drained, exiting\n", .{});
    std.process.exit(0);
}

fn acceptLoop(server: *Server, listener: *std.net.Server) void {
    while (true) {
        const conn = listener.accept() catch |err| {
            std.log.warn("accept: {s}", .{@errorName(err)});
            std.Thread.sleep(10 * std.time.ns_per_ms);
            continue;
        };
        const timeout = posix.timeval{ .sec = 30, .usec = 0 };
        posix.setsockopt(conn.stream.handle, posix.SOL.SOCKET, posix.SO.SNDTIMEO, std.mem.asBytes(&timeout)) catch {};
        if (server.connections.fetchAdd(1, .acq_rel) >= server.cfg.max_connections) {
            _ = server.connections.fetchSub(1, .acq_rel);
            var refused = http.Conn{ .fd = conn.stream.handle };
            http.respondError(&refused, 503, "too many connections", null, null, false);
            posix.close(conn.stream.handle);
            continue;
        }
        // The library's tokenizer and chat template run on this thread: a stack as large as a main thread's.
        const t = std.Thread.spawn(.{ .stack_size = 8 << 20 }, serveConnection, .{ server, conn.stream.handle }) catch {
            _ = server.connections.fetchSub(1, .acq_rel);
            posix.close(conn.stream.handle);
            continue;
        };
        t.detach();
    }
}

fn serveConnection(server: *Server, fd: posix.socket_t) void {
    defer _ = server.connections.fetchSub(1, .acq_rel);
    defer posix.close(fd);
    const conn = gpa.create(http.Conn) catch return;
    defer gpa.destroy(conn);
    conn.* = .{ .fd = fd };
    defer conn.deinit();
    while (!conn.broken) {
        switch (conn.read(server.limits)) {
            .closed => return,
            .refused => |r| {
                metrics.countFailure();
                http.respondError(conn, r.status, r.message, null, null, false);
                conn.lingeringClose();
                return;
            },
            .request => |req| {
                const keep = api.handle(server, conn, req);
                if (!keep or !req.keep_alive) return;
            },
        }
    }
}
