"""ReplicaFailures: what Ray replica failures cost a run, for the report.

A replica that dies or whose engine raises is replaced, and the rows it held run again
(ray_chunks.py); a row that fails every replica that runs it alone is isolated: skipped and
written to the error file. The local executor has no replicas: its report leaves these out.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReplicaFailures"]


@dataclass
class ReplicaFailures:
    replicas: int = 0  # replicas lost (process died, or engine raised) and replaced
    rows_rerun: int = 0  # rows a lost replica held, sent again (a row counts at each loss)
    rows_isolated: int = 0  # poison rows: skipped, each with its error row
    # known-good requests sent to tell an outage from a poison row (ray_chunks.py), when
    # only rows parked after failing alone were left
    probes: int = 0
