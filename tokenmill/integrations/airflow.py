"""Airflow: a tokenmill job as a task. ``TokenmillJobOperator`` runs ``run-job`` on a job.yaml
(or a dict of its sections) in a child process and maps its exit code onto Airflow's retry
rules; the task's return value (its XCom) is the path of the job's ``report.json``.

    execute ─► validate the spec here (exit-2 mistakes fail before anything starts)
            ─► run-job in a child process, its own session ─► its lines into the task log
            ─► exit 0: return <output.path>/report.json
               exit 2: AirflowFailException (no retry: the spec needs fixing)
               exit 1, 75, killed: AirflowException (Airflow retries; the retry resumes)
    on_kill ─► SIGTERM to run-job: it stops at its next commit boundary and exits 75

Why a child process and not ``tokenmill.submit()`` in the task process: run-job's exit codes
are the one contract cron and Airflow share (which failures are worth a retry is decided in
one place, ``tokenmill.jobs.cli``, run through the command, ``tokenmill.jobs.command``); the
model, torch, CUDA and Ray live and die with the child, not with the Airflow worker; and its
stop-at-a-commit-boundary handling of SIGTERM is the CLI's own, tested in
``tests/jobs/test_sigterm.py``.

Signals. To stop a task, Airflow 3 sends SIGTERM to the task's whole process group (its
handler calls ``on_kill``), then SIGKILL 5 s later. The child runs in a session of its own,
so it gets exactly one SIGTERM, from ``on_kill``: a second one would stop it at once instead
of at a commit. The child also asks Linux to SIGTERM it when the task process dies
(``PR_SET_PDEATHSIG``): after the SIGKILL, run-job, if still short of its commit boundary,
gets that second signal and stops at once (as safe as SIGKILL: committed shards are kept),
rather than running on unsupervised, holding the job's lock so that every retry exits 75.
``execution_timeout`` (raised inside ``execute``) gives it ``stop_timeout_s`` instead.

Idempotent: every retry and every rerun of the DAG runs the same job on the same output;
the runner skips committed shards, so rows are never duplicated, and a complete job loads
nothing and exits 0 at once. ``--fresh`` is deliberately not offered: a retry with it would
throw away the progress the retry is meant to keep.

Airflow is imported by this module only: ``tokenmill`` itself never needs it.
"""

from __future__ import annotations

import collections
import copy
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

__all__ = ["TokenmillJobOperator"]

# The child's program, run by a fresh interpreter (nothing runs between fork and exec, which
# is what makes it safe in a threaded task process): ask to be sent SIGTERM when the task
# process dies, check it has not died already, then run-job's own entry point.
_CHILD_PROGRAM = """\
import ctypes, os, signal, sys
parent = int(sys.argv.pop(1))
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(75)
sys.argv[0] = "run-job"
from tokenmill.jobs.command import entry
entry()
"""

_TAIL_LINES = 20  # run-job's last lines, kept for the exception message


def _take_chat_template(job: str | dict[str, Any]) -> Any:
    """A dict job's ``model.chat_template``, taken out of it (None when it has none)."""
    model = job.get("model") if isinstance(job, dict) else None
    if not isinstance(model, dict) or "chat_template" not in model:
        return None
    model = job["model"] = dict(model)
    return model.pop("chat_template")


class TokenmillJobOperator(BaseOperator):
    """Run (or resume) a tokenmill job; return the path of its ``report.json``.

    ``job``: a path to a job.yaml, or a dict of its sections (as ``tokenmill.submit`` takes);
    relative paths, in it and of it, resolve against the worker's working directory, so give
    absolute paths or URLs. ``overrides``: ``run-job --set`` items, ``"sampling.max_tokens=32"``.
    Both are Jinja-templated (``"output.path=s3://bucket/out/{{ ds }}/"``), but for a dict
    job's ``model.chat_template``, which is Jinja itself and goes to run-job as given (Airflow
    rendered it at the task's start: "'bos_token' is undefined", retried as a failure).
    ``stop_timeout_s``: how long a stopped run may take to reach its commit boundary before
    it is killed (only when the task itself is interrupted, e.g. by ``execution_timeout``).

    Raises AirflowFailException (never retried) for a spec that cannot work (run-job's exit
    2); AirflowException (retried per the task's ``retries``) for a failed or stopped run,
    another run holding the output (exit 75) or a storage failure. Rows are never returned
    through XCom: read them from ``<output.path>/shards/``.
    """

    template_fields: Sequence[str] = ("job", "overrides")

    def __init__(
        self,
        *,
        job: str | os.PathLike[str] | Mapping[str, Any],
        overrides: Sequence[str] = (),
        stop_timeout_s: float = 300.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(job, os.PathLike):
            job = os.fspath(job)
        if not isinstance(job, (str, Mapping)):
            raise TypeError(
                f"TokenmillJobOperator(task_id={self.task_id!r}): job must be a path to a "
                f"job.yaml or a dict of its sections, got {type(job).__name__}"
            )
        if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
            raise TypeError(
                f"TokenmillJobOperator(task_id={self.task_id!r}): overrides must be a list of "
                f"'key.path=value' strings (run-job --set), got {overrides!r}"
            )
        if stop_timeout_s <= 0:
            raise ValueError(
                f"TokenmillJobOperator(task_id={self.task_id!r}): stop_timeout_s must be > 0, "
                f"got {stop_timeout_s}"
            )
        self.job = job if isinstance(job, str) else copy.deepcopy(dict(job))
        # Kept out of the templated fields (the docstring says why), put back in _prepare.
        self._chat_template = _take_chat_template(self.job)
        self.overrides = list(overrides)
        self.stop_timeout_s = stop_timeout_s
        self._child: subprocess.Popen[str] | None = None
        self._stop_requested = False  # on_kill was called during (or before) this execute
        self._stop_sent = False  # the child got its SIGTERM
        self._executed = False  # execute ran on this object before (dag.test() reuses it)

    def _do_render_template_fields(
        self, parent: Any, template_fields: Any, context: Any, jinja_env: Any, seen_oids: Any
    ) -> None:
        """Render ``job`` and ``overrides``, registering every ``storage_options`` value in
        them with Airflow's secrets masker before (a failed render logs the templates) and
        after (the rendered values): the UI's rendered fields and the task log then read
        ``***`` for them, where Airflow hides values by key name only (``secret``), not an
        s3fs ``key`` or an override's text. This method, not ``render_template_fields``: a
        mapped task's operator is rendered by its MappedOperator through this one only."""
        if parent is self:
            _mask_storage_options(self.job, self.overrides)
        super()._do_render_template_fields(parent, template_fields, context, jinja_env, seen_oids)
        if parent is self:
            _mask_storage_options(self.job, self.overrides)

    def execute(self, context: Any) -> str:
        from tokenmill.jobs.exit_codes import EXIT_INVALID, EXIT_OK

        # A reused operator's (dag.test()'s retries) stop was its earlier try's. A first
        # execute keeps one: Airflow's SIGTERM handler, set before the task's start-up (its
        # API calls, rendering), calls on_kill then; clearing it ran the whole job, and the
        # task was SIGKILLed 5 s later.
        if self._executed:
            self._stop_requested = self._stop_sent = False
        self._executed = True
        with tempfile.TemporaryDirectory(prefix="tokenmill-airflow-") as scratch:
            args, report = self._prepare(Path(scratch))
            self.log.info("running the job: run-job %s (report: %s)", " ".join(args), report)
            code, tail = self._run(args)
        if code == EXIT_OK:
            self.log.info("the job is complete; report: %s", report)
            return report
        if code == EXIT_INVALID:
            raise AirflowFailException(
                f"run-job exited {code}: the spec cannot work; fix it, then clear this task "
                f"(a retry would fail the same way). run-job said:\n{tail}"
            )
        raise AirflowException(f"{_exit_meaning(code)}; run-job said:\n{tail}")

    def on_kill(self) -> None:
        """Ask run-job to stop at its next commit boundary (it then exits 75); before it
        starts, keep it from starting. Called from the task's SIGTERM handler, so it only
        signals: ``execute`` keeps reading the child's output until it exits (waiting here
        would stop that reading)."""
        self._stop_requested = True
        self._signal_child()

    def _signal_child(self) -> None:
        """SIGTERM to a running child, once, then SIGCONT: a stopped child (SIGSTOP, a
        debugger) kept the SIGTERM pending, and held the job's lock after its task was
        gone, every retry exiting 75 (an audit)."""
        child = self._child
        if child is not None and child.poll() is None and not self._stop_sent:
            self._stop_sent = True
            child.send_signal(signal.SIGTERM)
            child.send_signal(signal.SIGCONT)
            self.log.warning(
                "asked run-job (pid %d) to stop at its next commit boundary; committed shards "
                "are kept and a retry resumes",
                child.pid,
            )

    def _prepare(self, scratch: Path) -> tuple[list[str], str]:
        """run-job's arguments and the report's path, after checking the spec here, so a spec
        that cannot work fails the task without a retry before any process starts."""
        from tokenmill.io.storage import OutputStore
        from tokenmill.io.url_secrets import hide_url_secrets, url_credentials_refusal
        from tokenmill.jobs.ownership import REPORT_NAME
        from tokenmill.jobs.spec import JobSpec, JobSpecError, apply_override

        try:
            if isinstance(self.job, str):
                spec = JobSpec.load(self.job, self.overrides)
            else:
                raw = copy.deepcopy(self.job)
                if self._chat_template is not None:
                    raw.setdefault("model", {})["chat_template"] = self._chat_template
                where = f"task {self.task_id}'s job"
                for item in self.overrides:
                    apply_override(raw, item, where)
                spec = JobSpec.from_dict(raw, where)
            # run-job refuses these too, but only after the task log has shown the report's
            # path, with the output's credentials in it, which no masker knows.
            for key, url in (("input.path", spec.input.path), ("output.path", spec.output.path)):
                refusal = url_credentials_refusal(key, url)
                if refusal is not None:
                    raise JobSpecError(refusal)
            if isinstance(self.job, str) and not self.overrides:
                args = [self.job]
            else:
                # run-job reads the validated spec back: the same job, in plain YAML. The
                # overrides go in this way too, never on the command line, which the task
                # log shows and ps lists (they may carry credentials).
                job_file = scratch / "job.yaml"
                job_file.write_text(_to_yaml(spec.to_dict()))
                args = [str(job_file)]
            store = OutputStore(spec.output.path, dict(spec.output.storage_options), spec.name)
        except (JobSpecError, ValueError) as exc:
            # (Airflow logs and keeps the message: a URL's password or signature masked)
            raise AirflowFailException(
                f"the job spec cannot work: {hide_url_secrets(str(exc))}"
            ) from None
        return args, store.path(REPORT_NAME)

    def _run(self, args: list[str]) -> tuple[int, str]:
        """Run run-job with ``args``; its output goes to the task log line by line. Returns
        the exit code (negative: killed by that signal) and its last lines."""
        if self._stop_requested:
            raise AirflowException("the task was stopped before run-job started; a retry runs it")
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD_PROGRAM, str(os.getpid()), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8"},
            start_new_session=True,  # Airflow's SIGTERM to the task's group is on_kill's to send
        )
        self._child = child
        if self._stop_requested:  # on_kill ran while the child was being started
            self._signal_child()
        tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        # A thread reads, so this one can wait for the exit and run the SIGTERM handler.
        reader = threading.Thread(
            target=self._log_lines, args=(child, tail), name="run-job-output", daemon=True
        )
        reader.start()
        try:
            code = child.wait()
        except BaseException as exc:  # e.g. execution_timeout: stop the job before leaving
            from tokenmill.jobs.exit_codes import EXIT_OK

            self._stop(child)
            if child.returncode != EXIT_OK or isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            # It had completed the job as the timeout came (a stop gives 75): the task's work
            # is done (it failed, and a retry found nothing to do: an audit).
            self.log.warning("run-job completed the job as the task was being stopped")
            code = EXIT_OK
        finally:
            reader.join(timeout=10)
            self._child = None
        return code, "\n".join(tail) or "(nothing)"

    def _log_lines(self, child: subprocess.Popen[str], tail: collections.deque[str]) -> None:
        assert child.stdout is not None
        with child.stdout:
            for line in child.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                self.log.info("%s", line)

    def _stop(self, child: subprocess.Popen[str]) -> None:
        """SIGTERM (once), ``stop_timeout_s`` to reach a commit boundary, then SIGKILL."""
        self.on_kill()
        try:
            child.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.log.warning(
                "run-job (pid %d) did not stop within %.0f s; killing it (committed shards are "
                "kept)",
                child.pid,
                self.stop_timeout_s,
            )
            child.kill()
            child.wait()


def _mask_storage_options(job: str | dict[str, Any], overrides: Sequence[str]) -> None:
    from airflow.sdk.log import mask_secret

    for text in _storage_option_texts(job, overrides):
        mask_secret(text)


def _storage_option_texts(job: str | dict[str, Any], overrides: Sequence[str]) -> list[str]:
    """The text of every ``storage_options`` value of a dict job and of the overrides: each
    string in them, and an override's value as written (``...storage_options={key: K}``)."""
    from tokenmill.jobs.spec import (
        JobSpecError,
        apply_override,
        parse_override_value,
        split_malformed_override,
    )

    raw: dict[str, Any] = {} if isinstance(job, str) else copy.deepcopy(job)
    texts: list[str] = []
    for item in overrides:
        if not isinstance(item, str):
            continue
        key, sep, value = item.partition("=")
        if not sep:  # refused when the task runs (showing the key); the rest may be a value
            texts.append(split_malformed_override(item)[1].lstrip(":= "))
        elif "storage" in key.lower() or "storage_options" in value:  # typos, whole sections
            if not isinstance(parse_override_value(value), bool):  # not every "false"
                texts.append(value)
        try:
            apply_override(raw, item, "overrides")
        except JobSpecError:  # (refused with its message when the task runs)
            pass
    for section in raw.values():
        if isinstance(section, dict):
            texts += _strings(section.get("storage_options"))
    return texts


def _strings(value: Any) -> list[str]:
    """Every string in ``value`` (nested dicts and lists walked)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _to_yaml(spec: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(spec, sort_keys=False)


def _exit_meaning(code: int) -> str:
    """What a retryable exit code of run-job means, for the task's error."""
    from tokenmill.jobs.exit_codes import EXIT_FAILED, EXIT_TEMPORARY

    resumes = "committed shards are kept and Airflow's retry resumes from them"
    if code == EXIT_TEMPORARY:
        return (
            f"run-job exited {code}: temporary (another run holds the output, the run was "
            f"stopped by a signal, or the storage failed); {resumes}"
        )
    if code == EXIT_FAILED:
        return f"run-job exited {code}: the job failed; {resumes}"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"run-job was killed by {name}; {resumes}"
    return f"run-job exited {code} (unexpected); {resumes}"
