"""The weight GEMMs (W4A16, W8A16, FP8) load their operands 16 bytes at a time on an
H100/H200: their sm_90 PTX (compiled without a GPU by tests/kernels/ptx_loads.py) holds no
one-byte global load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_weight_gemms_load_sixteen_bytes_at_a_time() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.ptx_loads"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    loads = json.loads(run.stdout.strip().splitlines()[-1])
    for kernel, counts in loads.items():
        narrow = {op: n for op, n in counts.items() if op.endswith(("b8", "u8", "s8"))}
        assert not narrow, f"{kernel} loads single bytes: {counts}"
        # cp.async.cg copies 16 bytes into shared memory (the software pipeline's loads)
        wide = counts.get("cp.async.cg.shared.global", 0) + counts.get("ld.global.v4.b32", 0)
        assert wide > 0, f"{kernel} has no 16-byte load: {counts}"
