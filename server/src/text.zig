//! The text a choice streams: stop strings matched across token boundaries and never emitted, and only
//! whole UTF-8 characters let out; JSON string escaping for the responses.
const std = @import("std");

const Allocator = std.mem.Allocator;

/// Bytes decoded but not yet let out, and what decides when they may go.
pub const Holder = struct {
    held: std.ArrayList(u8) = .empty,

    pub fn deinit(h: *Holder, gpa: Allocator) void {
        h.held.deinit(gpa);
    }

    /// Takes a token's bytes; appends to `out` what can be let out now. Returns true when a stop string
    /// was found: `out` then ends right before it and nothing past it is kept.
    pub fn push(h: *Holder, gpa: Allocator, piece: []const u8, stops: []const []const u8, out: *std.ArrayList(u8)) !bool {
        try h.held.appendSlice(gpa, piece);
        const held = h.held.items;
        // The earliest stop string wins, as if the text had been scanned left to right.
        var first: ?usize = null;
        for (stops) |stop| {
            if (stop.len == 0) continue;
            if (std.mem.indexOf(u8, held, stop)) |at| {
                if (first == null or at < first.?) first = at;
            }
        }
        if (first) |at| {
            try appendValidUtf8(gpa, out, held[0..at]);
            h.held.clearRetainingCapacity();
            return true;
        }
        // A tail that may still grow into a stop string is kept back.
        var keep: usize = 0;
        for (stops) |stop| keep = @max(keep, partialSuffix(held, stop));
        var ready = held.len - keep;
        ready -= incompleteUtf8Tail(held[0..ready]);
        try appendValidUtf8(gpa, out, held[0..ready]);
        std.mem.copyForwards(u8, h.held.items[0 .. held.len - ready], held[ready..]);
        h.held.shrinkRetainingCapacity(held.len - ready);
        return false;
    }

    /// Lets out what is held (the generation ended): an incomplete character becomes U+FFFD.
    pub fn flush(h: *Holder, gpa: Allocator, out: *std.ArrayList(u8)) !void {
        try appendValidUtf8(gpa, out, h.held.items);
        h.held.clearRetainingCapacity();
    }
};

/// The length of the longest proper suffix of `text` that is a prefix of `stop`.
fn partialSuffix(text: []const u8, stop: []const u8) usize {
    if (stop.len == 0) return 0;
    var n = @min(text.len, stop.len - 1);
    while (n > 0) : (n -= 1) {
        if (std.mem.eql(u8, text[text.len - n ..], stop[0..n])) return n;
    }
    return 0;
}

/// How many bytes at the end of `text` begin a UTF-8 character that is not complete yet (0..3).
pub fn incompleteUtf8Tail(text: []const u8) usize {
    var back: usize = 1;
    while (back <= 3 and back <= text.len) : (back += 1) {
        const b = text[text.len - back];
        if (b & 0xC0 == 0x80) continue; // a continuation byte: look further back
        const need: usize = if (b & 0xE0 == 0xC0) 2 else if (b & 0xF0 == 0xE0) 3 else if (b & 0xF8 == 0xF0) 4 else 1;
        return if (need > back) back else 0;
    }
    return 0;
}

/// Appends `bytes` with every invalid sequence replaced by U+FFFD, so what leaves is always UTF-8.
pub fn appendValidUtf8(gpa: Allocator, out: *std.ArrayList(u8), bytes: []const u8) !void {
    var i: usize = 0;
    while (i < bytes.len) {
        const len = std.unicode.utf8ByteSequenceLength(bytes[i]) catch {
            try out.appendSlice(gpa, "\u{FFFD}");
            i += 1;
            continue;
        };
        if (i + len <= bytes.len and std.unicode.utf8ValidateSlice(bytes[i .. i + len])) {
            try out.appendSlice(gpa, bytes[i .. i + len]);
            i += len;
        } else {
            try out.appendSlice(gpa, "\u{FFFD}");
            i += 1;
        }
    }
}

/// Appends `s` as a JSON string literal (quotes included); `s` must be UTF-8.
pub fn appendJsonString(gpa: Allocator, out: *std.ArrayList(u8), s: []const u8) !void {
    try out.append(gpa, '"');
    for (s) |c| {
        switch (c) {
            '"' => try out.appendSlice(gpa, "\\\""),
            '\\' => try out.appendSlice(gpa, "\\\\"),
            '\n' => try out.appendSlice(gpa, "\\n"),
            '\r' => try out.appendSlice(gpa, "\\r"),
            '\t' => try out.appendSlice(gpa, "\\t"),
            0...8, 11, 12, 14...0x1f, 0x7f => try out.print(gpa, "\\u{x:0>4}", .{c}),
            else => try out.append(gpa, c),
        }
    }
    try out.append(gpa, '"');
}

/// Appends `s` as a JSON string literal, invalid UTF-8 replaced by U+FFFD first.
pub fn appendValidJsonString(gpa: Allocator, out: *std.ArrayList(u8), s: []const u8) !void {
    if (std.unicode.utf8ValidateSlice(s)) return appendJsonString(gpa, out, s);
    var valid: std.ArrayList(u8) = .empty;
    defer valid.deinit(gpa);
    try appendValidUtf8(gpa, &valid, s);
    try appendJsonString(gpa, out, valid.items);
}

/// Appends a float as JSON (NaN and infinities, which JSON lacks, as the lowest finite float).
pub fn appendJsonFloat(gpa: Allocator, out: *std.ArrayList(u8), x: f64) !void {
    const v = if (std.math.isFinite(x)) x else -std.math.floatMax(f32);
    try out.print(gpa, "{d}", .{v});
}

/// A holder the tests below feed, and all it has let out so far.
const Fed = struct {
    h: Holder = .{},
    out: std.ArrayList(u8) = .empty,

    fn deinit(f: *Fed) void {
        f.h.deinit(std.testing.allocator);
        f.out.deinit(std.testing.allocator);
    }

    fn push(f: *Fed, piece: []const u8, stops: []const []const u8) !bool {
        return f.h.push(std.testing.allocator, piece, stops, &f.out);
    }

    /// Pushes `piece` and expects no stop string found and `so_far` let out in all.
    fn expectHeld(f: *Fed, piece: []const u8, stops: []const []const u8, so_far: []const u8) !void {
        try std.testing.expect(!try f.push(piece, stops));
        try std.testing.expectEqualStrings(so_far, f.out.items);
    }
};

test "a stop string split across tokens is never let out" {
    var f: Fed = .{};
    defer f.deinit();
    const stops = [_][]const u8{"END"};
    try f.expectHeld("abc E", &stops, "abc ");
    try f.expectHeld("N", &stops, "abc ");
    try std.testing.expect(try f.push("Dxyz", &stops));
    try std.testing.expectEqualStrings("abc ", f.out.items);
}

test "a false start of a stop string is let out once it cannot match" {
    var f: Fed = .{};
    defer f.deinit();
    const stops = [_][]const u8{"END"};
    try std.testing.expect(!try f.push("EN", &stops));
    try f.expectHeld("X", &stops, "ENX");
}

test "a character split across tokens is held until whole" {
    var f: Fed = .{};
    defer f.deinit();
    const euro = "\u{20AC}"; // three bytes
    try f.expectHeld("a" ++ euro[0..1], &.{}, "a");
    try f.expectHeld(euro[1..2], &.{}, "a");
    try f.expectHeld(euro[2..3], &.{}, "a" ++ euro);
}

test "invalid bytes become U+FFFD and an unfinished character too at the end" {
    var f: Fed = .{};
    defer f.deinit();
    try f.expectHeld("x\xffy\xe2\x82", &.{}, "x\u{FFFD}y");
    try f.h.flush(std.testing.allocator, &f.out);
    try std.testing.expectEqualStrings("x\u{FFFD}y\u{FFFD}\u{FFFD}", f.out.items);
}

test "JSON strings escape quotes and control characters" {
    const gpa = std.testing.allocator;
    var out: std.ArrayList(u8) = .empty;
    defer out.deinit(gpa);
    try appendJsonString(gpa, &out, "a\"b\\\n\x01");
    try std.testing.expectEqualStrings("\"a\\\"b\\\\\\n\\u0001\"", out.items);
}
