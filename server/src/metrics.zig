//! Counters and histograms for GET /metrics, in Prometheus' text format.
const std = @import("std");
const c = @import("hostembed");

const Counter = std.atomic.Value(u64);

var requests_chat: Counter = .init(0);
var requests_completion: Counter = .init(0);
var requests_failed: Counter = .init(0);
var prompt_tokens: Counter = .init(0);
var completion_tokens: Counter = .init(0);
var prompt_cached: Counter = .init(0);
var prompt_computed: Counter = .init(0);
var spec_proposed: Counter = .init(0);
var spec_accepted: Counter = .init(0);
var steps: Counter = .init(0);
var step_items: Counter = .init(0);
var step_seconds_ns: Counter = .init(0);
var waiting: Counter = .init(0);
var running: Counter = .init(0);

/// Upper bounds in seconds, shared by time to first token and inter-token latency.
const bounds = [_]f64{ 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30 };

const Histogram = struct {
    mutex: std.Thread.Mutex = .{},
    counts: [bounds.len + 1]u64 = @splat(0),
    sum: f64 = 0,

    fn observe(h: *Histogram, ns: i128) void {
        const secs = @as(f64, @floatFromInt(@max(ns, 0))) / std.time.ns_per_s;
        h.mutex.lock();
        defer h.mutex.unlock();
        var i: usize = 0;
        while (i < bounds.len and secs > bounds[i]) i += 1;
        h.counts[i] += 1;
        h.sum += secs;
    }

    fn write(h: *Histogram, gpa: std.mem.Allocator, out: *std.ArrayList(u8), name: []const u8, help: []const u8) !void {
        h.mutex.lock();
        defer h.mutex.unlock();
        try out.print(gpa, "# HELP {s} {s}\n# TYPE {s} histogram\n", .{ name, help, name });
        var cumulative: u64 = 0;
        for (bounds, 0..) |b, i| {
            cumulative += h.counts[i];
            try out.print(gpa, "{s}_bucket{{le=\"{d}\"}} {d}\n", .{ name, b, cumulative });
        }
        cumulative += h.counts[bounds.len];
        try out.print(gpa, "{s}_bucket{{le=\"+Inf\"}} {d}\n{s}_sum {d}\n{s}_count {d}\n", .{ name, cumulative, name, h.sum, name, cumulative });
    }
};

var ttft: Histogram = .{};
var itl: Histogram = .{};

pub fn countRequest(chat: bool) void {
    _ = (if (chat) &requests_chat else &requests_completion).fetchAdd(1, .monotonic);
}
pub fn countFailure() void {
    _ = requests_failed.fetchAdd(1, .monotonic);
}
pub fn addPromptTokens(n: u64) void {
    _ = prompt_tokens.fetchAdd(n, .monotonic);
}
pub fn addCompletionTokens(n: u64) void {
    _ = completion_tokens.fetchAdd(n, .monotonic);
}
pub fn addPromptReuse(cached: u64, computed: u64) void {
    _ = prompt_cached.fetchAdd(cached, .monotonic);
    _ = prompt_computed.fetchAdd(computed, .monotonic);
}
pub fn addSpeculation(proposed: u64, accepted: u64) void {
    _ = spec_proposed.fetchAdd(proposed, .monotonic);
    _ = spec_accepted.fetchAdd(accepted, .monotonic);
}
pub fn observeStep(items: usize, ns: i128) void {
    _ = steps.fetchAdd(1, .monotonic);
    _ = step_items.fetchAdd(items, .monotonic);
    _ = step_seconds_ns.fetchAdd(@intCast(@max(ns, 0)), .monotonic);
}
pub fn setQueue(w: usize, r: usize) void {
    waiting.store(w, .monotonic);
    running.store(r, .monotonic);
}
pub fn observeTtft(ns: i128) void {
    ttft.observe(ns);
}
pub fn observeItl(ns: i128) void {
    itl.observe(ns);
}

fn counter(gpa: std.mem.Allocator, out: *std.ArrayList(u8), name: []const u8, kind: []const u8, help: []const u8, v: anytype) !void {
    try out.print(gpa, "# HELP {s} {s}\n# TYPE {s} {s}\n{s} {d}\n", .{ name, help, name, kind, name, v });
}

pub fn render(gpa: std.mem.Allocator, out: *std.ArrayList(u8), engine: *c.engine) !void {
    try out.print(gpa, "# HELP hostembed_requests_total Generation requests accepted, by endpoint.\n# TYPE hostembed_requests_total counter\n", .{});
    try out.print(gpa, "hostembed_requests_total{{endpoint=\"chat\"}} {d}\nhostembed_requests_total{{endpoint=\"completions\"}} {d}\n", .{ requests_chat.load(.monotonic), requests_completion.load(.monotonic) });
    try counter(gpa, out, "hostembed_request_errors_total", "counter", "Requests answered with an error status.", requests_failed.load(.monotonic));
    try counter(gpa, out, "hostembed_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", prompt_tokens.load(.monotonic));
    try counter(gpa, out, "hostembed_prompt_tokens_cached_total", "counter", "Prompt tokens whose KV positions the prefix cache gave.", prompt_cached.load(.monotonic));
    try counter(gpa, out, "hostembed_prompt_tokens_computed_total", "counter", "Prompt tokens computed (not given by the prefix cache).", prompt_computed.load(.monotonic));
    try counter(gpa, out, "hostembed_completion_tokens_total", "counter", "Tokens generated.", completion_tokens.load(.monotonic));
    try counter(gpa, out, "hostembed_steps_total", "counter", "engine_step_batch calls.", steps.load(.monotonic));
    try counter(gpa, out, "hostembed_step_items_total", "counter", "Items over all engine_step_batch calls.", step_items.load(.monotonic));
    try counter(gpa, out, "hostembed_step_seconds_total", "counter", "Time inside engine_step_batch.", @as(f64, @floatFromInt(step_seconds_ns.load(.monotonic))) / std.time.ns_per_s);
    try counter(gpa, out, "hostembed_requests_waiting", "gauge", "Requests waiting for a stream or KV room.", waiting.load(.monotonic));
    try counter(gpa, out, "hostembed_requests_running", "gauge", "Requests holding streams.", running.load(.monotonic));
    try counter(gpa, out, "hostembed_speculation_proposed_total", "counter", "Tokens proposed by speculation (prompt lookup or the drafter).", spec_proposed.load(.monotonic));
    try counter(gpa, out, "hostembed_speculation_accepted_total", "counter", "Proposed tokens verification accepted.", spec_accepted.load(.monotonic));
    var usage: c.struct_engine_kv_usage = undefined;
    if (c.engine_kv_usage(engine, &usage) == c.ENGINE_STATUS_OK) {
        try counter(gpa, out, "hostembed_kv_tokens_total", "gauge", "Positions of the KV pool.", usage.tokens_total);
        try counter(gpa, out, "hostembed_kv_tokens_free", "gauge", "Positions of pages no stream holds (prefix-cache pages included).", usage.tokens_free);
        try counter(gpa, out, "hostembed_kv_tokens_shared", "gauge", "Positions of pages several streams hold (forks and prefix-cache matches).", usage.tokens_shared);
        try counter(gpa, out, "hostembed_kv_tokens_cached", "gauge", "Positions the prefix cache keeps that no stream holds.", usage.tokens_cached);
    }
    try ttft.write(gpa, out, "hostembed_time_to_first_token_seconds", "From submission to the first token.");
    try itl.write(gpa, out, "hostembed_inter_token_seconds", "Between consecutive tokens of a choice.");
}
