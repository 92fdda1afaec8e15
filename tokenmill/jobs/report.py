"""The job report: what a run did, as JSON (report.json) and as a summary for people
(report.html, with plots, is report_html.py's)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from tokenmill.jobs.counted import counted


@dataclass
class JobReport:
    job: str
    output: str
    status: str = "running"  # running | complete | cancelled | failed
    # rows in the input; None where not known: a run stopped (cancelled, failed) before they
    # were counted (not the rows committed so far, which would read as the input's size)
    rows_total: int | None = None
    rows_ok: int = 0  # finished with a completion (this run and earlier runs)
    rows_failed: int = 0  # in the error files (this run and earlier runs)
    rows_this_run: int = 0
    rows_resumed: int = 0  # already done by an earlier run, skipped
    # rows finished this run whose shards were not complete when it stopped (cancelled):
    # not written, a rerun computes them again
    rows_not_committed: int = 0
    # tokens the engine processed this run (rows given a duplicate's result not counted)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # rows this run given a copy of an identical row's result (planner.dedup), in rows_ok or
    # rows_failed too, and the prompt + completion tokens the engine was spared by it
    rows_deduplicated: int = 0
    deduplicated_tokens: int = 0
    # the whole run, run_job's call to the reports' writing: checks, model load, generation,
    # last commits, the input's re-check, the manifest's save, the engine's close
    wall_seconds: float = 0.0
    # loading the model: the local engine's construction; Ray: starting Ray plus the first
    # replica's start (replicas load in parallel when their first rows arrive; the first up
    # generates while the others finish theirs)
    model_load_seconds: float = 0.0
    generation_seconds: float = 0.0  # model loaded to last result: what throughput is over
    prefix_cache_hit_rate: float = 0.0
    # rows the engines preempted this run (KV cache full): each recomputes its prompt and
    # output so far; many of them mean the cache is too small for max_num_seqs rows
    preemptions: int = 0
    speculative: dict | None = None  # draft counts when engine.speculative is on (this run)
    # Ray only: ReplicaFailures as a dict (replicas lost and replaced, rows they held sent
    # again, poison rows isolated into the error file); None for the local executor
    replica_failures: dict | None = None
    shards_committed: int = 0
    shards_recomputed: int = 0  # committed earlier, but their files had gone missing
    shards_recomputed_list: list[int] = field(default_factory=list)  # those shards' numbers
    executor: str = "local"
    model: str = ""  # model.source, as the spec gives it
    device: str = ""  # where the engine ran: "cpu", "cuda:0 (NVIDIA H200)", "ray: 4 replicas"
    error: str | None = None
    # (seconds since the model loaded, output tokens generated so far), about one a second
    throughput_over_time: list[tuple[float, int]] = field(default_factory=list)
    # the rows the engine completed this run (as prompt_tokens: duplicates' copies not
    # counted): LengthHistogram.to_dict, bins of prompt and output tokens (report.html plots
    # them); None when no row ran
    prompt_lengths: dict | None = None
    output_lengths: dict | None = None

    @property
    def output_tokens_per_s(self) -> float:
        """Output tokens over generation time (model loading excluded); 0 when none."""
        seconds = self.generation_seconds
        return self.completion_tokens / seconds if seconds > 0 else 0.0

    @property
    def nothing_to_do(self) -> bool:
        """Complete, and every row had been committed by earlier runs."""
        return self.status == "complete" and self.rows_this_run == 0

    def nothing_to_do_line(self) -> str:
        """What a run that found every row committed says."""
        if self.rows_total == 0:
            return f"nothing to do: the input has no rows (output: {self.output})"
        if self.rows_total is None:
            return f"nothing to do: every row already committed (output: {self.output})"
        return (
            f"nothing to do: all {self.rows_total} rows already committed (output: {self.output})"
        )

    def to_json(self) -> str:
        raw = asdict(self)
        raw["output_tokens_per_s"] = round(self.output_tokens_per_s, 2)
        return json.dumps(raw, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobReport:
        """The report a report.json holds (``to_json``'s text), to draw its page again: the
        derived ``output_tokens_per_s`` and keys this version does not know are left out.
        Raises ValueError (not JSON), TypeError or AttributeError (not a report)."""
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        report = cls(**{key: value for key, value in raw.items() if key in known})
        # JSON has no tuples: the samples come back as lists
        report.throughput_over_time = [tuple(p) for p in report.throughput_over_time]
        return report

    def summary(self) -> str:
        if self.nothing_to_do:
            lines = [f"job {self.job}: {self.status}; {self.nothing_to_do_line()}"]
            if self.rows_total:
                lines.append(
                    f"  rows        {self.rows_ok} ok, {self.rows_failed} failed "
                    "(all committed by earlier runs)"
                )
            return "\n".join(lines)
        lines = [
            f"job {self.job}: {self.status}",
            f"  rows        {self.rows_ok} ok, {self.rows_failed} failed "
            f"({self.rows_this_run} this run, {self.rows_resumed} resumed from earlier runs)",
            f"  tokens      {self.prompt_tokens} in, {self.completion_tokens} out (this run)",
            f"  throughput  {self._throughput()}",
            f"  prefix cache hit rate {self.prefix_cache_hit_rate:.1%} (this run)",
        ]
        if self.rows_not_committed:
            lines.append(
                f"  not kept    {counted(self.rows_not_committed, 'row')} finished in shards not "
                "complete at the stop: a rerun computes "
                f"{'it' if self.rows_not_committed == 1 else 'them'} again"
            )
        left = (self.rows_total or 0) - self.rows_ok - self.rows_failed
        if self.status != "complete" and self.rows_total and left > 0:
            lines.append(f"  left        {left} of the input's {counted(self.rows_total, 'row')}: "
                         f"a rerun resumes with {'it' if left == 1 else 'them'}")  # fmt: skip
        if self.preemptions:
            lines.append(
                f"  preempted   {counted(self.preemptions, 'time')} a row was put back for want "
                "of KV cache and recomputed: raise engine.kv_cache_memory, or lower "
                "engine.max_num_seqs, for speed"
            )
        if self.rows_deduplicated:
            lines.append(
                f"  dedup       {counted(self.rows_deduplicated, 'row')} copied from identical "
                f"rows ({counted(self.deduplicated_tokens, 'token')} not computed, this run)"
            )
        if self.speculative:
            s = self.speculative
            lines.append(
                f"  speculative {s['method']}: {s['accepted_tokens']} of {s['draft_tokens']} "
                f"drafts accepted ({s['acceptance_rate']:.1%}), "
                f"{s['mean_accepted_per_drafted_row']} a drafted row and step"
            )
        if self.replica_failures and self.replica_failures["replicas"]:
            f = self.replica_failures
            lines.append(
                f"  replicas    {f['replicas']} failed and "
                f"{'was' if f['replicas'] == 1 else 'were'} replaced; "
                f"{counted(f['rows_rerun'], 'row')} they held ran again, "
                f"{f['rows_isolated']} isolated (error file)"
            )
        lines.append(f"  output      {self.output}")
        if self.shards_recomputed:
            lines.append(
                f"  recomputed  {counted(self.shards_recomputed, 'committed shard')} whose files "
                "were gone or changed"
            )
        if self.error:
            lines.append(f"  error       {self.error}")
        return "\n".join(lines)

    def _throughput(self) -> str:
        load, whole = show_seconds(self.model_load_seconds), show_seconds(self.wall_seconds)
        times = f"model load {load}, whole run {whole}"
        if not self.completion_tokens or self.generation_seconds <= 0:
            return f"no output tokens generated this run ({times})"
        over = show_seconds(self.generation_seconds)
        return f"{self.output_tokens_per_s:.1f} output tokens/s over {over} of generation ({times})"


def show_seconds(seconds: float) -> str:
    """A duration to two significant digits below a second ("0.012 s", never "0.0 s" beside
    a rate computed over it), one decimal above (the summary's and report.html's)."""
    return f"{seconds:,.1f} s" if seconds >= 1 else f"{seconds:.2g} s"
