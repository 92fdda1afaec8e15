"""The dataset planner: work across requests and replicas, above one engine.

    rows in input order ─► dedup (dedup.py): a row identical to one queued, running or just
                           finished gets a copy of its result instead of running
                        ─► length ordering (reorder_window.py): longest predicted work
                           (work_estimate.py) first, within a bounded window
                        ─► prefix routing (prefix_router.py): which replica, by the row's
                           leading KV blocks, within a load bound
                        ─► engine replicas

Pure Python (no torch). A job's rows go through dedup and ordering in its RowFeed
(tokenmill/jobs/planned_rows.py), on the driver, for the local and the Ray executor alike;
PlannerSettings holds the job.yaml ``planner`` section. Prefix routing is for an executor
with several replicas to call.

This is not the engine's step scheduler (tokenmill/engine/core/scheduler.py), which
batches the requests of one engine.
"""

from tokenmill.scheduling.dedup import Deduplicator, copy_result, dedup_key
from tokenmill.scheduling.planner_settings import PlannerSettings
from tokenmill.scheduling.prefix_router import (
    PrefixRouter,
    prefix_key,
    row_prefix_key,
    text_prefix_key,
)
from tokenmill.scheduling.reorder_window import ReorderWindow
from tokenmill.scheduling.work_estimate import estimated_prompt_tokens, predicted_steps

__all__ = [
    "Deduplicator",
    "PlannerSettings",
    "PrefixRouter",
    "ReorderWindow",
    "copy_result",
    "dedup_key",
    "estimated_prompt_tokens",
    "predicted_steps",
    "prefix_key",
    "row_prefix_key",
    "text_prefix_key",
]
