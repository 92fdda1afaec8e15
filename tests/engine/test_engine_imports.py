"""The engine, kernels and benchmarks import with torch, triton, transformers and safetensors
alone: the GPU machines benchmarks run on may lack gguf, pydantic, ray, pyarrow and fsspec."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import builtins
real = builtins.__import__
absent = {"gguf", "pydantic", "ray", "pyarrow", "fsspec"}
def guarded(name, *args, **kwargs):
    if name.split(".")[0] in absent:
        raise ImportError("not on the GPU machine: " + name)
    return real(name, *args, **kwargs)
builtins.__import__ = guarded
from tokenmill import LLM, SamplingParams
import tokenmill.engine.llm_engine
import tokenmill.engine.cuda_graphs
import tokenmill.kernels.paged_decode_attention
import tokenmill.kernels.paged_prefill_attention
import bench.throughput
print("ok")
"""


def test_engine_imports_without_job_dependencies() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
