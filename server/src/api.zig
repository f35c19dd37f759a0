//! The endpoints: OpenAI's request fields checked and turned into a scheduler request, and its
//! response, chunk and error shapes written back.
const std = @import("std");
const c = @import("hostembed");
const http = @import("http.zig");
const sched = @import("sched.zig");
const text = @import("text.zig");
const metrics = @import("metrics.zig");
const tools = @import("tools.zig");
const Server = @import("main.zig").Server;

const gpa = std.heap.c_allocator;
const Value = std.json.Value;
const ObjectMap = std.json.ObjectMap;

/// A request the client got wrong: answered with a 4xx in OpenAI's error shape.
const Bad = struct {
    status: u16 = 400,
    message: []const u8,
    param: ?[]const u8 = null,
    code: ?[]const u8 = null,
};

const Kind = enum { chat, completion };

/// Serves one request; false when the connection must close afterwards.
pub fn handle(server: *Server, conn: *http.Conn, req: http.Request) bool {
    const path = if (std.mem.indexOfScalar(u8, req.target, '?')) |q| req.target[0..q] else req.target;
    if (std.mem.eql(u8, path, "/health")) {
        if (req.method != .GET and req.method != .HEAD) return methodNotAllowed(conn, req);
        const state: struct { status: u16, body: []const u8, extra: []const u8 } = if (!server.ready.load(.acquire))
            .{ .status = 503, .body = "{\"status\":\"loading\"}", .extra = "Retry-After: 1\r\n" }
        else if (server.draining.load(.acquire))
            .{ .status = 503, .body = "{\"status\":\"draining\"}", .extra = "" }
        else
            .{ .status = 200, .body = "{\"status\":\"ok\"}", .extra = "" };
        // HEAD gets GET's header alone.
        http.respondHead(conn, state.status, "application/json", state.body.len, req.keep_alive, state.extra);
        if (req.method == .GET) conn.writeAll(state.body);
        return true;
    }
    if (!server.authorized(req.authorization)) {
        metrics.countFailure();
        http.respondError(conn, 401, "a valid API key is required: Authorization: Bearer KEY", null, "invalid_api_key", req.keep_alive);
        return true;
    }
    if (!server.ready.load(.acquire)) {
        http.respondError(conn, 503, "the model is loading", null, null, req.keep_alive);
        return true;
    }
    if (std.mem.eql(u8, path, "/v1/models") or std.mem.startsWith(u8, path, "/v1/models/")) {
        if (req.method != .GET) return methodNotAllowed(conn, req);
        return models(server, conn, req, path);
    }
    if (std.mem.eql(u8, path, "/metrics")) {
        if (req.method != .GET) return methodNotAllowed(conn, req);
        var out: std.ArrayList(u8) = .empty;
        defer out.deinit(gpa);
        metrics.render(gpa, &out, server.engine.?) catch return false;
        http.respond(conn, 200, "text/plain; version=0.0.4", out.items, req.keep_alive, "");
        return true;
    }
    const kind: Kind = if (std.mem.eql(u8, path, "/v1/chat/completions")) .chat else if (std.mem.eql(u8, path, "/v1/completions")) .completion else {
        metrics.countFailure();
        http.respondError(conn, 404, "no such endpoint", null, null, req.keep_alive);
        return true;
    };
    if (req.method != .POST) return methodNotAllowed(conn, req);
    return generate(server, conn, req, kind);
}

fn methodNotAllowed(conn: *http.Conn, req: http.Request) bool {
    metrics.countFailure();
    http.respondError(conn, 405, "method not allowed for this endpoint", null, null, req.keep_alive);
    return true;
}

fn models(server: *Server, conn: *http.Conn, req: http.Request, path: []const u8) bool {
    var out: std.ArrayList(u8) = .empty;
    defer out.deinit(gpa);
    const one = path.len > "/v1/models/".len;
    if (one and !std.mem.eql(u8, path["/v1/models/".len..], server.name)) {
        http.respondError(conn, 404, "no such model", "model", "model_not_found", req.keep_alive);
        return true;
    }
    writeModel(server, &out, one) catch return false;
    http.respond(conn, 200, "application/json", out.items, req.keep_alive, "");
    return true;
}

fn writeModel(server: *Server, out: *std.ArrayList(u8), one: bool) !void {
    if (!one) try out.appendSlice(gpa, "{\"object\":\"list\",\"data\":[");
    try out.appendSlice(gpa, "{\"id\":");
    try text.appendValidJsonString(gpa, out, server.name);
    try out.print(gpa, ",\"object\":\"model\",\"created\":{d},\"owned_by\":\"hostembed\",\"max_model_len\":{d}}}", .{ server.created, server.info.window });
    if (!one) try out.appendSlice(gpa, "]}");
}

/// One prompt of a request: its tokens, the text `echo` puts before its choices' text, and its
/// `max_tokens` (default: the rest of the window).
const Prompt = struct {
    ids: []i32,
    echo: []const u8 = "",
    max_tokens: u32 = 0,
};

/// Most prompts one completions request may hold (each is a scheduler request of `n` choices).
const max_prompts = 64;

/// Everything a generation request asked for, checked.
const Params = struct {
    prompts: std.ArrayList(Prompt) = .empty,
    n: u32 = 1,
    stops: std.ArrayList([]const u8) = .empty,
    stream: bool = false,
    include_usage: bool = false,
    sampling: c.engine_sampling,
    top_logprobs: ?u32 = null,
    constraint: c.engine_constraint = c.ENGINE_CONSTRAINT_NONE,
    constraint_text: []const u8 = "",
    frequency_penalty: f32 = 0,
    presence_penalty: f32 = 0,
    logit_bias: []sched.Bias = &.{},
    echo: bool = false,
    /// The request's tools (chat): null when it offers none.
    tools: ?tools.Tools = null,

    fn promptTokens(p: *const Params) usize {
        var sum: usize = 0;
        for (p.prompts.items) |one| sum += one.ids.len;
        return sum;
    }
};

const chat_fields = [_][]const u8{
    "model",               "messages",           "max_tokens",       "max_completion_tokens", "temperature",
    "top_p",               "n",                  "stream",           "stream_options",        "stop",
    "seed",                "frequency_penalty",  "presence_penalty", "logprobs",              "top_logprobs",
    "response_format",     "user",               "logit_bias",       "tools",                 "tool_choice",
    "parallel_tool_calls", "store",              "metadata",         "service_tier",          "top_k",
    "min_p",               "repetition_penalty", "functions",        "function_call",
};
const completion_fields = [_][]const u8{
    "model",              "prompt",           "max_tokens",     "temperature", "top_p",
    "n",                  "stream",           "stream_options", "stop",        "seed",
    "frequency_penalty",  "presence_penalty", "logprobs",       "echo",        "best_of",
    "suffix",             "user",             "logit_bias",     "top_k",       "min_p",
    "repetition_penalty", "response_format",
};

fn generate(server: *Server, conn: *http.Conn, req: http.Request, kind: Kind) bool {
    var arena_state = std.heap.ArenaAllocator.init(gpa);
    defer arena_state.deinit();
    const arena = arena_state.allocator();
    var params: Params = .{ .sampling = c.engine_default_sampling() };
    parse(server, arena, req.body, kind, &params) catch |err| {
        metrics.countFailure();
        const why: Bad = switch (err) {
            error.Bad => last_bad,
            else => .{ .status = 500, .message = "out of memory" },
        };
        http.respondError(conn, why.status, why.message, why.param, why.code, req.keep_alive);
        return true;
    };
    if (server.draining.load(.acquire)) {
        http.respondError(conn, 503, "the server is shutting down", null, null, false);
        return false;
    }
    metrics.countRequest(kind == .chat);
    metrics.addPromptTokens(params.promptTokens());
    _ = server.busy.fetchAdd(1, .acq_rel);
    defer _ = server.busy.fetchSub(1, .acq_rel);

    // A scheduler request a prompt, all under one lock and signal.
    var sync: sched.Sync = .{};
    const rs = arena.alloc(*sched.Request, params.prompts.items.len) catch return false;
    var made: usize = 0;
    var submitted: usize = 0;
    defer {
        // The requests' memory goes only once the scheduler has let each go.
        sync.mutex.lock();
        for (rs[0..submitted]) |r| r.cancelled.store(true, .release);
        for (rs[0..submitted]) |r| while (!r.released) sync.cond.wait(&sync.mutex);
        sync.mutex.unlock();
        for (rs[0..made]) |r| {
            r.deinit();
            gpa.destroy(r);
        }
    }
    for (params.prompts.items, rs) |one, *slot| {
        const r = gpa.create(sched.Request) catch return false;
        r.* = .{
            .prompt = one.ids,
            .max_tokens = one.max_tokens,
            .stops = params.stops.items,
            .sampling = params.sampling,
            .constraint = params.constraint,
            .constraint_text = params.constraint_text,
            .top_logprobs = params.top_logprobs,
            .frequency_penalty = params.frequency_penalty,
            .presence_penalty = params.presence_penalty,
            .logit_bias = params.logit_bias,
            .score_prompt = params.echo and params.top_logprobs != null,
            .sync = &sync,
        };
        r.init(params.n) catch {
            gpa.destroy(r);
            return false;
        };
        slot.* = r;
        made += 1;
    }
    for (rs) |r| {
        server.scheduler.submit(r) catch |err| {
            metrics.countFailure();
            const msg = switch (err) {
                error.Draining => "the server is shutting down",
                error.Busy => "too many requests are waiting; retry later",
                error.OutOfMemory => "out of memory",
            };
            http.respondError(conn, 503, msg, null, null, req.keep_alive);
            return true;
        };
        submitted += 1;
    }
    var w = Writer{ .server = server, .conn = conn, .rs = rs, .sync = &sync, .kind = kind, .params = &params, .arena = arena };
    w.id = w.makeId();
    const keep = w.run();
    return keep and !w.streamed;
}

threadlocal var last_bad: Bad = .{ .message = "" };

fn bad(b: Bad) error{Bad} {
    last_bad = b;
    return error.Bad;
}

fn badf(arena: std.mem.Allocator, param: ?[]const u8, comptime fmt: []const u8, args: anytype) error{Bad} {
    return bad(.{ .message = std.fmt.allocPrint(arena, fmt, args) catch "invalid request", .param = param });
}

fn field(obj: ObjectMap, name: []const u8) ?Value {
    const v = obj.get(name) orelse return null;
    return if (v == .null) null else v;
}

fn getInt(arena: std.mem.Allocator, obj: ObjectMap, name: []const u8, min: i64, max: i64) error{Bad}!?i64 {
    const v = field(obj, name) orelse return null;
    const x = switch (v) {
        .integer => |i| i,
        .float => |f| if (@floor(f) == f and f >= -9e15 and f <= 9e15) @as(i64, @intFromFloat(f)) else return badf(arena, name, "'{s}' must be an integer", .{name}),
        .number_string => return badf(arena, name, "'{s}' is out of range ({d} to {d})", .{ name, min, max }),
        else => return badf(arena, name, "'{s}' must be an integer", .{name}),
    };
    if (x < min or x > max) return badf(arena, name, "'{s}' is {d}, outside {d} to {d}", .{ name, x, min, max });
    return x;
}

fn getFloat(arena: std.mem.Allocator, obj: ObjectMap, name: []const u8, min: f64, max: f64) error{Bad}!?f64 {
    const v = field(obj, name) orelse return null;
    const x: f64 = switch (v) {
        .integer => |i| @floatFromInt(i),
        .float => |f| f,
        .number_string => return badf(arena, name, "'{s}' is out of range ({d} to {d})", .{ name, min, max }),
        else => return badf(arena, name, "'{s}' must be a number", .{name}),
    };
    if (!(x >= min and x <= max)) return badf(arena, name, "'{s}' is {d}, outside {d} to {d}", .{ name, x, min, max });
    return x;
}

fn getBool(arena: std.mem.Allocator, obj: ObjectMap, name: []const u8) error{Bad}!?bool {
    const v = field(obj, name) orelse return null;
    return switch (v) {
        .bool => |b| b,
        else => badf(arena, name, "'{s}' must be a boolean", .{name}),
    };
}

fn getString(arena: std.mem.Allocator, obj: ObjectMap, name: []const u8) error{Bad}!?[]const u8 {
    const v = field(obj, name) orelse return null;
    return switch (v) {
        .string => |s| s,
        else => badf(arena, name, "'{s}' must be a string", .{name}),
    };
}

/// Depth of nesting of a JSON value, counted only up to `limit` (so the walk itself stays shallow).
fn depthOver(v: Value, limit: usize) bool {
    if (limit == 0) return true;
    switch (v) {
        .array => |a| for (a.items) |x| if (depthOver(x, limit - 1)) return true,
        .object => |o| for (o.values()) |x| if (depthOver(x, limit - 1)) return true,
        else => {},
    }
    return false;
}

/// Most nesting and most values a request body may hold: checked by a scan before any value is built,
/// so a body within the size limit cannot make the parse take a hundred times its size.
const max_depth = 64;
const max_values = 1 << 18;

fn precheck(arena: std.mem.Allocator, body: []const u8) error{Bad}!void {
    var scanner = std.json.Scanner.initCompleteInput(arena, body);
    var depth: usize = 0;
    var values: usize = 0;
    while (true) {
        const token = scanner.next() catch |err| return badf(arena, null, "the request body is not valid JSON ({s})", .{@errorName(err)});
        switch (token) {
            .object_begin, .array_begin => {
                depth += 1;
                if (depth > max_depth) return badf(arena, null, "the request body nests deeper than {d}", .{max_depth});
            },
            .object_end, .array_end => depth -= 1,
            .end_of_document => return,
            else => {},
        }
        values += 1;
        if (values > max_values) return badf(arena, null, "the request body holds more than {d} JSON values", .{max_values});
    }
}

fn parse(server: *Server, arena: std.mem.Allocator, body: []const u8, kind: Kind, p: *Params) !void {
    if (!std.unicode.utf8ValidateSlice(body)) return bad(.{ .message = "the request body is not valid UTF-8" });
    try precheck(arena, body);
    const root = std.json.parseFromSliceLeaky(Value, arena, body, .{ .duplicate_field_behavior = .use_last }) catch |err|
        return badf(arena, null, "the request body is not valid JSON ({s})", .{@errorName(err)});
    if (root != .object) return bad(.{ .message = "the request body must be a JSON object" });
    const obj = root.object;
    const known: []const []const u8 = if (kind == .chat) &chat_fields else &completion_fields;
    for (obj.keys()) |key| {
        for (known) |k| {
            if (std.mem.eql(u8, k, key)) break;
        } else return badf(arena, key, "unrecognized request argument supplied: {s}", .{key});
    }

    const model = (try getString(arena, obj, "model")) orelse return bad(.{ .message = "'model' is required", .param = "model" });
    if (!std.mem.eql(u8, model, server.name))
        return bad(.{ .status = 404, .message = try std.fmt.allocPrint(arena, "the model '{s}' does not exist (this server serves '{s}')", .{ model, server.name }), .param = "model", .code = "model_not_found" });

    for ([_][]const u8{ "functions", "function_call" }) |name| {
        if (field(obj, name)) |v| {
            const empty = (v == .array and v.array.items.len == 0) or (v == .string and std.mem.eql(u8, v.string, "none"));
            if (!empty) return badf(arena, name, "'{s}' (the deprecated form) is not supported: use 'tools' and 'tool_choice'", .{name});
        }
    }
    if (kind == .chat) {
        var why: tools.Failure = .{};
        p.tools = tools.parse(arena, field(obj, "tools"), field(obj, "tool_choice"), field(obj, "parallel_tool_calls"), &why) catch |err| switch (err) {
            error.Bad => return bad(.{ .message = why.message, .param = why.param }),
            error.OutOfMemory => return error.OutOfMemory,
        };
    }
    if (field(obj, "logit_bias")) |v| p.logit_bias = try parseLogitBias(server, arena, v);
    p.echo = (try getBool(arena, obj, "echo")) orelse false;
    const suffix = try getString(arena, obj, "suffix");
    if (suffix != null and suffix.?.len > 0 and server.fim == null)
        return bad(.{ .message = "'suffix' needs a model with fill-in-the-middle tokens, and this model has none", .param = "suffix" });

    const streams: i64 = @intCast(server.scheduler.streams());
    p.n = @intCast((try getInt(arena, obj, "n", 1, @min(streams, 128))) orelse 1);
    if (try getInt(arena, obj, "best_of", 1, 128)) |best_of| if (best_of != p.n) return bad(.{ .message = "'best_of' other than 'n' is not supported", .param = "best_of" });
    p.stream = (try getBool(arena, obj, "stream")) orelse false;
    if (field(obj, "stream_options")) |so| {
        if (so != .object) return bad(.{ .message = "'stream_options' must be an object", .param = "stream_options" });
        for (so.object.keys()) |key| if (!std.mem.eql(u8, key, "include_usage") and !std.mem.eql(u8, key, "include_obfuscation"))
            return badf(arena, "stream_options", "unrecognized stream option: {s}", .{key});
        p.include_usage = (try getBool(arena, so.object, "include_usage")) orelse false;
    }

    var s = c.engine_default_sampling();
    s.temperature = @floatCast((try getFloat(arena, obj, "temperature", 0, 2)) orelse 1.0);
    const top_p = (try getFloat(arena, obj, "top_p", 0, 1)) orelse 1.0;
    s.top_p = @floatCast(@max(top_p, 1e-6));
    s.top_k = @intCast((try getInt(arena, obj, "top_k", 0, 1 << 20)) orelse 0);
    s.min_p = @floatCast((try getFloat(arena, obj, "min_p", 0, 1)) orelse 0);
    if (try getFloat(arena, obj, "repetition_penalty", 0.01, 10)) |rp| {
        s.repeat_penalty = @floatCast(rp);
        s.repeat_last_n = 64;
    }
    p.frequency_penalty = @floatCast((try getFloat(arena, obj, "frequency_penalty", -2, 2)) orelse 0);
    p.presence_penalty = @floatCast((try getFloat(arena, obj, "presence_penalty", -2, 2)) orelse 0);
    // OpenAI's penalties and logit_bias: the server samples such a request itself from the logits.
    const penalized = p.frequency_penalty != 0 or p.presence_penalty != 0 or p.logit_bias.len > 0;
    if (penalized and field(obj, "repetition_penalty") != null)
        return bad(.{ .message = "'repetition_penalty' does not combine with 'frequency_penalty', 'presence_penalty' or 'logit_bias'", .param = "repetition_penalty" });
    if (try getInt(arena, obj, "seed", std.math.minInt(i64), std.math.maxInt(i64))) |seed| {
        s.seed = @bitCast(seed);
    } else s.seed = std.crypto.random.int(u64);
    p.sampling = s;

    if (kind == .chat) {
        if (try getBool(arena, obj, "logprobs")) |want| {
            if (want) p.top_logprobs = @intCast((try getInt(arena, obj, "top_logprobs", 0, 20)) orelse 0);
        }
        if (p.top_logprobs == null and field(obj, "top_logprobs") != null)
            return bad(.{ .message = "'top_logprobs' needs 'logprobs' true", .param = "top_logprobs" });
    } else if (try getInt(arena, obj, "logprobs", 0, 5)) |k| p.top_logprobs = @intCast(k);
    if (p.echo and p.top_logprobs != null and p.top_logprobs.? > 0)
        return bad(.{ .message = "'echo' with 'logprobs' above 0 is not supported: the prompt's tokens are scored without their alternatives ('logprobs': 0 gives each prompt token's log-probability)", .param = "logprobs" });

    if (field(obj, "stop")) |stop| {
        switch (stop) {
            .string => |one| try p.stops.append(arena, one),
            .array => |list| {
                if (list.items.len > 16) return bad(.{ .message = "at most 16 stop sequences", .param = "stop" });
                for (list.items) |item| {
                    if (item != .string) return bad(.{ .message = "'stop' must be a string or an array of strings", .param = "stop" });
                    try p.stops.append(arena, item.string);
                }
            },
            else => return bad(.{ .message = "'stop' must be a string or an array of strings", .param = "stop" }),
        }
        for (p.stops.items) |one| if (one.len == 0 or one.len > 512) return bad(.{ .message = "each stop sequence is 1 to 512 bytes", .param = "stop" });
    }

    if (field(obj, "response_format")) |rf| try parseResponseFormat(arena, rf, p);
    if (p.tools) |*t| if (t.constrained()) {
        // A required or named call is held to the tools' shapes by the engine's constraint.
        if (p.constraint != c.ENGINE_CONSTRAINT_NONE)
            return bad(.{ .message = "'response_format' does not combine with a 'tool_choice' of \"required\" or a named function", .param = "response_format" });
        p.constraint = c.ENGINE_CONSTRAINT_JSON_SCHEMA;
        p.constraint_text = try tools.schema(arena, t);
    };

    switch (kind) {
        .chat => try p.prompts.append(arena, .{ .ids = try chatPrompt(server, arena, obj, if (p.tools) |*t| t else null) }),
        .completion => try completionPrompts(server, arena, obj, suffix, p),
    }
    if (p.prompts.items.len * p.n > 128) return bad(.{ .message = "at most 128 choices (prompts times 'n') in one request", .param = "n" });

    const window: u64 = server.info.window;
    const asked = (try getInt(arena, obj, if (kind == .chat and field(obj, "max_completion_tokens") != null) "max_completion_tokens" else "max_tokens", 1, std.math.maxInt(u32)));
    for (p.prompts.items) |*one| {
        if (one.ids.len == 0) return bad(.{ .message = "the prompt is empty", .param = if (kind == .chat) "messages" else "prompt" });
        if (one.ids.len >= window or (asked != null and one.ids.len + @as(u64, @intCast(asked.?)) > window)) {
            return bad(.{
                .message = try std.fmt.allocPrint(arena, "this model's maximum context length is {d} tokens; the request has {d} prompt tokens and asks for {d} more", .{ window, one.ids.len, asked orelse 1 }),
                .param = if (kind == .chat) "messages" else "prompt",
                .code = "context_length_exceeded",
            });
        }
        one.max_tokens = if (asked) |a| @intCast(a) else @intCast(window - one.ids.len);
    }
}

/// OpenAI's `logit_bias`: an object of token ids (as strings) to biases in -100..100.
fn parseLogitBias(server: *Server, arena: std.mem.Allocator, v: Value) ![]sched.Bias {
    if (v != .object) return bad(.{ .message = "'logit_bias' must be an object of token ids to numbers", .param = "logit_bias" });
    if (v.object.count() > 1024) return bad(.{ .message = "'logit_bias' holds more than 1024 tokens", .param = "logit_bias" });
    const out = try arena.alloc(sched.Bias, v.object.count());
    var it = v.object.iterator();
    var i: usize = 0;
    while (it.next()) |e| : (i += 1) {
        const id = std.fmt.parseInt(i32, e.key_ptr.*, 10) catch
            return badf(arena, "logit_bias", "'logit_bias' key '{s}' is not a token id", .{e.key_ptr.*});
        if (id < 0 or id >= server.info.vocab) return badf(arena, "logit_bias", "'logit_bias' token id {d} is outside the vocabulary of {d}", .{ id, server.info.vocab });
        const x: f64 = switch (e.value_ptr.*) {
            .integer => |n| @floatFromInt(n),
            .float => |f| f,
            else => return badf(arena, "logit_bias", "'logit_bias' of token {d} must be a number", .{id}),
        };
        if (!(x >= -100 and x <= 100)) return badf(arena, "logit_bias", "'logit_bias' of token {d} is {d}, outside -100 to 100", .{ id, x });
        out[i] = .{ .id = id, .bias = @floatCast(x) };
    }
    return out;
}

/// The fill-in-the-middle tokens (prefix, suffix, middle) when the model's vocabulary has a family of
/// them that each tokenize to one id: StarCoder's `<fim_prefix>` or Qwen's `<|fim_prefix|>`.
pub fn fimTokens(engine: *c.engine) ?[3]i32 {
    const families = [_][3][]const u8{
        .{ "<fim_prefix>", "<fim_suffix>", "<fim_middle>" },
        .{ "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>" },
    };
    family: for (families) |names| {
        var ids: [3]i32 = undefined;
        for (names, &ids) |name, *id| {
            var n: usize = 0;
            var one: [2]i32 = undefined;
            const st = c.engine_tokenize(engine, name.ptr, name.len, c.ENGINE_BOS_NO, &one, one.len, &n);
            if (st != c.ENGINE_STATUS_OK or n != 1) continue :family;
            id.* = one[0];
        }
        return ids;
    }
    return null;
}

fn parseResponseFormat(arena: std.mem.Allocator, rf: Value, p: *Params) !void {
    if (rf != .object) return bad(.{ .message = "'response_format' must be an object", .param = "response_format" });
    const kind = (try getString(arena, rf.object, "type")) orelse return bad(.{ .message = "'response_format.type' is required", .param = "response_format" });
    if (std.mem.eql(u8, kind, "text")) return;
    if (std.mem.eql(u8, kind, "json_object")) {
        p.constraint = c.ENGINE_CONSTRAINT_JSON;
        return;
    }
    if (!std.mem.eql(u8, kind, "json_schema")) return badf(arena, "response_format", "unknown response_format type '{s}'", .{kind});
    const js = field(rf.object, "json_schema") orelse return bad(.{ .message = "'response_format.json_schema' is required", .param = "response_format" });
    if (js != .object) return bad(.{ .message = "'response_format.json_schema' must be an object", .param = "response_format" });
    const schema = field(js.object, "schema") orelse return bad(.{ .message = "'response_format.json_schema.schema' is required", .param = "response_format" });
    if (schema != .object and schema != .bool) return bad(.{ .message = "the schema must be a JSON object", .param = "response_format" });
    if (depthOver(schema, 64)) return bad(.{ .message = "the schema is nested too deeply", .param = "response_format" });
    p.constraint = c.ENGINE_CONSTRAINT_JSON_SCHEMA;
    p.constraint_text = try std.json.Stringify.valueAlloc(arena, schema, .{});
}

fn tokenize(server: *Server, arena: std.mem.Allocator, s: []const u8, add_bos: bool, param: []const u8) ![]i32 {
    var n: usize = 0;
    const bos: i32 = if (add_bos) c.ENGINE_BOS_YES else c.ENGINE_BOS_NO;
    var st = c.engine_tokenize(server.engine.?, s.ptr, s.len, bos, null, 0, &n);
    if (st != c.ENGINE_STATUS_OK and st != c.ENGINE_STATUS_OUT_OF_RANGE)
        return badf(arena, param, "the text cannot be tokenized: {s}", .{c.engine_last_error()});
    const ids = try arena.alloc(i32, n);
    st = c.engine_tokenize(server.engine.?, s.ptr, s.len, bos, ids.ptr, ids.len, &n);
    if (st != c.ENGINE_STATUS_OK) return badf(arena, param, "the text cannot be tokenized: {s}", .{c.engine_last_error()});
    return ids[0..n];
}

/// `prompt`: a string, an array of token ids, or an array of either (a prompt each, answered by `n`
/// choices each, in order); with `suffix`, each prompt is put in the model's fill-in-the-middle form.
fn completionPrompts(server: *Server, arena: std.mem.Allocator, obj: ObjectMap, suffix: ?[]const u8, p: *Params) !void {
    const shape = "'prompt' must be a string, an array of token ids, or an array of strings or of arrays of token ids";
    const prompt = field(obj, "prompt") orelse return bad(.{ .message = "'prompt' is required", .param = "prompt" });
    const fim_suffix = if (suffix) |sx| (if (sx.len > 0) sx else null) else null;
    switch (prompt) {
        .string => |s| try p.prompts.append(arena, try textPrompt(server, arena, s, fim_suffix)),
        .array => |list| {
            if (list.items.len == 0) return bad(.{ .message = "'prompt' is an empty array", .param = "prompt" });
            if (list.items[0] == .integer) return p.prompts.append(arena, try idsPrompt(server, arena, list.items, fim_suffix));
            if (list.items.len > max_prompts) return badf(arena, "prompt", "at most {d} prompts in one request", .{max_prompts});
            for (list.items) |item| try p.prompts.append(arena, switch (item) {
                .string => |s| try textPrompt(server, arena, s, fim_suffix),
                .array => |ids| try idsPrompt(server, arena, ids.items, fim_suffix),
                else => return bad(.{ .message = shape, .param = "prompt" }),
            });
        },
        else => return bad(.{ .message = shape, .param = "prompt" }),
    }
}

fn textPrompt(server: *Server, arena: std.mem.Allocator, s: []const u8, suffix: ?[]const u8) !Prompt {
    if (std.mem.indexOfScalar(u8, s, 0) != null) return bad(.{ .message = "the prompt holds a NUL character", .param = "prompt" });
    if (suffix == null) return .{ .ids = try tokenize(server, arena, s, server.info.add_bos, "prompt"), .echo = s };
    return .{ .ids = try fimPrompt(server, arena, try tokenize(server, arena, s, false, "prompt"), suffix.?), .echo = s };
}

fn idsPrompt(server: *Server, arena: std.mem.Allocator, items: []const Value, suffix: ?[]const u8) !Prompt {
    const ids = try arena.alloc(i32, items.len);
    var echo: std.ArrayList(u8) = .empty;
    var buf: [256]u8 = undefined;
    for (items, ids) |item, *id| {
        if (item != .integer) return bad(.{ .message = "an array of token ids holds only integers", .param = "prompt" });
        if (item.integer < 0 or item.integer >= server.info.vocab) return badf(arena, "prompt", "token id {d} is outside the vocabulary of {d}", .{ item.integer, server.info.vocab });
        id.* = @intCast(item.integer);
        const n = c.engine_token_piece(server.engine.?, id.*, &buf, buf.len);
        if (n > 0) try echo.appendSlice(arena, buf[0..@min(@as(usize, @intCast(n)), buf.len - 1)]);
    }
    return .{ .ids = if (suffix) |sx| try fimPrompt(server, arena, ids, sx) else ids, .echo = echo.items };
}

/// The prefix's tokens and the suffix in the prefix-suffix-middle order, BOS first where the model wants it.
fn fimPrompt(server: *Server, arena: std.mem.Allocator, prefix: []const i32, suffix: []const u8) ![]i32 {
    if (std.mem.indexOfScalar(u8, suffix, 0) != null) return bad(.{ .message = "the suffix holds a NUL character", .param = "suffix" });
    const fim = server.fim.?;
    const after = try tokenize(server, arena, suffix, false, "suffix");
    var ids: std.ArrayList(i32) = .empty;
    if (server.info.add_bos and server.info.bos >= 0) try ids.append(arena, server.info.bos);
    try ids.append(arena, fim[0]);
    try ids.appendSlice(arena, prefix);
    try ids.append(arena, fim[1]);
    try ids.appendSlice(arena, after);
    try ids.append(arena, fim[2]);
    return ids.items;
}

/// One message of a chat, checked: an assistant's `tool_calls` and a tool message's `tool_call_id`
/// beside the role and the content (text parts joined; null for an assistant that only calls).
const Message = struct {
    role: []const u8,
    content: ?[]const u8,
    name: ?[]const u8 = null,
    tool_calls: []const ToolCall = &.{},
    tool_call_id: ?[]const u8 = null,
};

/// A call an assistant message made: its id, the tool's name, and its arguments (the JSON text the
/// client sent back; the template gets the object it parses to, as transformers' templates expect).
const ToolCall = struct { id: []const u8, name: []const u8, arguments: []const u8 };

fn parseMessage(arena: std.mem.Allocator, m: Value) !Message {
    if (m != .object) return bad(.{ .message = "each message must be an object", .param = "messages" });
    for (m.object.keys()) |key| {
        const allowed = [_][]const u8{ "role", "content", "name", "refusal", "tool_calls", "tool_call_id" };
        for (allowed) |k| {
            if (std.mem.eql(u8, k, key)) break;
        } else return badf(arena, "messages", "unsupported message field '{s}'", .{key});
    }
    var role = (try getString(arena, m.object, "role")) orelse return bad(.{ .message = "each message needs a 'role'", .param = "messages" });
    if (std.mem.eql(u8, role, "developer")) role = "system";
    const roles = [_][]const u8{ "system", "user", "assistant", "tool" };
    for (roles) |k| {
        if (std.mem.eql(u8, k, role)) break;
    } else return badf(arena, "messages", "unsupported role '{s}' (system, developer, user, assistant and tool are)", .{role});
    const assistant = std.mem.eql(u8, role, "assistant");
    const is_tool = std.mem.eql(u8, role, "tool");
    var content: std.ArrayList(u8) = .empty;
    var has_content = true;
    if (field(m.object, "content")) |cv| switch (cv) {
        .string => |s| try content.appendSlice(arena, s),
        .array => |parts| for (parts.items) |part| {
            if (part != .object) return bad(.{ .message = "a content part must be an object", .param = "messages" });
            const t = (try getString(arena, part.object, "type")) orelse "";
            if (!std.mem.eql(u8, t, "text")) return badf(arena, "messages", "content parts of type '{s}' are not supported (text is)", .{t});
            const s = (try getString(arena, part.object, "text")) orelse return bad(.{ .message = "a text part needs 'text'", .param = "messages" });
            try content.appendSlice(arena, s);
        },
        else => return bad(.{ .message = "'content' must be a string or an array of text parts", .param = "messages" }),
    } else if (!assistant) return bad(.{ .message = "a message needs 'content'", .param = "messages" }) else {
        has_content = false;
    }
    if (std.mem.indexOfScalar(u8, content.items, 0) != null) return bad(.{ .message = "a message holds a NUL character", .param = "messages" });
    var msg: Message = .{ .role = role, .content = if (has_content) content.items else null, .name = try getString(arena, m.object, "name") };
    if (field(m.object, "tool_calls")) |tc| {
        if (!assistant) return bad(.{ .message = "only an assistant message has 'tool_calls'", .param = "messages" });
        if (tc != .array) return bad(.{ .message = "'tool_calls' must be an array", .param = "messages" });
        const calls = try arena.alloc(ToolCall, tc.array.items.len);
        for (tc.array.items, calls) |call, *out| {
            if (call != .object) return bad(.{ .message = "each tool call must be an object", .param = "messages" });
            const func = field(call.object, "function") orelse return bad(.{ .message = "a tool call needs 'function'", .param = "messages" });
            if (func != .object) return bad(.{ .message = "a tool call's 'function' must be an object", .param = "messages" });
            out.* = .{
                .id = (try getString(arena, call.object, "id")) orelse "",
                .name = (try getString(arena, func.object, "name")) orelse return bad(.{ .message = "a tool call needs 'function.name'", .param = "messages" }),
                .arguments = (try getString(arena, func.object, "arguments")) orelse "{}",
            };
        }
        msg.tool_calls = calls;
    }
    if (field(m.object, "tool_call_id")) |id| {
        if (!is_tool) return bad(.{ .message = "only a tool message has 'tool_call_id'", .param = "messages" });
        if (id != .string) return bad(.{ .message = "'tool_call_id' must be a string", .param = "messages" });
        msg.tool_call_id = id.string;
    } else if (is_tool) return bad(.{ .message = "a tool message needs 'tool_call_id'", .param = "messages" });
    return msg;
}

/// The conversation as the JSON array transformers gives a template: each message's fields, an
/// assistant's calls as `{"id", "type": "function", "function": {"name", "arguments"}}` with the
/// arguments an object where their text parses to one.
fn messagesJson(arena: std.mem.Allocator, msgs: []const Message) ![]const u8 {
    var out: std.ArrayList(u8) = .empty;
    try out.append(arena, '[');
    for (msgs, 0..) |m, i| {
        if (i > 0) try out.append(arena, ',');
        try out.appendSlice(arena, "{\"role\":");
        try text.appendJsonString(arena, &out, m.role);
        try out.appendSlice(arena, ",\"content\":");
        // Null only beside calls, as OpenAI's clients send it; an assistant message without either is "".
        if (m.content) |s| try text.appendJsonString(arena, &out, s) else try out.appendSlice(arena, if (m.tool_calls.len > 0) "null" else "\"\"");
        if (m.name) |s| {
            try out.appendSlice(arena, ",\"name\":");
            try text.appendJsonString(arena, &out, s);
        }
        if (m.tool_calls.len > 0) {
            try out.appendSlice(arena, ",\"tool_calls\":[");
            for (m.tool_calls, 0..) |call, k| {
                if (k > 0) try out.append(arena, ',');
                try out.appendSlice(arena, "{\"id\":");
                try text.appendJsonString(arena, &out, call.id);
                try out.appendSlice(arena, ",\"type\":\"function\",\"function\":{\"name\":");
                try text.appendJsonString(arena, &out, call.name);
                try out.appendSlice(arena, ",\"arguments\":");
                const parsed = std.json.parseFromSliceLeaky(Value, arena, call.arguments, .{}) catch null;
                if (parsed != null and parsed.? == .object)
                    try out.appendSlice(arena, try std.json.Stringify.valueAlloc(arena, parsed.?, .{}))
                else
                    try text.appendJsonString(arena, &out, call.arguments);
                try out.appendSlice(arena, "}}");
            }
            try out.append(arena, ']');
        }
        if (m.tool_call_id) |s| {
            try out.appendSlice(arena, ",\"tool_call_id\":");
            try text.appendJsonString(arena, &out, s);
        }
        try out.append(arena, '}');
    }
    try out.append(arena, ']');
    return out.items;
}

/// For a template that does not print tools: the tools shown in the system message (the Hermes form),
/// an assistant's calls written into its text as `<tool_call>` blocks, and a tool's result given as
/// the user's `<tool_response>`, so that plain roles and text carry the conversation.
fn foldTools(arena: std.mem.Allocator, all: []const Message, t: ?*const tools.Tools) ![]Message {
    var out: std.ArrayList(Message) = .empty;
    var msgs = all;
    if (t) |shown| {
        const about = try tools.systemText(arena, shown);
        if (msgs.len > 0 and std.mem.eql(u8, msgs[0].role, "system")) {
            try out.append(arena, .{ .role = "system", .content = try std.mem.concat(arena, u8, &.{ msgs[0].content orelse "", "\n\n", about }) });
            msgs = msgs[1..];
        } else try out.append(arena, .{ .role = "system", .content = about });
    }
    for (msgs) |m| {
        if (std.mem.eql(u8, m.role, "tool")) {
            try out.append(arena, .{ .role = "user", .content = try std.mem.concat(arena, u8, &.{ "<tool_response>\n", m.content orelse "", "\n</tool_response>" }) });
            continue;
        }
        if (m.tool_calls.len == 0) {
            try out.append(arena, m);
            continue;
        }
        var body: std.ArrayList(u8) = .empty;
        try body.appendSlice(arena, m.content orelse "");
        for (m.tool_calls) |call| {
            if (body.items.len > 0) try body.append(arena, '\n');
            try body.appendSlice(arena, "<tool_call>\n{\"name\": ");
            try text.appendJsonString(arena, &body, call.name);
            try body.appendSlice(arena, ", \"arguments\": ");
            try body.appendSlice(arena, call.arguments);
            try body.appendSlice(arena, "}\n</tool_call>");
        }
        try out.append(arena, .{ .role = m.role, .content = body.items });
    }
    return out.items;
}

fn chatPrompt(server: *Server, arena: std.mem.Allocator, obj: ObjectMap, t: ?*const tools.Tools) ![]i32 {
    const messages = field(obj, "messages") orelse return bad(.{ .message = "'messages' is required", .param = "messages" });
    if (messages != .array or messages.array.items.len == 0) return bad(.{ .message = "'messages' must be a non-empty array", .param = "messages" });
    if (messages.array.items.len > 4096) return bad(.{ .message = "too many messages", .param = "messages" });
    var msgs = try arena.alloc(Message, messages.array.items.len);
    var tool_messages = false;
    for (messages.array.items, msgs) |m, *out| {
        out.* = try parseMessage(arena, m);
        tool_messages = tool_messages or out.tool_calls.len > 0 or out.tool_call_id != null or std.mem.eql(u8, out.role, "tool");
    }
    // "none" keeps the tools out of the prompt: the model answers in text, and its text is not read for calls.
    const shown: ?*const tools.Tools = if (t) |x| (if (x.choice == .none) null else x) else null;
    if (server.template_tools and (shown != null or tool_messages)) {
        const mj = try arena.dupeZ(u8, try messagesJson(arena, msgs));
        const tj: ?[:0]const u8 = if (shown) |x| try arena.dupeZ(u8, try x.json(arena)) else null;
        const tp: [*c]const u8 = if (tj) |z| z.ptr else null;
        var buf = try arena.alloc(u8, 16 * 1024);
        var n = c.engine_chat_template_json(server.engine.?, mj.ptr, tp, true, buf.ptr, buf.len);
        if (n >= 0 and @as(usize, @intCast(n)) >= buf.len) {
            buf = try arena.alloc(u8, @as(usize, @intCast(n)) + 1);
            n = c.engine_chat_template_json(server.engine.?, mj.ptr, tp, true, buf.ptr, buf.len);
        }
        return renderedPrompt(server, arena, buf, n);
    }
    if (shown != null or tool_messages) msgs = try foldTools(arena, msgs, shown);
    const list = try arena.alloc(c.engine_chat_message, msgs.len);
    for (msgs, list) |m, *out| out.* = .{ .role = (try arena.dupeZ(u8, m.role)).ptr, .content = (try arena.dupeZ(u8, m.content orelse "")).ptr };
    var buf = try arena.alloc(u8, 16 * 1024);
    var n = c.engine_chat_template(server.engine.?, list.ptr, list.len, true, buf.ptr, buf.len);
    if (n >= 0 and @as(usize, @intCast(n)) >= buf.len) {
        buf = try arena.alloc(u8, @as(usize, @intCast(n)) + 1);
        n = c.engine_chat_template(server.engine.?, list.ptr, list.len, true, buf.ptr, buf.len);
    }
    return renderedPrompt(server, arena, buf, n);
}

fn renderedPrompt(server: *Server, arena: std.mem.Allocator, buf: []u8, n: i32) ![]i32 {
    if (n < 0) return badf(arena, "messages", "the chat template refused the messages: {s}", .{c.engine_last_error()});
    if (@as(usize, @intCast(n)) >= buf.len) return bad(.{ .status = 500, .message = "the chat template's text changed length between two renderings" });
    return tokenize(server, arena, buf[0..@intCast(n)], false, "messages");
}

/// Whether the model's chat template prints the tools it is given (Qwen2.5's, Llama 3.1's, Hermes'):
/// a probe tool's name appears in what it renders.
pub fn templateShowsTools(engine: *c.engine) bool {
    const probe = "hostembed_probe_tool";
    const messages = "[{\"role\":\"user\",\"content\":\"hi\"}]";
    const tool_list = "[{\"type\":\"function\",\"function\":{\"name\":\"" ++ probe ++ "\",\"description\":\"\",\"parameters\":{\"type\":\"object\",\"properties\":{}}}}]";
    var buf: [64 * 1024]u8 = undefined;
    const n = c.engine_chat_template_json(engine, messages, tool_list, true, &buf, buf.len);
    if (n < 0 or @as(usize, @intCast(n)) >= buf.len) return false;
    return std.mem.indexOf(u8, buf[0..@intCast(n)], probe) != null;
}

/// Writes what the choices produce: a whole response, or server-sent events as they come. The choices
/// of several prompts are numbered in order, `n` a prompt: prompt i's choice k is index i * n + k.
const Writer = struct {
    server: *Server,
    conn: *http.Conn,
    rs: []const *sched.Request,
    sync: *sched.Sync,
    kind: Kind,
    params: *Params,
    arena: std.mem.Allocator,
    id: []const u8 = "",
    created: i64 = 0,
    streamed: bool = false,
    headers_sent: bool = false,
    /// With tools to read calls for: each choice's reader of its output (streamed requests).
    readers: []tools.Reader = &.{},

    fn makeId(w: *Writer) []const u8 {
        var raw: [12]u8 = undefined;
        std.crypto.random.bytes(&raw);
        w.created = std.time.timestamp();
        const hex = std.fmt.bytesToHex(raw, .lower);
        return std.fmt.allocPrint(w.arena, "{s}-{s}", .{ if (w.kind == .chat) "chatcmpl" else "cmpl", hex }) catch "cmpl";
    }

    /// The first of the requests that failed (under the lock).
    fn failed(w: *const Writer) ?*sched.Request {
        for (w.rs) |r| if (r.failure != null) return r;
        return null;
    }

    fn released(w: *const Writer) bool {
        for (w.rs) |r| if (!r.released) return false;
        return true;
    }

    /// Returns false when the connection must close.
    fn run(w: *Writer) bool {
        const n = w.params.n;
        const total = w.rs.len * n;
        const sent = w.arena.alloc(usize, total) catch return false;
        const sent_lp = w.arena.alloc(usize, total) catch return false;
        const opened = w.arena.alloc(bool, total) catch return false;
        const closed = w.arena.alloc(bool, total) catch return false;
        @memset(sent, 0);
        @memset(sent_lp, 0);
        @memset(opened, false);
        @memset(closed, false);
        if (w.params.stream and w.toolsRead() != null) {
            w.readers = w.arena.alloc(tools.Reader, total) catch return false;
            @memset(w.readers, .{});
        }
        var chunk: std.ArrayList(u8) = .empty;
        defer chunk.deinit(gpa);
        var last_check = std.time.milliTimestamp();

        const sync = w.sync;
        sync.mutex.lock();
        while (true) {
            if (w.failed()) |r| {
                // The others stop too: the request is answered with this one's error.
                for (w.rs) |other| other.cancelled.store(true, .release);
                const why = r.failure.?;
                sync.mutex.unlock();
                metrics.countFailure();
                if (!w.headers_sent) {
                    http.respondError(w.conn, r.failure_status, why, null, null, w.params.stream == false);
                    return !w.params.stream;
                }
                chunk.clearRetainingCapacity();
                chunk.appendSlice(gpa, "data: ") catch return false;
                http.errorBody(&chunk, r.failure_status, why, null, null) catch return false;
                chunk.appendSlice(gpa, "\n\n") catch return false;
                w.conn.writeAll(chunk.items);
                return false;
            }
            if (w.params.stream) {
                chunk.clearRetainingCapacity();
                for (w.rs, 0..) |r, pi| for (r.choices, 0..) |*ch, k| {
                    const idx = pi * n + k;
                    if (closed[idx]) continue;
                    if (w.readers.len > 0) {
                        w.toolDeltas(&chunk, idx, ch, &sent_lp[idx]) catch return false;
                        closed[idx] = ch.finish != .none;
                        continue;
                    }
                    const new_text = ch.out.items[sent[idx]..];
                    const new_lp = ch.logprobs.items[sent_lp[idx]..];
                    // The echoed prompt comes with a choice's first event.
                    const echo = w.params.echo and !opened[idx];
                    if (new_text.len > 0 or new_lp.len > 0 or (echo and ch.finish != .none)) {
                        w.deltaEvent(&chunk, idx, if (echo) r else null, new_text, new_lp, null) catch return false;
                        sent[idx] = ch.out.items.len;
                        sent_lp[idx] = ch.logprobs.items.len;
                        opened[idx] = true;
                    }
                    if (ch.finish != .none) {
                        w.deltaEvent(&chunk, idx, null, "", &.{}, ch.finish) catch return false;
                        closed[idx] = true;
                    }
                };
                if (chunk.items.len > 0) {
                    sync.mutex.unlock();
                    w.startStream();
                    w.conn.writeAll(chunk.items);
                    sync.mutex.lock();
                }
            }
            if (w.released()) break;
            sync.cond.timedWait(&sync.mutex, 50 * std.time.ns_per_ms) catch {};
            const now = std.time.milliTimestamp();
            if (now - last_check >= 50) {
                last_check = now;
                sync.mutex.unlock();
                const gone = w.conn.peerGone();
                sync.mutex.lock();
                if (gone) {
                    // The client left: the streams go back at the scheduler's next step.
                    for (w.rs) |r| r.cancelled.store(true, .release);
                    sync.mutex.unlock();
                    return false;
                }
            }
        }
        sync.mutex.unlock();
        if (w.params.stream) {
            w.startStream();
            chunk.clearRetainingCapacity();
            if (w.params.include_usage) {
                w.eventHead(&chunk) catch return false;
                chunk.appendSlice(gpa, "[],\"usage\":") catch return false;
                w.usageJson(&chunk) catch return false;
                chunk.appendSlice(gpa, "}\n\n") catch return false;
            }
            chunk.appendSlice(gpa, "data: [DONE]\n\n") catch return false;
            w.conn.writeAll(chunk.items);
            return false;
        }
        chunk.clearRetainingCapacity();
        w.wholeResponse(&chunk) catch return false;
        http.respond(w.conn, 200, "application/json", chunk.items, true, "");
        return !w.conn.broken;
    }

    fn startStream(w: *Writer) void {
        if (w.headers_sent) return;
        w.headers_sent = true;
        w.streamed = true;
        w.conn.writeAll("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n");
        if (w.kind == .chat) {
            // The assistant's role comes first, as OpenAI sends it.
            var first: std.ArrayList(u8) = .empty;
            defer first.deinit(gpa);
            for (0..w.rs.len * w.params.n) |k| {
                w.eventHead(&first) catch return;
                first.print(gpa, "[{{\"index\":{d},\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n", .{k}) catch return;
            }
            w.conn.writeAll(first.items);
        }
    }

    /// The tools whose calls the output is read for: none without tools or with "none".
    fn toolsRead(w: *const Writer) ?*const tools.Tools {
        if (w.params.tools) |*t| return if (t.parsed()) t else null;
        return null;
    }

    /// A streamed choice's events when its output is read for calls: the text before any call as
    /// content as it comes, then each call as OpenAI streams one (its index, id and name with empty
    /// arguments first, then its arguments' text in pieces as they come) and `finish_reason`
    /// "tool_calls"; an output that holds no call goes out as content once it ends.
    fn toolDeltas(w: *Writer, out: *std.ArrayList(u8), idx: usize, ch: *const sched.Choice, sent_lp: *usize) !void {
        const t = w.toolsRead().?;
        const rd = &w.readers[idx];
        const finished = ch.finish != .none;
        const content = rd.advance(ch.out.items, finished, t.constrained());
        if (content.len > 0) {
            try w.deltaEvent(out, idx, null, content, ch.logprobs.items[sent_lp.*..], null);
            sent_lp.* = ch.logprobs.items.len;
        }
        var pieces: std.ArrayList(tools.Reader.Piece) = .empty;
        const is_calls = if (finished) try rd.finish(w.arena, ch.out.items, t, &pieces) else blk: {
            try rd.pieces(w.arena, ch.out.items, t, &pieces);
            break :blk true;
        };
        for (pieces.items) |p| {
            try w.eventHead(out);
            try out.print(gpa, "[{{\"index\":{d},\"delta\":{{\"tool_calls\":[{{\"index\":{d},", .{ idx, p.index });
            if (p.name) |name| {
                try out.print(gpa, "\"id\":\"{s}\",\"type\":\"function\",\"function\":{{\"name\":", .{tools.callId(w.arena)});
                try text.appendJsonString(gpa, out, name);
                try out.appendSlice(gpa, ",\"arguments\":");
            } else try out.appendSlice(gpa, "\"function\":{\"arguments\":");
            try text.appendJsonString(gpa, out, p.arguments);
            try out.appendSlice(gpa, "}}]},\"logprobs\":");
            // The calls' tokens' logprobs come with their pieces.
            try w.logprobsJson(out, null, ch.logprobs.items[sent_lp.*..], 0);
            sent_lp.* = ch.logprobs.items.len;
            try out.appendSlice(gpa, ",\"finish_reason\":null}]}\n\n");
        }
        if (!finished) return;
        if (!is_calls and !rd.began()) {
            // No call after all: what was held back is content.
            const rest = ch.out.items[rd.sent..];
            const lps = ch.logprobs.items[sent_lp.*..];
            if (rest.len > 0 or lps.len > 0) try w.deltaEvent(out, idx, null, rest, lps, null);
            sent_lp.* = ch.logprobs.items.len;
            return w.deltaEvent(out, idx, null, "", &.{}, ch.finish);
        }
        // A call cut short (by `max_tokens`) ends as the choice ended; whole calls end with "tool_calls".
        if (!is_calls) return w.deltaEvent(out, idx, null, "", &.{}, ch.finish);
        try w.eventHead(out);
        try out.print(gpa, "[{{\"index\":{d},\"delta\":{{}},\"logprobs\":null,\"finish_reason\":\"tool_calls\"}}]}}\n\n", .{idx});
    }

    fn eventHead(w: *Writer, out: *std.ArrayList(u8)) !void {
        try out.print(gpa, "data: {{\"id\":\"{s}\",\"object\":\"{s}\",\"created\":{d},\"model\":", .{ w.id, if (w.kind == .chat) "chat.completion.chunk" else "text_completion", w.created });
        try text.appendValidJsonString(gpa, out, w.server.name);
        try out.appendSlice(gpa, ",\"choices\":");
    }

    /// One choice's event; `echo` (a completion's first event with `echo`) puts its prompt first.
    fn deltaEvent(w: *Writer, out: *std.ArrayList(u8), k: usize, echo: ?*const sched.Request, new_text: []const u8, lps: []const sched.TokenLogprob, finish: ?sched.Finish) !void {
        try w.eventHead(out);
        try out.print(gpa, "[{{\"index\":{d},", .{k});
        if (w.kind == .chat) {
            try out.appendSlice(gpa, "\"delta\":");
            if (finish != null) try out.appendSlice(gpa, "{}") else {
                try out.appendSlice(gpa, "{\"content\":");
                try text.appendJsonString(gpa, out, new_text);
                try out.appendSlice(gpa, "}");
            }
        } else {
            try out.appendSlice(gpa, "\"text\":");
            try w.completionText(out, if (echo) |r| w.echoOf(r) else "", new_text);
        }
        try out.appendSlice(gpa, ",\"logprobs\":");
        try w.logprobsJson(out, echo, lps, 0);
        try out.appendSlice(gpa, ",\"finish_reason\":");
        try finishJson(out, finish orelse .none);
        try out.appendSlice(gpa, "}]}\n\n");
    }

    /// The prompt text `echo` puts before request `r`'s choices.
    fn echoOf(w: *const Writer, r: *const sched.Request) []const u8 {
        for (w.rs, w.params.prompts.items) |one, prompt| if (one == r) return prompt.echo;
        return "";
    }

    /// A completion's text: the echoed prompt (whole UTF-8) and then the choice's own.
    fn completionText(w: *const Writer, out: *std.ArrayList(u8), echo: []const u8, own: []const u8) !void {
        _ = w;
        if (echo.len == 0) return text.appendJsonString(gpa, out, own);
        var both: std.ArrayList(u8) = .empty;
        defer both.deinit(gpa);
        try text.appendValidUtf8(gpa, &both, echo);
        try both.appendSlice(gpa, own);
        try text.appendJsonString(gpa, out, both.items);
    }

    fn wholeResponse(w: *Writer, out: *std.ArrayList(u8)) !void {
        try out.print(gpa, "{{\"id\":\"{s}\",\"object\":\"{s}\",\"created\":{d},\"model\":", .{ w.id, if (w.kind == .chat) "chat.completion" else "text_completion", w.created });
        try text.appendValidJsonString(gpa, out, w.server.name);
        try out.appendSlice(gpa, ",\"choices\":[");
        for (w.rs, 0..) |r, pi| for (r.choices, 0..) |*ch, k| {
            const idx = pi * w.params.n + k;
            if (idx > 0) try out.append(gpa, ',');
            try out.print(gpa, "{{\"index\":{d},", .{idx});
            var calls: ?[]tools.Call = null;
            if (w.kind == .chat) {
                var content: ?[]const u8 = ch.out.items;
                if (w.toolsRead()) |t| {
                    var rd: tools.Reader = .{};
                    _ = rd.advance(ch.out.items, true, t.constrained());
                    calls = rd.calls(w.arena, ch.out.items, t);
                    if (calls != null) {
                        // The text before the calls, when there is any.
                        const before = ch.out.items[0..rd.start.?];
                        content = if (std.mem.trim(u8, before, " \t\r\n").len > 0) before else null;
                    }
                }
                try out.appendSlice(gpa, "\"message\":{\"role\":\"assistant\",\"content\":");
                if (content) |s| try text.appendJsonString(gpa, out, s) else try out.appendSlice(gpa, "null");
                try out.appendSlice(gpa, ",\"refusal\":null");
                if (calls) |list| {
                    try out.appendSlice(gpa, ",\"tool_calls\":[");
                    for (list, 0..) |call, i| {
                        if (i > 0) try out.append(gpa, ',');
                        try out.print(gpa, "{{\"id\":\"{s}\",\"type\":\"function\",\"function\":{{\"name\":", .{tools.callId(w.arena)});
                        try text.appendJsonString(gpa, out, call.name);
                        try out.appendSlice(gpa, ",\"arguments\":");
                        try text.appendJsonString(gpa, out, call.arguments);
                        try out.appendSlice(gpa, "}}");
                    }
                    try out.append(gpa, ']');
                }
                try out.append(gpa, '}');
            } else {
                try out.appendSlice(gpa, "\"text\":");
                try w.completionText(out, if (w.params.echo) w.echoOf(r) else "", ch.out.items);
            }
            try out.appendSlice(gpa, ",\"logprobs\":");
            try w.logprobsJson(out, if (w.params.echo) r else null, ch.logprobs.items, 0);
            try out.appendSlice(gpa, ",\"finish_reason\":");
            if (calls != null) try out.appendSlice(gpa, "\"tool_calls\"") else try finishJson(out, ch.finish);
            try out.append(gpa, '}');
        };
        try out.appendSlice(gpa, "],\"usage\":");
        try w.usageJson(out);
        try out.append(gpa, '}');
    }

    fn usageJson(w: *Writer, out: *std.ArrayList(u8)) !void {
        var prompt: u64 = 0;
        var completion: u64 = 0;
        var cached: u64 = 0;
        for (w.rs) |r| {
            prompt += r.prompt.len;
            completion += r.completionTokens();
            cached += r.cached_tokens;
        }
        try out.print(gpa, "{{\"prompt_tokens\":{d},\"completion_tokens\":{d},\"total_tokens\":{d},\"prompt_tokens_details\":{{\"cached_tokens\":{d}}}}}", .{ prompt, completion, prompt + completion, cached });
    }

    fn piece(w: *Writer, id: i32, buf: []u8) []const u8 {
        const n = c.engine_token_piece(w.server.engine.?, id, buf.ptr, buf.len);
        return if (n > 0) buf[0..@min(@as(usize, @intCast(n)), buf.len - 1)] else "";
    }

    /// A choice's logprobs; `echo` (a completion with `echo` and its prompt scored) puts its prompt's
    /// tokens first, the first with no log-probability.
    fn logprobsJson(w: *Writer, out: *std.ArrayList(u8), echo: ?*const sched.Request, lps: []const sched.TokenLogprob, offset: usize) !void {
        const prompt_ids: []const i32 = if (echo) |r| (if (r.score_prompt) r.prompt else &.{}) else &.{};
        const prompt_lps: []const f32 = if (echo) |r| r.prompt_logprobs.items else &.{};
        if (w.params.top_logprobs == null or (lps.len == 0 and prompt_ids.len == 0)) return out.appendSlice(gpa, "null");
        var buf: [256]u8 = undefined;
        if (w.kind == .chat) {
            try out.appendSlice(gpa, "{\"content\":[");
            for (lps, 0..) |lp, i| {
                if (i > 0) try out.append(gpa, ',');
                try w.tokenEntry(out, lp.id, lp.logprob, &buf);
                out.items.len -= 1; // reopen the entry for its alternatives
                try out.appendSlice(gpa, ",\"top_logprobs\":[");
                for (lp.top_ids, lp.top_logprobs, 0..) |id, x, j| {
                    if (j > 0) try out.append(gpa, ',');
                    try w.tokenEntry(out, id, x, &buf);
                }
                try out.appendSlice(gpa, "]}");
            }
            return out.appendSlice(gpa, "],\"refusal\":null}");
        }
        // The legacy completions shape: parallel arrays, and each position's alternatives as a map; an
        // echoed prompt's tokens first (the first has no log-probability: null).
        try out.appendSlice(gpa, "{\"tokens\":[");
        var i: usize = 0;
        for (prompt_ids) |id| {
            if (i > 0) try out.append(gpa, ',');
            try text.appendValidJsonString(gpa, out, w.piece(id, &buf));
            i += 1;
        }
        for (lps) |lp| {
            if (i > 0) try out.append(gpa, ',');
            try text.appendValidJsonString(gpa, out, w.piece(lp.id, &buf));
            i += 1;
        }
        try out.appendSlice(gpa, "],\"token_logprobs\":[");
        i = 0;
        for (prompt_ids, 0..) |_, j| {
            if (i > 0) try out.append(gpa, ',');
            const x = if (j < prompt_lps.len) prompt_lps[j] else std.math.nan(f32);
            if (std.math.isNan(x)) try out.appendSlice(gpa, "null") else try text.appendJsonFloat(gpa, out, x);
            i += 1;
        }
        for (lps) |lp| {
            if (i > 0) try out.append(gpa, ',');
            try text.appendJsonFloat(gpa, out, lp.logprob);
            i += 1;
        }
        try out.appendSlice(gpa, "],\"top_logprobs\":[");
        i = 0;
        for (prompt_ids, 0..) |_, j| {
            if (i > 0) try out.append(gpa, ',');
            // Echo takes logprobs 0 only: no alternatives.
            try out.appendSlice(gpa, if (j == 0) "null" else "{}");
            i += 1;
        }
        for (lps) |lp| {
            if (i > 0) try out.append(gpa, ',');
            try out.append(gpa, '{');
            for (lp.top_ids, lp.top_logprobs, 0..) |id, x, j| {
                if (j > 0) try out.append(gpa, ',');
                try text.appendValidJsonString(gpa, out, w.piece(id, &buf));
                try out.append(gpa, ':');
                try text.appendJsonFloat(gpa, out, x);
            }
            try out.append(gpa, '}');
            i += 1;
        }
        try out.appendSlice(gpa, "],\"text_offset\":[");
        var at = offset;
        i = 0;
        for (prompt_ids) |id| {
            if (i > 0) try out.append(gpa, ',');
            try out.print(gpa, "{d}", .{at});
            at += w.piece(id, &buf).len;
            i += 1;
        }
        for (lps) |lp| {
            if (i > 0) try out.append(gpa, ',');
            try out.print(gpa, "{d}", .{at});
            at += w.piece(lp.id, &buf).len;
            i += 1;
        }
        try out.appendSlice(gpa, "]}");
    }

    fn tokenEntry(w: *Writer, out: *std.ArrayList(u8), id: i32, logprob: f32, buf: []u8) !void {
        const p = w.piece(id, buf);
        try out.appendSlice(gpa, "{\"token\":");
        try text.appendValidJsonString(gpa, out, p);
        try out.appendSlice(gpa, ",\"logprob\":");
        try text.appendJsonFloat(gpa, out, logprob);
        try out.appendSlice(gpa, ",\"bytes\":[");
        for (p, 0..) |b, i| {
            if (i > 0) try out.append(gpa, ',');
            try out.print(gpa, "{d}", .{b});
        }
        try out.appendSlice(gpa, "]}");
    }
};

fn finishJson(out: *std.ArrayList(u8), f: sched.Finish) !void {
    try out.appendSlice(gpa, switch (f) {
        .none => "null",
        .stop => "\"stop\"",
        .length => "\"length\"",
    });
}
