"""Whether a process of this machine is stopped, and what resumes it: a run that holds an
output's lock while stopped (SIGSTOP, Ctrl-Z, a debugger, a frozen cgroup) keeps it until
someone resumes or ends it, so the refusal of the next run says so (lock.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["Stopped", "stopped_how"]


@dataclass(frozen=True)
class Stopped:
    """Why a holder is stopped (``how``) and what resumes it (``resume``)."""

    how: str
    resume: str


def stopped_how(
    pid: int, proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")
) -> Stopped | None:
    """How process ``pid`` of this machine is stopped, if it is: by a signal or a tracer
    (state T or t in ``/proc/<pid>/stat``), or in a frozen cgroup (whose tasks show S or D:
    only the cgroup says so). None: running, gone, or /proc cannot say (not Linux)."""
    state = _proc_state(pid, proc)
    if state == "T":
        return Stopped(
            f"stopped (state T in /proc/{pid}/stat: SIGSTOP, Ctrl-Z)",
            f"`kill -CONT {pid}` (or `fg` in the shell that stopped it)",
        )
    if state == "t":
        return Stopped(
            f"stopped by a debugger or tracer (state t in /proc/{pid}/stat)",
            f"the debugger's continue, or `kill -CONT {pid}` once it detaches",
        )
    frozen = _frozen_cgroup(pid, proc, cgroups)
    if frozen is not None:
        return Stopped(f"in the frozen cgroup {frozen.parent}", _thaw_command(frozen))
    return None


def _proc_state(pid: int, proc: Path) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (after the command name, which may itself
    hold spaces and parentheses); None when there is no such process or file."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[0] if fields else None


def _frozen_cgroup(pid: int, proc: Path, cgroups: Path) -> Path | None:
    """The freezer file of ``pid``'s cgroup when that cgroup is frozen (cgroup v2's
    ``cgroup.events`` saying ``frozen 1``, v1's ``freezer.state`` saying FROZEN)."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":  # v2 (or v1's unified hierarchy beside it)
            for base in (cgroups, cgroups / "unified"):
                events = base / relative / "cgroup.events"
                if "frozen 1" in _read(events).splitlines():
                    return base / relative / "cgroup.freeze"
        elif "freezer" in controllers.split(","):
            state = cgroups / "freezer" / relative / "freezer.state"
            if _read(state).strip() == "FROZEN":
                return state
    return None


def _thaw_command(freezer: Path) -> str:
    """The command that thaws the cgroup whose freezer file is ``freezer`` (its manager's
    own, ``docker unpause`` or ``systemctl thaw``, does too)."""
    value = "0" if freezer.name == "cgroup.freeze" else "THAWED"
    return f"`echo {value} > {freezer}` (or its manager's thaw: `docker unpause`, `systemctl thaw`)"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
