"""The ``run-job`` console script. It holds stop signals before it imports the job runner
(pyarrow, fsspec and the rest take up to a second), so a SIGTERM or Ctrl-C in that time
stops the run as any stop does, with exit 75, where it killed the process (exit -15 or -2)
before the runner's own handlers were in (stop_signals.py)."""

from __future__ import annotations

from tokenmill.jobs.stop_signals import hold_signals


def entry() -> None:
    hold_signals()
    from tokenmill.jobs.cli import entry as run_job

    run_job()


if __name__ == "__main__":
    entry()
