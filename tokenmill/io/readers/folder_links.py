"""Local input files below links to folders, for a folder input and a glob alike.

fsspec's local walk lists a link to a folder as an entry of type "other" and never enters
it: a folder input listed the link as a file (the job failed on it: "cannot tell the format
of .../more", or "Is a directory"), and a glob matched nothing below it, so its files' rows
were left out without a word. ``find -L``, Python's glob and Spark read the files below such
links; so do these. A link to a folder that holds it (its files would be read forever) is
refused by name. Object stores have no links: their listings pass through unchanged.
"""

from __future__ import annotations

import os
import re
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import glob_translate


def through_folder_links(fs: Any, paths: list[str], chain: tuple[str, ...] = ()) -> list[str]:
    """``paths`` (a local folder's ``fs.find``) with each link to a folder replaced by the
    files below it. ``chain``: the real folders already entered through links above.
    Raises ValueError naming a link to a folder that holds it."""
    if not isinstance(fs, LocalFileSystem):
        return paths
    out = []
    for path in paths:
        if not (os.path.islink(path) and os.path.isdir(path)):
            out.append(path)
            continue
        out += through_folder_links(fs, fs.find(path), _entered(path, chain))
    return out


def glob_through_links(fs: Any, pattern: str) -> dict[str, dict[str, Any]]:
    """``fs.glob(pattern, detail=True)``: each path ``pattern`` matches and its info, where
    a local pattern also matches paths below links to folders (``in/**``, ``in/*/*.jsonl``
    with ``in/more -> ../other/``: ``in/more/b.jsonl``). The matching is fsspec's, over the
    entries its walk would list, plus those below each link to a folder within the
    pattern's depth. Raises ValueError naming a link to a folder that holds it, when the
    pattern reaches below it."""
    if not isinstance(fs, LocalFileSystem):
        return fs.glob(pattern, detail=True)
    pattern = fs._strip_protocol(pattern)
    magic = min(i for i in (pattern.find(c) for c in "*?[") if i >= 0)
    root = pattern[: pattern.rfind("/", 0, magic) + 1]  # (fsspec's glob walks from there)
    depth = None if "**" in pattern else pattern[magic:].count("/") + 1
    found = fs.find(root, depth, withdirs=True, detail=True)
    entries = _entries_through_links(fs, root, found, depth)
    matches = re.compile(glob_translate(pattern)).match
    slash = pattern.endswith("/**")  # (as fsspec's: "in/**" matches "in/" itself)
    return {
        p: info
        for p, info in sorted(entries.items())
        if matches(p + "/" if slash and info["type"] == "directory" else p)
    }


def _entries_through_links(
    fs: Any,
    top: str,
    entries: dict[str, dict[str, Any]],
    depth: int | None,
    chain: tuple[str, ...] = (),
) -> dict[str, dict[str, Any]]:
    """``entries`` (``fs.find(top, depth, withdirs=True, detail=True)``) and, for each link
    to a folder among them above ``depth``, the entries below it, as below a folder."""
    top = fs._strip_protocol(top)
    out = dict(entries)
    for path, info in entries.items():
        if path == top or not (info.get("islink") and os.path.isdir(path)):
            continue
        left = None if depth is None else depth - path[len(top) :].strip("/").count("/") - 1
        if left is not None and left < 1:
            continue  # (nothing below it can match: fsspec's walk stops at this depth too)
        inner = _entered(path, chain)
        below = fs.find(path, left, withdirs=True, detail=True)  # (the link itself: a folder)
        out |= _entries_through_links(fs, path, below, left, inner)
    return out


def _entered(link: str, chain: tuple[str, ...]) -> tuple[str, ...]:
    """``chain`` (the real folders entered through links so far) with the folder holding
    ``link`` and the one it leads to added. Raises ValueError when ``link`` leads to one of
    them or a folder above one."""
    real = os.path.realpath(link)
    holders = (*chain, os.path.realpath(os.path.dirname(link)))
    if any(real == h or h.startswith(real.rstrip(os.sep) + os.sep) for h in holders):
        raise ValueError(
            f"input.path: {link} is a link to a folder that holds it ({real}), so its "
            "files would be read again and again; remove the link or point input.path "
            "at the data below it"
        )
    return (*holders, real)


def folder_links_entered(top: str, depth: int | None = None) -> list[tuple[str, str]]:
    """Each link to a folder that a listing of the local folder ``top`` enters (a folder
    input's: ``depth`` None; a glob's: fsspec's depth from ``top``, its fixed part), links
    below links too, as (its path below ``top``, the real folder it leads to). A link that
    holds it is left out (the listing refuses it by name), and so is a folder that cannot be
    read (the listing reports it).

    One ``scandir`` per folder, and a ``stat`` per link only: cheaper than the listing, which
    looks at every file."""
    found = []
    pending: list[tuple[str, int | None, tuple[str, ...]]] = [(top, depth, ())]
    while pending:
        folder, left, chain = pending.pop()
        if left is not None and left <= 1:
            continue  # (what lies below its folders is past the listing's depth)
        below = None if left is None else left - 1
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.is_symlink() and os.path.isdir(entry.path):
                        try:
                            inner = _entered(entry.path, chain)
                        except ValueError:
                            continue
                        found.append((entry.path, inner[-1]))
                        pending.append((entry.path, below, inner))
                    elif entry.is_dir(follow_symlinks=False):
                        pending.append((entry.path, below, chain))
        except OSError:
            continue
    return sorted(found)


def one_path_per_file(fs: Any, paths: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(``paths`` with each local file once, (a path left out, the path kept for its file)
    for each repeat). A link inside the input to a folder or file also there (``latest ->
    v3/`` beside ``v3/``) listed one file under two names, and its rows were read twice:
    twice in the output, or (with an id column) the second copy's rows all duplicate-id
    errors. The path kept is the file's own where listed (no link in it), else the first
    in sorted order; object stores have no links: ``paths`` as they are."""
    if not isinstance(fs, LocalFileSystem):
        return paths, []
    by_file: dict[str, list[str]] = {}
    for path in paths:
        by_file.setdefault(os.path.realpath(path), []).append(path)
    kept: set[str] = set()
    repeats: list[tuple[str, str]] = []
    for real, names in by_file.items():
        keep = real if real in names else min(names)
        kept.add(keep)
        repeats += [(name, keep) for name in sorted(names) if name != keep]
    return [p for p in paths if p in kept], sorted(repeats)
