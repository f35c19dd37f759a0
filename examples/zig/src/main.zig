//! Prints hostembed's fit plan and start-up line for the seed's 24 GB card at a 98304-token window.
const std = @import("std");
const c = @import("hostembed");

const MiB: u64 = 1 << 20;

fn placementName(placement: c.engine_placement) []const u8 {
    return switch (placement) {
        c.ENGINE_PLACEMENT_DEVICE => "device",
        c.ENGINE_PLACEMENT_HOST_MAPPED => "host_mapped",
        c.ENGINE_PLACEMENT_FILE_MAPPED => "file_mapped",
        else => "?",
    };
}

pub fn main() !void {
    var stdout_buffer: [4096]u8 = undefined;
    var stdout_writer = std.fs.File.stdout().writer(&stdout_buffer);
    const out = &stdout_writer.interface;

    if (c.engine_abi_version() != c.HOSTEMBED_ABI_VERSION) {
        std.debug.print("libhostembed ABI {d}, header {d}\n", .{ c.engine_abi_version(), c.HOSTEMBED_ABI_VERSION });
        return error.AbiMismatch;
    }

    // The seed's receipt: 248,320 bf16 rows of 5,120, streams of 64 KiB a token plus 922 MiB.
    const window: u32 = 98304;
    var in = c.engine_fit_default_inputs();
    in.room_bytes = 22754 * MiB;
    in.weight_bytes = 14236 * MiB;
    in.embed_bytes = 248320 * 5120 * 2;
    in.scratch_bytes = 700 * MiB;
    in.stream_bytes = 564 * MiB + @as(u64, window) * 64 * 1024;
    in.stream_bytes_per_token = 64 * 1024;
    in.drafter_weight_bytes = 1100 * MiB;
    in.drafter_stream_bytes = 358 * MiB;
    in.window = window;

    var plan: c.engine_plan = undefined;
    const status = c.engine_fit_plan(&in, &plan);
    if (status != c.ENGINE_STATUS_OK and status != c.ENGINE_STATUS_NO_ROOM) {
        std.debug.print("engine_fit_plan: {s}: {s}\n", .{ c.engine_status_str(status), c.engine_last_error() });
        return error.FitFailed;
    }

    try out.print("placement            {s}\n", .{placementName(plan.placement)});
    try out.print("streams              {d}\n", .{plan.streams});
    try out.print("window               {d}\n", .{plan.window});
    try out.print("need_bytes           {d}\n", .{plan.need_bytes});
    try out.print("on_card_bytes        {d}\n", .{plan.on_card_bytes});
    try out.print("left_bytes           {d}\n", .{plan.left_bytes});
    try out.print("stream_bytes         {d}\n", .{plan.stream_bytes});
    try out.print("embed_host_bytes     {d}\n", .{plan.embed_host_bytes});
    try out.print("max_window_on_card   {d}\n", .{plan.max_window_on_card});
    try out.print("max_window           {d} ({s})\n", .{ plan.max_window, placementName(plan.max_window_placement) });
    try out.print("max_window_unmapped  {d}\n", .{plan.max_window_unmapped});

    var line: [512]u8 = undefined;
    const needed = c.engine_plan_describe(&plan, &line, line.len);
    if (needed == 0 or needed >= line.len) {
        std.debug.print("engine_plan_describe returned {d}: {s}\n", .{ needed, c.engine_last_error() });
        return error.DescribeFailed;
    }
    try out.print("{s}\n", .{line[0..needed]});
    if (status == c.ENGINE_STATUS_NO_ROOM) try out.print("refused: {s}\n", .{c.engine_last_error()});
    try out.flush();
}
