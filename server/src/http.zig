//! HTTP/1.1 over a socket: requests read under deadlines and size limits, responses written whole or as
//! server-sent events. Only what an OpenAI client and curl send is understood; the rest is refused.
const std = @import("std");
const posix = std.posix;
const text = @import("text.zig");

const gpa = std.heap.c_allocator;

pub const header_limit = 16 * 1024;
const max_headers = 100;

pub const Limits = struct {
    max_body: usize,
    header_timeout_ms: i64,
    body_timeout_ms: i64,
    idle_timeout_ms: i64,
};

pub const Method = enum { GET, POST, HEAD, OTHER };

pub const Request = struct {
    method: Method,
    target: []const u8,
    keep_alive: bool,
    authorization: ?[]const u8 = null,
    body: []u8 = &.{},
};

/// What went wrong reading a request: answered with the status, then the connection closes.
pub const Refusal = struct { status: u16, message: []const u8 };

pub const ReadResult = union(enum) {
    request: Request,
    /// The peer closed, timed out while idle, or reset: nothing to answer.
    closed,
    refused: Refusal,
};

pub const Conn = struct {
    fd: posix.socket_t,
    buf: [header_limit]u8 = undefined,
    start: usize = 0,
    end: usize = 0,
    body: std.ArrayList(u8) = .empty,
    /// Set when a write failed: the peer is gone.
    broken: bool = false,

    pub fn deinit(conn: *Conn) void {
        conn.body.deinit(gpa);
    }

    /// Waits until the socket is readable or `deadline_ms` passes; false on timeout.
    fn waitReadable(conn: *Conn, deadline_ms: i64) bool {
        const left = deadline_ms - std.time.milliTimestamp();
        if (left <= 0) return false;
        var fds = [_]posix.pollfd{.{ .fd = conn.fd, .events = posix.POLL.IN, .revents = 0 }};
        const n = posix.poll(&fds, @intCast(@min(left, 60_000))) catch return false;
        return n > 0;
    }

    /// Reads more bytes into the header buffer; 0 when the peer closed or the deadline passed.
    fn fill(conn: *Conn, deadline_ms: i64) usize {
        if (conn.start > 0) {
            std.mem.copyForwards(u8, conn.buf[0 .. conn.end - conn.start], conn.buf[conn.start..conn.end]);
            conn.end -= conn.start;
            conn.start = 0;
        }
        if (conn.end == conn.buf.len) return 0;
        while (true) {
            if (!conn.waitReadable(deadline_ms)) return 0;
            const n = posix.read(conn.fd, conn.buf[conn.end..]) catch |err| switch (err) {
                error.WouldBlock => continue,
                else => return 0,
            };
            conn.end += n;
            return n;
        }
    }

    pub fn read(conn: *Conn, limits: Limits) ReadResult {
        // An idle keep-alive connection may wait for its next request; once it starts, the header has
        // its own bound, so a slow sender cannot hold the thread.
        var deadline = std.time.milliTimestamp() + limits.idle_timeout_ms;
        var started = conn.end > conn.start;
        if (started) deadline = std.time.milliTimestamp() + limits.header_timeout_ms;
        const head_end = while (true) {
            if (std.mem.indexOf(u8, conn.buf[conn.start..conn.end], "\r\n\r\n")) |at| break conn.start + at + 4;
            if (conn.end - conn.start >= conn.buf.len) return .{ .refused = .{ .status = 431, .message = "the request's header is over 16 KiB" } };
            const got = conn.fill(deadline);
            if (got == 0) {
                if (!started) return .closed;
                if (conn.end - conn.start >= conn.buf.len) return .{ .refused = .{ .status = 431, .message = "the request's header is over 16 KiB" } };
                return if (std.time.milliTimestamp() >= deadline)
                    .{ .refused = .{ .status = 408, .message = "the request's header did not arrive in time" } }
                else
                    .closed;
            }
            if (!started) {
                started = true;
                deadline = std.time.milliTimestamp() + limits.header_timeout_ms;
            }
        };
        const head = conn.buf[conn.start..head_end];
        var req: Request = .{ .method = .OTHER, .target = "", .keep_alive = true };
        var lines = std.mem.splitSequence(u8, head[0 .. head.len - 4], "\r\n");
        const request_line = lines.first();
        var parts = std.mem.splitScalar(u8, request_line, ' ');
        const method = parts.next() orelse "";
        const target = parts.next() orelse "";
        const version = parts.next() orelse "";
        if (parts.next() != null or target.len == 0 or target[0] != '/' or !std.mem.startsWith(u8, version, "HTTP/1."))
            return .{ .refused = .{ .status = 400, .message = "malformed request line" } };
        for (target) |ch| if (ch <= ' ' or ch >= 0x7f) return .{ .refused = .{ .status = 400, .message = "malformed request target" } };
        req.method = if (std.mem.eql(u8, method, "GET")) .GET else if (std.mem.eql(u8, method, "POST")) .POST else if (std.mem.eql(u8, method, "HEAD")) .HEAD else .OTHER;
        req.target = target;
        req.keep_alive = std.mem.eql(u8, version, "HTTP/1.1");
        var content_length: ?usize = null;
        var expect_continue = false;
        var count: usize = 0;
        while (lines.next()) |line| {
            count += 1;
            if (count > max_headers) return .{ .refused = .{ .status = 431, .message = "too many header fields" } };
            const colon = std.mem.indexOfScalar(u8, line, ':') orelse return .{ .refused = .{ .status = 400, .message = "a header line without a colon" } };
            const name = line[0..colon];
            if (name.len == 0 or std.mem.indexOfAny(u8, name, " \t") != null) return .{ .refused = .{ .status = 400, .message = "a malformed header name" } };
            const value = std.mem.trim(u8, line[colon + 1 ..], " \t");
            if (std.ascii.eqlIgnoreCase(name, "content-length")) {
                const n = std.fmt.parseInt(usize, value, 10) catch return .{ .refused = .{ .status = 400, .message = "a malformed Content-Length" } };
                if (content_length != null and content_length.? != n) return .{ .refused = .{ .status = 400, .message = "conflicting Content-Length fields" } };
                content_length = n;
            } else if (std.ascii.eqlIgnoreCase(name, "transfer-encoding")) {
                return .{ .refused = .{ .status = 411, .message = "chunked request bodies are not supported; send Content-Length" } };
            } else if (std.ascii.eqlIgnoreCase(name, "connection")) {
                if (std.ascii.indexOfIgnoreCase(value, "close") != null) req.keep_alive = false;
                if (std.ascii.indexOfIgnoreCase(value, "keep-alive") != null) req.keep_alive = true;
            } else if (std.ascii.eqlIgnoreCase(name, "authorization")) {
                req.authorization = value;
            } else if (std.ascii.eqlIgnoreCase(name, "expect")) {
                if (!std.ascii.eqlIgnoreCase(value, "100-continue")) return .{ .refused = .{ .status = 417, .message = "unsupported Expect" } };
                expect_continue = true;
            }
        }
        const length = content_length orelse 0;
        if (length > limits.max_body) return .{ .refused = .{ .status = 413, .message = "the request body is over the limit" } };
        // The header stays in the buffer (the request's slices point into it) until the next read.
        conn.start = head_end;
        conn.body.clearRetainingCapacity();
        conn.body.ensureTotalCapacity(gpa, length) catch return .{ .refused = .{ .status = 413, .message = "no memory for the body" } };
        const buffered = @min(length, conn.end - conn.start);
        conn.body.appendSliceAssumeCapacity(conn.buf[conn.start .. conn.start + buffered]);
        conn.start += buffered;
        if (conn.body.items.len < length and expect_continue) conn.writeAll("HTTP/1.1 100 Continue\r\n\r\n");
        const body_deadline = std.time.milliTimestamp() + limits.body_timeout_ms;
        while (conn.body.items.len < length) {
            if (!conn.waitReadable(body_deadline)) return .{ .refused = .{ .status = 408, .message = "the request body did not arrive in time" } };
            const dest = conn.body.unusedCapacitySlice()[0 .. length - conn.body.items.len];
            const n = posix.read(conn.fd, dest) catch return .closed;
            if (n == 0) return .closed;
            conn.body.items.len += n;
        }
        req.body = conn.body.items;
        return .{ .request = req };
    }

    pub fn writeAll(conn: *Conn, bytes: []const u8) void {
        var sent: usize = 0;
        while (sent < bytes.len and !conn.broken) {
            const n = posix.send(conn.fd, bytes[sent..], posix.MSG.NOSIGNAL) catch {
                conn.broken = true;
                return;
            };
            sent += n;
        }
    }

    /// Ends our side and reads what the peer still sends for a moment before closing: closing with
    /// unread bytes resets the connection, and the peer could lose the response it was sent.
    pub fn lingeringClose(conn: *Conn) void {
        posix.shutdown(conn.fd, .send) catch return;
        const deadline = std.time.milliTimestamp() + 1000;
        var discard: [16384]u8 = undefined;
        var left: usize = 16 << 20;
        while (left > 0 and conn.waitReadable(deadline)) {
            const n = posix.read(conn.fd, &discard) catch return;
            if (n == 0) return;
            left -|= n;
        }
    }

    /// True when the peer closed its side or reset the connection (checked without blocking).
    pub fn peerGone(conn: *Conn) bool {
        if (conn.broken) return true;
        var fds = [_]posix.pollfd{.{ .fd = conn.fd, .events = posix.POLL.IN | pollRdHup, .revents = 0 }};
        const n = posix.poll(&fds, 0) catch return true;
        if (n == 0) return false;
        return fds[0].revents & (posix.POLL.HUP | posix.POLL.ERR | pollRdHup) != 0;
    }
};

pub fn reason(status: u16) []const u8 {
    return switch (status) {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Payload Too Large",
        417 => "Expectation Failed",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        else => "Status",
    };
}

/// Writes a response's header for a body of `length` bytes. `extra` is more header lines, each ending
/// in CRLF.
pub fn respondHead(conn: *Conn, status: u16, content_type: []const u8, length: usize, keep_alive: bool, extra: []const u8) void {
    var head: [512]u8 = undefined;
    const h = std.fmt.bufPrint(&head, "HTTP/1.1 {d} {s}\r\nContent-Type: {s}\r\nContent-Length: {d}\r\nConnection: {s}\r\n{s}\r\n", .{
        status, reason(status), content_type, length, if (keep_alive) "keep-alive" else "close", extra,
    }) catch return;
    conn.writeAll(h);
}

/// Writes a whole response.
pub fn respond(conn: *Conn, status: u16, content_type: []const u8, body: []const u8, keep_alive: bool, extra: []const u8) void {
    respondHead(conn, status, content_type, body.len, keep_alive, extra);
    conn.writeAll(body);
}

/// The OpenAI error body: {"error": {"message", "type", "param", "code"}}.
pub fn errorBody(out: *std.ArrayList(u8), status: u16, message: []const u8, param: ?[]const u8, code: ?[]const u8) !void {
    const kind = switch (status) {
        401 => "authentication_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        500...599 => "server_error",
        else => "invalid_request_error",
    };
    try out.appendSlice(gpa, "{\"error\":{\"message\":");
    try text.appendValidJsonString(gpa, out, message);
    try out.print(gpa, ",\"type\":\"{s}\",\"param\":", .{kind});
    if (param) |p| try text.appendValidJsonString(gpa, out, p) else try out.appendSlice(gpa, "null");
    try out.appendSlice(gpa, ",\"code\":");
    if (code) |cd| try text.appendValidJsonString(gpa, out, cd) else try out.appendSlice(gpa, "null");
    try out.appendSlice(gpa, "}}");
}

pub fn respondError(conn: *Conn, status: u16, message: []const u8, param: ?[]const u8, code: ?[]const u8, keep_alive: bool) void {
    var body: std.ArrayList(u8) = .empty;
    defer body.deinit(gpa);
    errorBody(&body, status, message, param, code) catch return;
    const extra = if (status == 503 or status == 429) "Retry-After: 1\r\n" else if (status == 401) "WWW-Authenticate: Bearer\r\n" else "";
    respond(conn, status, "application/json", body.items, keep_alive, extra);
}

/// Linux's POLLRDHUP: the peer shut its writing side (std names it only among the epoll flags).
const pollRdHup: i16 = 0x2000;
