#!/usr/bin/env bash
# Compares the kernels of the working tree with those of a revision (default HEAD) without a GPU: each
# kernels/*.cu compiled to a cubin for one arch (default sm_90) with the build's flags but no line info,
# so a change that moves no instruction gives the same bytes. Prints, per file, "same" or "differs", and
# for every kernel whose registers, spills or shared memory changed, ptxas's figures before and after.
# A refactor of kernel code is checked by "same" everywhere; a tuning change by the resource lines.
# Usage: scripts/kernel-diff.sh [REV] [ARCH]   (extra -D flags from HOSTEMBED_KERNEL_DEFINES)
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-HEAD}
arch=${2:-90}
nvcc=${NVCC:-$(command -v nvcc || true)}
for candidate in /usr/local/cuda/bin/nvcc .cuda/nvidia/cu13/bin/nvcc; do
  [ -n "$nvcc" ] || { [ -x "$candidate" ] && nvcc=$candidate; }
done
[ -n "$nvcc" ] || { echo "no nvcc (NVCC, PATH, /usr/local/cuda/bin, .cuda/): scripts/install-cuda.sh installs one" >&2; exit 2; }
nvcc=$(realpath "$nvcc")

work=$(mktemp -d)
trap 'git worktree remove --force "$work/old" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add --detach --quiet "$work/old" "$rev"

# Compiles every kernel of tree $1 into $2: NAME.cubin, and NAME.res with one line a kernel (demangled)
# giving ptxas's registers, barriers, shared memory, stack and spills. As many nvcc at once as cores.
# Both trees compile from one path: anonymous namespaces' symbols carry a hash of the source's path.
compile() {
  mkdir -p "$2"
  rm -rf "$work/src" && mkdir -p "$work/src" && cp -r "$1/kernels" "$work/src/"
  # shellcheck disable=SC2016
  ls "$work"/src/kernels/*.cu | xargs -P "$(nproc)" -I{} sh -c '
    name=$(basename "$1" .cu)
    "$2" -cubin -std=c++17 --expt-relaxed-constexpr -O3 -arch="sm_$3" -I"$(dirname "$1")" $4 -Xptxas -v \
      "$1" -o "$5/$name.cubin" 2> "$5/$name.log" || { cat "$5/$name.log" >&2; exit 255; }
  ' sh {} "$nvcc" "$arch" "${HOSTEMBED_KERNEL_DEFINES:-}" "$2"
  for log in "$2"/*.log; do
    awk '/Compiling entry function/ { f = $0; sub(/.*function \047/, "", f); sub(/\047.*/, "", f) }
         /spill stores/ { s = $0; sub(/^ +/, "", s) }
         /Used [0-9]+ registers/ { u = $0; sub(/.*: Used/, "Used", u); print f ": " u "; " s }' "$log" |
      c++filt | sort > "${log%.log}.res"
  done
}
compile "$work/old" "$work/before"
compile "$PWD" "$work/after"

status=0
for cubin in "$work"/after/*.cubin; do
  name=$(basename "$cubin" .cubin)
  if [ ! -f "$work/before/$name.cubin" ]; then
    echo "$name.cu: new"
  elif cmp -s "$work/before/$name.cubin" "$cubin"; then
    echo "$name.cu: same"
  else
    echo "$name.cu: differs"
    status=1
    if cmp -s "$work/before/$name.res" "$work/after/$name.res"; then
      echo "  every kernel's registers, shared memory and spills unchanged"
    else
      diff "$work/before/$name.res" "$work/after/$name.res" | sed -n 's/^</  before:/p; s/^>/  after: /p' || true
    fi
  fi
done
exit $status
