"""Suite-wide setup: Triton kernels run in the interpreter when there is no GPU, tests
marked ``gpu`` are skipped without one, pytest-xdist runs (``make test``) get one CPU thread a
process and their work split by module, and a local Ray for the modules that ask for it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

# Under pytest-xdist (``make test`` runs ``-n``) the workers already fill the cores. A worker
# whose torch also spreads each op over every core oversubscribes them: OpenMP threads spinning
# on a busy core made the suite slower in parallel than alone. And Ray lowers its workers'
# priority (nice 15): beside two busy test workers its replicas got next to no CPU (one Ray
# test took 350 s instead of 15). Set before torch is imported and Ray started; run-job
# subprocesses and Ray workers inherit them. A plain ``pytest`` is unchanged.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["RAY_worker_niceness"] = "0"

# Ray workers and run-job subprocesses import tokenmill from the tree under test, first on
# their path: pytest puts the tree on this process's path alone, and elsewhere the import
# went to whatever tree the environment's editable install pointed at (a venv shared by two
# clones ran one clone's Ray tests against the other's replicas: AttributeError on a field
# the tree under test had added).
_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_TREE, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _TREE)]
)

import pytest  # noqa: E402
import torch  # noqa: E402

if TYPE_CHECKING:  # pytest-xdist is optional: a plain ``pytest`` (the GPU machine) lacks it
    from xdist.remote import Producer
    from xdist.scheduler import Scheduling

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any @triton.jit function is defined (i.e. before kernels import).
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Modules that one pytest-xdist worker runs one after another, as it runs each other module on
# its own (``make test``: ``-n 2 --dist loadfile``; see pytest_xdist_make_scheduler). "ray":
# each starts a Ray, and two at once on 2 cores starve each other's replicas; "smollm2": each
# runs the real model, which then loads in one worker only.
XDIST_GROUPS: dict[str, str] = {
    "tests/integrations/test_ray_data.py": "ray",
    "tests/jobs/test_prefix_routing.py": "ray",
    "tests/jobs/test_ray_executor.py": "ray",
    "tests/jobs/test_ray_failures.py": "ray",
    "tests/jobs/test_ray_poison_rows.py": "ray",
    "tests/engine/loader/test_smollm2_gguf.py": "smollm2",
    "tests/engine/models/test_int4.py": "smollm2",
    "tests/engine/test_llm.py": "smollm2",
    "tests/engine/test_matches_hf.py": "smollm2",
    "tests/engine/test_structured_output.py": "smollm2",
    "tests/engine/test_vllm_api.py": "smollm2",
}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: never called without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> Scheduling | None:
    """``--dist loadfile``, with the files of each XDIST_GROUPS group as one unit of work.

    (``--dist loadgroup`` with ``xdist_group`` marks would say this, but pytest-xdist 3.8 marks
    a group by editing node ids, which pytest 9.2 ignores: pytest-xdist issue #1386.)
    """
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return XDIST_GROUPS.get(path, path)

    return GroupedFiles(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its order is the work queue's
        # The groups are the slowest units: with --no-loadscope-reorder they are handed out
        # first, not last, where one of them would be the run's tail.
        items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in XDIST_GROUPS)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The test that runs next, while a test's teardown runs (set by pytest_runtest_teardown).
_next_item: pytest.Item | None = None
_ray_started = False  # the Ray now running was started by ray_session (not by a test)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    global _next_item
    _next_item = nextitem


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """A local Ray for the test modules that ask for it (``pytestmark = pytest.mark.
    usefixtures("ray_session")``): Ray starts slowly (2 s, and 1 s to shut down), so a module
    shares one, and so does the next module when it asks too, as the XDIST_GROUPS "ray"
    modules, run one after another, do. It is shut down before a test that does not ask for
    it: an idle Ray's daemons would take CPU from the modules that follow."""
    global _ray_started
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        _ray_started = True
    yield
    if _ray_started and (_next_item is None or "ray_session" not in _next_item.fixturenames):
        ray.shutdown()
        _ray_started = False
