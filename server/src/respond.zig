//! The response of a generation request: the whole JSON body, or server-sent events as the choices
//! produce tokens, with logprobs, usage and tool calls in OpenAI's shapes.
const std = @import("std");
const c = @import("hostembed");
const http = @import("http.zig");
const sched = @import("sched.zig");
const text = @import("text.zig");
const metrics = @import("metrics.zig");
const tools = @import("tools.zig");
const Server = @import("main.zig").Server;
const request = @import("request.zig");
const Kind = request.Kind;
const Params = request.Params;

const gpa = std.heap.c_allocator;

/// Writes what the choices produce: a whole response, or server-sent events as they come. The choices
/// of several prompts are numbered in order, `n` a prompt: prompt i's choice k is index i * n + k.
pub const Writer = struct {
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

    pub fn makeId(w: *Writer) []const u8 {
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
    pub fn run(w: *Writer) bool {
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
