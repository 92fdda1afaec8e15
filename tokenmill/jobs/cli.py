"""run-job: run a job to completion, resumably. Cron- and Airflow-friendly exit codes:

0   the job is complete (row errors are counted in the report, not fatal)
1   the job failed; rerun the same command to resume
2   the spec cannot work: invalid, its output/input/model paths are wrong, or the output
    holds progress made with other settings (the message names the file and the key);
    rerunning will not help until it is fixed
75  temporary: another run holds the output, the run was stopped by SIGTERM/SIGINT, the
    storage failed mid-run, or a Ray run lost its cluster; committed shards are kept: rerun
    the same command to resume

The job is a job.yaml, or, for one input and one output, flags alone:

    run-job job.yaml [--set key.path=value ...]
    run-job --model M --input in.jsonl --output out/ [--set key.path=value ...]

The flags build the JobSpec a job.yaml with ``model.source``, ``input.path`` and
``output.path`` would (``--set`` works on either), so both are validated by the same code.
"""

from __future__ import annotations

if __name__ == "__main__":  # ``python -m tokenmill.jobs.cli``: hold stops as run-job does,
    # before the imports below (up to a second): a SIGTERM then exited 143, not 75
    from tokenmill.jobs.stop_signals import hold_signals

    hold_signals()

import argparse
import logging
import os
import signal
import sys
import threading
from typing import NoReturn, TextIO

from tokenmill.io.url_secrets import HideUrlSecrets, hide_url_secrets
from tokenmill.jobs.exit_codes import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TEMPORARY,
    cluster_lost,
    exit_code,
    lasting,
)
from tokenmill.jobs.lock import JobLockedError
from tokenmill.jobs.manifest import FingerprintMismatchError, ManifestError, OutputChangedError
from tokenmill.jobs.rows_kept import resume_advice, rows_kept
from tokenmill.jobs.spec import JobSpec, JobSpecError
from tokenmill.jobs.stop_signals import STOP_SIGNALS, JobInterrupted, StopOnSignals
from tokenmill.jobs.store_loop_noise import quiet_store_loop_errors

log = logging.getLogger("tokenmill.jobs")

# Set where a second stop signal ended the run (``main``): ``entry`` then leaves at once.
_STOPPED_AT_ONCE = threading.Event()
_DRY_RUN_AGAIN = "a dry run writes nothing; rerun it"


def main(argv: list[str] | None = None) -> int:
    """Run the job ``argv`` describes; returns the exit code. A usage error (no job.yaml and
    a missing ``--model``/``--input``/``--output``) exits with 2 through argparse."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.job is None:
        missing = [flag for flag, key in _FLAGS.items() if not _given(args, flag, key)]
        if missing:
            parser.error(
                f"give a job.yaml, or {', '.join(_FLAGS)} without one (missing: "
                f"{', '.join(missing)})"
            )
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(HideUrlSecrets())
    quiet_store_loop_errors()
    cancel = threading.Event()
    with StopOnSignals(cancel) as stop:
        try:
            return _run(args, cancel, stop)
        except (JobInterrupted, KeyboardInterrupt) as exc:
            if stop.again:  # (not a stop while Ray started: its shutdown must run)
                _STOPPED_AT_ONCE.set()
            again = _again(args, exc)
            return _fail(f"stopped ({str(exc) or 'interrupted'}); {again}", EXIT_TEMPORARY)
        except Exception as exc:
            code = exit_code(exc)  # (what a submit() handle's exit_code() says too)
            return _fail(_explain(exc, code, _again(args, exc)), code)


def _again(args: argparse.Namespace, exc: BaseException) -> str:
    """What a rerun after ``exc`` does: a dry run's writes nothing; a run's resumes from the
    rows its output holds, where the runner said how many (``rows_kept``)."""
    return _DRY_RUN_AGAIN if args.dry_run else resume_advice(rows_kept(exc))


def _explain(exc: Exception, code: int, again: str) -> str:
    """run-job's line for a run that raised ``exc`` and exits ``code``."""
    if isinstance(exc, _EXPLAINED):
        return str(exc)
    lost = cluster_lost(exc)
    if lost is not None:
        return f"{lost}; {again}"
    fix = lasting(exc)
    if fix is not None:
        return (
            f"{type(fix).__name__}: {fix}; {again} once it is fixed "
            "(rerunning as it is does not help)"
        )
    if code == EXIT_TEMPORARY:
        return f"storage error: {type(exc).__name__}: {exc}; {again}"
    log.exception("the job failed")
    return f"the job failed ({type(exc).__name__}: {exc}); {again}"


# Errors whose message says all there is to do: no traceback or advice to add.
_EXPLAINED = (JobSpecError, JobLockedError, FingerprintMismatchError, ManifestError,
              OutputChangedError)  # fmt: skip


# The flags that stand for a job.yaml's required keys (and set them over a job.yaml's).
_FLAGS = {"--model": "model.source", "--input": "input.path", "--output": "output.path"}

_EXAMPLES = """\
examples:
  run-job job.yaml
  run-job job.yaml --set sampling.max_tokens=64 --set engine.max_num_seqs=128
  run-job --model smollm2-135m-instruct --input prompts.jsonl --output out/
  run-job --model M --input batch.jsonl --output out/ --set output.format=openai-batch

--set takes any job.yaml key by its dotted path; the value is read as YAML (64, 0.5,
true, [a, b]). Without a job.yaml the job is named "job" (--set name=... to change it).

exit codes: 0 complete, 1 failed, 2 invalid spec or usage, or a file, path or permission
to fix (a missing or corrupt input, an output not allowed or on a read-only file system),
75 temporary (locked, stopped by a signal, storage failure, Ray cluster lost): rerun to
resume
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run-job",
        usage="%(prog)s (JOB.yaml | --model M --input PATH --output PATH) [--set KEY.PATH=VALUE]"
        " [--dry-run] [--fresh] [--quiet]",
        description="Run a tokenmill batch inference job (resumes where it stopped).",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "job",
        nargs="?",
        metavar="JOB.yaml",
        help="path to the job.yaml (leave it out to give the job by flags)",
    )
    parser.add_argument(
        "--model", metavar="M", help="model.source: an alias, an HF directory or a .gguf file"
    )
    parser.add_argument(
        "--input",
        metavar="PATH",
        help="input.path: a file, folder, glob or fsspec URL (format detected as usual)",
    )
    parser.add_argument(
        "--output", metavar="PATH", help="output.path: the folder the job writes into"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="set a spec key by its dotted path, e.g. sampling.max_tokens=64 (repeatable)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate and tokenize every row; load no weights, write nothing",
    )
    parser.add_argument(
        "--fresh", action="store_true", help="discard earlier progress in the output and start over"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def _given(args: argparse.Namespace, flag: str, key: str) -> bool:
    """Whether ``flag``'s key has a value: the flag itself, or a ``--set`` of its key."""
    if getattr(args, flag.lstrip("-")) is not None:
        return True
    return any(item.partition("=")[0].strip() == key for item in args.overrides)


def _spec(args: argparse.Namespace) -> JobSpec:
    """The JobSpec of the command line: the job.yaml (if any), the flags, then ``--set``."""
    settings = {
        key: getattr(args, flag.lstrip("-"))
        for flag, key in _FLAGS.items()
        if getattr(args, flag.lstrip("-")) is not None
    }
    if args.job is None:
        return JobSpec.from_settings(settings, args.overrides)
    return JobSpec.load(args.job, args.overrides, settings)


def _run(args: argparse.Namespace, cancel: threading.Event, stop: StopOnSignals) -> int:
    spec = _spec(args)
    if args.dry_run:
        from tokenmill.jobs.dry_run import dry_run

        _print(hide_url_secrets(dry_run(spec, cancel, fresh=args.fresh).summary()))
        return EXIT_OK
    from tokenmill.jobs.runner import run_job

    report = run_job(spec, fresh=args.fresh, cancel=cancel, show_progress=not args.quiet)
    _print(hide_url_secrets(report.summary()))
    if report.status == "complete":
        return EXIT_OK
    if stop.received is not None:
        kept = resume_advice(report.rows_ok + report.rows_failed)
        _say(f"run-job: stopped by {stop.received}; {kept}")
        return EXIT_TEMPORARY
    return EXIT_FAILED


def _print(text: str) -> None:
    """Print to stdout; a reader that went away (``run-job ... | head``) or a full disk under
    a cron job's ``>> nightly.log`` (it exited 75, "storage error ... rerun", for a complete
    job: an audit) changes nothing about the job, so its exit code stays."""
    _write_or_drop(sys.stdout, text)


def _say(text: str) -> None:
    """Print to stderr; one that went away (a closed terminal, ``run-job ... 2>&1 | head``,
    a full disk under ``2>> log``) changes nothing about the job either: a stopped run's
    message raised BrokenPipeError, which became a "storage error" whose own message raised
    again, and a SIGTERM'd run exited 1 instead of 75 (an audit)."""
    _write_or_drop(sys.stderr, text)


def _write_or_drop(stream: TextIO, text: str) -> None:
    """Print ``text`` to ``stream``; when that fails, the stream's file descriptor goes to
    /dev/null, so that neither this line nor any later one (Python's own flush at exit
    included) raises."""
    try:
        print(text, file=stream, flush=True)
    except (OSError, ValueError):
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass


def entry() -> None:
    """The ``run-job`` command: ``main``, then exit without being cut short by a late
    SIGTERM/SIGINT (the run is over; interpreter shutdown takes a moment with torch loaded)."""
    code = main()
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if _STOPPED_AT_ONCE.is_set():
        _leave_now(code)
    sys.exit(code)


def _leave_now(code: int) -> NoReturn:
    """Exit with ``code`` without the interpreter's shutdown, once a second stop signal ended
    the run: it left its threads at work (a hung write, the last report, the reader), and
    shutdown stops each as it next takes the GIL, which inside C++ code (matplotlib's,
    pyarrow's) aborts the process: exit -6, "terminate called without an active exception",
    not 75 (test_sigterm failed so at times). Nothing committed is lost: a commit is whole
    files, then the record naming them, as after a SIGKILL; the logs, stdout and stderr are
    flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _fail(message: str, code: int) -> int:
    _say(f"run-job: {hide_url_secrets(message)}")
    return code


if __name__ == "__main__":
    entry()
