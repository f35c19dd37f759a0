//! Builds the Zig caller of hostembed: `python3 -m ziglang build run` (zig 0.15.2, from the ziglang wheel).
//! -Dlib-dir names the folder holding libhostembed.so (default ../../target/release); the program
//! carries it as an rpath, so it runs without LD_LIBRARY_PATH.
const std = @import("std");

pub fn build(b: *std.Build) void {
    const target = b.standardTargetOptions(.{});
    const optimize = b.standardOptimizeOption(.{});
    const lib_dir = b.option([]const u8, "lib-dir", "folder holding libhostembed.so") orelse
        b.pathFromRoot("../../target/release");
    const include_dir = b.pathFromRoot("../../include");

    const module = b.createModule(.{
        .root_source_file = b.path("src/main.zig"),
        .target = target,
        .optimize = optimize,
        .link_libc = true,
    });
    module.addIncludePath(.{ .cwd_relative = include_dir });
    module.addLibraryPath(.{ .cwd_relative = lib_dir });
    module.addRPath(.{ .cwd_relative = lib_dir });
    module.linkSystemLibrary("hostembed", .{});

    const exe = b.addExecutable(.{ .name = "hostembed-fit", .root_module = module });
    b.installArtifact(exe);

    const run = b.addRunArtifact(exe);
    run.step.dependOn(b.getInstallStep());
    b.step("run", "print the fit plan for the seed's 98k case").dependOn(&run.step);
}
