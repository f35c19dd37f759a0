//! scripts/install.sh staged under a DESTDIR: the tree a C library installs (the shared library with
//! its soname and links, the static library, the header, the pkg-config file), and C programs linked
//! against it, shared and static, print the version Cargo.toml gives.

mod native;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const VERSION: &str = env!("CARGO_PKG_VERSION");
const MAJOR: &str = env!("CARGO_PKG_VERSION_MAJOR");
const PREFIX: &str = "/opt/hostembed";

/// Runs the install script into a fresh DESTDIR, with the profile and the features these tests were built
/// with: the shared library is then the one cargo test built, not a rebuild without the checkpoint
/// writers (which add no C function).
fn install() -> PathBuf {
    let stage = native::scratch("install");
    let profile = match native::profile_dir().file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev".to_string(),
        Some(name) => name.to_string(),
        None => panic!("no profile folder above {}", native::profile_dir().display()),
    };
    let out = Command::new(native::repo().join("scripts/install.sh"))
        .args(["--prefix", PREFIX, "--profile", &profile, "--features", "fixtures"])
        .env("DESTDIR", &stage)
        .output()
        .expect("run scripts/install.sh");
    assert!(
        out.status.success(),
        "scripts/install.sh failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    stage.join(PREFIX.trim_start_matches('/'))
}

/// Runs a tool without cargo's LD_LIBRARY_PATH (which names the build's own library folders).
fn tool(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `Key: value` fields and `name=value` variables of a .pc file.
fn pc_fields(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| l.split_once(": ").or_else(|| l.split_once('=')))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

const PROGRAM: &str = r#"#include <stdio.h>
#include "hostembed.h"

int main(void) {
    printf("%s %s %d.%d.%d %u %u\n", engine_version(), HOSTEMBED_VERSION, HOSTEMBED_VERSION_MAJOR,
           HOSTEMBED_VERSION_MINOR, HOSTEMBED_VERSION_PATCH, (unsigned)engine_abi_version(),
           (unsigned)HOSTEMBED_ABI_VERSION);
    return 0;
}
"#;

/// Compiles PROGRAM against the installed header with `link` for the library, runs it (without
/// LD_LIBRARY_PATH), checks the versions it prints and returns its `ldd` lines.
fn build_and_run(root: &Path, name: &str, link: &[String]) -> String {
    let dir = root.parent().unwrap().join("programs");
    fs::create_dir_all(&dir).unwrap();
    let source = dir.join(format!("{name}.c"));
    fs::write(&source, PROGRAM).unwrap();
    let exe = dir.join(name);
    let include = format!("-I{}", root.join("include").display());
    let mut args: Vec<String> = native::C99.iter().map(|s| s.to_string()).collect();
    args.extend([include, source.display().to_string(), "-o".into(), exe.display().to_string()]);
    args.extend(link.iter().cloned());
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|s| s.as_ref()).collect();
    native::compile(&native::c_compiler(), &args, name);

    let out = native::run(&exe, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{name}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    let abi = hostembed::ffi::HOSTEMBED_ABI_VERSION;
    assert_eq!(stdout, format!("{VERSION} {VERSION} {VERSION} {abi} {abi}\n"), "{name}");
    tool("ldd", &[exe.to_str().unwrap()])
}

#[test]
fn install_stages_a_c_library_tree() {
    let root = install();
    let lib = root.join("lib");
    let real = format!("libhostembed.so.{VERSION}");
    let soname = format!("libhostembed.so.{MAJOR}");

    // The shared library under its full version, named by its soname, and the links to it.
    assert!(fs::symlink_metadata(lib.join(&real)).unwrap().file_type().is_file(), "{real} is not a file");
    assert_eq!(fs::read_link(lib.join(&soname)).unwrap(), Path::new(&real));
    assert_eq!(fs::read_link(lib.join("libhostembed.so")).unwrap(), Path::new(&soname));
    let dynamic = tool("readelf", &["-d", lib.join(&real).to_str().unwrap()]);
    assert!(dynamic.contains(&format!("Library soname: [{soname}]")), "{real} has no soname {soname}:\n{dynamic}");

    let archive = fs::read(lib.join("libhostembed.a")).unwrap();
    assert!(archive.starts_with(b"!<arch>\n"), "libhostembed.a is not an archive");

    let header = fs::read_to_string(root.join("include/hostembed.h")).unwrap();
    assert_eq!(header, fs::read_to_string(native::repo().join("include/hostembed.h")).unwrap());

    let pc = fs::read_to_string(lib.join("pkgconfig/hostembed.pc")).unwrap();
    let fields = pc_fields(&pc);
    let field = |key: &str| {
        fields.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str()).unwrap_or_else(|| panic!("no {key} in:\n{pc}"))
    };
    assert_eq!(field("prefix"), PREFIX);
    assert_eq!(field("libdir"), "${exec_prefix}/lib");
    assert_eq!(field("includedir"), "${prefix}/include");
    assert_eq!(field("Name"), "hostembed");
    assert_eq!(field("Version"), VERSION);
    assert_eq!(field("Libs"), "-L${libdir} -lhostembed");
    assert_eq!(field("Cflags"), "-I${includedir}");
    let private = field("Libs.private");
    for system in ["-lpthread", "-ldl", "-lc"] {
        assert!(private.split_whitespace().any(|l| l == system), "Libs.private lacks {system}: {private}");
    }

    // Linked the way `pkg-config --libs` says, and statically with what `--static` adds.
    let libdir = format!("-L{}", lib.display());
    let rpath = format!("-Wl,-rpath,{}", lib.display());
    let shared = build_and_run(&root, "shared", &[libdir.clone(), "-lhostembed".into(), rpath]);
    let expected = format!("{soname} => {}", lib.join(&soname).display());
    assert!(shared.contains(&expected), "the shared program does not load {expected}:\n{shared}");

    let mut link = vec![libdir, "-l:libhostembed.a".to_string()];
    link.extend(private.split_whitespace().map(str::to_string));
    let linked = build_and_run(&root, "static", &link);
    for name in ["libhostembed", "libcuda", "libcudart", "libcublas"] {
        assert!(!linked.contains(name), "the statically linked program loads {name}:\n{linked}");
    }
}
