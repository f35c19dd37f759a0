//! OpenAI's tool calling, the request's side: its `tools`, `tool_choice` and `parallel_tool_calls`
//! checked; the JSON schema that holds a required or named call to the tools' shapes (for the engine's
//! constraint); and the system text that shows the tools to a model whose template does not print them.
//! tool_calls.zig reads the model's output back as calls.
const std = @import("std");
const tool_calls = @import("tool_calls.zig");
const Value = std.json.Value;
const Allocator = std.mem.Allocator;

pub const Choice = union(enum) { none, auto, required, named: []const u8 };

pub const Tool = struct {
    name: []const u8,
    /// The tool's whole `{"type": "function", "function": {...}}` object as the request gave it.
    value: Value,
    /// Its `parameters` schema, null when it has none (any object of arguments).
    parameters: ?Value,
};

pub const Tools = struct {
    list: []const Tool,
    choice: Choice,
    parallel: bool = true,

    /// A required or named call: the output is held to `schema`'s shape and read as a call from its
    /// first byte.
    pub fn constrained(t: *const Tools) bool {
        return t.choice == .required or t.choice == .named;
    }

    /// Whether the output is read for calls at all (`tool_choice` "none": never).
    pub fn parsed(t: *const Tools) bool {
        return t.choice != .none;
    }

    pub fn find(t: *const Tools, name: []const u8) ?*const Tool {
        for (t.list) |*tool| if (std.mem.eql(u8, tool.name, name)) return tool;
        return null;
    }

    /// The tools as the chat template receives them: the request's array, keys in its order.
    pub fn json(t: *const Tools, arena: Allocator) ![]const u8 {
        var out: std.ArrayList(u8) = .empty;
        try out.append(arena, '[');
        for (t.list, 0..) |tool, i| {
            if (i > 0) try out.append(arena, ',');
            try out.appendSlice(arena, try std.json.Stringify.valueAlloc(arena, tool.value, .{}));
        }
        try out.append(arena, ']');
        return out.items;
    }
};

/// Why a request's tools were refused: OpenAI's 400 with this message and parameter.
pub const Failure = struct { message: []const u8 = "", param: []const u8 = "tools" };

pub const Error = error{ Bad, OutOfMemory };

fn fail(f: *Failure, param: []const u8, arena: Allocator, comptime fmt: []const u8, args: anytype) Error {
    f.* = .{ .message = std.fmt.allocPrint(arena, fmt, args) catch "invalid tools", .param = param };
    return error.Bad;
}

fn present(v: ?Value) ?Value {
    const x = v orelse return null;
    return if (x == .null) null else x;
}

/// Most tools one request may offer.
pub const max_tools = 128;

/// The request's tool fields checked; null when it offers no tools (the request is served as one
/// without them: `tool_choice` "none" or "auto" alone is accepted, "required" or a name refused).
pub fn parse(arena: Allocator, tools_v: ?Value, choice_v: ?Value, parallel_v: ?Value, f: *Failure) Error!?Tools {
    const parallel = if (present(parallel_v)) |p| switch (p) {
        .bool => |b| b,
        else => return fail(f, "parallel_tool_calls", arena, "'parallel_tool_calls' must be a boolean", .{}),
    } else true;
    var list: std.ArrayList(Tool) = .empty;
    if (present(tools_v)) |tv| {
        if (tv != .array) return fail(f, "tools", arena, "'tools' must be an array of tools", .{});
        if (tv.array.items.len > max_tools) return fail(f, "tools", arena, "at most {d} tools in one request", .{max_tools});
        for (tv.array.items, 0..) |item, i| try list.append(arena, try parseTool(arena, item, i, list.items, f));
    }
    const choice: Choice = if (present(choice_v)) |cv| switch (cv) {
        .string => |s| if (std.mem.eql(u8, s, "none"))
            .none
        else if (std.mem.eql(u8, s, "auto"))
            .auto
        else if (std.mem.eql(u8, s, "required"))
            .required
        else
            return fail(f, "tool_choice", arena, "'tool_choice' must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, not \"{s}\"", .{s}),
        .object => |o| blk: {
            const kind = present(o.get("type"));
            if (kind == null or kind.? != .string or !std.mem.eql(u8, kind.?.string, "function"))
                return fail(f, "tool_choice", arena, "'tool_choice.type' must be \"function\"", .{});
            const func = present(o.get("function")) orelse return fail(f, "tool_choice", arena, "'tool_choice.function' is required", .{});
            if (func != .object) return fail(f, "tool_choice", arena, "'tool_choice.function' must be an object", .{});
            const name = present(func.object.get("name")) orelse return fail(f, "tool_choice", arena, "'tool_choice.function.name' is required", .{});
            if (name != .string) return fail(f, "tool_choice", arena, "'tool_choice.function.name' must be a string", .{});
            for (o.keys()) |key| if (!std.mem.eql(u8, key, "type") and !std.mem.eql(u8, key, "function"))
                return fail(f, "tool_choice", arena, "unrecognized field in 'tool_choice': {s}", .{key});
            break :blk .{ .named = name.string };
        },
        else => return fail(f, "tool_choice", arena, "'tool_choice' must be a string or an object", .{}),
    } else .auto;
    if (list.items.len == 0) {
        if (choice == .required or choice == .named)
            return fail(f, "tool_choice", arena, "'tool_choice' is only allowed when 'tools' are specified", .{});
        return null;
    }
    const t: Tools = .{ .list = list.items, .choice = choice, .parallel = parallel };
    if (choice == .named and t.find(choice.named) == null)
        return fail(f, "tool_choice", arena, "'tool_choice' names the function '{s}', which is not among the tools", .{choice.named});
    return t;
}

fn validName(name: []const u8) bool {
    if (name.len == 0 or name.len > 64) return false;
    for (name) |ch| if (!std.ascii.isAlphanumeric(ch) and ch != '_' and ch != '-') return false;
    return true;
}

fn parseTool(arena: Allocator, item: Value, i: usize, before: []const Tool, f: *Failure) Error!Tool {
    if (item != .object) return fail(f, "tools", arena, "tools[{d}] must be an object", .{i});
    for (item.object.keys()) |key| if (!std.mem.eql(u8, key, "type") and !std.mem.eql(u8, key, "function"))
        return fail(f, "tools", arena, "unrecognized field in tools[{d}]: {s}", .{ i, key });
    const kind = present(item.object.get("type"));
    if (kind == null or kind.? != .string or !std.mem.eql(u8, kind.?.string, "function"))
        return fail(f, "tools", arena, "tools[{d}].type must be \"function\"", .{i});
    const func = present(item.object.get("function")) orelse return fail(f, "tools", arena, "tools[{d}].function is required", .{i});
    if (func != .object) return fail(f, "tools", arena, "tools[{d}].function must be an object", .{i});
    for (func.object.keys()) |key| {
        const known = [_][]const u8{ "name", "description", "parameters", "strict" };
        for (known) |k| {
            if (std.mem.eql(u8, k, key)) break;
        } else return fail(f, "tools", arena, "unrecognized field in tools[{d}].function: {s}", .{ i, key });
    }
    const name = present(func.object.get("name")) orelse return fail(f, "tools", arena, "tools[{d}].function.name is required", .{i});
    if (name != .string or !validName(name.string))
        return fail(f, "tools", arena, "tools[{d}].function.name must be 1 to 64 letters, digits, underscores or dashes", .{i});
    for (before) |other| if (std.mem.eql(u8, other.name, name.string))
        return fail(f, "tools", arena, "two tools are named '{s}'", .{name.string});
    if (present(func.object.get("description"))) |d| if (d != .string)
        return fail(f, "tools", arena, "tools[{d}].function.description must be a string", .{i});
    if (present(func.object.get("strict"))) |s| if (s != .bool)
        return fail(f, "tools", arena, "tools[{d}].function.strict must be a boolean", .{i});
    const parameters = present(func.object.get("parameters"));
    if (parameters) |p| if (p != .object)
        return fail(f, "tools", arena, "tools[{d}].function.parameters must be a JSON schema object", .{i});
    return .{ .name = name.string, .value = item, .parameters = parameters };
}

/// The JSON schema a required or named call is held to: `{"name": the tool's name, "arguments": its
/// parameters}` for the named tool, or any of the tools for "required". One call, written compact
/// (llguidance's `x-guidance` option: no white space between tokens), as OpenAI's arguments are.
pub fn schema(arena: Allocator, t: *const Tools) ![]const u8 {
    var out: std.ArrayList(u8) = .empty;
    try out.appendSlice(arena, "{\"x-guidance\":{\"whitespace_flexible\":false},\"anyOf\":[");
    switch (t.choice) {
        .named => |name| try callSchema(arena, &out, t.find(name).?),
        .required => for (t.list, 0..) |*tool, i| {
            if (i > 0) try out.append(arena, ',');
            try callSchema(arena, &out, tool);
        },
        .none, .auto => unreachable,
    }
    try out.appendSlice(arena, "]}");
    return out.items;
}

fn callSchema(arena: Allocator, out: *std.ArrayList(u8), tool: *const Tool) !void {
    try out.appendSlice(arena, "{\"type\":\"object\",\"properties\":{\"name\":{\"const\":");
    try out.appendSlice(arena, try std.json.Stringify.valueAlloc(arena, tool.name, .{}));
    try out.appendSlice(arena, "},\"arguments\":");
    if (tool.parameters) |p|
        try out.appendSlice(arena, try std.json.Stringify.valueAlloc(arena, p, .{}))
    else
        try out.appendSlice(arena, "{\"type\":\"object\"}");
    try out.appendSlice(arena, "},\"required\":[\"name\",\"arguments\"],\"additionalProperties\":false}");
}

/// The system text that shows the tools to a model whose chat template does not print them: the
/// Hermes form that Qwen2.5's template writes, whose `<tool_call>` blocks `Reader` reads back.
pub fn systemText(arena: Allocator, t: *const Tools) ![]const u8 {
    var out: std.ArrayList(u8) = .empty;
    try out.appendSlice(arena, "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" ++
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>");
    for (t.list) |tool| {
        try out.append(arena, '\n');
        try out.appendSlice(arena, try std.json.Stringify.valueAlloc(arena, tool.value, .{}));
    }
    try out.appendSlice(arena, "\n</tools>\n\nFor each function call, return a json object with function name and arguments " ++
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
    return out.items;
}

pub const Call = tool_calls.Call;
pub const Reader = tool_calls.Reader;
pub const callId = tool_calls.callId;

const testing = std.testing;

pub fn testTools(arena: Allocator, json: []const u8, choice: []const u8) !?Tools {
    var f: Failure = .{};
    const tv = try std.json.parseFromSliceLeaky(Value, arena, json, .{});
    const cv = try std.json.parseFromSliceLeaky(Value, arena, choice, .{});
    return parse(arena, tv, cv, null, &f);
}

pub const weather =
    \\[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}},
    \\ {"type":"function","function":{"name":"get_time"}}]
;

test "tools and tool_choice are checked" {
    var state = std.heap.ArenaAllocator.init(testing.allocator);
    defer state.deinit();
    const arena = state.allocator();
    const t = (try testTools(arena, weather, "{\"type\":\"function\",\"function\":{\"name\":\"get_time\"}}")).?;
    try testing.expectEqualStrings("get_time", t.choice.named);
    try testing.expectEqualStrings(
        "{\"x-guidance\":{\"whitespace_flexible\":false},\"anyOf\":[{\"type\":\"object\",\"properties\":{\"name\":{\"const\":\"get_time\"},\"arguments\":{\"type\":\"object\"}},\"required\":[\"name\",\"arguments\"],\"additionalProperties\":false}]}",
        try schema(arena, &t),
    );
    try testing.expectError(error.Bad, testTools(arena, weather, "{\"type\":\"function\",\"function\":{\"name\":\"nope\"}}"));
    try testing.expectError(error.Bad, testTools(arena, weather, "\"sometimes\""));
    try testing.expectError(error.Bad, testTools(arena, "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":[]}}]", "\"auto\""));
    try testing.expectError(error.Bad, testTools(arena, "[{\"type\":\"function\",\"function\":{\"name\":\"a b\"}}]", "\"auto\""));
    try testing.expectError(error.Bad, testTools(arena, "[]", "\"required\""));
    try testing.expect((try testTools(arena, "[]", "\"auto\"")) == null);
}
