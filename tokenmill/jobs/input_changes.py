"""What changed in a job's input since its manifest was written, file by file.

The manifest keeps, beside the input's fingerprint, a short hash of each input file's entry
(its size and first and last MiB, under its URL without a password or a query string;
``InputFingerprint.entries``, up to MAX_NAMED_FILES files). A run refused because the input
changed names the files added, gone or changed, rather than only how many files and bytes
there are now:

    input files added: s3://bucket/in/part-0004.jsonl
    input files changed: s3://bucket/in/part-0001.jsonl, ... (and 2 more)
"""

from __future__ import annotations

from tokenmill.io.url_secrets import hide_url_secrets

__all__ = ["file_changes"]

_NAMED = 3  # files named per kind of change; the rest counted


def file_changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """``["input files added: a, b", "input files gone: c", "input files changed: d"]``, the
    kinds that happened (sorted URLs, credentials hidden), between two ``{url: entry hash}``
    maps; [] when they agree."""
    added = sorted(after.keys() - before.keys())
    gone = sorted(before.keys() - after.keys())
    changed = sorted(url for url in before.keys() & after.keys() if before[url] != after[url])
    out = []
    for kind, urls in (("added", added), ("gone", gone), ("changed", changed)):
        if urls:
            named = ", ".join(hide_url_secrets(url) for url in urls[:_NAMED])
            more = f" (and {len(urls) - _NAMED} more)" if len(urls) > _NAMED else ""
            out.append(f"input files {kind}: {named}{more}")
    return out
