from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jobs import ray_poison
from tests.jobs.job_helpers import TINY_ENGINE
from tests.tiny_models import save_tiny_model
from tokenmill import LLM


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a byte-level tokenizer and a chat template."""
    return save_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    """The Python API on the tiny model, the reference of a module's job outputs."""
    return LLM(str(tiny_model), **TINY_ENGINE)


@pytest.fixture(scope="module")
def poisoned_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A local Ray of the module's own (not the shared ``ray_session``) whose workers run
    ``ray_poison.install``, so their engines fail on marked prompts; for the modules that ask
    (``pytestmark = pytest.mark.usefixtures("poisoned_ray")``).

    The poison folder (outage files, the hung-start flag) is this test process's own, set in
    its environment and in its Ray workers' through the runtime env: two pytest-xdist workers
    each running a failure module, each with its own Ray, do not share one. (Two local Rays
    share no port or folder either: ``ray.init`` picks free ports and a session folder named
    by time and pid.)"""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    poison_dir = str(tmp_path_factory.mktemp("poison"))
    # Ray's workers cannot import the tests: the hook travels by value
    ray.cloudpickle.register_pickle_by_value(ray_poison)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ray_poison.POISON_DIR_VAR, poison_dir)
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={
                "worker_process_setup_hook": ray_poison.install,
                "env_vars": {ray_poison.POISON_DIR_VAR: poison_dir},
            },
        )
        yield
        ray.shutdown()
