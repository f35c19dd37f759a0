//! Builds and runs small C programs against include/hostembed.h and the libhostembed.so cargo built.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const C99: &[&str] = &["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic"];
pub const CXX17: &[&str] = &["-std=c++17", "-Wall", "-Wextra", "-Werror"];

pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// target/<profile>/, found from this test binary's own path (target/<profile>/deps/<test>).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

/// The cdylib cargo built with the rlib this test links: in deps/ beside the test binary (`cargo test`
/// leaves it there), else target/<profile>/ where `cargo build` copies it.
pub fn library_dir() -> PathBuf {
    let deps = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    [deps, profile_dir()].into_iter().find(|d| d.join("libhostembed.so").is_file()).unwrap_or_else(|| {
        panic!(
            "no libhostembed.so in {} or its parent: cargo builds the cdylib with the package",
            profile_dir().display()
        )
    })
}

/// A fresh folder for this test's outputs under target/<profile>/native-tests/.
pub fn scratch(test: &str) -> PathBuf {
    let dir = profile_dir().join("native-tests").join(format!("{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn c_compiler() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

pub fn cxx_compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

/// Runs a compiler and fails the test with its diagnostics when it does not succeed.
pub fn compile(compiler: &str, args: &[&std::ffi::OsStr], what: &str) {
    let out = Command::new(compiler).args(args).output().unwrap_or_else(|e| panic!("{what}: run {compiler}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {compiler} {:?} failed:\n{}{}",
        args,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Compiles `source` as C99 with every warning an error, against include/ and libhostembed.so,
/// with an rpath so the program runs without LD_LIBRARY_PATH.
pub fn build_c_program(source: &Path, exe: &Path) {
    let lib = library_dir();
    let include = repo().join("include");
    let rpath = format!("-Wl,-rpath,{}", lib.display());
    let mut args: Vec<&std::ffi::OsStr> = C99.iter().map(|s| s.as_ref()).collect();
    args.extend([
        "-I".as_ref(),
        include.as_os_str(),
        source.as_os_str(),
        "-o".as_ref(),
        exe.as_os_str(),
        "-L".as_ref(),
        lib.as_os_str(),
        "-lhostembed".as_ref(),
        // examples/perplexity.c's exp and sqrt.
        "-lm".as_ref(),
        rpath.as_ref(),
    ]);
    compile(&c_compiler(), &args, &source.display().to_string());
}

pub fn run(exe: &Path, args: &[&str]) -> Output {
    Command::new(exe)
        .args(args)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()))
}
