"""`run-job` reads and checks its job file before it imports torch or transformers: a
mistyped key or `--help` answers in about a second instead of the several seconds those
imports take (1.3-1.5 s against 4.5-7 s on a 2-core machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import sys
import tokenmill.jobs.cli
from tokenmill.jobs.spec import coerce_spec
heavy = sorted({"torch", "transformers", "triton"} & set(sys.modules))
print("heavy:", heavy)
"""


def test_cli_and_spec_checks_import_no_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("heavy: []"), out.stdout


def test_a_bad_job_file_exits_2_without_loading_torch(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("name: x\nmodel: {source: smollm2-135m-instruct}\n")  # no input, no output
    probe = (
        "import sys\n"
        "from tokenmill.jobs.cli import main\n"
        f"code = main([{str(job)!r}, '--quiet'])\n"
        "print('code', code, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip().endswith("code 2 False"), (out.stdout, out.stderr[-2000:])
    assert "input" in out.stderr and "required" in out.stderr, out.stderr[-2000:]
