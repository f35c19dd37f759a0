//! The hostembed Zig package (zig 0.15.2). A project names it in its build.zig.zon (`.path`, or a URL
//! with its hash) and imports the module "hostembed", the C header translated, with the library linked:
//!     const hostembed = b.dependency("hostembed", .{ .target = target, .optimize = optimize });
//!     exe.root_module.addImport("hostembed", hostembed.module("hostembed"));
//! -Dlib-dir=DIR links the libhostembed.so in DIR (an installed one: PREFIX/lib); without it the package
//! builds the library with `cargo build --release --lib` (cargo's environment picks the kernels, as for
//! scripts/install.sh) and links target/release's. The program carries the folder as an rpath.
const std = @import("std");

pub fn build(b: *std.Build) void {
    const target = b.standardTargetOptions(.{});
    const optimize = b.standardOptimizeOption(.{});
    const lib_dir = b.option([]const u8, "lib-dir", "folder holding libhostembed.so (default: cargo builds it into target/release)");

    const header = b.addTranslateC(.{
        .root_source_file = b.path("include/hostembed.h"),
        .target = target,
        .optimize = optimize,
    });
    const module = header.addModule("hostembed");
    const lib_path: std.Build.LazyPath = if (lib_dir) |dir| .{ .cwd_relative = dir } else path: {
        const cargo = b.addSystemCommand(&.{ "cargo", "build", "--release", "--lib" });
        cargo.setCwd(b.path("."));
        // Everything that imports the module waits for the library through the translated header.
        header.step.dependOn(&cargo.step);
        break :path b.path("target/release");
    };
    module.addLibraryPath(lib_path);
    module.addRPath(lib_path);
    module.linkSystemLibrary("hostembed", .{ .use_pkg_config = .no });
}
