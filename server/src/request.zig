//! A generation request's body, checked: OpenAI's chat and completions fields into `Params` (the
//! prompts tokenized; a chat's messages through chat.zig), or the `Bad` that says what the client got wrong.
const std = @import("std");
const c = @import("hostembed");
const sched = @import("sched.zig");
const text = @import("text.zig");
const tools = @import("tools.zig");
const Server = @import("main.zig").Server;
const chat = @import("chat.zig");

const Value = std.json.Value;
const ObjectMap = std.json.ObjectMap;

/// A request the client got wrong: answered with a 4xx in OpenAI's error shape.
pub const Bad = struct {
    status: u16 = 400,
    message: []const u8,
    param: ?[]const u8 = null,
    code: ?[]const u8 = null,
};

pub const Kind = enum { chat, completion };

/// One prompt of a request: its tokens, the text `echo` puts before its choices' text, and its
/// `max_tokens` (default: the rest of the window).
pub const Prompt = struct {
    ids: []i32,
    echo: []const u8 = "",
    max_tokens: u32 = 0,
};

/// Most prompts one completions request may hold (each is a scheduler request of `n` choices).
const max_prompts = 64;

/// Everything a generation request asked for, checked.
pub const Params = struct {
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

    pub fn promptTokens(p: *const Params) usize {
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

pub threadlocal var last_bad: Bad = .{ .message = "" };

pub fn bad(b: Bad) error{Bad} {
    last_bad = b;
    return error.Bad;
}

pub fn badf(arena: std.mem.Allocator, param: ?[]const u8, comptime fmt: []const u8, args: anytype) error{Bad} {
    return bad(.{ .message = std.fmt.allocPrint(arena, fmt, args) catch "invalid request", .param = param });
}

pub fn field(obj: ObjectMap, name: []const u8) ?Value {
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

pub fn getString(arena: std.mem.Allocator, obj: ObjectMap, name: []const u8) error{Bad}!?[]const u8 {
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

pub fn parse(server: *Server, arena: std.mem.Allocator, body: []const u8, kind: Kind, p: *Params) !void {
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
        .chat => try p.prompts.append(arena, .{ .ids = try chat.chatPrompt(server, arena, obj, if (p.tools) |*t| t else null) }),
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

pub fn tokenize(server: *Server, arena: std.mem.Allocator, s: []const u8, add_bos: bool, param: []const u8) ![]i32 {
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
