//! Builds hostembed-server through the hostembed package at the repository's root (build.zig.zon names
//! it), as any Zig caller would: `zig build` (zig 0.15.2). -Dlib-dir names the folder holding
//! libhostembed.so (an installed PREFIX/lib, or ../target/release); without it the package builds the
//! library with cargo. -Drpath adds a run-time search path such as `$ORIGIN/..`, for a binary that is
//! moved with the library (scripts/gpu-build.sh's bundle).
const std = @import("std");

pub fn build(b: *std.Build) void {
    const target = b.standardTargetOptions(.{});
    const optimize = b.standardOptimizeOption(.{});
    const lib_dir = b.option([]const u8, "lib-dir", "folder holding libhostembed.so");
    const rpath = b.option([]const u8, "rpath", "another run-time search path, as given ($ORIGIN/.. finds the library beside a moved folder)");
    const hostembed = b.dependency("hostembed", .{ .target = target, .optimize = optimize, .@"lib-dir" = lib_dir });

    const module = b.createModule(.{
        .root_source_file = b.path("src/main.zig"),
        .target = target,
        .optimize = optimize,
        .link_libc = true,
    });
    module.addImport("hostembed", hostembed.module("hostembed"));
    if (rpath) |r| module.addRPathSpecial(r);

    const exe = b.addExecutable(.{ .name = "hostembed-server", .root_module = module });
    b.installArtifact(exe);

    const run = b.addRunArtifact(exe);
    run.step.dependOn(b.getInstallStep());
    if (b.args) |args| run.addArgs(args);
    b.step("run", "run the server (arguments after --)").dependOn(&run.step);

    const unit = b.addTest(.{ .root_module = b.createModule(.{
        .root_source_file = b.path("src/text.zig"),
        .target = target,
        .optimize = optimize,
    }) });
    const unit_tools = b.addTest(.{ .root_module = b.createModule(.{
        .root_source_file = b.path("src/tools.zig"),
        .target = target,
        .optimize = optimize,
    }) });
    const unit_calls = b.addTest(.{ .root_module = b.createModule(.{
        .root_source_file = b.path("src/tool_calls.zig"),
        .target = target,
        .optimize = optimize,
    }) });
    const test_step = b.step("test", "unit tests of the text handling (UTF-8 holding, stop strings, JSON escaping) and of tool calls");
    test_step.dependOn(&b.addRunArtifact(unit).step);
    test_step.dependOn(&b.addRunArtifact(unit_tools).step);
    test_step.dependOn(&b.addRunArtifact(unit_calls).step);
}
