"""A job owns its output prefix: one job per ``output.path``, and nothing foreign is touched.

    <output>/_tokenmill_owner.json   {"job": "quickstart", "fingerprint": "…", "created": "…"}

The first run of a job writes this record before any shard. A run of another job pointed
at the same prefix is refused (``OutputOwnedError``, a spec error: exit 2), so two jobs can
never overwrite each other's shards and both report complete. A prefix with no record is
claimed only when none of the names a job writes are already taken by files it did not
write; outputs made before the record existed (or whose record was deleted) are recognised
by their manifest or its journal.

The leading underscore keeps the record out of the datasets that pyarrow, Spark and duckdb
read from the prefix.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from tokenmill.io.storage import OutputStore
from tokenmill.jobs.manifest import Manifest
from tokenmill.jobs.spec import JobSpecError

OWNER_FILE = "_tokenmill_owner.json"
REPORT_NAME = "report.json"
REPORT_HTML_NAME = "report.html"  # the same report as a page with plots (report_html.py)
_MANIFEST_SUFFIX = Manifest.file_name("")
_JOB_FOLDERS = ("shards/", "errors/")
_SHOWN = 5  # foreign file names quoted in a refusal


class OutputOwnedError(JobSpecError):
    """``output.path`` belongs to another job, or holds files no run of this job wrote."""


@dataclass(frozen=True)
class Owner:
    job: str
    fingerprint: str
    created: str


def read_owner(store: OutputStore) -> Owner | None:
    """The ownership record of ``store``, or None. Raises OutputOwnedError when the file
    exists but is not one (a file of the same name someone else wrote)."""
    data = store.read_bytes(OWNER_FILE)
    if data is None:
        return None
    try:
        raw = json.loads(data)
        return Owner(str(raw["job"]), str(raw.get("fingerprint", "")), str(raw.get("created", "")))
    except (ValueError, KeyError, TypeError):
        raise OutputOwnedError(
            f"output.path {store.url}: {OWNER_FILE} is not a tokenmill ownership record; "
            "point output.path at a folder of its own"
        ) from None


def check_claimable(store: OutputStore, job: str) -> Owner | None:
    """The owner record of ``store`` after checking that ``job`` may write there (reads only).

    Raises OutputOwnedError when another job owns it, or when an unclaimed prefix already
    holds files at names this job would write (shards/, errors/, report.json, report.html,
    manifests).
    """
    owner = read_owner(store)
    if owner is not None:
        if owner.job != job:
            raise OutputOwnedError(_owned_by(store, owner.job, owner.created, job))
        return owner
    names = store.top_names() + store.list("shards/") + store.list("errors/")
    manifests = [n for n in names if "/" not in n and n.endswith(_MANIFEST_SUFFIX)]
    others = [m[: -len(_MANIFEST_SUFFIX)] for m in manifests if m != Manifest.file_name(job)]
    if others:
        raise OutputOwnedError(_owned_by(store, others[0], "", job))
    # This job's manifest journal is its own as much as its manifest: a run whose output was
    # emptied under it (``rm -rf out/*``, the lock file kept) went on committing shards and
    # records, and its rerun was refused as holding files "job 'x' did not write", --fresh
    # too (an audit); now the rerun says the manifest is gone and --fresh starts over.
    if not manifests and not store.list(Manifest.journal_prefix(job)):
        # not an output of an earlier run of this job: must be free of our names
        taken = [
            n for n in names if n.startswith(_JOB_FOLDERS) or n in (REPORT_NAME, REPORT_HTML_NAME)
        ]
        if taken:
            shown = ", ".join(taken[:_SHOWN]) + (" ..." if len(taken) > _SHOWN else "")
            raise OutputOwnedError(
                f"output.path {store.url} already holds files that job {job!r} did not write "
                f"({shown}); they would be overwritten. Point output.path at a new or empty "
                "folder, or move those files away."
            )
    return None


def check_not_inside_another(store: OutputStore, job: str) -> None:
    """Raise OutputOwnedError when a folder above ``store`` is a job's output (holds an
    ownership record) newer than ``store``'s own: a job written into another's ``shards/``
    put its manifest and reports among that job's data files, and pyarrow and polars could
    no longer read them as a dataset. An output that was there first stays its job's (a
    job later pointed at a folder above it does not lock it out). The walk up stops at the
    first folder that cannot be read (no right to, or a store out of reach: what opening
    the output then says)."""
    own = read_owner(store)  # first: a store out of reach says so once, here
    for parent in _parents(store):
        try:
            record = store.fs.cat_file(f"{parent.rstrip('/')}/{OWNER_FILE}")
        except FileNotFoundError:
            continue
        except Exception:  # nothing known above, and each try may take a store's retries
            return
        try:
            raw = json.loads(record)
            other, created = repr(str(raw["job"])), str(raw.get("created", ""))
        except (ValueError, KeyError, TypeError, AttributeError):
            other, created = "(unreadable record)", ""
        if own is not None and own.created and created and own.created <= created:
            continue  # this output was there first
        raise OutputOwnedError(
            f"output.path {store.url} is inside the output of job {other} "
            f"({store.url_of(parent)} holds "
            f"{OWNER_FILE}); job {job!r} would write among that job's files. Give job "
            f"{job!r} a folder outside it."
        )


def _parents(store: OutputStore) -> list[str]:
    """The folders above ``store``'s root, nearest first: up to the filesystem root, or up
    to the bucket on an object store (the bucket itself included)."""
    parts = store.root.rstrip("/").split("/")
    return ["/".join(parts[:i]) or "/" for i in range(len(parts) - 1, 0, -1)]


def claim_output(store: OutputStore, job: str, fingerprint: str, owner: Owner | None) -> None:
    """Write (or update) the record making ``job`` the owner of ``store``; ``owner`` is what
    ``check_claimable`` returned. Call under the output's lock."""
    if owner is not None and owner.fingerprint == fingerprint:
        return
    created = owner.created if owner else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    _write(store, Owner(job, fingerprint, created))


def _write(store: OutputStore, owner: Owner) -> None:
    record = {"job": owner.job, "fingerprint": owner.fingerprint, "created": owner.created}
    store.write_atomic(OWNER_FILE, json.dumps(record, indent=1).encode())


def _owned_by(store: OutputStore, other: str, created: str, job: str) -> str:
    since = f" since {created}" if created else ""
    return (
        f"output.path {store.url} belongs to job {other!r}{since}; job {job!r} may not write "
        f"there (the two would overwrite each other's shards). Give job {job!r} its own "
        f"output.path, or name it {other!r} if it is the same job."
    )
