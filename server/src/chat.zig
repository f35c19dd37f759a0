//! A chat's messages, checked, and the prompt the model's template makes of them: the tools shown
//! where the template does not print them, an assistant's calls and the tools' results carried as text.
const std = @import("std");
const c = @import("hostembed");
const text = @import("text.zig");
const tools = @import("tools.zig");
const Server = @import("main.zig").Server;
const request = @import("request.zig");
const bad = request.bad;
const badf = request.badf;
const field = request.field;
const getString = request.getString;
const tokenize = request.tokenize;

const Value = std.json.Value;
const ObjectMap = std.json.ObjectMap;

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

pub fn chatPrompt(server: *Server, arena: std.mem.Allocator, obj: ObjectMap, t: ?*const tools.Tools) ![]i32 {
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
