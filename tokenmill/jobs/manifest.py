"""The checkpoint manifest: which shards are committed, under which fingerprint.

    <output>/<job>.manifest.json
    {"version": 1, "job": "quickstart", "fingerprint": "…", "settings": {…},
     "rows_per_shard": 1000,
     "output_schema": {"origin": "…", "passthrough": {"topic": "string"}, "arrow": "…"},
     "shards": {"0": {"first_row": 0, "end_row": 1000, "ok": 998, "errors": 2,
                      "data": "shards/part-00000.parquet", "error_file": "errors/part-00000.jsonl",
                      "data_bytes": …, "error_bytes": …,
                      "prompt_tokens": …, "completion_tokens": …},
                "1": {…, "errors": 0, "error_file": null, "error_bytes": null, …}, …},
     "complete": false, "total_rows": null}

A shard's files are committed first, then the manifest names them: one small atomic write of
the shard's record to the manifest's journal, ``<job>.manifest.d/<shard>.json`` (the commit
point). A crash between the two leaves files the manifest does not list; the rerun recomputes
that shard and overwrites the same names, so each row ends up in the output exactly once.
Once the journal holds more than ``max(64, shards / 64)`` records, the whole manifest is
rewritten with them and the journal entries deleted (an entry left by a crash in between
repeats what the manifest holds; journal entries win when both name a shard). Rewriting the
whole file at every commit had made a long job's manifest uploads grow with the square of
its shard count (10,000 shards: ~12 GB of PUTs of a 2.5 MB file); now each shard costs one
small write and the rewrites add up to a few dozen manifests.
A shard without bad rows has no error file (``error_file`` null); an error file the manifest
does not name is a leftover of such a crash, and a run removes it before recomputing its
shard. A resume checks that every committed shard's files still exist with the sizes recorded
here (``drop_missing_shards``); a shard whose files went missing is computed again.
``output_schema`` (Parquet output) is the schema the job's first run fixed for every shard;
manifests written before it existed have none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.storage import OutputStore
from tokenmill.jobs.fingerprint import JobSettings, changed_settings, same_content

MANIFEST_VERSION = 1
# The journal is folded into the manifest file once it holds more than
# max(_MIN_JOURNAL, shards // _JOURNAL_SHARE) records.
_MIN_JOURNAL = 64
_JOURNAL_SHARE = 64
_JOURNAL_NAME = re.compile(r"^[0-9]{8}\.json$")  # a journal record's name (_journal_entry)


class FingerprintMismatchError(RuntimeError):
    """The output holds progress of a different job configuration."""


class InputChangedError(FingerprintMismatchError):
    """The input changed while a run read it: the output holds rows of either content."""


class ManifestError(RuntimeError):
    """The output's manifest, or its journal, cannot be read as one: a rerun cannot fix it,
    ``--fresh`` can."""


class OutputChangedError(RuntimeError):
    """Files of shards this job committed were removed or rewritten while it ran: the job is
    not complete, and a rerun recomputes them."""


@dataclass(frozen=True)
class ShardRecord:
    first_row: int
    end_row: int
    ok: int
    errors: int
    data: str | None  # None: a JSON Lines shard without good rows, so no data file
    error_file: str | None  # None: the shard has no bad rows, so no error file
    prompt_tokens: int = 0
    completion_tokens: int = 0
    data_bytes: int | None = None  # None in manifests written before sizes were recorded
    error_bytes: int | None = None

    def files(self) -> dict[str, int | None]:
        """{file name: recorded size or None}"""
        files = {} if self.data is None else {self.data: self.data_bytes}
        if self.error_file is not None:
            files[self.error_file] = self.error_bytes
        return files


@dataclass
class Manifest:
    job: str
    fingerprint: str
    rows_per_shard: int
    shards: dict[int, ShardRecord] = field(default_factory=dict)
    complete: bool = False
    total_rows: int | None = None
    settings: JobSettings | None = None  # what the fingerprint hashes, to name changes
    output_schema: OutputSchema | None = None  # Parquet output: fixed before the first shard
    # shards whose record is in the journal (not yet in the manifest file)
    journaled: set[int] = field(default_factory=set, repr=False)
    # the manifest file's own records that journal records replaced at load
    superseded: dict[int, ShardRecord] = field(default_factory=dict, repr=False)

    @staticmethod
    def file_name(job: str) -> str:
        return f"{job}.manifest.json"

    @staticmethod
    def journal_prefix(job: str) -> str:
        return f"{job}.manifest.d/"

    def _journal_entry(self, index: int) -> str:
        """The name of shard ``index``'s record in the journal."""
        return f"{self.journal_prefix(self.job)}{index:08d}.json"

    def commit_shard(self, store: OutputStore, index: int, record: ShardRecord) -> None:
        """Name shard ``index``'s committed files: ``write_record``, then ``add_record``."""
        compacted = self.write_record(store, index, record)
        self.add_record(index, record, compacted)
        if compacted:
            self.drop_journal(store)

    def write_record(self, store: OutputStore, index: int, record: ShardRecord) -> bool:
        """Write shard ``index``'s record where a reload finds it: in the journal (one small
        atomic write), or, when the journal is long enough, in the whole manifest rewritten
        (returns True: its journal records are then ``drop_journal``'s). The manifest here
        is left as it was (``add_record`` once written): where the write fails, or the run
        stops during it, the shard is not counted as committed (it was: a failed run's
        report gave rows_ok 12 of 16 rows with 8 committed, an interrupted one 8 with 4; an
        audit)."""
        count = len(self.shards) + (index not in self.shards)
        if len(self.journaled) + 1 > max(_MIN_JOURNAL, count // _JOURNAL_SHARE):
            text = self._text({**self.shards, index: record})
            store.write_atomic(self.file_name(self.job), text.encode())
            return True
        store.write_atomic(self._journal_entry(index), json.dumps(vars(record)).encode())
        return False

    def add_record(self, index: int, record: ShardRecord, compacted: bool) -> None:
        """Shard ``index``'s record, written by ``write_record``, in the manifest here."""
        self.shards[index] = record
        if not compacted:
            self.journaled.add(index)

    @classmethod
    def load(cls, store: OutputStore, job: str) -> Manifest | None:
        """The job's manifest with its journal's records (read concurrently:
        ``OutputStore.read_many``), applied in shard order; None when it has none. Raises
        ManifestError naming the file or record that is not one (files in the journal's
        folder with other names are not records: left alone), and the store's OSError when
        it fails."""
        name = cls.file_name(job)
        data = store.read_bytes(name)
        if data is None:
            return None
        try:
            raw = json.loads(data)
            schema = raw.get("output_schema")
            manifest = cls(
                job=raw["job"],
                fingerprint=raw["fingerprint"],
                rows_per_shard=int(raw["rows_per_shard"]),
                shards={int(k): ShardRecord(**v) for k, v in raw["shards"].items()},
                complete=bool(raw.get("complete", False)),
                total_rows=raw.get("total_rows"),
                settings=raw.get("settings"),
                output_schema=None if schema is None else OutputSchema.from_record(schema),
            )
        except _NOT_A_RECORD as exc:
            raise _manifest_error(store, name, exc) from None
        prefix = cls.journal_prefix(job)
        entries = sorted(  # (names in folders below the journal's are not its records)
            (int(base.removesuffix(".json")), entry)
            for entry in store.list(prefix)
            if _JOURNAL_NAME.match(base := entry.removeprefix(prefix))
        )
        found = store.read_many([entry for _, entry in entries])
        for (index, entry), text in zip(entries, found, strict=True):
            if text is None:  # deleted by a compaction since the listing
                continue
            try:
                record = ShardRecord(**json.loads(text))
            except _NOT_A_RECORD as exc:
                raise _manifest_error(store, entry, exc) from None
            if index in manifest.shards:
                manifest.superseded[index] = manifest.shards[index]
            manifest.shards[index] = record
            manifest.journaled.add(index)
        return manifest

    def matches(
        self, fingerprint: str, settings: JobSettings, earlier: tuple[str, ...] = ()
    ) -> bool:
        """Whether a run with ``fingerprint`` and ``settings`` (``settings_record``'s) may
        resume this progress: the hash (or one of the ``earlier`` ones an older version gave
        the same settings: ``earlier_fingerprints``), and what is kept beside it
        (``same_content``)."""
        hashes = (fingerprint, *earlier)
        return self.fingerprint in hashes and same_content(self.settings, settings)

    def check_fingerprint(
        self, fingerprint: str, settings: JobSettings, where: str, earlier: tuple[str, ...] = ()
    ) -> None:
        """Raise FingerprintMismatchError naming the changed settings (old -> new)."""
        if self.matches(fingerprint, settings, earlier):
            return
        if self.settings is not None:
            changes = changed_settings(self.settings, settings)
            what = "; ".join(changes) if changes else "an internal setting"
        else:
            what = "the model, sampling, chat template, input or output settings"
        raise FingerprintMismatchError(
            f"{where} holds progress of job {self.job!r} made with other settings; refusing "
            f"to mix results. Changed since then: {what}. Rerun with --fresh to discard the "
            "earlier progress, or point output.path elsewhere."
        )

    def missing_shards(self, sizes: dict[str, int]) -> dict[int, list[str]]:
        """{shard: [problems]} for the committed shards whose files are missing from
        ``sizes`` ({name: bytes}) or have another size than recorded."""
        missing: dict[int, list[str]] = {}
        for index, shard in sorted(self.shards.items()):
            problems = _problems(shard, sizes)
            if problems:
                missing[index] = problems
        return missing

    def restore_superseded(self, sizes: dict[str, int]) -> list[int]:
        """Shards whose journal record names files that are not there as written while the
        manifest file's own record of them does: the manifest's record back. A run of this
        version compacts its records into the manifest file, so the two agree; they differ
        when a version without the journal finished the job over records this one left.
        Returns the shards restored (their stale records go at the next ``save``)."""
        restored = []
        for index, record in self.superseded.items():
            current = self.shards.get(index)
            if current is not None and _problems(current, sizes) and not _problems(record, sizes):
                self.shards[index] = record
                restored.append(index)
        self.superseded.clear()
        return restored

    def drop_missing_shards(self, sizes: dict[str, int]) -> dict[int, list[str]]:
        """Forget the committed shards ``missing_shards`` names; return what it said."""
        dropped = self.missing_shards(sizes)
        for index in dropped:
            del self.shards[index]
        if dropped:
            self.complete = False
        return dropped

    def save(self, store: OutputStore) -> None:
        """Write the manifest file whole, then delete the journal records it now holds."""
        store.write_atomic(self.file_name(self.job), self._text(self.shards).encode())
        self.drop_journal(store)

    def drop_journal(self, store: OutputStore) -> None:
        """Delete the journal records the manifest file now holds."""
        store.delete_many([self._journal_entry(i) for i in sorted(self.journaled)])
        self.journaled.clear()

    def _text(self, shards: dict[int, ShardRecord]) -> str:
        """The manifest as JSON: its fields a line each, a shard's record a line. Written
        record by record (json's C encoder; ``indent`` takes its Python one, and
        ``asdict`` copies deeply): 30,000 shards took 2.2 s a rewrite that way."""
        head = {
            "version": MANIFEST_VERSION,
            "job": self.job,
            "fingerprint": self.fingerprint,
            "settings": self.settings,
            "rows_per_shard": self.rows_per_shard,
            "output_schema": None if self.output_schema is None else self.output_schema.to_record(),
        }
        tail = {"complete": self.complete, "total_rows": self.total_rows}
        lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
        lines_of = [f'  "{k}": {json.dumps(vars(v))}' for k, v in sorted(shards.items())]
        body = "\n" + ",\n".join(lines_of) + "\n " if lines_of else ""
        lines.append(' "shards": {' + body + "},")
        lines += [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in tail.items()]
        lines[-1] = lines[-1].rstrip(",")
        return "{\n" + "\n".join(lines) + "\n}"

    @property
    def rows_done(self) -> int:
        return sum(s.end_row - s.first_row for s in self.shards.values())


_NOT_A_RECORD = (ValueError, KeyError, TypeError, AttributeError)  # what bad JSON raises here


def _manifest_error(store: OutputStore, name: str, exc: Exception) -> ManifestError:
    return ManifestError(
        f"{store.path(name)} is not a tokenmill manifest record ({exc}); the job's "
        "progress cannot be trusted: rerun with --fresh to start it over"
    )


def _problems(record: ShardRecord, sizes: dict[str, int]) -> list[str]:
    """How ``record``'s files differ from ``sizes`` ({name: bytes}): missing, or another
    size than written (an empty list: as written)."""
    problems = []
    for name, expected in record.files().items():
        if name not in sizes:
            problems.append(f"{name} is missing")
        elif expected is not None and sizes[name] != expected:
            problems.append(f"{name} has {sizes[name]} bytes, {expected} were written")
    return problems
