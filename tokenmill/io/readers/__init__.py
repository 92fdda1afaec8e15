"""Input readers: JSONL, Parquet and OpenAI Batch files, local or on object storage (fsspec).

cfg = InputConfig(path="s3://bucket/prompts/", id_column="id", prompt_column="prompt")
for row in iter_input_rows(cfg):   # streams; row.error set on bad rows
    ...
"""

from tokenmill.io.readers.file_listing import list_input_files
from tokenmill.io.readers.format_detection import detect_format
from tokenmill.io.readers.input_config import FORMATS, InputConfig
from tokenmill.io.readers.input_fingerprint import fingerprint_input, input_fingerprint
from tokenmill.io.readers.input_rows import IdOnlyRow, RowPredicate, iter_input_rows
from tokenmill.io.readers.passthrough_types import passthrough_schema

__all__ = [
    "FORMATS",
    "IdOnlyRow",
    "InputConfig",
    "detect_format",
    "fingerprint_input",
    "input_fingerprint",
    "iter_input_rows",
    "list_input_files",
    "passthrough_schema",
    "RowPredicate",
]
