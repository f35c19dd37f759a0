//! The scheduler: one thread owns the engine's streams and steps every running request in one
//! engine_step_batch per step, the decode tokens of the running choices beside chunks of the prompts
//! still being read, under a token budget. Connection threads submit requests and wait on them.
const std = @import("std");
const c = @import("hostembed");
const text = @import("text.zig");
const metrics = @import("metrics.zig");

const gpa = std.heap.c_allocator;
// The request's types live in requests.zig; the connections name them through the scheduler.
const requests = @import("requests.zig");
pub const Finish = requests.Finish;
pub const TokenLogprob = requests.TokenLogprob;
pub const Choice = requests.Choice;
pub const Sync = requests.Sync;
pub const Bias = requests.Bias;
pub const Request = requests.Request;

pub const Options = struct {
    batch_tokens: u32,
    chunk_tokens: u32,
    /// Most tokens a stream proposes a step (0: no speculation).
    lookup: u32,
    /// Proposals come from the engine's drafter model rather than prompt lookup.
    drafter: bool = false,
    queue_timeout_ms: u64,
    max_waiting: usize,
};

pub const SubmitError = error{ Draining, Busy, OutOfMemory };

pub const Scheduler = struct {
    engine: *c.engine,
    opts: Options,
    vocab: u32,
    kv_total: u64,
    total_streams: u32,
    window: u32,

    mutex: std.Thread.Mutex = .{},
    cond: std.Thread.Condition = .{},
    incoming: std.ArrayList(*Request) = .empty,
    draining: bool = false,

    // The scheduler thread's own.
    waiting: std.ArrayList(*Request) = .empty,
    running: std.ArrayList(*Request) = .empty,
    free_streams: std.ArrayList(u32) = .empty,
    reserved: u64 = 0,
    items: std.ArrayList(c.engine_batch_item) = .empty,
    owners: std.ArrayList(Owner) = .empty,
    logits: []f32 = &.{},
    /// The ids a constrained choice's stream allows next (`engine_allowed_tokens`), for its own sampling.
    allowed: []u32 = &.{},
    candidates: std.ArrayList(Candidate) = .empty,

    /// Requests submitted and not yet released, for draining and the metrics.
    live: std.atomic.Value(u32) = .init(0),

    const Owner = struct { req: *Request, choice: ?u32, chunk: usize };

    const Candidate = struct {
        id: i32,
        /// Weight relative to the likeliest token.
        p: f64,

        fn likelierFirst(_: void, a: Candidate, b: Candidate) bool {
            return a.p > b.p or (a.p == b.p and a.id < b.id);
        }
    };

    pub fn init(s: *Scheduler, engine: *c.engine, opts: Options) !void {
        var info: c.struct_engine_model_info = undefined;
        if (c.engine_model_info(engine, &info) != c.ENGINE_STATUS_OK) return error.EngineInfo;
        var usage: c.struct_engine_kv_usage = undefined;
        if (c.engine_kv_usage(engine, &usage) != c.ENGINE_STATUS_OK) return error.EngineInfo;
        s.* = .{ .engine = engine, .opts = opts, .vocab = info.vocab, .kv_total = usage.tokens_total, .total_streams = info.streams, .window = info.window };
        var k: u32 = info.streams;
        while (k > 0) {
            k -= 1;
            try s.free_streams.append(gpa, k);
        }
        s.logits = try gpa.alloc(f32, info.vocab);
        s.allowed = try gpa.alloc(u32, (info.vocab + 31) / 32);
    }

    pub fn streams(s: *const Scheduler) usize {
        return s.total_streams;
    }

    pub fn submit(s: *Scheduler, r: *Request) SubmitError!void {
        s.mutex.lock();
        defer s.mutex.unlock();
        if (s.draining) return error.Draining;
        if (s.incoming.items.len + s.waiting.items.len >= s.opts.max_waiting) return error.Busy;
        r.submitted_ns = std.time.nanoTimestamp();
        try s.incoming.append(gpa, r);
        _ = s.live.fetchAdd(1, .monotonic);
        s.cond.signal();
    }

    pub fn drain(s: *Scheduler) void {
        s.mutex.lock();
        defer s.mutex.unlock();
        s.draining = true;
        s.cond.signal();
    }

    pub fn run(s: *Scheduler) void {
        while (true) {
            s.mutex.lock();
            while (s.incoming.items.len == 0 and s.waiting.items.len == 0 and s.running.items.len == 0) {
                s.cond.timedWait(&s.mutex, 100 * std.time.ns_per_ms) catch {};
            }
            s.waiting.appendSlice(gpa, s.incoming.items) catch {};
            s.incoming.clearRetainingCapacity();
            s.mutex.unlock();

            s.dropCancelled();
            s.admit();
            metrics.setQueue(s.waiting.items.len, s.running.items.len);
            if (s.running.items.len == 0) {
                // Nothing admitted: the waiting ones wait for room (or time out); don't spin.
                if (s.waiting.items.len > 0) std.Thread.sleep(2 * std.time.ns_per_ms);
                continue;
            }
            s.step();
        }
    }

    fn dropCancelled(s: *Scheduler) void {
        var i: usize = 0;
        while (i < s.running.items.len) {
            const r = s.running.items[i];
            if (r.cancelled.load(.acquire)) {
                _ = s.running.orderedRemove(i);
                s.release(r);
            } else i += 1;
        }
        i = 0;
        while (i < s.waiting.items.len) {
            const r = s.waiting.items[i];
            if (r.cancelled.load(.acquire)) {
                _ = s.waiting.orderedRemove(i);
                s.releaseWaiting(r, null, 0);
            } else i += 1;
        }
    }

    /// KV positions a request may come to hold: its prompt (shared by the forked choices) and every
    /// choice's tokens with a step of speculation past the last, at most a full window a stream.
    fn kvNeed(s: *const Scheduler, r: *const Request) u64 {
        const extra: u64 = s.opts.lookup;
        const tokens = r.prompt.len + @as(u64, r.n) * (@as(u64, r.max_tokens) + 1 + extra);
        return @min(tokens, @as(u64, r.n) * s.window);
    }

    fn admit(s: *Scheduler) void {
        const now = std.time.nanoTimestamp();
        while (s.waiting.items.len > 0) {
            const r = s.waiting.items[0];
            const need = s.kvNeed(r);
            if (need > s.kv_total or r.n > s.streams()) {
                _ = s.waiting.orderedRemove(0);
                s.releaseWaiting(r, "the request needs more KV cache or streams than the server has", 400);
                continue;
            }
            if (s.free_streams.items.len < r.n or s.reserved + need > s.kv_total) {
                // First come, first served: the head waits for room, or gives up after the queue timeout.
                const waited_ms: u64 = @intCast(@divTrunc(@max(now - r.submitted_ns, 0), std.time.ns_per_ms));
                if (waited_ms < s.opts.queue_timeout_ms) return;
                _ = s.waiting.orderedRemove(0);
                s.releaseWaiting(r, "the server is at capacity; retry later", 503);
                continue;
            }
            _ = s.waiting.orderedRemove(0);
            r.reserved = need;
            s.reserved += need;
            for (r.choices) |*ch| ch.stream = s.free_streams.pop().?;
            s.running.append(gpa, r) catch {
                s.release(r);
                continue;
            };
            s.setUp(r) catch {
                _ = s.running.pop();
                s.fail(r, 400);
                s.release(r);
                continue;
            };
            if (r.prefillEnd() == 0) {
                s.countPrompt(r);
                if (r.score_prompt) s.notePromptLogprobs(r, &.{std.math.nan(f32)});
                s.enterDecode(r) catch {
                    _ = s.running.pop();
                    s.fail(r, 400);
                    s.release(r);
                };
            }
        }
    }

    fn setUp(s: *Scheduler, r: *Request) !void {
        const spec_on = s.opts.lookup > 0 and r.top_logprobs == null and !r.samplesItself();
        for (r.choices) |ch| {
            if (c.engine_reset(s.engine, ch.stream) != c.ENGINE_STATUS_OK) return error.Engine;
            if (c.engine_set_sampling(s.engine, ch.stream, &r.sampling) != c.ENGINE_STATUS_OK) return error.Engine;
            var spec = c.engine_default_speculation();
            if (spec_on) {
                spec.draft = if (s.opts.drafter) c.ENGINE_DRAFT_MODEL else c.ENGINE_DRAFT_NGRAM;
                spec.max_tokens = s.opts.lookup;
            }
            if (c.engine_set_speculation(s.engine, ch.stream, &spec) != c.ENGINE_STATUS_OK) return error.Engine;
        }
    }

    /// Holds the choices' streams to the request's constraint from their next step on, which samples
    /// their first token (the constraint would refuse the prompt's tokens stepped after it).
    fn constrain(s: *Scheduler, r: *Request) !void {
        if (r.constraint == c.ENGINE_CONSTRAINT_NONE) return;
        r.constrained = true;
        for (r.choices) |ch| {
            const st = c.engine_set_constraint(s.engine, ch.stream, r.constraint, r.constraint_text.ptr, r.constraint_text.len);
            if (st != c.ENGINE_STATUS_OK) return error.Engine;
        }
    }

    /// After the shared part of the prompt: the other choices fork from the first stream and every choice
    /// steps the prompt's last token itself.
    fn enterDecode(s: *Scheduler, r: *Request) !void {
        const shared: u32 = @intCast(r.prefillEnd());
        for (r.choices[1..]) |ch| {
            if (shared > 0 and c.engine_fork(s.engine, r.choices[0].stream, ch.stream, shared) != c.ENGINE_STATUS_OK) return error.Engine;
        }
        try s.constrain(r);
        for (r.choices) |*ch| ch.pending = r.prompt[r.prompt.len - 1];
        r.decoding = true;
    }

    fn step(s: *Scheduler) void {
        s.items.clearRetainingCapacity();
        s.owners.clearRetainingCapacity();
        var budget: usize = s.opts.batch_tokens;
        for (s.running.items) |r| {
            if (!r.decoding) continue;
            for (r.choices, 0..) |*ch, k| {
                if (ch.finish != .none) continue;
                s.addItem(r, @intCast(k), ch.stream, @as([*]const i32, @ptrCast(&ch.pending))[0..1], &ch.spec_out) catch return;
                budget -|= 1;
            }
        }
        // Prompts get at least one small chunk a step, so decoding streams never starve them.
        budget = @max(budget, @min(32, s.opts.batch_tokens));
        for (s.running.items) |r| {
            if (r.decoding or budget == 0) continue;
            const end = r.prefillEnd();
            const chunk = @min(end - r.prefilled, budget, s.opts.chunk_tokens);
            if (r.score_prompt) {
                s.scoreChunk(r, chunk);
                budget -= chunk;
                continue;
            }
            if (r.prefillSamples() and r.prefilled + chunk == end) s.constrain(r) catch {
                r.cancelled.store(true, .release);
                s.fail(r, 400);
                continue;
            };
            s.addItem(r, null, r.choices[0].stream, r.prompt[r.prefilled .. r.prefilled + chunk], &r.choices[0].spec_out) catch return;
            s.owners.items[s.owners.items.len - 1].chunk = chunk;
            budget -= chunk;
        }
        if (s.items.items.len == 0) {
            s.dropCancelled();
            return;
        }

        const t0 = std.time.nanoTimestamp();
        const st = c.engine_step_batch(s.engine, s.items.items.ptr, s.items.items.len);
        metrics.observeStep(s.items.items.len, std.time.nanoTimestamp() - t0);
        if (st != c.ENGINE_STATUS_OK) {
            // A malformed batch is this server's bug; fail what was in it rather than loop on it.
            std.log.err("engine_step_batch: {s}: {s}", .{ c.engine_status_str(@intCast(st)), c.engine_last_error() });
            for (s.owners.items) |o| s.fail(o.req, 500);
        } else {
            for (s.items.items, s.owners.items) |*item, o| s.collect(item, o);
        }
        s.retireFinished();
    }

    fn addItem(s: *Scheduler, r: *Request, choice: ?u32, stream: u32, tokens: []const i32, out: []i32) !void {
        try s.items.append(gpa, .{
            .stream = stream,
            .tokens = tokens.ptr,
            .n = tokens.len,
            .next = -1,
            .status = c.ENGINE_STATUS_OK,
            .out = if (s.opts.lookup > 0) out.ptr else null,
            .out_cap = if (s.opts.lookup > 0) out.len else 0,
            .n_out = 0,
        });
        try s.owners.append(gpa, .{ .req = r, .choice = choice, .chunk = 0 });
    }

    fn collect(s: *Scheduler, item: *c.engine_batch_item, o: Owner) void {
        const r = o.req;
        if (r.failure != null) return;
        if (item.status != c.ENGINE_STATUS_OK) {
            if (o.choice) |k| {
                // Past the window or out of KV pages mid-generation: the choice ends as OpenAI's "length".
                s.finishChoice(r, &r.choices[k], .length);
            } else s.fail(r, if (item.status == c.ENGINE_STATUS_NO_ROOM) 503 else 400);
            return;
        }
        var own: [1]i32 = undefined;
        const ends_prefill = o.choice == null and r.prefilled + o.chunk >= r.prefillEnd() and r.prefillSamples();
        const produced: []const i32 = if (r.samplesItself() and (o.choice != null or ends_prefill)) own: {
            own[0] = s.sampleItself(r, &r.choices[o.choice orelse 0]) catch {
                s.fail(r, 500);
                return;
            };
            break :own &own;
        } else if (item.out != null and item.n_out > 0) item.out[0..item.n_out] else @as([*]const i32, @ptrCast(&item.next))[0..1];
        if (o.choice) |k| {
            const ch = &r.choices[k];
            for (produced) |tok| {
                s.takeToken(r, ch, tok);
                if (ch.finish != .none) break;
            }
            return;
        }
        r.prefilled += o.chunk;
        if (r.prefilled < r.prefillEnd()) return;
        s.countPrompt(r);
        if (r.prefillSamples()) {
            r.decoding = true;
            for (produced) |tok| {
                s.takeToken(r, &r.choices[0], tok);
                if (r.choices[0].finish != .none) break;
            }
        } else s.enterDecode(r) catch s.fail(r, 400);
    }

    /// Reads the next `chunk` tokens of a scored prompt with `engine_score` (beside the step, as a call of
    /// its own), keeping their log-probabilities; after the last, the last prompt token's from the logits
    /// the score left, and the choices go on to decode.
    fn scoreChunk(s: *Scheduler, r: *Request, chunk: usize) void {
        const tokens = r.prompt[r.prefilled .. r.prefilled + chunk];
        const lps = gpa.alloc(f32, chunk + 1) catch {
            s.fail(r, 500);
            return;
        };
        defer gpa.free(lps);
        const st = c.engine_score(s.engine, r.choices[0].stream, tokens.ptr, tokens.len, lps.ptr);
        if (st != c.ENGINE_STATUS_OK) {
            s.fail(r, if (st == c.ENGINE_STATUS_NO_ROOM) 503 else 400);
            return;
        }
        r.prefilled += chunk;
        var n = chunk;
        if (r.prefilled == r.prefillEnd()) {
            lps[chunk] = s.logprobAt(r.choices[0].stream, r.prompt[r.prompt.len - 1]) catch std.math.nan(f32);
            n += 1;
        }
        s.notePromptLogprobs(r, lps[0..n]);
        if (r.prefilled < r.prefillEnd()) return;
        s.countPrompt(r);
        s.enterDecode(r) catch s.fail(r, 400);
    }

    fn notePromptLogprobs(s: *Scheduler, r: *Request, lps: []const f32) void {
        r.sync.mutex.lock();
        defer r.sync.mutex.unlock();
        r.prompt_logprobs.appendSlice(gpa, lps) catch s.failLocked(r, 500);
    }

    /// Once the prompt is read: how many of its tokens the prefix cache gave and how many were computed,
    /// from the stream that read it (the last token, which every choice steps itself when n > 1, counted
    /// once as computed).
    fn countPrompt(s: *Scheduler, r: *Request) void {
        var cached: u64 = 0;
        var computed: u64 = 0;
        if (r.prefillEnd() > 0 and c.engine_prefix_stats(s.engine, r.choices[0].stream, &cached, &computed) != c.ENGINE_STATUS_OK) return;
        computed += r.prompt.len - r.prefillEnd();
        r.sync.mutex.lock();
        r.cached_tokens = cached;
        r.sync.mutex.unlock();
        metrics.addPromptReuse(cached, computed);
    }

    fn takeToken(s: *Scheduler, r: *Request, ch: *Choice, tok: i32) void {
        const now = std.time.nanoTimestamp();
        if (r.first_token_ns == 0) {
            r.first_token_ns = now;
            metrics.observeTtft(now - r.submitted_ns);
        } else if (ch.last_token_ns != 0) metrics.observeItl(now - ch.last_token_ns);
        ch.last_token_ns = now;

        if (c.engine_is_eog(s.engine, tok)) {
            s.finishChoice(r, ch, .stop);
            return;
        }
        ch.generated += 1;
        metrics.addCompletionTokens(1);
        if (r.samplesItself()) {
            const entry = ch.counts.getOrPut(gpa, tok) catch null;
            if (entry) |e| e.value_ptr.* = if (e.found_existing) e.value_ptr.* + 1 else 1;
        }
        var lp: ?TokenLogprob = null;
        if (r.top_logprobs) |k| lp = s.logprobOf(ch.stream, tok, k) catch null;

        var piece_buf: [256]u8 = undefined;
        const len = c.engine_token_piece(s.engine, tok, &piece_buf, piece_buf.len);
        const piece: []const u8 = if (len > 0) piece_buf[0..@min(@as(usize, @intCast(len)), piece_buf.len - 1)] else "";

        r.sync.mutex.lock();
        const stopped = ch.holder.push(gpa, piece, r.stops, &ch.out) catch true;
        if (lp) |v| ch.logprobs.append(gpa, v) catch {};
        r.sync.mutex.unlock();
        if (stopped) {
            s.finishChoice(r, ch, .stop);
        } else if (ch.generated >= r.max_tokens) {
            s.finishChoice(r, ch, .length);
        } else {
            ch.pending = tok;
            r.sync.cond.broadcast();
        }
    }

    /// Samples a choice's next token from its stream's logits: OpenAI's logit_bias added, its penalties
    /// subtracted (frequency_penalty times the token's count, presence_penalty once it occurred), then the
    /// request's temperature, top-k, top-p and min-p, among the ids its constraint allows when it has
    /// one; greedy at temperature 0. The draws come from the choice's own generator, seeded by the
    /// request's seed and the choice's index.
    fn sampleItself(s: *Scheduler, r: *Request, ch: *Choice) !i32 {
        const logits = s.logits;
        if (c.engine_logits(s.engine, ch.stream, logits.ptr, logits.len) != c.ENGINE_STATUS_OK) return error.Engine;
        for (r.logit_bias) |b| logits[@intCast(b.id)] += b.bias;
        var it = ch.counts.iterator();
        while (it.next()) |e| {
            const id: usize = @intCast(e.key_ptr.*);
            logits[id] -= r.frequency_penalty * @as(f32, @floatFromInt(e.value_ptr.*)) + r.presence_penalty;
        }
        // A constrained choice draws among the ids its constraint allows next, as the engine's draw would.
        var first_allowed: ?usize = null;
        if (r.constrained) {
            if (c.engine_allowed_tokens(s.engine, ch.stream, s.allowed.ptr, s.allowed.len) != c.ENGINE_STATUS_OK) return error.Engine;
            for (logits, 0..) |*x, i| {
                if (s.allowed[i / 32] >> @intCast(i % 32) & 1 == 0) {
                    x.* = -std.math.inf(f32);
                } else if (first_allowed == null) first_allowed = i;
            }
        }
        var best: usize = first_allowed orelse 0;
        for (logits, 0..) |x, i| if (x > logits[best]) {
            best = i;
        };
        const sp = r.sampling;
        if (!(sp.temperature > 0)) return @intCast(best);
        // Candidates: tokens within e^-30 of the likeliest (the rest weigh nothing next to it), likeliest first.
        s.candidates.clearRetainingCapacity();
        const floor = logits[best] - 30 * sp.temperature;
        for (logits, 0..) |x, i| if (x >= floor) try s.candidates.append(gpa, .{ .id = @intCast(i), .p = 0 });
        for (s.candidates.items) |*cand| cand.p = @exp((logits[@intCast(cand.id)] - logits[best]) / sp.temperature);
        std.mem.sort(Candidate, s.candidates.items, {}, Candidate.likelierFirst);
        var keep = s.candidates.items.len;
        if (sp.top_k > 0) keep = @min(keep, sp.top_k);
        var total: f64 = 0;
        for (s.candidates.items[0..keep]) |cand| total += cand.p;
        if (sp.top_p < 1) {
            var sum: f64 = 0;
            for (s.candidates.items[0..keep], 0..) |cand, i| {
                sum += cand.p;
                if (sum >= sp.top_p * total) {
                    keep = i + 1;
                    break;
                }
            }
        }
        if (sp.min_p > 0) {
            var i: usize = 1;
            while (i < keep and s.candidates.items[i].p >= sp.min_p) i += 1;
            keep = i;
        }
        total = 0;
        for (s.candidates.items[0..keep]) |cand| total += cand.p;
        var draw = ch.rng.random().float(f64) * total;
        for (s.candidates.items[0..keep]) |cand| {
            draw -= cand.p;
            if (draw <= 0) return cand.id;
        }
        return s.candidates.items[keep - 1].id;
    }

    /// Token `tok`'s log-probability after stream `stream`'s last step: the log-softmax of its logits.
    fn logprobAt(s: *Scheduler, stream: u32, tok: i32) !f32 {
        if (c.engine_logits(s.engine, stream, s.logits.ptr, s.logits.len) != c.ENGINE_STATUS_OK) return error.Engine;
        var max: f64 = -std.math.inf(f64);
        for (s.logits) |x| max = @max(max, x);
        var sum: f64 = 0;
        for (s.logits) |x| sum += @exp(@as(f64, x) - max);
        return @floatCast(@as(f64, s.logits[@intCast(tok)]) - (max + @log(sum)));
    }

    /// The sampled token's log-probability (from the logits, as it may lie outside the top k) and the
    /// k likeliest tokens', all before the sampling transforms.
    fn logprobOf(s: *Scheduler, stream: u32, tok: i32, k: u32) !TokenLogprob {
        const logprob = try s.logprobAt(stream, tok);
        const ids = try gpa.alloc(i32, k);
        errdefer gpa.free(ids);
        const lps = try gpa.alloc(f32, k);
        errdefer gpa.free(lps);
        if (c.engine_top_logprobs(s.engine, stream, k, ids.ptr, lps.ptr) != c.ENGINE_STATUS_OK) return error.Engine;
        return .{ .id = tok, .logprob = logprob, .top_ids = ids, .top_logprobs = lps };
    }

    fn finishChoice(s: *Scheduler, r: *Request, ch: *Choice, why: Finish) void {
        _ = s;
        r.sync.mutex.lock();
        defer r.sync.mutex.unlock();
        ch.holder.flush(gpa, &ch.out) catch {};
        ch.finish = why;
        r.sync.cond.broadcast();
    }

    fn fail(s: *Scheduler, r: *Request, status: u16) void {
        r.sync.mutex.lock();
        defer r.sync.mutex.unlock();
        s.failLocked(r, status);
    }

    fn failLocked(s: *Scheduler, r: *Request, status: u16) void {
        _ = s;
        if (r.failure == null) {
            const why = std.mem.span(c.engine_last_error());
            r.failure = gpa.dupe(u8, if (why.len > 0) why else "the engine refused the request") catch null;
            r.failure_status = status;
        }
        r.sync.cond.broadcast();
    }

    fn retireFinished(s: *Scheduler) void {
        var i: usize = 0;
        while (i < s.running.items.len) {
            const r = s.running.items[i];
            var done = r.failure != null;
            if (!done and r.decoding) {
                done = true;
                for (r.choices) |ch| done = done and ch.finish != .none;
            }
            if (done) {
                _ = s.running.orderedRemove(i);
                s.release(r);
            } else i += 1;
        }
    }

    /// Gives a running request's streams back and lets its connection thread go on without it.
    fn release(s: *Scheduler, r: *Request) void {
        var proposed: u64 = 0;
        var accepted: u64 = 0;
        for (r.choices) |ch| {
            var p: u64 = 0;
            var a: u64 = 0;
            if (c.engine_speculation_stats(s.engine, ch.stream, &p, &a) == c.ENGINE_STATUS_OK) {
                proposed += p;
                accepted += a;
            }
            if (r.constrained) _ = c.engine_set_constraint(s.engine, ch.stream, c.ENGINE_CONSTRAINT_NONE, null, 0);
            _ = c.engine_reset(s.engine, ch.stream);
        }
        // Back in reverse, so the next request takes the same streams in the same order: a sampled draw
        // depends on (seed, stream, position), and a seeded request repeated alone repeats its output.
        var k = r.choices.len;
        while (k > 0) {
            k -= 1;
            s.free_streams.append(gpa, r.choices[k].stream) catch {};
        }
        metrics.addSpeculation(proposed, accepted);
        s.reserved -= r.reserved;
        r.reserved = 0;
        s.markReleased(r);
    }

    fn releaseWaiting(s: *Scheduler, r: *Request, why: ?[]const u8, status: u16) void {
        if (why) |w| {
            r.sync.mutex.lock();
            r.failure = gpa.dupe(u8, w) catch null;
            r.failure_status = status;
            r.sync.mutex.unlock();
        }
        s.markReleased(r);
    }

    fn markReleased(s: *Scheduler, r: *Request) void {
        _ = s.live.fetchSub(1, .monotonic);
        r.sync.mutex.lock();
        defer r.sync.mutex.unlock();
        r.released = true;
        r.sync.cond.broadcast();
    }
};
