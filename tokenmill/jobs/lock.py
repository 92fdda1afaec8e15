"""One run per output prefix at a time: an exclusive ``flock`` held for the whole run.

The kernel drops the lock when the process dies (SIGKILL included), so a killed run never
leaves a stale lock behind. The lock belongs to the output prefix, not to the job name, so
two jobs pointed at one prefix can never write it at once (the ownership record then refuses
the one that does not own it). Local outputs keep the lock file in the output folder;
object-store outputs keep it in ``~/.cache/tokenmill/locks`` (one machine at a time: runs on
several machines against one bucket prefix are not prevented).

A lock file removed while its run holds it (a person's ``rm``, a cleanup script's) lets a
second run create and lock a new one: the kernel's lock is on the removed file. The holder
cannot prevent that, so it fences itself: before each write that commits (a shard's files,
its manifest record, the final manifest and report) it checks that the file at the path is
still the one it locked (``check_held``) and otherwise stops with ``LockLostError`` (exit
75), writing nothing more. The newer run is then the only writer; committed shards are
kept, and a rerun resumes once it has finished.
"""

from __future__ import annotations

import calendar
import errno
import fcntl
import hashlib
import os
import re
import threading
import time
from pathlib import Path

from tokenmill.jobs.output_location import OutputPathError
from tokenmill.jobs.process_state import stopped_how

LOCK_FILE = ".tokenmill.lock"
_TRIES = 5  # takes of the lock before giving up on a lock file taken away as it is locked

# The locks this process holds ({lock path: the JobLock}): a second run in this process
# (another submit()) is told so, not to wait for "another process" to exit. A forked child
# holds none of them.
_HELD: dict[Path, JobLock] = {}
_HELD_GUARD = threading.Lock()


def _forked() -> None:
    """In a forked child: no lock is its (and the guard is new: another thread may have held
    it at the fork). Its copies of the held locks' files are closed, not unlocked (that
    would free the parent's lock): a flock belongs to the open file, which the child shared,
    so a child outliving its parent (a fork-started worker of the program that ran
    submit()) kept the lock of a run that had died, and every later run was refused, told
    to wait for the dead parent's pid (an audit)."""
    global _HELD_GUARD
    for lock in _HELD.values():
        if lock._fd is not None:
            os.close(lock._fd)
            lock._fd = None
    _HELD.clear()
    _HELD_GUARD = threading.Lock()


os.register_at_fork(after_in_child=_forked)


class JobLockedError(RuntimeError):
    """Another run holds the output's lock; ``holder_job`` names its job when the lock file
    says (None: it does not)."""

    def __init__(
        self,
        message: str,
        holder_job: str | None = None,
        holder_pid: int | None = None,
        holder_stopped: bool = False,
    ) -> None:
        super().__init__(message)
        self.holder_job = holder_job
        self.holder_pid = holder_pid  # None: the lock file does not say
        # The holder is a process of this machine that is stopped or frozen: it keeps the
        # lock until someone resumes or ends it, so retrying alone never gets through.
        self.holder_stopped = holder_stopped


class LockLostError(JobLockedError):
    """The run's lock file was removed or replaced while it ran: another run may hold the
    output now, so this one must not commit anything more."""


class JobLock:
    def __init__(
        self, job: str, output_url: str, local_dir: str | None, identity: str | None = None
    ) -> None:
        """``identity``: the output whatever its spelling (``OutputStore.identity``), which
        names an object-store output's lock (default ``output_url``)."""
        self._in_cache = local_dir is None  # an object-store output's, in ~/.cache
        if local_dir is not None:
            self.path = Path(local_dir) / LOCK_FILE
        else:
            digest = hashlib.sha256((identity or output_url).encode()).hexdigest()[:16]
            self.path = Path.home() / ".cache" / "tokenmill" / "locks" / f"{digest}.lock"
        self.job = job
        self.output_url = output_url
        self._fd: int | None = None
        self._key = self.path  # resolved once held (the _HELD entry)
        self._made_folder = False  # acquire created the lock's folder (a new local output)

    def acquire(self) -> None:
        """Take the lock or raise JobLockedError naming the holder (OutputPathError when the
        lock file is a symbolic link).

        A run that opened the lock file just before its holder released it, taking the file
        away (``release``), would lock a file no longer at the path while a third run locks
        the new one there: both would write. So the file locked must still be the one at
        the path; if not, the lock is let go and taken again from the start."""
        self._made_folder = False
        for _ in range(_TRIES):
            if self._try_acquire():
                return
        raise JobLockedError(
            f"output {self.output_url}: its lock file {self.path} was taken away "
            f"{_TRIES} times as job {self.job!r} locked it (other runs starting and "
            "stopping on this output at once); it wrote nothing. Run it again."
        )

    def _try_acquire(self) -> bool:
        """One try: False when the file locked was no longer the lock file (or its folder
        went as it was opened)."""
        self._made_folder |= not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # never through a link: the lock would write where it points
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except FileNotFoundError:  # the folder, made by a run that took it away as it ended
            return False
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise OutputPathError(
                f"output {self.output_url}: its lock file {self.path} is a symbolic link; a "
                "job never writes through one. Remove the link."
            ) from None
        # The lock taken and registered as one step under the guard: a run of this process
        # that lost in between found no holder here and was told another process held it.
        won, here = False, None
        with _HELD_GUARD:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                here = _HELD.get(self.path.resolve())
            else:
                if not _still_at(fd, self.path):  # taken away before it was locked
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
                    return False
                won, self._fd, self._key = True, fd, self.path.resolve()
                _HELD[self._key] = self
        if not won:
            holder = _holder(fd)
            named = re.match(r"job '(.*)', pid (\d+)", holder)
            mine = named is not None and int(named[2]) == os.getpid()  # (being released)
            if here is not None or mine:
                os.close(fd)
                job = here.job if here is not None else named[1]  # type: ignore[index]
                raise JobLockedError(
                    f"output {self.output_url} is being written by job {job!r} in "
                    f"this process (another submit() or run_job of this program); job "
                    f"{self.job!r} wrote nothing. Run it once that job has finished (its "
                    "handle's result()), or give each job its own output.path.",
                    job,
                ) from None
            since = _since(holder, fd)
            os.close(fd)
            raise _held_elsewhere(self, holder, since) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, _holder_text(self.job).encode())
        except OSError as exc:  # (disk full): let the lock go, or this process kept it
            self.release()  # and refused its every later run on this output (an audit)
            if exc.filename is not None or exc.errno is None:
                raise
            raise type(exc)(exc.errno, exc.strerror, str(self.path)) from exc
        return True

    def check_held(self) -> None:
        """Raise LockLostError unless this run still holds the lock through the file at the
        path: once that file is removed, another run can lock a new one and write beside
        this run. Cheap (two stats): called before each commit."""
        if self._fd is not None and _still_at(self._fd, self.path):
            return
        folder = self.path.parent
        if not self._in_cache and not folder.is_dir():  # not the lock file alone: all of it
            raise LockLostError(
                f"output {self.output_url}: job {self.job!r} lost its lock, the output folder "
                f"{folder} was removed or renamed while it ran, so it stopped before "
                "committing more. Its committed shards are where the folder went: move it "
                "back and rerun the same command to resume (or rerun to start over)."
            )
        raise LockLostError(
            f"output {self.output_url}: job {self.job!r} lost its lock, the file {self.path} "
            "was removed or replaced while it ran (by a person or a cleanup script; "
            "another run may be writing the output now), so it stopped before committing "
            "more. Do not delete a running job's lock file; rerun the same command to "
            "resume once no other run is writing the output."
        )

    def release(self) -> None:
        """Let go of the lock. An object-store output's lock file goes (one was left in
        ~/.cache/tokenmill/locks for every such output ever run: an audit); a local
        output's when the output holds nothing but the lock (the run stopped before
        writing: a model that would not load), and the folder too if acquire made it.
        Either while the lock is still held: a run that opened the file meanwhile finds it
        taken away and takes the lock again (``acquire``)."""
        if self._fd is not None:
            with _HELD_GUARD:  # first: a run may take a new lock file once this one goes
                if _HELD.get(self._key) is self:
                    del _HELD[self._key]
            try:
                self._remove_file(self._fd)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = None

    def _remove_file(self, fd: int) -> None:
        """``release``'s removal of the lock file (and of the folder acquire made), only
        while the file at the path is still the one this run locked: one removed meanwhile
        (a cache cleaner's ``rm``, a person's) may have been replaced by another run's, and
        unlinking that one let a third run lock a new file and write beside it (an audit).
        The folder stays when another run's lock file appeared in it meanwhile."""
        if not self._in_cache:
            try:
                if os.listdir(self.path.parent) != [LOCK_FILE]:
                    return
            except (FileNotFoundError, NotADirectoryError):
                # The output folder was renamed or deleted mid-run: the lock file went with
                # it. Raising here replaced the run's own error (its LockLostError, exit 75)
                # with this one (exit 2, "rerunning does not help"): an audit.
                return
        if not _still_at(fd, self.path):
            return
        self.path.unlink(missing_ok=True)
        if self._made_folder and not self._in_cache:
            try:
                self.path.parent.rmdir()
            except OSError as exc:  # another run's lock file in it since: theirs now
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    raise

    def __enter__(self) -> JobLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _still_at(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the one at ``path`` (not unlinked, nor replaced)."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def _holder(fd: int) -> str:
    """What the lock file says of its holder: the holder writes it just after taking the
    lock, so an empty file is read again for a moment."""
    for _ in range(5):
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 200).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.02)
    return "another process"


# What a holder writes in the lock file (``_holder_text``); older versions wrote no "since".
_HOLDER = re.compile(r"job '(.*)', pid (\d+)(?: on (\S+?))?(?:, since (\S+))?$")


def _holder_text(job: str) -> str:
    """The lock file's text: who holds it and since when (UTC), for the refusal of a run
    that finds it held and for a person reading the file."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"job {job!r}, pid {os.getpid()} on {os.uname().nodename}, since {started}"


def _since(holder: str, fd: int) -> float:
    """When the holder took the lock (epoch seconds): the time it wrote, else (a lock file
    of an older version, which wrote none) the file's mtime, as the holder writes the file
    once, just after taking the lock."""
    named = _HOLDER.match(holder)
    if named is not None and named[4]:
        try:
            return float(calendar.timegm(time.strptime(named[4], "%Y-%m-%dT%H:%M:%SZ")))
        except ValueError:
            pass
    return os.fstat(fd).st_mtime


def _held_elsewhere(lock: JobLock, holder: str, since: float) -> JobLockedError:
    """The refusal of ``lock`` held by another process: who holds it, since when, and, for
    a process of this machine that is stopped or frozen, that it is and how to resume or
    end it (a stopped run keeps the lock forever: each cron start exited 75 saying only
    "rerun when it has finished", an audit)."""
    named = _HOLDER.match(holder)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(since))
    ago = _duration(time.time() - since)
    head = (
        f"output {lock.output_url} is held by another run ({holder.split(', since ')[0]}, "
        f"since {started}, {ago} ago; lock {lock.path}); job {lock.job!r} wrote nothing."
    )
    if named is None:  # (a file of another program, or empty: nothing to look up)
        return JobLockedError(f"{head} Rerun when it has finished.")
    job, pid, host = named[1], int(named[2]), named[3]
    local = host is None or host == os.uname().nodename
    stopped = stopped_how(pid) if local else None
    if stopped is not None:
        return JobLockedError(
            f"{head} Process {pid} is {stopped.how}: it keeps the lock until it is resumed "
            "or ended, so every start is refused until then (run-job: exit 75). Resume it "
            f"with {stopped.resume}, "
            f"or end it with `kill {pid}` and then resume it (a stopped process acts on "
            f"SIGTERM only once resumed; it stops at its next commit, keeping committed "
            f"shards), or `kill -KILL {pid}` to end it at once.",
            job,
            pid,
            holder_stopped=True,
        )
    where = "" if local else f" (on {host}, not this machine: its state cannot be read here)"
    return JobLockedError(
        f"{head} Rerun when it has finished{where} (the lock goes when that process exits; "
        f"a hung one keeps it: see it with `ps -o pid,stat,etime -p {pid}`).",
        job,
        pid,
    )


def _duration(seconds: float) -> str:
    """``seconds`` as "3 h 05 min", "12 min" or "40 s"."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
