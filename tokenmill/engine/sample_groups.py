"""One prompt, several completions: ``SamplingParams.n`` and ``best_of`` over one-completion
engine requests.

The engine runs one completion per request. The front end (LLM) turns a prompt asking for
``k = best_of or n`` completions into k requests with the same prompt, added together, so
the scheduler's prefix cache lets the later ones reuse the prompt's KV blocks; then it
gathers their outputs back into one RequestOutput:

    prompt, SamplingParams(n=2, best_of=3, seed=s)
      ├─ "7-0"   n=1, seed=s                  ─┐
      ├─ "7-0.1" n=1, seed=sample_seed(s, 1)   ├─► rank by cumulative logprob ─► outputs[0..1]
      └─ "7-0.2" n=1, seed=sample_seed(s, 2)  ─┘

Completion 0 keeps the request's id and seed, so ``n=1`` is exactly one plain request; it
alone computes ``prompt_logprobs`` (the prompt is the same for all), which the result takes.
Ranking (``best_of > n``) needs the sampled tokens' logprobs: the requests ask for them
(``logprobs=0``) when the user did not, and the returned completions then carry the
cumulative logprob but no ``logprobs`` list, as if none had been computed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.seeds import sample_seed

__all__ = ["SampleGroup", "sample_groups", "sample_seed"]


@dataclass(frozen=True)
class SampleGroup:
    """The engine requests of one prompt and how their outputs become its RequestOutput."""

    request_id: str
    params: SamplingParams
    sample_params: tuple[SamplingParams, ...]  # one-completion params per sample

    @classmethod
    def of(cls, request_id: str, params: SamplingParams) -> SampleGroup:
        return cls(request_id, params, _sample_params(params))

    def requests(self) -> list[tuple[str, SamplingParams]]:
        """(engine request id, its SamplingParams) per completion, completion 0 first."""
        ids = [self.request_id] + [f"{self.request_id}.{i}" for i in range(1, self.num_samples)]
        return list(zip(ids, self.sample_params, strict=True))

    @property
    def num_samples(self) -> int:
        return self.params.num_samples

    def gather(
        self, samples: Mapping[str, RequestOutput], prompt: str | None = None
    ) -> RequestOutput:
        """The prompt's RequestOutput from its requests' outputs (``samples`` by request id).

        With ``best_of > n`` the n completions with the highest cumulative logprob, best
        first (ties keep sample order); else all of them in sample order. Indexes are
        renumbered 0..n-1. Raises KeyError when a request's output is missing.
        """
        outs = [samples[rid] for rid, _ in self.requests()]
        if len(outs) == 1:
            return dataclasses.replace(outs[0], prompt=prompt)
        p = self.params
        order = list(range(len(outs)))
        if self.num_samples > p.n:
            # Every output of a ranked group has a cumulative logprob: its requests asked.
            # A failed sample's output is no candidate: it ranks after every other.
            order.sort(key=lambda i: (outs[i].error is not None, -_score(outs[i])))
            order = order[: p.n]
        failed = [(rank, outs[i].error) for rank, i in enumerate(order) if outs[i].error]
        completions = [
            dataclasses.replace(
                outs[i].outputs[0],
                index=rank,
                logprobs=None if p.logprobs is None else outs[i].outputs[0].logprobs,
            )
            for rank, i in enumerate(order)
        ]
        return RequestOutput.from_completions(
            self.request_id,
            outs[order[0]].prompt_token_ids,
            completions,
            prompt=prompt,
            num_cached_tokens=outs[order[0]].num_cached_tokens,
            prompt_logprobs=outs[0].prompt_logprobs,
            error=None if not failed else f"completion {failed[0][0]}: {failed[0][1]}",
        )


def sample_groups(prefix: str, params: Sequence[SamplingParams]) -> list[SampleGroup]:
    """One group per prompt, with request ids ``{prefix}-{i}``. Prompts sharing one
    SamplingParams object share its per-sample params (built once, not once per prompt)."""
    built: dict[int, tuple[SamplingParams, ...]] = {}
    groups = []
    for i, p in enumerate(params):
        per_sample = built.get(id(p))
        if per_sample is None:
            per_sample = built[id(p)] = _sample_params(p)
        groups.append(SampleGroup(f"{prefix}-{i}", p, per_sample))
    return groups


def _sample_params(params: SamplingParams) -> tuple[SamplingParams, ...]:
    """One-completion SamplingParams per sample; ``params`` itself for a plain request."""
    if params.num_samples == 1:
        return (params if params.n == 1 and params.best_of is None else _one(params, 0),)
    return tuple(_one(params, i) for i in range(params.num_samples))


def _one(params: SamplingParams, index: int) -> SamplingParams:
    ranked = params.num_samples > params.n
    return dataclasses.replace(
        params,
        n=1,
        best_of=None,
        seed=None if params.seed is None else sample_seed(params.seed, index),
        logprobs=0 if ranked and params.logprobs is None else params.logprobs,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )


def _score(out: RequestOutput) -> float:
    value = out.outputs[0].cumulative_logprob
    return float("-inf") if value is None else value
