"""What a job's error means to whoever runs it again: run-job's exit codes, for run-job and
for a program holding a ``submit()`` handle alike.

    0   complete
    1   failed: rerun to resume
    2   the spec, a file, a path or a permission must be fixed first: a rerun as it is fails
    75  temporary: another run holds the output, the run was stopped, the storage failed or a
        Ray cluster was lost; rerun later to resume

A program cannot tell these apart by the exception's type alone: a FingerprintMismatchError
(2) and a JobLockedError (75) are both RuntimeErrors, a FileNotFoundError (2) and a disk
full (75) both OSErrors, and a store client's own errors (75) are neither.
"""

from __future__ import annotations

import errno

from tokenmill.io.readers.compression import CorruptInputError
from tokenmill.io.readers.storage import STORE_CLIENTS
from tokenmill.jobs.error_chain import in_chain
from tokenmill.jobs.lock import JobLockedError
from tokenmill.jobs.manifest import FingerprintMismatchError, ManifestError, OutputChangedError
from tokenmill.jobs.ray_cluster_watch import ClusterLostError
from tokenmill.jobs.spec import JobSpecError
from tokenmill.jobs.stop_signals import JobInterrupted

__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_INVALID",
    "EXIT_TEMPORARY",
    "exit_code",
    "lasting",
    "cluster_lost",
]

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_TEMPORARY = 0, 1, 2, 75

# Failures that stay until someone fixes a file, a path or a permission.
_LASTING = (CorruptInputError, FileNotFoundError, PermissionError, NotADirectoryError,
            IsADirectoryError)  # fmt: skip
# The same by errno where Python has no OSError subclass for it: a read-only file system
# (a read-only mount, or a disk the kernel remounted read-only after an error) is not
# writable on a rerun either; as a "storage error" it exited 75, which cron and Airflow
# retry without telling anyone (README's cron line counts 75 as fine): an audit.
_LASTING_ERRNOS = (errno.EROFS,)


def exit_code(exc: BaseException) -> int:
    """run-job's exit code for a run that raised ``exc`` (1, 2 or 75, never 0)."""
    if isinstance(exc, (JobSpecError, FingerprintMismatchError, ManifestError)):
        return EXIT_INVALID  # fix the spec, or give --fresh (fresh=True) or another output
    if isinstance(exc, (JobLockedError, JobInterrupted, KeyboardInterrupt)):
        return EXIT_TEMPORARY
    if isinstance(exc, OutputChangedError):
        return EXIT_FAILED
    if cluster_lost(exc) is not None:  # once the cluster is up, a rerun resumes
        return EXIT_TEMPORARY
    if lasting(exc) is not None:  # does not come right by waiting
        return EXIT_INVALID
    # The storage (disk full, object store down after retries; a store client's own
    # exception types, e.g. botocore's while reading the input) is temporary.
    if isinstance(exc, OSError) or _from_a_store_client(exc):
        return EXIT_TEMPORARY
    return EXIT_FAILED


def lasting(exc: BaseException) -> BaseException | None:
    """The exception in ``exc``'s chain that will not go away on a rerun, if any."""
    return in_chain(
        exc,
        lambda e: (
            isinstance(e, _LASTING) or (isinstance(e, OSError) and e.errno in _LASTING_ERRNOS)
        ),
    )


def cluster_lost(exc: BaseException) -> BaseException | None:
    """The ClusterLostError in ``exc``'s chain (a Ray run's driver lost its cluster), if any."""
    return in_chain(exc, lambda e: isinstance(e, ClusterLostError))


def _from_a_store_client(exc: BaseException) -> bool:
    return in_chain(exc, lambda e: type(e).__module__.split(".")[0] in STORE_CLIENTS) is not None
