#!/usr/bin/env bash
# Builds the library, which regenerates the header from the sources, and copies it to
# include/hostembed.h. Run it after changing anything exported; commit the header with the change.
# Extra arguments go to cargo build (e.g. --release).
set -euo pipefail
cd "$(dirname "$0")/.."
messages=$(mktemp)
trap 'rm -f "$messages"' EXIT
cargo build --lib --message-format=json-render-diagnostics "$@" >"$messages"
out_dir=$(python3 - "$messages" <<'PY'
import json, sys
dirs = []
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "build-script-executed" and m.get("package_id", "").find("hostembed") >= 0:
        dirs.append(m["out_dir"])
print(dirs[-1] if dirs else "")
PY
)
if [ -z "$out_dir" ] || [ ! -f "$out_dir/hostembed.h" ]; then
  echo "update-header: the build generated no header (see cbindgen's warning above)" >&2
  exit 1
fi
if cmp -s "$out_dir/hostembed.h" include/hostembed.h; then
  echo "include/hostembed.h is current"
else
  cp "$out_dir/hostembed.h" include/hostembed.h
  echo "include/hostembed.h updated"
fi
