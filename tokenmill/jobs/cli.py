"""run-job: run a job.yaml to completion, resumably. Cron-friendly exit codes:

0   the job is complete (row errors are counted in the report, not fatal)
1   the job failed (or was cancelled); rerun the same command to resume
2   the spec is invalid (the message names the file and key)
75  another run of the same job holds the lock
"""

from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.jobs.lock import JobLockedError
from tokenmill.jobs.manifest import FingerprintMismatchError
from tokenmill.jobs.spec import JobSpec, JobSpecError

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_LOCKED = 0, 1, 2, 75


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="run-job",
        description="Run a tokenmill batch inference job (resumes where it stopped).",
        epilog="exit codes: 0 complete, 1 failed, 2 invalid spec, 75 locked by another run",
    )
    parser.add_argument("job", help="path to the job.yaml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a spec key (repeatable)",
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
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
    )

    try:
        spec = JobSpec.load(args.job, args.overrides)
    except JobSpecError as exc:
        print(f"run-job: {exc}", file=sys.stderr)
        return EXIT_INVALID

    try:
        if args.dry_run:
            from tokenmill.jobs.dry_run import dry_run

            print(dry_run(spec).summary())
            return EXIT_OK
        from tokenmill.jobs.runner import run_job

        report = run_job(spec, fresh=args.fresh, show_progress=not args.quiet)
    except JobLockedError as exc:
        print(f"run-job: {exc}", file=sys.stderr)
        return EXIT_LOCKED
    except (FingerprintMismatchError, FileNotFoundError, ValueError) as exc:
        print(f"run-job: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("run-job: interrupted; rerun the same command to resume", file=sys.stderr)
        return EXIT_FAILED
    print(report.summary())
    return EXIT_OK if report.status == "complete" else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
