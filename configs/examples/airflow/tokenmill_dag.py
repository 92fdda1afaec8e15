"""An Airflow DAG that runs the quickstart job every day, into one output folder per day.

Put a file like this in Airflow's DAGs folder, in an environment with tokenmill installed (the
worker runs `run-job` with the worker's own Python). Each run writes
output/airflow/<logical date>/: a retry of a run resumes its own folder (committed shards are
kept, no row is written twice), and clearing a finished run does nothing but return the same
report path. The paths point into this repository; edit them for your own job.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, task

from tokenmill.integrations.airflow import TokenmillJobOperator

# Relative paths would resolve against the worker's working directory, which Airflow does
# not fix: give absolute paths (or object-store URLs).
REPO = Path(__file__).resolve().parents[3]

with DAG(
    dag_id="tokenmill_quickstart",
    schedule="@daily",
    start_date=datetime(2025, 1, 1),
    catchup=False,
    # A run stopped by a signal, a storage failure or another run holding the output is
    # retried, and the retry resumes; a spec that cannot work fails at once, unretried.
    default_args={"retries": 3, "retry_delay": timedelta(minutes=2)},
    tags=["tokenmill"],
) as dag:
    generate = TokenmillJobOperator(
        task_id="generate",
        job=str(REPO / "configs/examples/quickstart.yaml"),
        overrides=[  # run-job --set items; Jinja-templated
            f"input.path={REPO / 'configs/examples/data/prompts.jsonl'}",
            "output.path=" + str(REPO / "output/airflow") + "/{{ ds }}/",
        ],
        # Past this, the job stops at its next commit boundary; the retry resumes it.
        execution_timeout=timedelta(hours=6),
    )

    @task
    def summarize(report_path: str) -> dict[str, float]:
        """The XCom is report.json's path, never the rows; read what you need from it."""
        import fsspec

        with fsspec.open(report_path, "r") as f:
            report = json.load(f)
        return {key: report[key] for key in ("rows_ok", "rows_failed", "output_tokens_per_s")}

    summarize(generate.output)
