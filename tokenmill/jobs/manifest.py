"""The checkpoint manifest: which shards are committed, under which fingerprint.

    <output>/<job>.manifest.json
    {"version": 1, "job": "quickstart", "fingerprint": "…", "rows_per_shard": 1000,
     "shards": {"0": {"first_row": 0, "end_row": 1000, "ok": 998, "errors": 2,
                      "data": "shards/part-00000.parquet", "error_file": "errors/part-00000.jsonl",
                      "prompt_tokens": …, "completion_tokens": …}, …},
     "complete": false, "total_rows": null}

A shard's files are committed first, then the manifest is rewritten (one atomic write) to name
them. A crash between the two leaves files the manifest does not list; the rerun recomputes
that shard and overwrites the same names, so each row ends up in the output exactly once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from tokenmill.io.storage import OutputStore

MANIFEST_VERSION = 1


class FingerprintMismatchError(RuntimeError):
    """The output holds progress of a different job configuration."""


@dataclass(frozen=True)
class ShardRecord:
    first_row: int
    end_row: int
    ok: int
    errors: int
    data: str
    error_file: str
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Manifest:
    job: str
    fingerprint: str
    rows_per_shard: int
    shards: dict[int, ShardRecord] = field(default_factory=dict)
    complete: bool = False
    total_rows: int | None = None

    @staticmethod
    def file_name(job: str) -> str:
        return f"{job}.manifest.json"

    @classmethod
    def load(cls, store: OutputStore, job: str) -> Manifest | None:
        data = store.read_bytes(cls.file_name(job))
        if data is None:
            return None
        try:
            raw = json.loads(data)
            return cls(
                job=raw["job"],
                fingerprint=raw["fingerprint"],
                rows_per_shard=int(raw["rows_per_shard"]),
                shards={int(k): ShardRecord(**v) for k, v in raw["shards"].items()},
                complete=bool(raw.get("complete", False)),
                total_rows=raw.get("total_rows"),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(
                f"{store.path(cls.file_name(job))} is not a tokenmill manifest ({exc}); "
                "move it away or rerun with --fresh"
            ) from None

    def check_fingerprint(self, fingerprint: str, where: str) -> None:
        if fingerprint != self.fingerprint:
            raise FingerprintMismatchError(
                f"{where} holds progress of job {self.job!r} made with a different model, "
                "sampling, chat template, input or output settings; refusing to mix results. "
                "Rerun with --fresh to discard it, or point output.path elsewhere."
            )

    def save(self, store: OutputStore) -> None:
        raw = {
            "version": MANIFEST_VERSION,
            "job": self.job,
            "fingerprint": self.fingerprint,
            "rows_per_shard": self.rows_per_shard,
            "shards": {str(k): asdict(v) for k, v in sorted(self.shards.items())},
            "complete": self.complete,
            "total_rows": self.total_rows,
        }
        store.write_atomic(self.file_name(self.job), json.dumps(raw, indent=1).encode())

    @property
    def rows_done(self) -> int:
        return sum(s.end_row - s.first_row for s in self.shards.values())
