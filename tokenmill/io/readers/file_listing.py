"""Expanding an input path (file, directory, glob, URL) into the sorted list of its files."""

from __future__ import annotations

import logging
from typing import Any

from tokenmill.io.readers.compression import strip_compression_suffix
from tokenmill.io.readers.folder_links import (
    glob_through_links,
    one_path_per_file,
    through_folder_links,
)
from tokenmill.io.readers.input_config import InputConfig
from tokenmill.io.readers.listing_cache import forget_listings
from tokenmill.io.readers.storage import has_protocol, location_problem, relative_note, resolve
from tokenmill.io.url_secrets import hide_url_secrets, without_query

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES

log = logging.getLogger(__name__)


def list_input_files(cfg: InputConfig) -> list[str]:
    """The input files of ``cfg.path``, sorted, as URLs that can be reopened.

    A glob keeps every file it matches. A directory gives every file below it, recursively,
    skipping names that start with "." or "_" (``_SUCCESS``, ``_temporary/``, ``.crc`` files
    of Spark and Hadoop) and, with a warning naming them, files that are documentation or
    code, never data (``README.md`` beside a dataset's Parquet files, ``NOTEBOOK.ipynb``:
    ``NOT_DATA_SUFFIXES``, ``NOT_DATA_NAMES``). Files whose suffix says no format
    (``part-00000`` of a Hadoop text export, ``x.jsonl.lz4``) are listed too: read as
    ``input.format`` says where it is set, refused by name by detect_format where it is auto
    or the suffix is an archive it cannot open, never left out without a word (their rows
    would be lost). Compressed Parquet is listed for the same reason.
    Both read a local path's files below links to folders, as Python's glob does
    (folder_links.py: a link to a folder that holds it raises ValueError naming it).
    URLs keep their protocol (``s3://bucket/key``); local paths stay plain absolute paths.
    Raises FileNotFoundError naming the path when nothing matches, and ValueError when the
    files are a Delta Lake or Iceberg table's (a folder with ``_delta_log/`` or
    ``metadata/*.metadata.json`` holds them, or is below the path): its Parquet files hold
    rows the table has deleted or replaced since. A config with ``files`` (listed once for
    a run: ``preflight.check_input``) gives those.
    """
    if cfg.files is not None:
        return list(cfg.files)
    forget_listings(cfg.path, cfg.storage_options)  # the store as it is now (listing_cache.py)
    fs, root = resolve(cfg.path, cfg.storage_options)
    # (a file named a[1] is a file; an HTTP(S) URL's "?" starts its query, not a pattern)
    if any(ch in without_query(root) for ch in "*?[") and not fs.exists(root):
        matches = glob_through_links(fs, root)  # (below links to folders too)
        paths = [
            p for p, info in matches.items() if _is_file(fs, p, info) and not _folder_marker(p)
        ]
        if not paths:
            raise FileNotFoundError(
                f"input.path {cfg.path!r} matches no files{relative_note(cfg.path)}; check the "
                "pattern and the location"
            )
        holders = {p.rpartition("/")[0] for p in paths}
    elif fs.isdir(root):
        found = through_folder_links(fs, [p for p in fs.find(root) if not _folder_marker(p)])
        _refuse_table_files(cfg.path, [_table_inside(p[len(root) :]) for p in found])
        paths = [p for p in found if not _hidden(p[len(root) :])]
        paths = _without_documents(cfg.path, paths)
        if not paths:
            raise FileNotFoundError(
                f"input.path {cfg.path!r} is a directory with no files in it (names starting "
                "with '.' or '_' are left out); point it at the data"
            )
        holders = {root}
    elif _is_file_there(fs, root, cfg.path):
        paths = [root]
        holders = {root.rpartition("/")[0]}
    else:
        raise FileNotFoundError(f"input.path {cfg.path!r} does not exist{relative_note(cfg.path)}")
    paths = _each_file_once(cfg.path, fs, paths)
    if not cfg.path.lower().startswith(("http://", "https://")):  # (no tables served so)
        # the folders that hold the files, and theirs: a glob's, a file's, a partition's
        _refuse_table_files(cfg.path, _tables_above(fs, sorted(holders)[:_TABLE_LOOKS]))
    if has_protocol(cfg.path):
        paths = [fs.unstrip_protocol(p) for p in paths]
    for path in paths:  # a key s3fs would not open as listed (every run would fail alike)
        problem = location_problem(path)
        if problem is not None:
            raise ValueError(f"input.path {cfg.path!r}: an input file {problem}")
    return sorted(paths)


def _each_file_once(shown: str, fs: Any, paths: list[str]) -> list[str]:
    """``paths`` with a file listed under two names (through a link) once, with a warning
    naming the names left out (``one_path_per_file``)."""
    paths, repeats = one_path_per_file(fs, paths)
    if repeats:
        more = f" and {len(repeats) - 3} more" if len(repeats) > 3 else ""
        log.warning(
            "input.path %r: left out %d file(s) that a link makes a second name of a file "
            "read already (%s%s); each file's rows are read once",
            shown,
            len(repeats),
            ", ".join(f"{left} is {kept}" for left, kept in repeats[:3]),
            more,
        )
    return paths


def display_names(files: list[str]) -> list[str]:
    """Short names for ids and messages: each file's path below the files' common directory.

    For files in one directory this is the base name; files in subdirectories keep the
    subdirectory (``a/part-0.jsonl``), so two ``part-0.jsonl`` never give the same ids.
    An HTTP(S) URL's query string is left out: a presigned URL's signature and token would
    otherwise land in every row id of the output. URLs that differ only there (an HTTP
    folder listing ``rows.jsonl?versionId=1`` and ``=2``) get ``rows.jsonl``,
    ``rows.jsonl~2``, ...: one name for both gave their rows the same ids, and every row of
    the second was refused as a duplicate.
    """
    parts = [without_query(f).split("/") for f in files]
    common = min((len(p) - 1 for p in parts), default=0)
    for i in range(common):
        if len({p[i] for p in parts}) > 1:
            common = i
            break
    return _numbered_repeats(["/".join(p[common:]) for p in parts])


def _numbered_repeats(names: list[str]) -> list[str]:
    """``names`` with each repeat of an earlier one as ``<name>~2``, ``~3``, ... (the first
    number no name in the list has)."""
    taken = set(names)
    if len(taken) == len(names):
        return names
    seen: set[str] = set()
    out = []
    for name in names:
        if name in seen:
            n = 2
            while f"{name}~{n}" in taken:
                n += 1
            name = f"{name}~{n}"
            taken.add(name)
        seen.add(name)
        out.append(name)
    return out


def _folder_marker(path: str) -> bool:
    """Whether ``path`` is an object store's folder marker, not data: an empty key ending
    in "/" (the S3 console's "Create folder", rclone, S3A) or Hadoop's ``<name>_$folder$``.
    Listed as files, a folder of Parquet files failed as "Parquet file size is 0 bytes", an
    auto-format one "cannot tell the format of s3://b/in/" (an audit)."""
    return path.endswith(("/", "_$folder$"))


def _is_file_there(fs: Any, path: str, given: str) -> bool:
    """Whether ``path`` (input.path ``given``) is a file, where only its absence answers
    False: fsspec's ``isfile`` answers False to any error, so an input object the store
    would not show (503 SlowDown, 500 after the client's retries) was "input.path ... does
    not exist", exit 2 ("rerunning does not help") for an outage a rerun gets past (an
    audit). The store's error raises. So does the client's refusal to send the request at
    all, which fsspec's HTTP ``info`` also turns into FileNotFoundError (aiohttp: "Cannot
    combine AUTHORIZATION header with ... credentials encoded in URL"): ValueError, saying
    so, where it read "does not exist"."""
    try:
        return fs.info(path).get("type") == "file"
    except FileNotFoundError as exc:
        if isinstance(exc.__cause__, ValueError | TypeError):  # never sent: not an answer
            raise ValueError(
                f"input.path {hide_url_secrets(given)!r}: the storage client refused the "
                f"request ({hide_url_secrets(str(exc.__cause__))}); check input.storage_options "
                "against the path"
            ) from None
        return False


def _is_file(fs: Any, path: str, info: dict[str, Any]) -> bool:
    """Whether a glob match is a file to read: a file, or a link to one. A dangling link is
    kept too, so that reading it fails naming it (as it does in a directory input) instead
    of its rows going missing without a word; links to folders are left out like folders."""
    if info.get("type") == "file":
        return True
    return bool(info.get("islink")) and (fs.isfile(path) or not fs.exists(path))


def warn_hidden_matches(cfg: InputConfig, files: list[str]) -> None:
    """Warn when ``cfg.path`` is a glob and ``files`` (its matches) hold files below folders
    or names starting with "." or "_" (``.ipynb_checkpoints/`` with a stale copy, Spark's
    ``_temporary/``): a glob keeps them, where a folder input, Python's glob and
    pyarrow.dataset leave them out."""
    fs, pattern = resolve(cfg.path, cfg.storage_options)  # as list_input_files matched it
    if not any(c in pattern for c in "*?["):
        return
    fixed = pattern[: min(pattern.find(c) for c in "*?[" if c in pattern)].rpartition("/")[0]
    paths = [fs._strip_protocol(f) for f in files]  # (a relative path's files are absolute)
    hidden = [p for p in paths if p.startswith(fixed) and _hidden(p[len(fixed) :])]
    if hidden:
        log.warning(
            "input.path %r matches %d file(s) below a name starting with '.' or '_' (e.g. "
            "%s), and reads them: a folder input leaves such files out; narrow the pattern "
            "if they are not data",
            cfg.path,
            len(hidden),
            hidden[0],
        )


# Files a dataset folder holds beside its data that are never data (a Hugging Face dataset's
# README.md, a notebook, a schema description): left out of a folder input, with a warning.
# Not .txt: JSONL saved as .txt and read with input.format set must not lose its rows
# (a README.txt goes by its name).
NOT_DATA_SUFFIXES = (
    ".md", ".rst", ".html", ".pdf", ".py", ".sh", ".ipynb", ".yaml", ".yml", ".toml",
    ".cfg", ".ini", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".lock", ".crc",
)  # fmt: skip
NOT_DATA_NAMES = ("readme", "license", "licence", "notice", "changelog", "copying", "authors")


def _without_documents(path: str, paths: list[str]) -> list[str]:
    """``paths`` less the documents among them (NOT_DATA_SUFFIXES, NOT_DATA_NAMES), which a
    warning names."""
    documents = [p for p in paths if _is_document(p.rsplit("/", 1)[-1].lower())]
    if not documents:
        return paths
    left_out = set(documents)
    names = ", ".join(d.rsplit("/", 1)[-1] for d in documents[:5])
    more = f" and {len(documents) - 5} more" if len(documents) > 5 else ""
    log.warning(
        "input.path %r: left out %d file(s) that are documentation, not data (%s%s)",
        path,
        len(documents),
        names,
        more,
    )
    return [p for p in paths if p not in left_out]


def _is_document(name: str) -> bool:
    """Whether a (lower-cased) file name is a document's: never where its suffix names a
    data format (``authors.jsonl``, ``license.parquet``, compressed or not)."""
    if strip_compression_suffix(name).endswith(SUPPORTED_SUFFIXES):
        return False
    return name.endswith(NOT_DATA_SUFFIXES) or name.split(".", 1)[0] in NOT_DATA_NAMES


def _hidden(relative: str) -> bool:
    """Whether a path below the input folder lies below, or is, a name Spark and Hadoop
    leave out: one starting with "." or "_" (``_SUCCESS``, ``_temporary/``, ``.crc``), but
    not a Hive partition ``_key=value`` (Spark reads ``_col=1/``: its rows were left out
    without a word, an audit)."""
    return any(
        part.startswith(".") or (part.startswith("_") and "=" not in part)
        for part in relative.strip("/").split("/")
    )


_TABLE_LOOKS = 16  # folders whose ancestors are looked at: any one finds its table

_DELTA = "a Delta Lake table's (a folder with _delta_log/ holds them)"
_ICEBERG = "an Iceberg table's (a folder with metadata/*.metadata.json holds them)"


def _table_inside(relative: str) -> str | None:
    """The table kind a file found below the input folder (``relative`` to it) says that
    folder holds, or None."""
    parts = relative.strip("/").split("/")
    if "_delta_log" in parts[:-1]:
        return _DELTA
    if len(parts) >= 2 and parts[-2] == "metadata" and parts[-1].endswith(".metadata.json"):
        return _ICEBERG
    return None


def _tables_above(fs: Any, folders: list[str]) -> list[str | None]:
    """The table kind of each folder of ``folders`` and their ancestors that is a table's
    root, or None for one that is not (each folder looked at once)."""
    kinds: dict[str, str | None] = {}
    for folder in folders:
        while folder and folder not in kinds:
            kinds[folder] = _table_kind(fs, folder)
            parent = folder.rpartition("/")[0]
            folder = parent if parent != folder else ""
    return list(kinds.values())


def _table_kind(fs: Any, folder: str) -> str | None:
    try:
        if fs.exists(f"{folder}/_delta_log"):
            return _DELTA
        if fs.exists(f"{folder}/metadata") and fs.glob(f"{folder}/metadata/*.metadata.json"):
            return _ICEBERG
    except Exception:  # a folder the store will not show us: not a table we know of
        return None
    return None


def _refuse_table_files(shown: str, kinds: list[str | None]) -> None:
    """ValueError when a kind of ``kinds`` says the input's files are a table's: which of
    its Parquet files hold the table's rows, and which of their rows are deleted, only the
    table's log says."""
    kind = next((k for k in kinds if k is not None), None)
    if kind is not None:
        raise ValueError(
            f"input.path {shown!r}: its files are {kind}; they also hold rows the table "
            "has deleted or replaced since, which only the table's log tells apart; export "
            "the table's current version to Parquet or JSONL (Spark, duckdb, deltalake or "
            "pyiceberg) and point input.path there"
        )
