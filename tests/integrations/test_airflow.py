"""TokenmillJobOperator on a real Airflow 3 (a sqlite metadata DB, DAGs parsed from a DAG file,
run by ``dag.test()``, which applies Airflow's own retry rules), running a real run-job on the
tiny random model: the report path goes to XCom and the rows match an uninterrupted run; a
rerun of the DAG adds nothing; a task killed mid-run (SIGTERM: Airflow's handler calls
on_kill) resumes on its retry with every row exactly once; another run holding the output is
retried, a spec that cannot work is not."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.jobs.job_helpers import (
    chat_rows,
    committed_shards,
    job_dict,
    read_jsonl_dir,
    write_jsonl,
)
from tests.tiny_models import save_tiny_model
from tokenmill.jobs.lock import JobLockedError
from tokenmill.jobs.runner import open_output
from tokenmill.jobs.spec import JobSpec

if importlib.util.find_spec("airflow") is None:
    pytest.skip("apache-airflow is not installed: pip install -e '.[dev]'", allow_module_level=True)

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "configs/examples/airflow/tokenmill_dag.py"
ROWS = 24  # 6 shards of 4: room to stop the job between its first and last commit
# A batch is a shard; every row gets exactly max_tokens tokens.
SETTINGS: dict[str, Any] = {"sampling": {"ignore_eos": True}, "engine": {"max_num_seqs": 4}}
TASK = "generate"

# Starts run-job as the operator does (argv: the child program, the job file), then waits.
ORPHAN_PARENT = """\
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2], "--quiet"])
time.sleep(600)
"""

# One DAG per case in cases.json, as a scheduler would parse them from a DAGs folder.
DAG_FILE = """\
import json
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG

from tokenmill.integrations.airflow import TokenmillJobOperator

for case in json.loads((Path(__file__).parent / "cases.json").read_text()):
    with DAG(case["dag_id"], schedule=None, start_date=datetime(2024, 1, 1), catchup=False):
        if case.get("mapped"):  # one task a list of overrides
            TokenmillJobOperator.partial(
                task_id="generate", job=case["job"], retries=case["retries"]
            ).expand(overrides=case["overrides"])
            continue
        TokenmillJobOperator(
            task_id="generate",
            job=case["job"],
            overrides=case["overrides"],
            retries=case["retries"],
            retry_delay=timedelta(0),
        )
"""


class Airflow:
    """A metadata DB and a DAGs folder; ``run`` runs one DAG with ``dag.test()``."""

    def __init__(self, dags: Path) -> None:
        from airflow.dag_processing.dagbag import DagBag

        bag = DagBag(str(dags))
        assert not bag.import_errors, bag.import_errors
        self.bag = bag

    def run(self, dag_id: str) -> tuple[str, Any, int, Any]:
        """(dag run state, task state, the task's tries, its XCom return value)."""
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session

        run = self.bag.get_dag(dag_id).test()
        ti = run.get_task_instance(TASK)
        with create_session() as session:
            query = XComModel.get_many(
                run_id=run.run_id, dag_ids=dag_id, task_ids=TASK, key="return_value"
            )
            row = session.scalars(query).first()
            value = None if row is None else XComModel.deserialize_value(row)
        return run.state, ti.state, ti.try_number, value


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("airflow-jobs")
    write_jsonl(folder / "in.jsonl", chat_rows(ROWS))
    return folder


@pytest.fixture(scope="module")
def cases(model: Path, work: Path) -> dict[str, dict[str, Any]]:
    """The DAGs' jobs: a job.yaml path with --set overrides, and dicts."""
    src = work / "in.jsonl"
    spec = job_dict(model, src, work / "complete", **SETTINGS)
    spec["sampling"]["max_tokens"] = 5  # set to 8 by the task's override
    job_file = work / "complete.yaml"
    job_file.write_text(yaml.safe_dump(spec))
    bad_key = job_dict(model, src, work / "bad_key", **SETTINGS)
    bad_key["sampling"]["max_tokenz"] = 3
    return {
        "complete": {"job": str(job_file), "overrides": ["sampling.max_tokens=8"], "retries": 0},
        "killed": {"job": job_dict(model, src, work / "killed", **SETTINGS), "retries": 1},
        "locked": {"job": job_dict(model, src, work / "locked", **SETTINGS), "retries": 1},
        "no_model": {"job": job_dict(work / "no-such-model", src, work / "nm"), "retries": 2},
        "bad_key": {"job": bad_key, "retries": 2},
        "mapped": {
            "job": job_dict(model, src, work / "mapped", **SETTINGS),
            "overrides": [
                [
                    "output.storage_options.auto_mkdir=true",
                    "output.storage_options.token=MappedSecret_0042",
                ]
            ],
            "mapped": True,
            "retries": 0,
        },  # fmt: skip
    }


@pytest.fixture(scope="module")
def airflow(
    tmp_path_factory: pytest.TempPathFactory, cases: dict[str, dict[str, Any]]
) -> Iterator[Airflow]:
    """Airflow with its home, sqlite DB and DAGs folder in a temp dir, set up once (the DB
    takes seconds). Airflow reads its config when first imported, so it is imported here, after
    the environment is set; what importing it changes in this process (root logger, warning
    filters) and the SIGTERM handler its task runner installs are put back afterwards."""
    home = tmp_path_factory.mktemp("airflow-home")
    dags = home / "dags"
    dags.mkdir()
    (dags / "cases.json").write_text(
        json.dumps([{"dag_id": k, "overrides": [], **v} for k, v in cases.items()])
    )
    (dags / "tokenmill_test_dags.py").write_text(DAG_FILE)
    root = logging.getLogger()
    saved = (root.level, root.handlers[:], warnings.filters[:], signal.getsignal(signal.SIGTERM))
    with pytest.MonkeyPatch.context() as env:
        for key, value in {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        }.items():
            env.setenv(key, value)
        from airflow.utils import db

        import tokenmill.integrations.airflow  # noqa: F401  (airflow.sdk before its DB code)

        db.initdb()
        yield Airflow(dags)
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    warnings.filters[:] = saved[2]
    signal.signal(signal.SIGTERM, saved[3])


def _rows(out: Path) -> dict[str, str]:
    """{id: text} of the output; fails on an id written twice."""
    rows = read_jsonl_dir(out / "shards")
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a row was written twice"
    return {r["id"]: r["text"] for r in rows}


def _committed(out: Path) -> int:
    return len(committed_shards(out))


def _when(ready: Callable[[], bool], then: Callable[[], None], timeout: float = 120) -> list[bool]:
    """Start a thread that runs ``then`` once ``ready()``; the list says whether it did."""
    done: list[bool] = []

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                then()
                done.append(True)
                return
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()
    return done


@pytest.fixture(scope="module")
def uninterrupted(airflow: Airflow, work: Path) -> dict[str, str]:
    """The "complete" DAG, run once: {id: text} of its output, the others' reference."""
    out = work / "complete"
    assert airflow.run("complete") == ("success", "success", 1, str(out / "report.json"))
    return _rows(out)


def test_dag_run_returns_the_report_path_and_a_rerun_adds_nothing(
    airflow: Airflow, uninterrupted: dict[str, str], work: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = work / "complete"
    assert sorted(uninterrupted) == [f"r{i:04d}" for i in range(ROWS)]
    first = json.loads((out / "report.json").read_text())
    assert first["status"] == "complete" and first["rows_this_run"] == first["rows_ok"] == ROWS
    assert first["completion_tokens"] == ROWS * 8  # the override's max_tokens, not the file's

    # A second DAG run: the job is complete; nothing is generated or written again.
    shards = {p.name: p.stat().st_mtime_ns for p in (out / "shards").iterdir()}
    capfd.readouterr()
    assert airflow.run("complete") == ("success", "success", 1, str(out / "report.json"))
    task_log = capfd.readouterr().out  # dag.test() prints the task's log
    said = [line for line in task_log.splitlines() if "TokenmillJobOperator" in line]
    summary = f"job test: complete; nothing to do: all {ROWS} rows already committed"
    assert any(summary in line for line in said), task_log  # run-job's own line
    assert _rows(out) == uninterrupted
    assert {p.name: p.stat().st_mtime_ns for p in (out / "shards").iterdir()} == shards
    assert json.loads((out / "report.json").read_text()) == first


def test_a_task_killed_mid_run_resumes_on_its_retry(
    airflow: Airflow, uninterrupted: dict[str, str], work: Path
) -> None:
    """SIGTERM to the task process once the first shard is committed: Airflow's handler
    calls on_kill, run-job stops at a commit boundary (exit 75), the task is up for retry,
    and the retry resumes from the committed shards."""
    out = work / "killed"
    main = threading.main_thread().ident  # where dag.test() runs the task, and its handler
    assert main is not None
    killed = _when(lambda: _committed(out) > 0, lambda: signal.pthread_kill(main, signal.SIGTERM))
    assert airflow.run("killed") == ("success", "success", 2, str(out / "report.json"))
    assert killed, "the job finished before it could be killed"
    report = json.loads((out / "report.json").read_text())
    assert 0 < report["rows_resumed"] < ROWS, report  # the retry resumed a partial job
    assert report["rows_this_run"] + report["rows_resumed"] == ROWS
    assert _rows(out) == uninterrupted  # every row exactly once, as in an uninterrupted run
    assert not read_jsonl_dir(out / "errors")


def test_an_output_held_by_another_run_is_retried(
    airflow: Airflow, cases: dict[str, dict[str, Any]], work: Path
) -> None:
    """run-job exits 75 while another run holds the lock: both tries fail, as retryable."""
    with open_output(JobSpec.from_dict(cases["locked"]["job"]))[1]:
        assert airflow.run("locked") == ("failed", "failed", 2, None)
    assert not (work / "locked" / "shards").exists()


@pytest.mark.parametrize("case", ["no_model", "bad_key"])
def test_a_spec_that_cannot_work_is_not_retried(airflow: Airflow, case: str) -> None:
    """Exit 2 from run-job (a missing model) or a spec refused before it starts (an unknown
    key): one try, though the task has two retries."""
    assert airflow.run(case) == ("failed", "failed", 1, None)


def test_run_job_does_not_outlive_a_killed_task_process(
    airflow: Airflow, work: Path, cases: dict[str, dict[str, Any]]
) -> None:
    """When Airflow's last resort SIGKILLs the task process, the kernel sends run-job SIGTERM
    (PR_SET_PDEATHSIG): it stops at a commit boundary and frees the job's lock, rather than
    running on unsupervised while every retry finds the lock held."""
    from tokenmill.integrations.airflow import _CHILD_PROGRAM

    out = work / "orphan"
    spec = copy.deepcopy(cases["killed"]["job"])
    spec["output"]["path"] = str(out)
    job = work / "orphan.yaml"
    job.write_text(yaml.safe_dump(spec))
    # A stand-in for the task process: it starts run-job as the operator does, then waits.
    task = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_PARENT, _CHILD_PROGRAM, str(job)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while _committed(out) == 0 and time.monotonic() < deadline and task.poll() is None:
            time.sleep(0.005)
        assert _committed(out) > 0, "run-job committed nothing"
    finally:
        task.kill()
        task.wait()
    lock = open_output(JobSpec.from_dict(spec))[1]
    deadline = time.monotonic() + 60
    while True:  # free once run-job has exited
        try:
            lock.acquire()
            break
        except JobLockedError:
            assert time.monotonic() < deadline, "run-job outlived its task process"
            time.sleep(0.05)
    lock.release()
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "cancelled" and report["rows_ok"] < ROWS, report


def test_a_stopped_run_job_is_woken_to_stop(airflow: Airflow) -> None:
    """An audit: on_kill's SIGTERM stayed pending in a run-job stopped by SIGSTOP, which
    then held the job's lock after its task was gone (every retry exiting 75)."""
    from tokenmill.integrations.airflow import TokenmillJobOperator

    operator = TokenmillJobOperator(task_id="t", job="job.yaml")
    child = subprocess.Popen(  # stands in for run-job: SIGTERM ends it with 75
        [sys.executable, "-c", "import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
         "print('ready', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGSTOP)
        operator._child = child
        operator.on_kill()
        assert child.wait(timeout=20) == 75
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.parametrize(("exit_code", "task_fails"), [(0, False), (75, True)])
def test_a_timeout_as_run_job_completes_leaves_the_task_done(
    airflow: Airflow, monkeypatch: pytest.MonkeyPatch, exit_code: int, task_fails: bool
) -> None:
    """An audit: an execution_timeout that came as run-job was finishing a complete job
    (it then exited 0) failed the task; a retry found nothing to do. A run-job that
    stopped (75) still fails it, for the retry to resume."""
    from tokenmill.integrations import airflow as airflow_module

    class Timeout(BaseException):  # as Airflow's AirflowTaskTimeout
        pass

    real = subprocess.Popen

    class Child(real):  # type: ignore[misc,valid-type]
        def __init__(self, args: list[str], **kwargs: Any) -> None:
            program = f"print('run-job: done', flush=True); raise SystemExit({exit_code})"
            super().__init__([sys.executable, "-c", program], **kwargs)
            self.timed_out = False

        def wait(self, timeout: float | None = None) -> int:
            code = super().wait(timeout)
            if not self.timed_out:  # the timeout fires as the child ends
                self.timed_out = True
                raise Timeout()
            return code

    monkeypatch.setattr(airflow_module.subprocess, "Popen", Child)
    operator = airflow_module.TokenmillJobOperator(task_id="t", job="job.yaml")
    if task_fails:
        with pytest.raises(Timeout):
            operator._run([])
    else:
        assert operator._run([]) == (0, "run-job: done")


def test_the_example_dag_parses(airflow: Airflow) -> None:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(str(EXAMPLE))
    assert not bag.import_errors, bag.import_errors
    dag = bag.get_dag("tokenmill_quickstart")
    assert dag is not None and set(dag.task_ids) == {"generate", "summarize"}
    assert dag.get_task("generate").overrides[1].endswith("/output/airflow/{{ ds }}/")


def test_the_operator_refuses_what_it_cannot_run(airflow: Airflow) -> None:
    from tokenmill.integrations.airflow import TokenmillJobOperator

    with pytest.raises(TypeError, match="job must be a path to a job.yaml or a dict"):
        TokenmillJobOperator(task_id="t", job=3)
    with pytest.raises(TypeError, match="overrides must be a list of 'key.path=value'"):
        TokenmillJobOperator(task_id="t", job="job.yaml", overrides="sampling.max_tokens=3")


def test_overrides_reach_run_job_in_a_scratch_job_yaml_not_its_arguments(
    airflow: Airflow, tmp_path: Path
) -> None:
    """Overrides may carry credentials: the task log shows run-job's arguments and ps lists
    them, so they go in through a scratch job.yaml (as a dict job does)."""
    from tokenmill.integrations.airflow import TokenmillJobOperator

    job_file = tmp_path / "job.yaml"
    spec = job_dict(tmp_path / "model", tmp_path / "in.jsonl", tmp_path / "out")
    job_file.write_text(yaml.safe_dump(spec))
    secret = "output.storage_options.secret=SuperSecret_ZX9"
    op = TokenmillJobOperator(task_id="t", job=str(job_file), overrides=[secret])
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    args, _ = op._prepare(scratch)
    assert not any("SuperSecret_ZX9" in arg for arg in args)
    written = yaml.safe_load(Path(args[0]).read_text())
    assert written["output"]["storage_options"]["secret"] == "SuperSecret_ZX9"
    assert TokenmillJobOperator(task_id="u", job=str(job_file))._prepare(scratch)[0] == [
        str(job_file)
    ]


@pytest.mark.parametrize(
    "output",
    [
        "s3://AKIA_ZX9:UrlSecret_ZX9@bucket/out",  # the report's path, logged as the task ran
        "https://u:UrlSecret_ZX9@host/out?X-Amz-Signature=UrlSecret_ZX9",  # an error's text
        "gs://AKIA_ZX9:UrlSecret_ZX9@bucket/out",  # (gcsfs not installed: an error's text too)
    ],
)
def test_credentials_in_an_output_url_reach_no_task_log(
    airflow: Airflow, tmp_path: Path, output: str
) -> None:
    """A URL's password or signature is refused before the task logs the report's path, and
    the refusal (which Airflow logs and keeps) shows it masked."""
    from airflow.sdk.exceptions import AirflowFailException

    from tokenmill.integrations.airflow import TokenmillJobOperator

    spec = job_dict(tmp_path / "model", tmp_path / "in.jsonl", output)
    op = TokenmillJobOperator(task_id="t", job=spec)
    with pytest.raises(AirflowFailException, match="the job spec cannot work") as err:
        op._prepare(tmp_path)
    assert "UrlSecret_ZX9" not in str(err.value), err.value


def test_a_dict_jobs_chat_template_is_not_rendered_by_airflow(
    airflow: Airflow, tmp_path: Path
) -> None:
    """A chat template is Jinja itself: Airflow rendered it with the task's context at its
    start ("'bos_token' is undefined"), a failure it then retried."""
    from airflow.sdk import DAG

    from tokenmill.integrations.airflow import TokenmillJobOperator

    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    spec = job_dict(tmp_path / "model", tmp_path / "in.jsonl", str(tmp_path / "out/{{ ds }}"))
    spec["model"]["chat_template"] = template
    with DAG("chat_template_kept", schedule=None):
        op = TokenmillJobOperator(task_id="t", job=spec)
    op.render_template_fields({"ds": "2026-12-06"})
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    args, _ = op._prepare(scratch)
    written = yaml.safe_load(Path(args[0]).read_text())
    assert written["model"]["chat_template"] == template
    assert written["output"]["path"] == str(tmp_path / "out/2026-12-06")  # rendered
    assert spec["model"]["chat_template"] == template  # the caller's dict is left as it was


def test_a_mapped_tasks_storage_options_are_masked(airflow: Airflow) -> None:
    """A mapped task's operator is rendered by its MappedOperator, which does not call the
    operator's render_template_fields: the rendered fields kept in the DB showed the token."""
    from airflow.models.renderedtifields import RenderedTaskInstanceFields
    from airflow.utils.session import create_session

    run = airflow.bag.get_dag("mapped").test()
    assert run.state == "success"
    with create_session() as session:
        rows = session.query(RenderedTaskInstanceFields).filter_by(dag_id="mapped").all()
        shown = json.dumps([row.rendered_fields for row in rows])
    assert rows and "MappedSecret_0042" not in shown, shown
    assert "auto_mkdir=true" in shown  # a boolean is not a secret (nor is every "true")


def test_storage_options_are_masked_in_the_rendered_fields(
    airflow: Airflow, tmp_path: Path
) -> None:
    """The UI shows a task's rendered fields as Airflow serializes them: values of keys it
    deems sensitive (``secret``) were hidden, an s3fs ``key`` and an override's text were
    not. Every ``storage_options`` value is masked now; the rest stays readable."""
    from airflow.sdk import DAG
    from airflow.sdk.execution_time.task_runner import _serialize_rendered_fields

    from tokenmill.integrations.airflow import TokenmillJobOperator

    spec = job_dict(tmp_path / "model", tmp_path / "in.jsonl", str(tmp_path / "out/{{ ds }}"))
    endpoint = {"endpoint_url": "http://127.0.0.1:9000"}
    spec["input"]["storage_options"] = {"key": "AKIAEXAMPLE0001", "client_kwargs": endpoint}
    overrides = [
        "output.storage_options.token=TokenValue_0002",
        "model.storage_options={key: KeyInYaml_0003}",
        "sampling.max_tokens=7",
    ]
    with DAG("masked", schedule=None):
        op = TokenmillJobOperator(task_id="t", job=spec, overrides=overrides)
    op.render_template_fields({"ds": "2026-12-06"})
    shown = json.dumps(_serialize_rendered_fields(op))
    for secret in ("AKIAEXAMPLE0001", "127.0.0.1:9000", "TokenValue_0002", "KeyInYaml_0003"):
        assert secret not in shown, shown
    assert "out/2026-12-06" in shown and "sampling.max_tokens=7" in shown


@pytest.mark.parametrize(
    ("override", "secret"),
    [
        ("output.storage_option.key=TypoKey_0051", "TypoKey_0051"),  # a key misspelt
        ("output.storage_options.key:ColonTypo_0052", "ColonTypo_0052"),  # ':' for '='
        ("output={path: /x, storage_options: {key: 'It''sSecret_0053'}}", "It''sSecret_0053"),
    ],
)
def test_overrides_mistyped_or_whole_sections_are_masked(
    airflow: Airflow, tmp_path: Path, override: str, secret: str
) -> None:
    from airflow.sdk import DAG
    from airflow.sdk.execution_time.task_runner import _serialize_rendered_fields

    from tokenmill.integrations.airflow import TokenmillJobOperator

    spec = job_dict(tmp_path / "model", tmp_path / "in.jsonl", tmp_path / "out")
    with DAG("forms", schedule=None):
        op = TokenmillJobOperator(task_id="t", job=spec, overrides=[override])
    op.render_template_fields({})
    assert secret not in json.dumps(_serialize_rendered_fields(op))


def test_a_failed_render_does_not_log_the_overrides_unmasked(
    airflow: Airflow, tmp_path: Path, capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A Jinja error in one override: Airflow logs the field's template (the whole list)."""
    from airflow.sdk import DAG

    from tokenmill.integrations.airflow import TokenmillJobOperator

    spec = job_dict(tmp_path / "model", tmp_path / "in.jsonl", tmp_path / "out")
    overrides = ["output.storage_options.key=RenderFail_0071", "output.path={{ nope }}"]
    with DAG("render_fails", schedule=None):
        op = TokenmillJobOperator(task_id="t", job=spec, overrides=overrides)
    with pytest.raises(Exception, match="nope"):
        op.render_template_fields({})
    out = capfd.readouterr()
    text = out.out + out.err + caplog.text
    assert "Exception rendering Jinja template" in text
    assert "RenderFail_0071" not in text, text


def test_a_stop_before_execute_keeps_run_job_from_starting(
    airflow: Airflow, model: Path, work: Path
) -> None:
    """Airflow's SIGTERM handler calls on_kill from the task's start-up on, before execute:
    that stop was cleared as execute began, and the whole job ran (to be SIGKILLed)."""
    from airflow.sdk.exceptions import AirflowException

    from tokenmill.integrations.airflow import TokenmillJobOperator

    out = work / "stopped_early"
    spec = job_dict(model, work / "in.jsonl", out, **SETTINGS)
    operator = TokenmillJobOperator(task_id="t", job=spec)
    operator.on_kill()
    with pytest.raises(AirflowException, match="stopped before run-job started"):
        operator.execute({})
    assert not out.exists()
