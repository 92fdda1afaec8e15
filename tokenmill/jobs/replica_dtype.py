"""What ``model.dtype: auto`` resolves to on a Ray run's replicas, recorded in the manifest
and checked on resume as a local run's is (``resolved_dtype``, runner.settings_of).

A local run resolves it before its manifest is checked. A Ray run's replicas resolve it on
their own nodes, on the device the cluster gives them (``replica_resources``: a GPU where
the cluster has one), which the driver knows once it has joined the cluster, before any
replica loads a model. Until then the manifest's value is kept (``kept_dtype``): a Ray run
recorded none, so a job begun on a CPU (float32) resumed under Ray on GPUs (bfloat16), and
back, mixing the two in one output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenmill.io.storage import OutputStore
from tokenmill.jobs.fingerprint import JobSettings
from tokenmill.jobs.manifest import Manifest
from tokenmill.jobs.spec import JobSpec

if TYPE_CHECKING:
    import torch

__all__ = ["check_replica_dtype", "dtype_on", "kept_dtype", "replica_dtype"]


def replica_dtype(spec: JobSpec, on_gpu: bool) -> str | None:
    """The dtype (``"bfloat16"``) the job's replicas run its model in when model.dtype is
    auto, on a GPU (``on_gpu``: RayExecutor.on_gpu) or a CPU; None when model.dtype names
    one (it is hashed then). Reads the model's config (the driver's copy: a replica's is at
    the same path)."""
    if spec.model.dtype != "auto":
        return None
    import torch

    from tokenmill.engine.loader import resolve_model_source

    config = resolve_model_source(spec.model.source).load_config()
    return dtype_on(spec, config, torch.device("cuda" if on_gpu else "cpu"))


def dtype_on(spec: JobSpec, config: Any, device: torch.device) -> str:
    """What the job's model.dtype is on ``device`` for the model ``config`` (auto: fp32 on a
    CPU, the checkpoint's on a GPU), named as the manifest records it ("bfloat16")."""
    from tokenmill.jobs.local_executor import engine_config

    return str(engine_config(spec).resolve_dtype(config, device)).removeprefix("torch.")


def kept_dtype(spec: JobSpec, old: JobSettings | None, new: JobSettings) -> JobSettings:
    """``new`` (a run's settings record) with ``old``'s (the manifest's) resolved dtype where
    the run is a Ray one, which resolves it only once it has joined its cluster
    (``check_replica_dtype``): the manifest does not forget it meanwhile."""
    if spec.execution.executor != "ray" or old is None or "resolved_dtype" not in old:
        return new
    return {**new, "resolved_dtype": old["resolved_dtype"]}


def check_replica_dtype(
    manifest: Manifest, dtype: str | None, store: OutputStore, still_held: Callable[[], None]
) -> None:
    """Refuse a resume whose progress was made in another dtype than ``dtype`` (the
    replicas': ``replica_dtype``), or record ``dtype`` in ``manifest`` (saved to ``store``
    once ``still_held`` says the output is still this run's) where it has none.

    Raises FingerprintMismatchError naming ``resolved_dtype``, its old and new value and
    what to do, as a local run's refused resume does."""
    if dtype is None:
        return
    settings = {**(manifest.settings or {}), "resolved_dtype": dtype}
    manifest.check_fingerprint(manifest.fingerprint, settings, store.url)
    if manifest.settings != settings:
        manifest.settings = settings
        still_held()
        manifest.save(store)
