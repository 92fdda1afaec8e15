"""InputConfig: where a job's prompts come from and which columns hold what."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.io.readers.parquet_footers import ParquetFooters

DEFAULT_ID_COLUMN = "id"  # optional: a file without it gets file:line ids

FORMATS = ("auto", "jsonl", "parquet", "openai-batch")


@dataclass(frozen=True)
class InputConfig:
    """The job.yaml ``input`` section, validated when built.

    ``path`` is a file, a directory (every supported file inside, recursively), a glob, or an
    fsspec URL (``s3://bucket/prefix/*.jsonl``). ``id_column`` None, or a column the data does
    not have, gives ids ``"<file name>:<line or row>"``. When ``messages_column`` is set rows
    are chat conversations and ``prompt_column`` is not read. ``structured_output_column``
    names a column of plain rows holding each row's own output constraint (null: the job's
    ``sampling.structured_output``); see plain_rows.py. ``storage_options`` go to fsspec
    (``endpoint_url``, credentials, ...) and never into the input fingerprint. ``files``: the
    input's files as listed once for a run (``preflight.check_input``), so that its
    fingerprint and its reads see the same files while a folder fills; None: listed from
    ``path`` at each use. ``files_format``: the format ``files`` resolved to as the same
    check found it (``detect_format``, which looks into the first file: on an object store
    a request each time), taken by every later reader of those files; None: detected anew.
    ``footers``: Parquet ``files``' footers as the run read them (parquet_footers.py), so
    that its row count and passthrough types do not read each again; None: read anew.
    Raises ValueError naming the key when a value is invalid.
    """

    path: str
    format: str = "auto"
    id_column: str | None = DEFAULT_ID_COLUMN
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    passthrough_columns: tuple[str, ...] = ()
    storage_options: dict[str, Any] = field(default_factory=dict)
    structured_output_column: str | None = None
    files: tuple[str, ...] | None = None
    files_format: str | None = None
    footers: ParquetFooters | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Lists from YAML are accepted and frozen into a tuple.
        if isinstance(self.passthrough_columns, str):
            raise ValueError(
                "input.passthrough_columns must be a list of column names, got the string "
                f"{self.passthrough_columns!r}; write [{self.passthrough_columns!r}]"
            )
        object.__setattr__(self, "passthrough_columns", tuple(self.passthrough_columns))
        if not isinstance(self.path, str) or not self.path.strip():
            raise ValueError(f"input.path must be a non-empty string, got {self.path!r}")
        if self.format not in FORMATS:
            raise ValueError(
                f"input.format must be one of {', '.join(FORMATS)}, got {self.format!r}"
            )
        for key in ("id_column", "prompt_column", "messages_column", "structured_output_column"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"input.{key} must be a column name or null, got {value!r}")
        for name in self.passthrough_columns:
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"input.passthrough_columns entries must be column names, got {name!r}"
                )
        if self.format in ("jsonl", "parquet"):
            self.check_plain_columns()
        if not isinstance(self.storage_options, dict):
            raise ValueError(
                "input.storage_options must be a mapping, "
                f"got {type(self.storage_options).__name__}"
            )

    def check_plain_columns(self) -> None:
        """Raise ValueError unless plain rows (JSONL/Parquet) have a prompt or messages column."""
        if self.prompt_column is None and self.messages_column is None:
            raise ValueError(
                "input: set prompt_column (plain prompts) or messages_column (chat "
                "conversations); both are null"
            )
