"""A local output never writes through a symbolic link inside it.

A job writes, replaces and (``--fresh``) deletes files below ``output.path``: its lock,
``shards/``, ``errors/``, the manifest and its journal, the report. A link planted there
(``out/shards -> /elsewhere``, ``out/.tokenmill.lock -> ~/.bashrc``) would carry those
writes and deletes outside the output, so a run refuses an output folder holding one, naming
it (exit 2), before it takes the lock or writes anything. ``output.path`` itself may be a
link (an output folder on another disk): only what is inside it is checked. Object stores
have no links.
"""

from __future__ import annotations

import os

from tokenmill.jobs.output_location import OutputPathError


def check_no_links(root: str) -> None:
    """Raise OutputPathError naming the first symbolic link found below the local folder
    ``root`` (nothing to check when it does not exist yet)."""
    if not os.path.isdir(root):
        return
    pending = [root]
    while pending:
        folder = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_symlink():
                    raise OutputPathError(
                        f"output.path {root!r} holds a symbolic link, {entry.path!r} -> "
                        f"{os.readlink(entry.path)!r}; a job writes and deletes only its own "
                        "files below output.path and never through a link. Remove the link "
                        "(or give the job another output.path)."
                    )
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
