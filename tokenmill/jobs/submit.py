"""tokenmill.submit(spec): run a job in the background and get a handle on it."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import traceback
import weakref
from typing import Any

from tokenmill.jobs.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_TEMPORARY, exit_code
from tokenmill.jobs.progress import Progress, ProgressSnapshot
from tokenmill.jobs.report import JobReport
from tokenmill.jobs.runner import run_job
from tokenmill.jobs.spec import JobSpec, coerce_spec

log = logging.getLogger("tokenmill.jobs")

# Handles whose job still runs: stopped at their next commit boundary when the process
# exits (``_stop_at_exit``). A forked child runs none of them (their threads stay in the
# parent): it held them, and its exit waited forever for jobs it did not run (an audit).
_RUNNING: weakref.WeakSet[JobHandle] = weakref.WeakSet()
os.register_at_fork(after_in_child=_RUNNING.clear)


class JobHandle:
    """A running job. ``cancel`` stops it at the next commit boundary: committed shards stay,
    in-flight rows are dropped, and a later run of the same job resumes from there."""

    def __init__(self, spec: JobSpec, fresh: bool) -> None:
        self.spec = spec
        self._cancel = threading.Event()
        self._report: JobReport | None = None
        self._error: BaseException | None = None
        self._error_tb: Any = None
        self._progress: Progress | None = None
        # Set when the job's thread is done: a join cut short by Ctrl-C marks a thread that
        # still runs as stopped (CPython 3.11), so the state never comes from the thread.
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(fresh,), name=f"tokenmill-job-{spec.name}", daemon=True
        )
        _RUNNING.add(self)
        self._thread.start()

    def _run(self, fresh: bool) -> None:
        try:
            self._report = run_job(
                self.spec, fresh=fresh, cancel=self._cancel, show_progress=False,
                on_progress=self._watch,
            )  # fmt: skip
        except BaseException as exc:  # handed to the caller through result()
            _drop_frame_locals(exc)
            self._error, self._error_tb = exc, exc.__traceback__
        finally:
            self._done.set()
            _RUNNING.discard(self)

    def _watch(self, progress: Progress) -> None:
        self._progress = progress

    def progress(self) -> ProgressSnapshot | None:
        """Rows done (of how many), in flight, output tokens, tok/s and ETA, as the progress
        line says them; None before generation starts (checks, model load)."""
        progress = self._progress
        return None if progress is None else progress.snapshot()

    def status(self) -> str:
        """running | complete | cancelled | failed"""
        if not self._done.is_set():
            return "running"
        if self._error is not None:
            return "failed"
        return self._report.status if self._report else "failed"

    def exit_code(self) -> int | None:
        """What run-job would have exited with (README's table), None while it runs: 0
        complete, 1 failed (rerun to resume), 2 fix the spec, a file or a path first (or
        rerun with fresh=True where the output holds progress made with other settings),
        75 temporary (another run holds the output, the job was cancelled, the storage
        failed): rerun later to resume. The exception result() raises does not say which
        by its type: a JobLockedError (75) and a FingerprintMismatchError (2) are both
        RuntimeErrors, a file gone mid-run (2) and a full disk (75) both OSErrors."""
        if not self._done.is_set():
            return None
        if self._error is not None:
            return exit_code(self._error)
        status = self._report.status if self._report else "failed"
        if status == "complete":
            return EXIT_OK
        return EXIT_TEMPORARY if status == "cancelled" else EXIT_FAILED

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job ends or ``timeout`` seconds pass; True when it ended.

        Ctrl-C while waiting stops the job at its next commit boundary, as it stops run-job
        (committed shards stay; a rerun resumes), waits for that, and then raises
        KeyboardInterrupt; a second Ctrl-C stops the waiting at once (the job goes on to
        its boundary in the background)."""
        try:
            return self._done.wait(timeout)
        except KeyboardInterrupt:
            self._cancel.set()
            self._done.wait()
            raise

    def cancel(self) -> None:
        self._cancel.set()

    def result(self, timeout: float | None = None) -> JobReport:
        """The report once the job ended; re-raises the job's error if it failed.
        Raises TimeoutError when it is still running after ``timeout`` seconds."""
        if not self.wait(timeout):
            raise TimeoutError(f"job {self.spec.name!r} is still running")
        if self._error is not None:  # (its own traceback each time: raising grew it)
            raise self._error.with_traceback(self._error_tb)
        if self._report is None:  # (the thread always leaves one or the other)
            raise RuntimeError(f"job {self.spec.name!r} ended without a report")
        return self._report


def _drop_frame_locals(exc: BaseException) -> None:
    """Clear the locals of the finished frames in ``exc``'s tracebacks (its causes' and
    contexts' too): the handle keeps the error for ``result()``, and those frames' locals
    held the job's engine, its weights and KV cache, for as long as the handle lived (a job
    failing after its model loaded, e.g. a KV cache shorter than the context: +328 MiB a
    failed handle kept, an audit). The traceback still prints every file and line."""
    todo, seen = [exc], set()
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        todo += [err.__cause__, err.__context__, *getattr(err, "exceptions", ())]


@atexit.register
def _stop_at_exit() -> None:
    """Stop the jobs still running as the process exits, each at its next commit boundary
    (committed shards stay, a rerun resumes), and wait for them: their threads, left to the
    interpreter's shutdown, took the engine down mid-step (the process aborted, SIGABRT,
    no report written)."""
    running = list(_RUNNING)
    if not running:
        return
    log.warning(
        "the process is exiting with %d tokenmill job(s) still running (%s): stopping them at "
        "their next commit boundary; a rerun resumes them",
        len(running),
        ", ".join(h.spec.name for h in running),
    )
    for handle in running:
        handle.cancel()
    for handle in running:
        handle._done.wait()


def submit(spec: JobSpec | str | os.PathLike | dict[str, Any], *, fresh: bool = False) -> JobHandle:
    """Start a job (a JobSpec, a job.yaml path or a dict) in a background thread."""
    return JobHandle(coerce_spec(spec), fresh)
