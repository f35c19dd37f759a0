//! What a connection hands the scheduler (sched.zig) and reads back: a request, its choices with their
//! tokens, text and logprobs, and the lock and signal that join them.
const std = @import("std");
const c = @import("hostembed");
const text = @import("text.zig");

const gpa = std.heap.c_allocator;

pub const Finish = enum { none, stop, length };

pub const TokenLogprob = struct {
    id: i32,
    logprob: f32,
    top_ids: []i32,
    top_logprobs: []f32,
};

pub const Choice = struct {
    stream: u32 = 0,
    holder: text.Holder = .{},
    /// The token the next step feeds this choice's stream.
    pending: i32 = -1,
    generated: u32 = 0,
    last_token_ns: i128 = 0,
    spec_out: [c.ENGINE_SPECULATION_MAX_TOKENS + 1]i32 = undefined,
    // Read by the connection thread under the request's lock (`Request.sync`).
    finish: Finish = .none,
    out: std.ArrayList(u8) = .empty,
    logprobs: std.ArrayList(TokenLogprob) = .empty,
    /// For the server's own sampling (OpenAI's penalties): how often each token was generated, and the
    /// choice's random draws.
    counts: std.AutoHashMapUnmanaged(i32, u32) = .empty,
    rng: std.Random.DefaultPrng = .init(0),

    fn deinit(ch: *Choice) void {
        ch.holder.deinit(gpa);
        ch.counts.deinit(gpa);
        ch.out.deinit(gpa);
        for (ch.logprobs.items) |lp| {
            gpa.free(lp.top_ids);
            gpa.free(lp.top_logprobs);
        }
        ch.logprobs.deinit(gpa);
    }
};

/// The lock and signal of a connection's requests (several prompts in one body are a request each).
pub const Sync = struct {
    mutex: std.Thread.Mutex = .{},
    cond: std.Thread.Condition = .{},
};

/// A token's bias added to its logit before sampling (OpenAI's `logit_bias`).
pub const Bias = struct { id: i32, bias: f32 };

pub const Request = struct {
    // What was asked (owned by the connection thread, read-only here).
    prompt: []const i32,
    n: u32 = 1,
    max_tokens: u32,
    stops: []const []const u8 = &.{},
    sampling: c.engine_sampling,
    constraint: c.engine_constraint = c.ENGINE_CONSTRAINT_NONE,
    constraint_text: []const u8 = "",
    /// null: no logprobs; else how many alternatives each token reports.
    top_logprobs: ?u32 = null,
    /// OpenAI's penalties; either nonzero makes the server sample the choices itself from the logits.
    frequency_penalty: f32 = 0,
    presence_penalty: f32 = 0,
    /// Added to the logits before the penalties; any makes the server sample the choices itself.
    logit_bias: []const Bias = &.{},
    /// The prompt's tokens are scored (`engine_score`) for `prompt_logprobs` as they are read (echo
    /// with logprobs): all but the last, which every choice steps itself as with n > 1.
    score_prompt: bool = false,

    // The scheduler's own.
    choices: []Choice = &.{},
    prefilled: usize = 0,
    decoding: bool = false,
    constrained: bool = false,
    submitted_ns: i128 = 0,
    first_token_ns: i128 = 0,
    reserved: u64 = 0,
    /// Prompt tokens whose positions the engine's prefix cache gave (`engine_prefix_stats`), for `usage`.
    cached_tokens: u64 = 0,

    // Shared with the connection thread, under `sync`.
    sync: *Sync,
    /// With `score_prompt`: each prompt token's log-probability (NaN for the first), complete once the
    /// choices decode.
    prompt_logprobs: std.ArrayList(f32) = .empty,
    cancelled: std.atomic.Value(bool) = .init(false),
    /// The scheduler holds nothing of the request any more: the connection thread may free it.
    released: bool = false,
    /// Set when the request failed before or while running; `failure_status` is the HTTP status.
    failure: ?[]u8 = null,
    failure_status: u16 = 500,

    pub fn init(r: *Request, n: u32) !void {
        r.n = n;
        r.choices = try gpa.alloc(Choice, n);
        for (r.choices, 0..) |*ch, k| ch.* = .{ .rng = .init(r.sampling.seed +% k *% 0x9E3779B97F4A7C15) };
    }

    pub fn samplesItself(r: *const Request) bool {
        return r.frequency_penalty != 0 or r.presence_penalty != 0 or r.logit_bias.len > 0;
    }

    pub fn deinit(r: *Request) void {
        for (r.choices) |*ch| ch.deinit();
        gpa.free(r.choices);
        r.prompt_logprobs.deinit(gpa);
        if (r.failure) |f| gpa.free(f);
    }

    /// Tokens past the prompt that the choices hold, for `usage`.
    pub fn completionTokens(r: *Request) u64 {
        var sum: u64 = 0;
        for (r.choices) |ch| sum += ch.generated;
        return sum;
    }

    /// Prompt tokens read on the first stream before the others fork from it: all but the last when
    /// several choices share the prompt (or it is scored), so each of them steps the last one itself and
    /// samples its own.
    pub fn prefillEnd(r: *const Request) usize {
        return if (r.prefillSamples()) r.prompt.len else r.prompt.len - 1;
    }

    /// Whether the step reading the prompt's last chunk samples the first token (one choice, the prompt
    /// stepped rather than scored).
    pub fn prefillSamples(r: *const Request) bool {
        return r.n == 1 and !r.score_prompt;
    }
};
