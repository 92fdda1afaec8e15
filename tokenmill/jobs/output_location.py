"""Where a job may write: ``output.path`` checked against the filesystem root and the input.

    refused: output.path = /              (or a whole bucket: s3://bucket)
             output.path = the input file, or any existing file
             output.path = an ancestor of the input       (shards would land among the inputs)
             output.path inside an input directory        (the next read takes the job's own
                                                           files as input rows)
             output.path = a local model folder, or inside one (the job's files would change
                                                           the model's fingerprint)

Checks compare paths only (local paths after resolving ``..`` and symlinks), so they cost no
request to object storage. Raised as OutputPathError, a spec error (exit 2) naming the key.
"""

from __future__ import annotations

import os
import re
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from tokenmill.io.readers.file_listing import SUPPORTED_SUFFIXES
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
    file, the input, an ancestor of the input, or inside an input directory."""
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
    base, is_folder, pattern = _input_base(in_root, in_fs, local)
    if _within(base, out):
        raise OutputPathError(
            f"{where} contains the input {input_path!r}; the job's shards would land among "
            "its inputs. Give output.path a folder outside the input."
        )
    inside = is_folder and _within(out, base)
    if pattern is not None and not inside:
        inside = any(pattern.fullmatch(f"{out}/{name}") for name in _WRITTEN_EXAMPLES)
    if inside:
        raise OutputPathError(
            f"{where} is inside the input folder {input_path!r}; the next read would take "
            "the job's own files as input rows. Give output.path a folder outside the input."
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


def _input_base(root: str, fs: Any, local: bool) -> tuple[str, bool, re.Pattern[str] | None]:
    """(the input's fixed folder or file, whether everything below it is input, the glob as a
    regex over full paths when the input is a glob).

    A glob's base is its part before the first wildcard component; with ``**`` everything
    below the base is input, otherwise only what the pattern reaches (``dir/*.jsonl`` reads
    ``dir/a.jsonl`` but never ``dir/out/shards/part-00000.jsonl``)."""
    parts = root.split("/")
    wild = next((i for i, p in enumerate(parts) if any(c in p for c in _GLOB_CHARS)), None)
    if wild is not None and not fs.exists(root):  # (a folder named run[1] is that folder,
        # as the reader takes it: file_listing.list_input_files)
        base = _normal("/".join(parts[:wild]) or "/", local)
        rest = "/".join(parts[wild:])
        return base, "**" in rest, re.compile(re.escape(base.rstrip("/")) + "/" + _glob_regex(rest))
    path = _normal(root, local)
    if local:
        return path, os.path.isdir(path), None
    return path, not path.lower().endswith(SUPPORTED_SUFFIXES), None


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
