//! The committed header is the one the sources generate, it compiles cleanly as C99 and C++17
//! (twice in one unit), it carries the crate's version, and a C program agrees with the library on the
//! ABI version and the version.

mod native;

use std::ffi::OsStr;
use std::fs;

#[test]
fn committed_header_is_current() {
    let generated = env!("HOSTEMBED_GENERATED_HEADER");
    let generated = fs::read_to_string(generated).unwrap_or_else(|e| {
        panic!("{generated}: {e}: cbindgen could not generate the header (see the build's warning)")
    });
    let committed = native::repo().join("include/hostembed.h");
    let committed = fs::read_to_string(&committed).unwrap_or_else(|e| panic!("{}: {e}", committed.display()));
    if generated != committed {
        let first = generated.lines().zip(committed.lines()).position(|(g, c)| g != c);
        let line = first.unwrap_or_else(|| generated.lines().count().min(committed.lines().count()));
        panic!(
            "include/hostembed.h differs from the header the sources generate (first at line {}): run scripts/update-header.sh\n  generated: {:?}\n  committed: {:?}",
            line + 1,
            generated.lines().nth(line).unwrap_or("<end>"),
            committed.lines().nth(line).unwrap_or("<end>")
        );
    }
}

/// Includes the header twice, then uses a little of it so an unusable declaration shows up too.
const TWICE: &str = r#"#include "hostembed.h"
#include "hostembed.h"

int use_the_header(void);
int use_the_header(void) {
    engine_fit_inputs in = engine_fit_default_inputs();
    engine_plan plan;
    struct engine_device_info info;
    engine_status status = engine_fit_plan(&in, &plan);
    (void)info;
    return (int)status + (int)plan.placement + (int)HOSTEMBED_ABI_VERSION;
}
"#;

fn syntax_check(compiler: &str, flags: &[&str], file: &str) {
    let dir = native::scratch(&format!("header-{file}"));
    let source = dir.join(file);
    fs::write(&source, TWICE).unwrap();
    let include = native::repo().join("include");
    let mut args: Vec<&OsStr> = flags.iter().map(|s| s.as_ref()).collect();
    args.extend(["-fsyntax-only".as_ref(), "-I".as_ref(), include.as_os_str(), source.as_os_str()]);
    native::compile(compiler, &args, &format!("include/hostembed.h included twice in {file}"));
}

#[test]
fn header_compiles_as_c99_twice_in_one_unit() {
    syntax_check(&native::c_compiler(), native::C99, "twice.c");
}

#[test]
fn header_compiles_as_cxx17_twice_in_one_unit() {
    syntax_check(&native::cxx_compiler(), native::CXX17, "twice.cpp");
}

#[test]
fn c_program_sees_the_header_abi_version() {
    let dir = native::scratch("abi-version");
    let source = dir.join("abi.c");
    fs::write(
        &source,
        r#"#include <stdio.h>
#include <string.h>
#include "hostembed.h"

int main(void) {
    uint32_t loaded = engine_abi_version();
    printf("header %u library %u\n", (unsigned)HOSTEMBED_ABI_VERSION, (unsigned)loaded);
    printf("header %s library %s\n", HOSTEMBED_VERSION, engine_version());
    return loaded == HOSTEMBED_ABI_VERSION && strcmp(engine_version(), HOSTEMBED_VERSION) == 0 ? 0 : 1;
}
"#,
    )
    .unwrap();
    let exe = dir.join("abi");
    native::build_c_program(&source, &exe);
    let out = native::run(&exe, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the library's ABI version differs from the header's: {stdout}");
    let expected = format!(
        "header {v} library {v}\nheader {c} library {c}\n",
        v = hostembed::ffi::HOSTEMBED_ABI_VERSION,
        c = env!("CARGO_PKG_VERSION")
    );
    assert_eq!(stdout, expected);
}

/// The header's version macros are Cargo.toml's version, and so are what `engine_version()` returns
/// and the Zig package's version.
#[test]
fn header_library_and_zig_package_carry_the_crate_version() {
    let header = fs::read_to_string(native::repo().join("include/hostembed.h")).unwrap();
    let version = env!("CARGO_PKG_VERSION");
    let defines = [
        ("HOSTEMBED_VERSION_MAJOR", env!("CARGO_PKG_VERSION_MAJOR").to_string()),
        ("HOSTEMBED_VERSION_MINOR", env!("CARGO_PKG_VERSION_MINOR").to_string()),
        ("HOSTEMBED_VERSION_PATCH", env!("CARGO_PKG_VERSION_PATCH").to_string()),
        ("HOSTEMBED_VERSION", format!("\"{version}\"")),
    ];
    for (name, value) in defines {
        let line = format!("#define {name} {value}");
        assert!(header.lines().any(|l| l == line), "include/hostembed.h lacks `{line}`");
    }
    // SAFETY: engine_version returns a pointer to a static NUL-terminated string.
    let loaded = unsafe { std::ffi::CStr::from_ptr(hostembed::ffi::engine_version()) };
    assert_eq!(loaded.to_str().unwrap(), version);
    let zon = fs::read_to_string(native::repo().join("build.zig.zon")).unwrap();
    let line = format!(".version = \"{version}\",");
    assert!(zon.lines().any(|l| l.trim() == line), "build.zig.zon lacks `{line}`");
}

/// Internal constants must not leak into callers' namespace as bare macros like VERSION.
#[test]
fn every_macro_in_the_header_is_prefixed() {
    let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/hostembed.h")).unwrap();
    let bare: Vec<&str> = header
        .lines()
        .filter_map(|l| l.trim().strip_prefix("#define "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| !name.starts_with("HOSTEMBED_") && !name.starts_with("ENGINE_"))
        .collect();
    assert!(bare.is_empty(), "unprefixed macros in include/hostembed.h: {bare:?}");
}
