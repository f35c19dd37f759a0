//! OpenAI's tool calling, the output's side: the model's output read back as calls, whole or while it
//! streams. Two output formats are read: Hermes' and Qwen's `<tool_call>{"name": ..., "arguments": ...}
//! </tool_call>` blocks (after any text), and a bare JSON object `{"name": ..., "arguments" or
//! "parameters": ...}` that opens the reply (Llama 3.x, and what the constraint makes).
const std = @import("std");
const tools = @import("tools.zig");
const Value = std.json.Value;
const Allocator = std.mem.Allocator;
const Tools = tools.Tools;

/// A call read from the output: the tool's name and its arguments as a JSON text.
pub const Call = struct { name: []const u8, arguments: []const u8 };

const open_tag = "<tool_call>";
const close_tag = "</tool_call>";
const space = " \t\r\n";

/// Follows one choice's output: lets out the text before any call as content, holds back what may
/// begin one (a `{` opening the reply, or a `<tool_call>` tag, whole or in part), marks where the calls
/// begin, and gives each call's pieces as they come: its name once whole, then its arguments' text.
pub const Reader = struct {
    /// Bytes of the output let out as content.
    sent: usize = 0,
    /// Where the calls begin, once seen.
    start: ?usize = null,
    /// Calls wholly let out, whether the next one's name went out, and the bytes of its arguments that did.
    done: usize = 0,
    opened: bool = false,
    args_sent: usize = 0,
    /// Where the call being read begins (its `{`), and where the next one is looked for.
    call_at: ?usize = null,
    next_from: usize = 0,
    /// False once the calls cannot be let out as they come (the arguments before the name, arguments
    /// given as a string, an unknown name, text that is no call): what is left goes out at the end.
    live: bool = true,

    /// The content that may go out now, from the output so far (`finished`: there is no more).
    /// With `forced` (a constrained call) the whole output is the call.
    pub fn advance(r: *Reader, out: []const u8, finished: bool, forced: bool) []const u8 {
        if (r.start != null) return "";
        if (forced) {
            r.start = 0;
            return "";
        }
        if (r.sent == 0) {
            // A reply that opens with `{` is read as a bare JSON call; white space before it waits.
            if (std.mem.indexOfNone(u8, out, space)) |lead| {
                if (out[lead] == '{') {
                    r.start = lead;
                    return "";
                }
            } else if (!finished) return "";
        }
        const from = r.sent -| (open_tag.len - 1);
        if (std.mem.indexOf(u8, out[from..], open_tag)) |i| {
            const at = @max(from + i, r.sent);
            r.start = at;
            defer r.sent = at;
            return out[r.sent..at];
        }
        var end = out.len;
        if (!finished) end -= partialTag(out[r.sent..]);
        defer r.sent = end;
        return out[r.sent..end];
    }

    /// A piece of a call as it streams: the first of each call carries its name (and no arguments).
    pub const Piece = struct { index: usize, name: ?[]const u8 = null, arguments: []const u8 = "" };

    /// Appends the pieces of the calls that may go out now, from the output so far.
    pub fn pieces(r: *Reader, arena: Allocator, out: []const u8, t: *const Tools, list: *std.ArrayList(Piece)) !void {
        const start = r.start orelse return;
        if (r.done == 0 and r.call_at == null) r.next_from = start;
        while (r.live) {
            if (r.call_at == null) {
                const rest = out[r.next_from..];
                const lead = std.mem.indexOfNone(u8, rest, space) orelse return;
                // The closing tag of the call before, whole or not yet.
                if (r.done > 0 and std.mem.startsWith(u8, rest[lead..], close_tag)) {
                    r.next_from += lead + close_tag.len;
                    continue;
                }
                if (r.done > 0 and std.mem.startsWith(u8, close_tag, rest[lead..])) return;
                if (rest[lead] == '{' and r.done == 0 and !std.mem.startsWith(u8, out[start..], open_tag)) {
                    r.call_at = r.next_from + lead;
                } else if (std.mem.startsWith(u8, rest[lead..], open_tag)) {
                    const after = lead + open_tag.len;
                    const brace = std.mem.indexOfNone(u8, rest[after..], space) orelse return;
                    if (rest[after + brace] != '{') return r.stop();
                    r.call_at = r.next_from + after + brace;
                } else if (std.mem.startsWith(u8, open_tag, rest[lead..])) {
                    return; // a tag not yet whole
                } else return r.stop();
            }
            const json = out[r.call_at.?..];
            const o = outline(json);
            if (o.bad) return r.stop();
            const args_start = o.args_start orelse return;
            if (!r.opened) {
                const raw = o.name orelse return r.stop(); // the arguments came first
                const name = std.json.parseFromSliceLeaky([]const u8, arena, raw, .{}) catch return r.stop();
                if (t.find(name) == null or json[args_start] != '{') return r.stop();
                try list.append(arena, .{ .index = r.done, .name = name });
                r.opened = true;
            }
            const end = o.args_end orelse json.len;
            if (end > args_start + r.args_sent) {
                try list.append(arena, .{ .index = r.done, .arguments = json[args_start + r.args_sent .. end] });
                r.args_sent = end - args_start;
            }
            const closed = o.end orelse return;
            r.done += 1;
            r.opened = false;
            r.args_sent = 0;
            r.next_from = r.call_at.? + closed;
            r.call_at = null;
            if (!t.parallel) return r.stop();
        }
    }

    fn stop(r: *Reader) void {
        r.live = false;
    }

    /// Whether some of a call went out already (then the output can no longer be given as content).
    pub fn began(r: *const Reader) bool {
        return r.done > 0 or r.opened;
    }

    /// Appends what is left of the calls of a finished output, after what `pieces` let out; false when
    /// it holds no calls that parse.
    pub fn finish(r: *Reader, arena: Allocator, out: []const u8, t: *const Tools, list: *std.ArrayList(Piece)) !bool {
        if (r.live) try r.pieces(arena, out, t, list);
        const found = r.calls(arena, out, t) orelse return false;
        for (found, 0..) |call, i| {
            if (i < r.done) continue;
            if (i == r.done and r.opened) {
                // Its name and the first of its arguments went out as they came.
                const rest = if (call.arguments.len >= r.args_sent) call.arguments[r.args_sent..] else "";
                if (rest.len > 0) try list.append(arena, .{ .index = i, .arguments = rest });
                continue;
            }
            try list.append(arena, .{ .index = i, .name = call.name });
            try list.append(arena, .{ .index = i, .arguments = call.arguments });
        }
        return true;
    }

    /// The calls of a finished output, or null when it holds none that parse (it is all content then).
    pub fn calls(r: *const Reader, arena: Allocator, out: []const u8, t: *const Tools) ?[]Call {
        const start = r.start orelse return null;
        const found = parseCalls(arena, out[start..], t) catch return null;
        if (found.len == 0) return null;
        return if (t.parallel) found else found[0..1];
    }
};

/// Where the parts of a call's JSON object lie, as far as the text so far shows them: its name's
/// JSON string once whole, where its arguments' value begins and ends, and where the object ends.
/// `bad` when the text cannot be such an object.
const Outline = struct {
    name: ?[]const u8 = null,
    args_start: ?usize = null,
    args_end: ?usize = null,
    end: ?usize = null,
    bad: bool = false,
};

fn outline(json: []const u8) Outline {
    var o: Outline = .{};
    var i = skipSpace(json, 0);
    if (i >= json.len) return o;
    if (json[i] != '{') return .{ .bad = true };
    i += 1;
    while (true) {
        i = skipSpace(json, i);
        if (i >= json.len) return o;
        if (json[i] == '}') {
            o.end = i + 1;
            return o;
        }
        if (json[i] != '"') return .{ .bad = true };
        const key_end = stringEnd(json, i) orelse return o;
        const key = json[i + 1 .. key_end - 1];
        i = skipSpace(json, key_end);
        if (i >= json.len) return o;
        if (json[i] != ':') return .{ .bad = true };
        i = skipSpace(json, i + 1);
        if (i >= json.len) return o;
        const is_args = (std.mem.eql(u8, key, "arguments") or std.mem.eql(u8, key, "parameters")) and o.args_start == null;
        if (is_args) o.args_start = i;
        const value_end = valueEnd(json, i) orelse return o;
        if (is_args) o.args_end = value_end;
        if (std.mem.eql(u8, key, "name")) o.name = json[i..value_end];
        i = skipSpace(json, value_end);
        if (i >= json.len) return o;
        switch (json[i]) {
            ',' => i += 1,
            '}' => {
                o.end = i + 1;
                return o;
            },
            else => return .{ .bad = true },
        }
    }
}

fn skipSpace(s: []const u8, from: usize) usize {
    return std.mem.indexOfNonePos(u8, s, from, space) orelse s.len;
}

/// Past the closing quote of the JSON string opening at `i`, or null when it is not closed yet.
fn stringEnd(s: []const u8, i: usize) ?usize {
    var k = i + 1;
    while (k < s.len) : (k += 1) {
        switch (s[k]) {
            '\\' => k += 1,
            '"' => return k + 1,
            else => {},
        }
    }
    return null;
}

/// Past the JSON value opening at `i`, or null when it is not whole yet (a number or a word is
/// whole once something follows it).
fn valueEnd(s: []const u8, i: usize) ?usize {
    switch (s[i]) {
        '"' => return stringEnd(s, i),
        '{', '[' => {
            var depth: usize = 0;
            var k = i;
            while (k < s.len) : (k += 1) {
                switch (s[k]) {
                    '"' => k = (stringEnd(s, k) orelse return null) - 1,
                    '{', '[' => depth += 1,
                    '}', ']' => {
                        depth -= 1;
                        if (depth == 0) return k + 1;
                    },
                    else => {},
                }
            }
            return null;
        },
        else => {
            const end = std.mem.indexOfAnyPos(u8, s, i, ",}] \t\r\n") orelse return null;
            return end;
        },
    }
}

/// How many bytes at the end of `s` may be the beginning of `<tool_call>`.
fn partialTag(s: []const u8) usize {
    var k = @min(s.len, open_tag.len - 1);
    while (k > 0) : (k -= 1) {
        if (std.mem.eql(u8, s[s.len - k ..], open_tag[0..k])) return k;
    }
    return 0;
}

fn parseCalls(arena: Allocator, region: []const u8, t: *const Tools) ![]Call {
    var found: std.ArrayList(Call) = .empty;
    var rest = std.mem.trim(u8, region, space);
    if (std.mem.startsWith(u8, rest, "{")) {
        try found.append(arena, try callOf(arena, rest, t));
        return found.items;
    }
    // `<tool_call>` blocks, each a JSON object; the last may lack its closing tag (a stop string or
    // the end of the output cut it); text after the blocks is dropped.
    while (std.mem.startsWith(u8, rest, open_tag)) {
        rest = rest[open_tag.len..];
        const end = std.mem.indexOf(u8, rest, close_tag) orelse rest.len;
        try found.append(arena, try callOf(arena, std.mem.trim(u8, rest[0..end], space), t));
        rest = std.mem.trimLeft(u8, rest[@min(rest.len, end + close_tag.len)..], space);
    }
    return found.items;
}

/// A call from its JSON object: the arguments as the model wrote them when they are an object, the
/// text of a string that holds one, or `{}` when there are none.
fn callOf(arena: Allocator, json: []const u8, t: *const Tools) !Call {
    const v = try std.json.parseFromSliceLeaky(Value, arena, json, .{ .duplicate_field_behavior = .use_last });
    if (v != .object) return error.NotACall;
    const name = v.object.get("name") orelse return error.NotACall;
    if (name != .string or t.find(name.string) == null) return error.NotACall;
    const args: Value = v.object.get("arguments") orelse v.object.get("parameters") orelse return .{ .name = name.string, .arguments = "{}" };
    switch (args) {
        .object => {
            const o = outline(json);
            if (o.args_start == null or o.args_end == null) return error.NotACall;
            return .{ .name = name.string, .arguments = json[o.args_start.?..o.args_end.?] };
        },
        .string => |s| {
            const inner = std.json.parseFromSliceLeaky(Value, arena, s, .{}) catch return error.NotACall;
            if (inner != .object) return error.NotACall;
            return .{ .name = name.string, .arguments = std.mem.trim(u8, s, space) };
        },
        else => return error.NotACall,
    }
}

/// A tool call's id: "call_" and 24 random hex digits.
pub fn callId(arena: Allocator) []const u8 {
    var raw: [12]u8 = undefined;
    std.crypto.random.bytes(&raw);
    return std.fmt.allocPrint(arena, "call_{s}", .{std.fmt.bytesToHex(raw, .lower)}) catch "call_0";
}

const testing = std.testing;
const testTools = tools.testTools;
const weather = tools.weather;

test "calls are read from Hermes blocks and from a bare JSON object" {
    var state = std.heap.ArenaAllocator.init(testing.allocator);
    defer state.deinit();
    const arena = state.allocator();
    const t = (try testTools(arena, weather, "\"auto\"")).?;
    const hermes = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\"}";
    var r: Reader = .{};
    // Streamed a byte at a time: the content stops before the tag and never lets a part of it out.
    var content: std.ArrayList(u8) = .empty;
    for (1..hermes.len + 1) |n| try content.appendSlice(arena, r.advance(hermes[0..n], n == hermes.len, false));
    try testing.expectEqualStrings("Let me look.\n", content.items);
    const calls = r.calls(arena, hermes, &t).?;
    try testing.expectEqual(2, calls.len);
    try testing.expectEqualStrings("{\"city\": \"Paris\"}", calls[0].arguments);
    try testing.expectEqualStrings("{}", calls[1].arguments);

    const bare = "  {\"name\": \"get_weather\", \"parameters\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}";
    r = .{};
    try testing.expectEqualStrings("", r.advance(bare[0..1], false, false));
    try testing.expectEqualStrings("", r.advance(bare, true, false));
    try testing.expectEqualStrings("{\"city\": \"Oslo\"}", r.calls(arena, bare, &t).?[0].arguments);

    // An unknown name, or a brace that is no call, is content.
    r = .{};
    const other = "{\"name\": \"get_mail\"}";
    _ = r.advance(other, true, false);
    try testing.expect(r.calls(arena, other, &t) == null);
    r = .{};
    try testing.expectEqualStrings("a <tool", r.advance("a <tool", true, false));
}

test "calls stream as they come: the name once whole, then the arguments' text" {
    var state = std.heap.ArenaAllocator.init(testing.allocator);
    defer state.deinit();
    const arena = state.allocator();
    const t = (try testTools(arena, weather, "\"auto\"")).?;
    const outputs = [_][]const u8{
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris \\\"}\\\" [x\"}}",
        "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>",
        "{\"arguments\": {\"city\": \"Oslo\"}, \"name\": \"get_weather\"}",
    };
    const opened_early = [_]bool{ true, true, false };
    const calls_before_end = [_]usize{ 1, 2, 0 };
    for (outputs, opened_early, calls_before_end) |out, early, before_end| {
        var r: Reader = .{};
        var list: std.ArrayList(Reader.Piece) = .empty;
        var first_name_at: ?usize = null;
        for (1..out.len) |n| {
            _ = r.advance(out[0..n], false, false);
            try r.pieces(arena, out[0..n], &t, &list);
            if (first_name_at == null and list.items.len > 0) first_name_at = n;
        }
        var names_before_end: usize = 0;
        for (list.items) |p| names_before_end += @intFromBool(p.name != null);
        try testing.expectEqual(before_end, names_before_end);
        _ = r.advance(out, true, false);
        try testing.expect(try r.finish(arena, out, &t, &list));
        try testing.expectEqual(early, first_name_at != null);
        // Put together by index, the pieces are the calls read from the whole output.
        const whole = r.calls(arena, out, &t).?;
        for (whole, 0..) |call, i| {
            var args: std.ArrayList(u8) = .empty;
            var names: usize = 0;
            for (list.items) |p| if (p.index == i) {
                if (p.name) |name| {
                    try testing.expectEqualStrings(call.name, name);
                    try testing.expectEqual(0, args.items.len);
                    names += 1;
                }
                try args.appendSlice(arena, p.arguments);
            };
            try testing.expectEqual(1, names);
            try testing.expectEqualStrings(call.arguments, args.items);
        }
    }
}
