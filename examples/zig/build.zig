//! Builds the Zig caller of hostembed through the package at the repository's root (build.zig.zon
//! names it): `python3 -m ziglang build run` (zig 0.15.2, from the ziglang wheel). -Dlib-dir names
//! the folder holding libhostembed.so (an installed PREFIX/lib, or ../../target/release); without it
//! the package builds the library with cargo.
const std = @import("std");

pub fn build(b: *std.Build) void {
    const target = b.standardTargetOptions(.{});
    const optimize = b.standardOptimizeOption(.{});
    const lib_dir = b.option([]const u8, "lib-dir", "folder holding libhostembed.so");
    const hostembed = b.dependency("hostembed", .{ .target = target, .optimize = optimize, .@"lib-dir" = lib_dir });

    const module = b.createModule(.{
        .root_source_file = b.path("src/main.zig"),
        .target = target,
        .optimize = optimize,
        .link_libc = true,
    });
    module.addImport("hostembed", hostembed.module("hostembed"));

    const exe = b.addExecutable(.{ .name = "hostembed-fit", .root_module = module });
    b.installArtifact(exe);

    const run = b.addRunArtifact(exe);
    run.step.dependOn(b.getInstallStep());
    b.step("run", "print the fit plan for the seed's 98k case").dependOn(&run.step);
}
