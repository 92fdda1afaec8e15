"""Noticing that the Ray driver lost its cluster (the head's GCS went away) in time to say so.

When the head process dies mid-job, nothing raises in Python: ``ray.wait`` keeps returning
nothing, and after ``gcs_rpc_server_reconnect_timeout_s`` (60 s) Ray's C++ core ends the
driver process itself ("Failed to connect to GCS within 60 seconds ... The program will
terminate", exit 1). run-job then left no report.json and no message of its own (an
audit). This watch connects to the GCS's port every few seconds; once it has not answered
for ``LOST_AFTER_S`` (well inside Ray's 60 s), ``check`` raises ClusterLostError, so the
run fails as any failed run does: its committed shards kept, its report written, exit 75.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

log = logging.getLogger("tokenmill.jobs")

LOST_AFTER_S = 15.0  # no answer for this long: the cluster is gone (Ray gives up at 60 s)
_EVERY_S = 2.0  # seconds between connects
_CONNECT_S = 2.0  # one connect's timeout (a head on another machine that went silent)


class ClusterLostError(RuntimeError):
    """The driver lost the Ray cluster (its head's GCS stopped answering): temporary, a
    rerun resumes from the committed shards once the cluster is up."""


def gcs_answers(address: str, timeout: float = _CONNECT_S) -> bool:
    """Whether something accepts a TCP connection at ``address`` ("host:port")."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError):
        return False
    return True


def wait_for_head(address: str | None, within_s: float | None = None) -> None:
    """Before joining the cluster at ``address`` (``execution.ray_address``, else Ray's
    ``RAY_ADDRESS``): wait up to ``within_s`` (LOST_AFTER_S) for its head to accept a
    connection, else raise ClusterLostError naming the address. ``ray.init`` itself retried a
    head that was down for minutes, and a cron run hung there (an audit). Addresses Ray
    resolves itself ("auto", "local", none) are left to it."""
    address = address or os.environ.get("RAY_ADDRESS") or ""
    host_port = address.removeprefix("ray://")
    if address in ("", "auto", "local") or ":" not in host_port:
        return
    patience = LOST_AFTER_S if within_s is None else within_s
    deadline = time.monotonic() + patience
    while not gcs_answers(host_port):
        if time.monotonic() >= deadline:
            raise ClusterLostError(
                f"no Ray cluster answers at {address} (tried for {patience:.0f} s): start "
                "it (`ray start --head ...`) or correct execution.ray_address (or RAY_ADDRESS)"
            )
        time.sleep(min(_EVERY_S, max(0.0, deadline - time.monotonic())))


class GcsWatch:
    """A daemon thread that connects to the GCS at ``address`` every ``every_s`` seconds;
    ``check`` raises ClusterLostError once it has not answered for ``lost_after_s``."""

    def __init__(
        self, address: str, lost_after_s: float | None = None, every_s: float | None = None
    ) -> None:
        self.address = address
        # (the module's settings as of now, not as of import: a test shortens them)
        self._lost_after_s = LOST_AFTER_S if lost_after_s is None else lost_after_s
        self._every_s = _EVERY_S if every_s is None else every_s
        self._silent_since: float | None = None  # first failed connect of the current run
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tokenmill-gcs-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._every_s):
            if gcs_answers(self.address):
                self._silent_since = None
                continue
            now = time.monotonic()
            if self._silent_since is None:
                self._silent_since = now
                log.warning("the Ray head (GCS at %s) does not answer", self.address)
            if now - self._silent_since >= self._lost_after_s:
                self.lost = True
                return

    def answers(self) -> bool:
        """Whether the GCS answers a connect now (before a Ray call that would wait on it)."""
        return gcs_answers(self.address)

    def check(self) -> None:
        """Raise ClusterLostError if the cluster is lost."""
        if self.lost:
            raise ClusterLostError(
                f"the Ray cluster went away: its head (GCS at {self.address}) has not answered "
                f"for {self._lost_after_s:.0f} s (the head process died or was stopped, or the "
                "network to it is down), so the rows on its replicas are lost. Start the "
                "cluster again (`ray start --head ...`) and rerun the same command: it resumes "
                "from the committed shards"
            )

    def stop(self) -> None:
        self._stop.set()
