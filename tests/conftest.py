"""Suite-wide setup: Triton kernels run in the interpreter when there is no GPU, tests
marked ``gpu`` are skipped without one, and a local Ray for the modules that ask for it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any @triton.jit function is defined (i.e. before kernels import).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """A local Ray for one test module (``pytestmark = pytest.mark.usefixtures(
    "ray_session")``): Ray and each actor pool start slowly, so a module shares one."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        yield
        return
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
