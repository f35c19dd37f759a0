//! The endpoints: the routes, the models list, and a generation request's life: its body checked
//! (request.zig, chat.zig), a scheduler request a prompt, and the response written (respond.zig).
const std = @import("std");
const c = @import("hostembed");
const http = @import("http.zig");
const sched = @import("sched.zig");
const text = @import("text.zig");
const metrics = @import("metrics.zig");
const Server = @import("main.zig").Server;
const request = @import("request.zig");
const respond = @import("respond.zig");
const Bad = request.Bad;
const Kind = request.Kind;
const Params = request.Params;

const gpa = std.heap.c_allocator;

pub const fimTokens = request.fimTokens;
pub const templateShowsTools = @import("chat.zig").templateShowsTools;

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

fn generate(server: *Server, conn: *http.Conn, req: http.Request, kind: Kind) bool {
    var arena_state = std.heap.ArenaAllocator.init(gpa);
    defer arena_state.deinit();
    const arena = arena_state.allocator();
    var params: Params = .{ .sampling = c.engine_default_sampling() };
    request.parse(server, arena, req.body, kind, &params) catch |err| {
        metrics.countFailure();
        const why: Bad = switch (err) {
            error.Bad => request.last_bad,
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
    var w = respond.Writer{ .server = server, .conn = conn, .rs = rs, .sync = &sync, .kind = kind, .params = &params, .arena = arena };
    w.id = w.makeId();
    const keep = w.run();
    return keep and !w.streamed;
}
