#!/usr/bin/env bash
# Builds the library as shipped and installs it as a C library into PREFIX (default /usr/local),
# staged under DESTDIR when that is set:
#   lib/libhostembed.so.X.Y.Z (soname libhostembed.so.X), lib/libhostembed.so.X and lib/libhostembed.so
#   lib/libhostembed.a, include/hostembed.h, lib/pkgconfig/hostembed.pc
# X.Y.Z is Cargo.toml's version. The build takes cargo's environment: by default every kernel
# architecture (HOSTEMBED_CUDA_ARCHS=native builds this machine's only, HOSTEMBED_NO_CUDA=1 none).
# Usage: scripts/install.sh [--prefix DIR] [--libdir DIR] [--profile NAME] [--features LIST]  (or PREFIX=DIR)
# --profile and --features are cargo's (tests/install.rs installs the build the tests already made).
set -euo pipefail
# A relative DESTDIR names a folder under the caller's directory, not the repository's.
case "${DESTDIR:-}" in '' | /*) ;; *) DESTDIR=$PWD/$DESTDIR ;; esac
cd "$(dirname "$0")/.."

prefix=${PREFIX:-/usr/local}
libdir=
profile=release
features=()
usage() { echo "usage: scripts/install.sh [--prefix DIR] [--libdir DIR] [--profile NAME] [--features LIST]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) [ $# -ge 2 ] || usage; prefix=$2; shift 2 ;;
    --prefix=*) prefix=${1#*=}; shift ;;
    --libdir) [ $# -ge 2 ] || usage; libdir=$2; shift 2 ;;
    --libdir=*) libdir=${1#*=}; shift ;;
    --profile) [ $# -ge 2 ] || usage; profile=$2; shift 2 ;;
    --profile=*) profile=${1#*=}; shift ;;
    --features) [ $# -ge 2 ] || usage; features=(--features "$2"); shift 2 ;;
    --features=*) features=(--features "${1#*=}"); shift ;;
    *) usage ;;
  esac
done
case "$prefix" in /*) ;; *) echo "install.sh: --prefix must be an absolute path: $prefix" >&2; exit 2 ;; esac
# The .pc file names the library folder relative to the prefix when it lies under it.
case "$libdir" in
  '') libdir=$prefix/lib; pc_libdir='${exec_prefix}/lib' ;;
  "$prefix"/*) pc_libdir="\${exec_prefix}/${libdir#"$prefix"/}" ;;
  /*) pc_libdir=$libdir ;;
  *) libdir=$prefix/$libdir; pc_libdir="\${exec_prefix}/${libdir#"$prefix"/}" ;;
esac

read -r target_dir version description < <(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
m = json.load(sys.stdin)
p = next(p for p in m["packages"] if p["name"] == "hostembed")
print(m["target_directory"], p["version"], p["description"])')
major=${version%%.*}
case "$profile" in dev | test) out=$target_dir/debug ;; bench) out=$target_dir/release ;; *) out=$target_dir/$profile ;; esac

cargo build --profile "$profile" --lib ${features[@]+"${features[@]}"}
# The static library is a second build of the crate alone; rustc prints the system libraries it needs
# (cargo replays that note when the build is fresh).
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo rustc --profile "$profile" --lib ${features[@]+"${features[@]}"} --crate-type staticlib \
  -- --print native-static-libs 2>&1 | tee "$log"
static_libs=$(sed -n 's/^note: native-static-libs: //p' "$log" | tail -1)
[ -n "$static_libs" ] || { echo "install.sh: rustc printed no native-static-libs line" >&2; exit 1; }

dest_lib=${DESTDIR:-}$libdir
dest_include=${DESTDIR:-}$prefix/include
mkdir -p "$dest_lib/pkgconfig" "$dest_include"
install -m 755 "$out/libhostembed.so" "$dest_lib/libhostembed.so.$version"
ln -sfn "libhostembed.so.$version" "$dest_lib/libhostembed.so.$major"
ln -sfn "libhostembed.so.$major" "$dest_lib/libhostembed.so"
install -m 644 "$out/libhostembed.a" "$dest_lib/libhostembed.a"
install -m 644 include/hostembed.h "$dest_include/hostembed.h"
cat >"$dest_lib/pkgconfig/hostembed.pc" <<EOF
prefix=$prefix
exec_prefix=\${prefix}
libdir=$pc_libdir
includedir=\${prefix}/include

Name: hostembed
Description: $description
Version: $version
Libs: -L\${libdir} -lhostembed
Libs.private: $static_libs
Cflags: -I\${includedir}
EOF
echo "installed hostembed $version into ${DESTDIR:-}$prefix"
