"""One run per job at a time: an exclusive ``flock`` held for the whole run.

The kernel drops the lock when the process dies (SIGKILL included), so a killed run never
leaves a stale lock behind. Local outputs keep the lock file beside the output; object-store
outputs keep it in ``~/.cache/tokenmill/locks`` (one machine at a time: runs on several
machines against one bucket prefix are not prevented).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path


class JobLockedError(RuntimeError):
    """Another run of the same job holds the lock."""


class JobLock:
    def __init__(self, job: str, output_url: str, local_dir: str | None) -> None:
        if local_dir is not None:
            self.path = Path(local_dir) / f".{job}.lock"
        else:
            digest = hashlib.sha256(output_url.encode()).hexdigest()[:16]
            self.path = Path.home() / ".cache" / "tokenmill" / "locks" / f"{job}-{digest}.lock"
        self.job = job
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise JobLockedError naming the holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise JobLockedError(
                f"job {self.job!r} is already running ({holder}; lock {self.path})"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> JobLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
