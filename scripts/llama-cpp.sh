#!/usr/bin/env bash
# llama.cpp, the reference BENCHMARKS.md compares against, built on the GPU machine (which has nvcc and
# no network) from source packed here.
#
#   scripts/llama-cpp.sh pack    (this machine) fetches the llama-cpp-python sdist pinned below from PyPI
#                                and packs its vendored llama.cpp, without docs, models, tests, examples and
#                                the other backends, into .gpu/llama.cpp.tar.xz (about 7 MB): carry it.
#   scripts/llama-cpp.sh build   (the GPU machine) unpacks it under .gpu/llama.cpp (ignored by git, so a
#                                warm machine keeps it for the next call) and builds llama-bench,
#                                llama-batched-bench and llama-quantize for sm_90 with CUDA (about 4 minutes
#                                on 16 cores), unless they are built already; prints the binaries' folder.
#
# llama-bench prints the build's commit with its results.
set -euo pipefail
cd "$(dirname "$0")/.."

SDIST_VERSION=0.3.36
SDIST_URL=https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PACK=.gpu/llama.cpp.tar.xz

pack() {
  work=""
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  curl -fsSL -o "$work/sdist.tar.gz" "$SDIST_URL"
  echo "$SDIST_SHA256  $work/sdist.tar.gz" | sha256sum -c --quiet
  tar -C "$work" -xzf "$work/sdist.tar.gz"
  local src="$work/llama_cpp_python-$SDIST_VERSION/vendor/llama.cpp"
  rm -rf "$src"/{docs,models,tests,examples,media,benches,gguf-py,conversion,scripts,app,ci,pocs,grammars,requirements} \
    "$src"/{.devops,.github,.gemini}
  (cd "$src/ggml/src" && rm -rf ggml-{cann,et,hexagon,hip,metal,musa,opencl,openvino,sycl,virtgpu,vulkan,webgpu,zdnn,zendnn})
  (cd "$src/tools" && find . -mindepth 1 -maxdepth 1 -type d ! -name batched-bench ! -name llama-bench ! -name quantize \
    -exec rm -rf {} +)
  # Only the three tools are configured.
  cat > "$src/tools/CMakeLists.txt" <<'EOF'
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(batched-bench)
add_subdirectory(llama-bench)
add_subdirectory(quantize)
EOF
  mkdir -p .gpu
  tar -C "$work/llama_cpp_python-$SDIST_VERSION/vendor" -cJf "$PACK" llama.cpp
  ls -la "$PACK"
}

build() {
  local dir=.gpu/llama.cpp
  if [ -x "$dir/build/bin/llama-bench" ] && [ -x "$dir/build/bin/llama-batched-bench" ]; then
    echo "$PWD/$dir/build/bin"
    return
  fi
  rm -rf "$dir" && tar -C .gpu -xJf "$PACK"
  # The CUDA toolkit the machine has (nvcc on PATH or under /usr/local/cuda).
  command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  cmake -S "$dir" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON > "$dir/configure.log" 2>&1 || { tail -30 "$dir/configure.log"; return 1; }
  cmake --build "$dir/build" -j 16 --target llama-bench llama-batched-bench llama-quantize > "$dir/build.log" 2>&1 ||
    { tail -30 "$dir/build.log"; return 1; }
  echo "$PWD/$dir/build/bin"
}

case "${1:-}" in
  pack) pack ;;
  build) build ;;
  *) echo "usage: scripts/llama-cpp.sh pack|build" >&2; exit 2 ;;
esac
