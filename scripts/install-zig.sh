#!/usr/bin/env bash
# Installs the pinned Zig (the ziglang wheel) into .zig unless it is there, and prints its binary's path.
# The binary itself, not `python3 -m ziglang`: through a pyenv shim that changes PATH, which build.rs
# watches, and the Zig package's cargo build would then build the crate again.
set -euo pipefail
cd "$(dirname "$0")/.."
ZIG_VERSION=0.15.2
zig_bin=$PWD/.zig/ziglang/zig
if [ "$("$zig_bin" version 2>/dev/null)" != "$ZIG_VERSION" ]; then
  rm -rf .zig
  python3 -m pip install --quiet --disable-pip-version-check --target .zig "ziglang==$ZIG_VERSION" >&2
fi
[ "$("$zig_bin" version)" = "$ZIG_VERSION" ] || { echo "install-zig: .zig holds no zig $ZIG_VERSION" >&2; exit 1; }
echo "$zig_bin"
