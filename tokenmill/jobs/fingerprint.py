"""The job fingerprint: a hash of everything that changes results.

Model identity (resolved file or directory, its size), dtype, quantization, the sampling
section, the chat template, the input (files, sizes, content samples, columns), and the output
format and shard size (they decide which file holds which row). Engine tuning (batch sizes,
block size, replicas) is left out: it does not change greedy results.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tokenmill.jobs.spec import JobSpec


def model_identity(path: Path) -> dict[str, Any]:
    if path.is_file():
        return {"file": str(path.resolve()), "size": path.stat().st_size}
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json"))
    return {
        "dir": str(path.resolve()),
        "files": [(p.name, p.stat().st_size) for p in files],
    }


def job_fingerprint(
    spec: JobSpec, model_path: Path, chat_template: str | None, input_fingerprint: str
) -> str:
    payload = {
        "model": model_identity(model_path),
        "dtype": spec.model.dtype,
        "quantization": spec.model.quantization,
        "sampling": spec.sampling.model_dump(mode="json"),
        "chat_template": chat_template or "",
        "input": input_fingerprint,
        "output": {"format": spec.output.format, "rows_per_shard": spec.output.rows_per_shard},
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()
