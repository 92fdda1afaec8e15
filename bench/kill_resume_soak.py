"""Kill/resume soak: SIGKILL and SIGTERM real `run-job` processes at random moments, over
every output format and both stores; every row must end up exactly once, as in a clean run.

For each (format, store) in {parquet, jsonl, openai-batch} x {local, s3}:

    reference run (uninterrupted) ──► ref rows
    run ─► engine ready ─► trigger ─► SIGKILL | SIGTERM ─► run ─► ... ─► run exits 0
                             │
                             ├─ delay:       a random delay after "engine ready"
                             ├─ shards:      k more shards named by the manifest (k = 1..2)
                             └─ uncommitted: a shard file the manifest does not name yet
                                             (the window between the two commit steps)
    final output vs ref rows: lost, duplicated, mismatched (whole record), temp files left

A SIGTERM must end the run with exit 75 and a "rerun ... to resume" message, or 0 when the
run finished first. One that lands while a completed run's interpreter is exiting (after
run-job put the default handlers back; about 1 s with torch loaded) kills it with exit -15:
counted as late_terms, not as terms.

Interrupts are spread over the combinations; when a combination finishes before its share,
the rest carry over (another round on a fresh output if needed). S3 is moto's threaded server
on 127.0.0.1, started here. The tiny random Llama of the tests (tests/tiny_models.py) runs on
the CPU, greedy.

    PYTHONPATH=. .venv/bin/python bench/kill_resume_soak.py [--kills 50] [--terms 10]
        [--seed 0] [--rows 160] [--rows-per-shard 8] [--formats jsonl,parquet,openai-batch]
        [--stores local,s3] [--verbose]

Exit status 1 on any lost, duplicated or mismatched row, temp file left, unexpected exit code,
or when the requested number of interrupts was not reached.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.moto_env import MOTO_ENV  # noqa: E402
from tests.jobs.job_helpers import chat_rows, job_dict, write_jsonl  # noqa: E402

FORMATS = ("parquet", "jsonl", "openai-batch")
STORES = ("local", "s3")
POLICIES = ("delay", "shards", "uncommitted")
TOTALED = (
    "kills",
    "terms",
    "late_terms",
    "rounds",
    "rows",
    "lost",
    "duplicated",
    "mismatched",
    "temp_left",
    "seconds",
)
COLUMNS = ("format", "store", *TOTALED)
RESUME_HINT = "rerun the same command to resume"
JOB = "soak"
RUN_TIMEOUT_S = 180.0


@dataclass
class Output:
    """One output prefix, seen from this process (local folder or S3 prefix on moto)."""

    url: str
    options: dict[str, Any]

    def __post_init__(self) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.options)
        self.root = self.root.rstrip("/")

    def names(self, sub: str = "") -> list[str]:
        """Every file below the prefix (or ``sub``), relative to it, temp files included."""
        base = f"{self.root}/{sub}".rstrip("/")
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        return sorted(p[len(self.root) + 1 :] for p in found)

    def shard_files(self) -> set[str]:
        """Data files in shards/ (no temp files): one listing, as cheap as it gets."""
        if not self.options:
            try:
                return {
                    f"shards/{n}" for n in os.listdir(f"{self.root}/shards") if ".tmp-" not in n
                }
            except FileNotFoundError:
                return set()
        return {n for n in self.names("shards") if ".tmp-" not in n}

    def read(self, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(f"{self.root}/{name}")
        except FileNotFoundError:
            return None

    def manifest(self) -> dict[str, Any] | None:
        data = self.read(f"{JOB}.manifest.json")
        try:
            return json.loads(data) if data else None
        except ValueError:
            return None  # local reads see whole files (os.replace); be safe anyway

    def committed(self) -> set[str]:
        """Data files the manifest names."""
        raw = self.manifest()
        shards = raw["shards"].values() if raw else ()
        return {s["data"] for s in shards if s["data"] is not None}  # None: no good rows


@dataclass
class Combo:
    fmt: str
    store: str
    kills: int = 0
    terms: int = 0
    late_terms: int = 0  # SIGTERMs that hit a run already exiting after completing: exit -15
    rounds: int = 0
    rows: int = 0
    lost: int = 0
    duplicated: int = 0
    mismatched: int = 0
    temp_left: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Soak:
    """Everything a combination's runs share."""

    args: argparse.Namespace
    work: Path
    model: Path
    s3_options: dict[str, Any] | None
    bucket: str
    rng: random.Random
    triggers: Counter = field(default_factory=Counter)
    term_latency: list[float] = field(default_factory=list)
    lock_files: set[Path] = field(default_factory=set)  # of S3 outputs: removed at the end

    def output(self, store: str, name: str) -> Output:
        if store == "local":
            return Output(str(self.work / "out" / name), {})
        assert self.s3_options is not None
        return Output(f"s3://{self.bucket}/{name}", dict(self.s3_options))

    def write_job(self, fmt: str, out: Output, name: str) -> Path:
        a = self.args
        src = self.work / f"in-{fmt}.jsonl"
        if not src.exists():
            batch = fmt == "openai-batch"
            write_jsonl(src, batch_lines(a.rows, a.max_tokens) if batch else chat_rows(a.rows))
        spec = job_dict(
            self.model,
            src,
            out.url,
            name=JOB,
            sampling={"max_tokens": a.max_tokens},
            output={"format": fmt, "rows_per_shard": a.rows_per_shard},
            engine={"max_num_seqs": a.max_num_seqs},
        )
        if fmt == "openai-batch":
            spec["input"] = {"path": str(src), "format": "auto"}
        if out.options:
            spec["output"]["storage_options"] = {
                k: v for k, v in out.options.items() if k != "skip_instance_cache"
            }
        store = "s3" if out.options else "local"
        job = self.work / f"{store}-{name.replace('/', '-')}.yaml"
        job.write_text(yaml.safe_dump(spec))
        if out.options:  # S3 outputs lock in ~/.cache/tokenmill/locks, one file per URL
            from tokenmill.jobs.runner import open_output
            from tokenmill.jobs.spec import JobSpec

            self.lock_files.add(open_output(JobSpec.from_dict(spec))[1].path)
        return job

    def remove_lock_files(self) -> None:
        for path in self.lock_files:
            path.unlink(missing_ok=True)


def batch_lines(n: int, max_tokens: int) -> list[dict[str, Any]]:
    """OpenAI Batch chat requests with the same conversations as ``chat_rows(n)``."""
    return [
        {
            "custom_id": row["id"],
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": row["messages"], "max_tokens": max_tokens},
        }
        for row in chat_rows(n)
    ]


# -- one run-job process ---------------------------------------------------------------------


class Run:
    """A `run-job` subprocess whose stderr is drained by a thread (``ready`` is set once the
    engine has loaded)."""

    def __init__(self, job: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.jobs.cli", str(job)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        self.ready = threading.Event()
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for raw in io.TextIOWrapper(self.proc.stderr, errors="replace"):
            self.lines.append(raw.rstrip("\n"))
            if "engine ready" in raw:
                self.ready.set()

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
            self.lines.append(f"[soak] killed after {timeout:.0f} s without finishing")
        self._reader.join(5)
        return rc

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)


def wait_for_trigger(soak: Soak, run: Run, out: Output) -> str | None:
    """Block until this run's kill moment; return the policy that fired, or None when the
    run exited first."""
    poll = 0.02 if out.options else 0.002  # S3 polls are requests to moto
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not run.ready.wait(0.01):
        if run.proc.poll() is not None or time.monotonic() > deadline:
            return None
    policy = soak.rng.choice(POLICIES)
    if policy == "delay":
        until = time.monotonic() + soak.rng.uniform(0.0, 0.4)
        while time.monotonic() < until:
            if run.proc.poll() is not None:
                return None
            time.sleep(poll)
        return policy
    more = soak.rng.randint(1, 2)
    start, before = out.committed(), out.shard_files()
    committed = start
    while time.monotonic() < deadline:
        if run.proc.poll() is not None:
            return None
        if policy == "shards":
            committed = out.committed()
            if len(committed - start) >= more:
                return policy
        else:
            # A data file neither there before nor named by the manifest: the run is between
            # the two steps of a commit. Re-read the manifest only when such a file shows up.
            new = out.shard_files() - before
            if new - committed:
                committed = out.committed()
                if new - committed:
                    return policy
            if len(committed - start) >= more + 2:
                return "uncommitted-fallback"
        time.sleep(poll)
    return None


def interrupt(soak: Soak, combo: Combo, job: Path, out: Output, sig: signal.Signals) -> bool:
    """One run, interrupted by ``sig`` at a random moment. Returns True when it ran to
    completion instead (exit 0 before the signal)."""
    run = Run(job)
    policy = wait_for_trigger(soak, run, out)
    if policy is not None and run.proc.poll() is None:
        sent = time.monotonic()
        os.kill(run.proc.pid, sig)
        rc = run.wait()
        soak.triggers[f"{sig.name}:{policy}"] += 1
        if sig == signal.SIGKILL:
            if rc == -signal.SIGKILL:
                combo.kills += 1
            elif rc != 0:
                combo.errors.append(f"SIGKILL run exited {rc}: {run.stderr[-800:]}")
        else:
            soak.term_latency.append(time.monotonic() - sent)
            finished = bool((out.manifest() or {}).get("complete"))
            if rc == 75 and RESUME_HINT in run.stderr and "SIGTERM" in run.stderr:
                combo.terms += 1
            elif rc == -signal.SIGTERM and finished and "SIGTERM received" not in run.stderr:
                # The run had completed and put the default handlers back: the signal landed
                # while the interpreter was exiting (about 1 s with torch loaded).
                combo.late_terms += 1
                rc = 0
            elif rc != 0:
                combo.errors.append(
                    f"SIGTERM run exited {rc} (want 75 and {RESUME_HINT!r}): {run.stderr[-800:]}"
                )
        log(soak, f"  {combo.fmt}/{combo.store}: {sig.name} after {policy} -> exit {rc}")
        return rc == 0
    rc = run.wait()
    if rc != 0:
        combo.errors.append(f"run exited {rc} before it could be interrupted: {run.stderr[-800:]}")
    log(soak, f"  {combo.fmt}/{combo.store}: finished before {sig.name} (exit {rc})")
    return True


def run_clean(job: Path) -> tuple[int, str]:
    run = Run(job)
    return run.wait(), run.stderr


# -- comparing outputs -----------------------------------------------------------------------


def read_rows(out: Output, fmt: str) -> tuple[list[dict[str, Any]], list[dict], list[str]]:
    """(data rows, error rows, temp files) of a finished output."""
    names = out.names()
    temp = [n for n in names if ".tmp-" in n]
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for name in names:
        if name in temp or not name.startswith(("shards/", "errors/")):
            continue
        data = out.read(name) or b""
        if name.endswith(".parquet"):
            found = pq.read_table(io.BytesIO(data)).to_pylist()
        else:
            found = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
        (rows if name.startswith("shards/") else errors).extend(found)
    return rows, errors, temp


def row_key(row: dict[str, Any]) -> str:
    return row["custom_id"] if "custom_id" in row else row["id"]


def compare(combo: Combo, ref: list[dict[str, Any]], out: Output) -> None:
    rows, errors, temp = read_rows(out, combo.fmt)
    want = {row_key(r): r for r in ref}
    got: dict[str, dict[str, Any]] = {}
    for r in rows:
        if row_key(r) in got:
            combo.duplicated += 1
        got[row_key(r)] = r
    combo.rows += len(rows)
    combo.lost += len(set(want) - set(got))
    combo.mismatched += sum(1 for k, r in got.items() if k in want and r != want[k])
    combo.mismatched += len(set(got) - set(want))  # rows the reference never had
    combo.temp_left += len(temp)
    if errors:
        combo.errors.append(f"{len(errors)} error rows: {errors[:2]}")
    manifest = out.manifest()
    if not manifest or not manifest.get("complete"):
        combo.errors.append(f"{out.url}: the manifest does not say complete")


# -- the soak --------------------------------------------------------------------------------


def soak_combo(soak: Soak, combo: Combo, ref: list[dict[str, Any]], kills: int, terms: int):
    """One round on a fresh output: ``kills`` SIGKILLs and ``terms`` SIGTERMs (fewer if the
    job completes first), then a run to completion, then the comparison."""
    start = time.monotonic()
    combo.rounds += 1
    name = f"soak/{combo.fmt}-r{combo.rounds}"
    out = soak.output(combo.store, name)
    job = soak.write_job(combo.fmt, out, name)
    plan = [signal.SIGKILL] * kills + [signal.SIGTERM] * terms
    soak.rng.shuffle(plan)
    done = False
    for sig in plan:
        if interrupt(soak, combo, job, out, sig):
            done = True
            break
    if not done:
        rc, err = run_clean(job)
        if rc != 0:
            combo.errors.append(f"the final run exited {rc}: {err[-800:]}")
    compare(combo, ref, out)
    combo.seconds += time.monotonic() - start


def reference(soak: Soak, fmt: str, store: str) -> list[dict[str, Any]]:
    out = soak.output(store, f"ref/{fmt}")
    rc, err = run_clean(soak.write_job(fmt, out, f"ref/{fmt}"))
    if rc != 0:
        raise SystemExit(f"the reference run ({fmt}, {store}) exited {rc}:\n{err[-2000:]}")
    rows, errors, _ = read_rows(out, fmt)
    if errors or len(rows) != soak.args.rows:
        raise SystemExit(f"the reference run ({fmt}, {store}): {len(rows)} rows, {errors[:2]}")
    return rows


def log(soak: Soak, message: str) -> None:
    if soak.args.verbose:
        print(message, flush=True)


def run_soak(soak: Soak, combos: list[Combo]) -> None:
    """A reference run per combination; then one round each with an even share of the
    interrupts; then extra rounds (fresh outputs, least interrupted combination first) for
    whatever landed short: a job can finish before its share is used."""
    a = soak.args
    refs = {(c.fmt, c.store): reference(soak, c.fmt, c.store) for c in combos}

    def left() -> tuple[int, int]:
        return (
            max(a.kills - sum(c.kills for c in combos), 0),
            max(a.terms - sum(c.terms for c in combos), 0),
        )

    for i, combo in enumerate(combos):
        kills, terms = left()
        share = len(combos) - i
        kills, terms = -(-kills // share), -(-terms // share)  # ceil: the first ones round up
        soak_combo(soak, combo, refs[combo.fmt, combo.store], kills, terms)
        report_progress(combo)
    for _ in range(a.max_extra_rounds):
        if not any(left()):
            break
        combo = min(combos, key=lambda c: (c.kills + c.terms, c.rounds))  # the least tried
        soak_combo(soak, combo, refs[combo.fmt, combo.store], *left())
        report_progress(combo)


def report_progress(combo: Combo) -> None:
    print(
        f"{combo.fmt:>12} {combo.store:>5}: round {combo.rounds}, {combo.kills} kills, "
        f"{combo.terms} terms so far, {combo.seconds:.0f} s",
        flush=True,
    )


def print_table(combos: list[Combo]) -> None:
    total = Combo("total", "")
    for c in combos:
        for name in TOTALED:
            setattr(total, name, getattr(total, name) + getattr(c, name))
    print("\n| " + " | ".join(COLUMNS) + " |")
    print("|" + "|".join("---" for _ in COLUMNS) + "|")
    for c in [*combos, total]:
        cells = [c.fmt, c.store, *(getattr(c, name) for name in TOTALED[:-1])]
        print("| " + " | ".join(str(x) for x in [*cells, f"{c.seconds:.0f}"]) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50, help="SIGKILLs in all (at least)")
    parser.add_argument("--terms", type=int, default=10, help="SIGTERMs in all (at least)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=160)
    parser.add_argument("--rows-per-shard", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument(
        "--max-extra-rounds", type=int, default=6, help="rounds to make up for short shares"
    )
    parser.add_argument("--verbose", action="store_true", help="one line per interrupted run")
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    stores = [s for s in args.stores.split(",") if s]
    if not set(formats) <= set(FORMATS) or not set(stores) <= set(STORES):
        parser.error(f"--formats from {FORMATS}, --stores from {STORES}")
    combos = [Combo(f, s) for f in formats for s in stores]

    os.environ.update(MOTO_ENV)  # moto only; the children inherit them
    os.environ.pop("AWS_PROFILE", None)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = None
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kill-resume-soak-") as tmp:
        from tests.tiny_models import save_tiny_model

        model = save_tiny_model("llama", Path(tmp) / "tiny", max_position_embeddings=1024)
        s3_options = None
        bucket = f"tokenmill-soak-{secrets.token_hex(4)}"  # the S3 lock is per URL: unique
        if "s3" in stores:
            from moto.server import ThreadedMotoServer

            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            s3_options = {
                "endpoint_url": f"http://{host}:{port}",
                "key": "testing",
                "secret": "testing",
                "skip_instance_cache": True,
            }
            fsspec.filesystem("s3", **s3_options).mkdir(bucket)
        soak = Soak(args, Path(tmp), model, s3_options, bucket, random.Random(args.seed))
        try:
            run_soak(soak, combos)
        finally:
            soak.remove_lock_files()
            if server is not None:
                server.stop()

    print_table(combos)
    lat = sorted(soak.term_latency)
    if lat:
        print(f"\nSIGTERM to exit: median {lat[len(lat) // 2]:.2f} s, max {lat[-1]:.2f} s")
    print("triggers:", ", ".join(f"{k} {v}" for k, v in sorted(soak.triggers.items())))
    print(f"wall {time.monotonic() - started:.0f} s, seed {args.seed}")
    failures = [f"{c.fmt}/{c.store}: {e}" for c in combos for e in c.errors]
    bad = [c for c in combos if c.lost or c.duplicated or c.mismatched or c.temp_left]
    kills, terms = sum(c.kills for c in combos), sum(c.terms for c in combos)
    if kills < args.kills or terms < args.terms:
        failures.append(f"only {kills} SIGKILLs / {terms} SIGTERMs landed mid-run")
    for line in failures:
        print("FAIL", line[:2000])
    if bad:
        print(
            "FAIL rows lost, duplicated, mismatched or temp files left:",
            ", ".join(f"{c.fmt}/{c.store}" for c in bad),
        )
    return 1 if failures or bad else 0


if __name__ == "__main__":
    sys.exit(main())
