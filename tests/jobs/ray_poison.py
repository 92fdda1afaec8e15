"""Poison prompts for the Ray failure tests: a ``worker_process_setup_hook`` that makes the
engine in every Ray worker process fail on marked prompts, as an engine bug would.

Ray runs ``install`` in each worker process it starts for the job (``ray.init(runtime_env=
{"worker_process_setup_hook": "tests.jobs.ray_poison.install"})``), so the replicas' own
engines change; the driver's do not. From then on, an engine step taken while a request
whose prompt holds ``RAISE`` is in the engine raises RuntimeError (the replica's engine
fails mid-batch), one holding ``KILL`` SIGKILLs its own process (a native crash), and one
holding ``HANG`` never returns (a hung engine: the process lives, and answers calls). An
outage: while ``outage_dir()`` holds files, each engine step takes one away and raises,
whatever its rows (one replica failure a file). The recovery that follows is the executor's
own; nothing here touches it.

The outage folder and the hung-start flag lie in the folder named by ``$POISON_DIR_VAR``, which
the test process sets and its Ray workers get through the runtime env's ``env_vars``: each
pytest-xdist worker (each its own local Ray) has its own, so two failure modules can run at
once without one's outage failing the other's replicas.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

RAISE = "POISON-RAISE"
KILL = "POISON-KILL"
HANG = "POISON-HANG"
POISON_DIR_VAR = "TOKENMILL_TEST_POISON_DIR"


def _poison_dir() -> Path:
    # read at each call: the variable is set (by the poisoned_ray fixture) after the import
    return Path(os.environ[POISON_DIR_VAR])


def hang_start_flag() -> Path:
    """While this file exists, the first actor of replica slot 1 never answers ready() (a
    start that hangs: a model load stuck on a network file system, a CUDA init that never
    returns)."""
    return _poison_dir() / "hang-start"


def outage_dir() -> Path:
    """The outage's folder: one file a failure still to come."""
    return _poison_dir() / "outage"


def outage_failure() -> bool:
    """Whether this engine step is one of the outage's failures: it takes one of
    ``outage_dir()``'s files (os.remove is atomic: of two replicas racing for one file, one
    gets it, so the outage is exactly as many failures as files)."""
    outage = outage_dir()
    try:
        tokens = os.listdir(outage)
    except FileNotFoundError:
        return False
    for token in tokens:
        try:
            os.remove(outage / token)
        except FileNotFoundError:
            continue
        return True
    return False


def install() -> None:
    """Wrap LLMEngine.add_request (note marked prompts) and LLMEngine.step (fail on them)."""
    from tokenmill.engine.llm_engine import LLMEngine

    add_request, step = LLMEngine.add_request, LLMEngine.step

    def marked_add_request(self: Any, request_id: str, prompt_ids: list[int], params: Any) -> None:
        add_request(self, request_id, prompt_ids, params)
        text = self.tokenizer.decode(prompt_ids)
        for mark in (KILL, RAISE, HANG):
            if mark in text:
                self.__dict__.setdefault("_poison_marks", set()).add(mark)

    def marked_step(self: Any) -> Any:
        marks = self.__dict__.get("_poison_marks", set())
        if KILL in marks:
            os.kill(os.getpid(), signal.SIGKILL)
        if HANG in marks:
            threading.Event().wait()  # forever; the GIL is free, as in a hung native call
        if RAISE in marks:
            raise RuntimeError(f"the test engine cannot run a prompt holding {RAISE}")
        if outage_failure():
            raise RuntimeError("the test engine fails whatever it runs: an outage")
        return step(self)

    LLMEngine.add_request = marked_add_request
    LLMEngine.step = marked_step

    from tokenmill.jobs.ray_replica import EngineReplica

    ready = EngineReplica.ready

    def hanging_ready(self: Any) -> Any:
        import ray

        name = ray.get_runtime_context().get_actor_name() or ""
        if hang_start_flag().exists() and name.endswith("-replica-1"):
            threading.Event().wait()
        return ready(self)

    EngineReplica.ready = hanging_ready
