"""Where a job may write: ``output.path`` checked against the filesystem root and the input.

    refused: output.path = /              (or a whole bucket: s3://bucket)
             output.path = the input file, or any existing file
             output.path = an ancestor of the input       (shards would land among the inputs)
             output.path inside an input directory        (the next read takes the job's own
                                                           files as input rows)
             output.path inside, or over, a folder that   (the same, reached through the
             a local input's listing enters by a link      link: folder_links.py)
             output.path = a local model folder, or inside one (the job's files would change
                                                           the model's fingerprint)

Checks compare paths only (local paths after resolving ``..`` and symlinks), so they cost no
request to object storage; the links a local listing enters are found by reading its folders,
not its files. Raised as OutputPathError, a spec error (exit 2) naming the key.
"""

from __future__ import annotations

import os
import re
from typing import Any, NamedTuple

from fsspec.implementations.local import LocalFileSystem

from tokenmill.io.readers.file_listing import SUPPORTED_SUFFIXES
from tokenmill.io.readers.folder_links import folder_links_entered
from tokenmill.io.readers.storage import resolve
from tokenmill.jobs.spec import JobSpecError

_GLOB_CHARS = "*?["
# Names of every kind a job writes below its prefix, to test a glob input against.
_WRITTEN_EXAMPLES = (
    "report.json",
    "report.html",
    "job.manifest.json",
    "job.manifest.d/00000000.json",
    "_tokenmill_owner.json",
    "shards/part-00000.jsonl",
    "shards/part-00000.parquet",
    "errors/part-00000.jsonl",
)


class OutputPathError(JobSpecError):
    """``output.path`` is somewhere a job must not write."""


def check_output_location(
    output_path: str,
    output_options: dict[str, Any],
    input_path: str,
    input_options: dict[str, Any],
) -> None:
    """Raise OutputPathError naming ``output.path`` when it is the root, a whole bucket, a
    file, the input, an ancestor of the input, or inside an input directory, that directory
    reached through a link to a folder too."""
    if not isinstance(output_path, str) or not output_path.strip():
        raise OutputPathError("output.path is empty; give a folder or an s3://bucket/prefix")
    try:
        out_fs, out_root = resolve(output_path, output_options)
        in_fs, in_root = resolve(input_path, input_options)
    except (ImportError, ValueError) as exc:
        raise OutputPathError(
            f"output.path {output_path!r} or input.path {input_path!r}: cannot open its "
            f"filesystem ({exc}); for s3:// install s3fs and check storage_options"
        ) from None
    local = isinstance(out_fs, LocalFileSystem)
    out = _normal(out_root, local)
    where = f"output.path {output_path!r}"
    if local and out == "/":
        raise OutputPathError(f"{where} is the filesystem root; give a folder of its own")
    if not local and "/" not in out:
        raise OutputPathError(f"{where} names a whole bucket; give a prefix (s3://bucket/out/)")
    if local and os.path.exists(out) and not os.path.isdir(out):
        what = "the input file" if out == _normal(in_root, True) else "an existing file"
        raise OutputPathError(f"{where} is {what}; output.path must be a folder")
    if local:
        above = _existing_ancestor(out)
        if not os.path.isdir(above):
            raise OutputPathError(
                f"{where} is under {above!r}, which is a file, not a folder; give output.path "
                "a folder that can be made there"
            )
    if not local and _is_object(out_fs, out):
        raise OutputPathError(
            f"{where} is an existing object; output.path must be a prefix (s3://bucket/out/)"
        )
    if type(in_fs) is not type(out_fs):
        return
    shape = _input_base(in_root, in_fs, local)
    if _within(shape.base, out):
        raise OutputPathError(
            f"{where} contains the input {input_path!r}; the job's shards would land among "
            "its inputs. Give output.path a folder outside the input."
        )
    if (shape.is_folder and _within(out, shape.base)) or _reaches(shape.pattern, out):
        raise OutputPathError(
            f"{where} is inside the input folder {input_path!r}; the next read would take "
            "the job's own files as input rows. Give output.path a folder outside the input."
        )
    if local and (shape.is_folder or shape.pattern is not None):
        _check_linked_folders(where, out, input_path, shape)


def _check_linked_folders(where: str, out: str, input_path: str, shape: _InputShape) -> None:
    """Raise OutputPathError naming the link when the real ``out`` is inside, or holds, a
    folder that the listing of the local input ``shape`` enters through a link: the paths
    compared above are real ones, where the listing reads ``in/more/out/shards/...`` for
    ``in/more -> ../other`` and an output ``other/out``."""
    for link, real in folder_links_entered(shape.base, shape.depth):
        seen = link + out[len(real) :]  # output.path as the listing would reach it
        if _within(out, real) and (shape.is_folder or _reaches(shape.pattern, seen)):
            raise OutputPathError(
                f"{where} is inside {real!r}, which input.path {input_path!r} reads through "
                f"the link {link!r}; the next read would take the job's own files as input "
                f"rows (as {seen!r}). Give output.path a folder outside the input, or remove "
                "the link."
            )
        if _within(real, out):
            raise OutputPathError(
                f"{where} contains {real!r}, which input.path {input_path!r} reads through "
                f"the link {link!r}; the job's shards would land among its inputs. Give "
                "output.path a folder outside the input, or remove the link."
            )


def _existing_ancestor(path: str) -> str:
    """The nearest of ``path``'s parents that exists (``path`` itself not included)."""
    parent = os.path.dirname(path)
    while parent != path and not os.path.lexists(parent):
        path, parent = parent, os.path.dirname(parent)
    return parent


def check_output_outside_model(output_path: str, model_source: str) -> None:
    """Raise OutputPathError when ``model_source`` is a local folder and the local
    ``output.path`` is that folder or inside it: the job's JSON files would land among the
    model's, which its fingerprint reads, so the job could never resume."""
    # Spelled as the job reads and writes them: ``~`` expanded (the loader and the output
    # store both expand it), and a file:// output is the local folder it names.
    model_dir = os.path.expanduser(model_source)
    if not os.path.isdir(model_dir):
        return
    try:
        out_fs, out_root = resolve(output_path, {})
    except (ImportError, ValueError):
        return
    if not isinstance(out_fs, LocalFileSystem):
        return
    model, out = os.path.realpath(model_dir), os.path.realpath(out_root)
    if _within(out, model):
        where = "is the model folder" if out == model else "is inside the model folder"
        raise OutputPathError(
            f"output.path {output_path!r} {where} {model_source!r} "
            "(model.source); the job's files would land among the model's. Give output.path "
            "a folder outside the model."
        )


class _InputShape(NamedTuple):
    """What a listing of the input reads, as paths."""

    base: str  # its fixed folder or file (local: the real path)
    is_folder: bool  # whether everything below ``base`` is input
    pattern: re.Pattern[str] | None  # a glob, as a regex over full paths
    depth: int | None  # how many levels below ``base`` a glob without "**" reaches


def _reaches(pattern: re.Pattern[str] | None, folder: str) -> bool:
    """Whether the glob ``pattern`` matches a file a job writes below ``folder``."""
    return pattern is not None and any(
        pattern.fullmatch(f"{folder}/{name}") for name in _WRITTEN_EXAMPLES
    )


def _input_base(root: str, fs: Any, local: bool) -> _InputShape:
    """The input's shape (``_InputShape``).

    A glob's base is its part before the first wildcard component; with ``**`` everything
    below the base is input, otherwise only what the pattern reaches (``dir/*.jsonl`` reads
    ``dir/a.jsonl`` but never ``dir/out/shards/part-00000.jsonl``)."""
    parts = root.split("/")
    wild = next((i for i, p in enumerate(parts) if any(c in p for c in _GLOB_CHARS)), None)
    if wild is not None and not fs.exists(root):  # (a folder named run[1] is that folder,
        # as the reader takes it: file_listing.list_input_files)
        base = _normal("/".join(parts[:wild]) or "/", local)
        rest = "/".join(parts[wild:])
        regex = re.compile(re.escape(base.rstrip("/")) + "/" + _glob_regex(rest))
        recursive = "**" in rest
        return _InputShape(base, recursive, regex, None if recursive else rest.count("/") + 1)
    path = _normal(root, local)
    if local:
        return _InputShape(path, os.path.isdir(path), None, None)
    return _InputShape(path, not path.lower().endswith(SUPPORTED_SUFFIXES), None, None)


def _glob_regex(pattern: str) -> str:
    """A glob as a regex: ``*`` and ``?`` stay within one path component, ``**`` does not."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 1 :]:
            end = pattern.index("]", i + 1)
            body = pattern[i + 1 : end].replace("\\", "\\\\").replace("[", "\\[")
            out.append(f"[^{body[1:]}]" if body.startswith("!") else f"[{body}]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


def _normal(path: str, local: bool) -> str:
    return os.path.realpath(path) if local else path.strip("/")


def _within(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip("/") + "/")


def _is_object(fs: Any, path: str) -> bool:
    """Whether ``path`` is an object in ``fs`` (False when the store cannot say: the run's
    first read reports an unreachable store, naming it)."""
    try:
        return bool(fs.isfile(path))
    except Exception:
        return False
