"""Multi-token steps: decode rows carry draft tokens, the step computes 1 + k tokens for them,
and the sampled tokens accept the drafts that agree. Proven with test-only proposers: one
that proposes the true continuation (everything accepted: fewer steps, same output) and one
that proposes wrong tokens (nothing accepted: the same steps and output as without drafts)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.tiny_models import save_tiny_model
from tokenmill import SamplingParams
from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.core.drafts import accepted_counts, draft_lengths
from tokenmill.engine.engine_config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.spec_decode.device_ngram import DeviceNgramProposer
from tokenmill.engine.spec_decode.ngram import NgramProposer

MAX_TOKENS = 24
K = 3


class ContinuationProposer:
    """Proposes the next ``max_drafts`` tokens of a known output (the true ones, or with
    ``wrong`` each one replaced by a neighbouring id, so never accepted)."""

    def __init__(self, outputs: dict[str, list[int]], max_drafts: int, wrong: bool = False):
        self.outputs = outputs
        self.max_drafts = max_drafts
        self.wrong = wrong
        self.calls = 0

    def propose(self, slots: BatchSlots, rows: np.ndarray) -> np.ndarray:
        self.calls += 1
        drafts = np.full((len(rows), self.max_drafts), -1, dtype=np.int64)
        for i, slot in enumerate(rows.tolist()):
            want = self.outputs[slots.requests[slot].request_id]
            done = int(slots.num_tokens[slot] - slots.num_prompt[slot])
            nxt = want[done : done + self.max_drafts]
            if self.wrong:
                nxt = [t - 1 if t else 1 for t in nxt]
            drafts[i, : len(nxt)] = nxt
        return drafts


class AheadProposer(ContinuationProposer):
    """A ContinuationProposer that also predicts ahead of a step in flight (core/drafts.py):
    the true tokens at the positions asked for, or with ``flaky`` wrong at about one
    output position in three (a fixed pattern: rows accept different numbers of drafts)."""

    def __init__(self, outputs, max_drafts, wrong=False, flaky=False):
        super().__init__(outputs, max_drafts, wrong)
        self.flaky = flaky
        self.predicted = 0

    def predict(self, slots: BatchSlots, rows: np.ndarray, count: int) -> np.ndarray:
        self.predicted += len(rows)
        out = np.full((len(rows), count), -1, dtype=np.int64)
        for i, slot in enumerate(rows.tolist()):
            want = self.outputs[slots.requests[slot].request_id]
            done = int(slots.num_tokens[slot] - slots.num_prompt[slot])
            for j, t in enumerate(want[done : done + count]):
                bad = self.wrong or (self.flaky and (done + j) * 7 % 3 == 1)
                out[i, j] = (t - 1 if t else 1) if bad else t
        return out


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("multi") / "m")


def _prompts() -> list[list[int]]:
    return [[(13 * i + 7 * t) % 250 + 5 for t in range(5 + 3 * i)] for i in range(6)]


def _run(
    model_path: Path,
    params: list[SamplingParams],
    proposer=None,
    block_size: int = 4,
    device: str = "cpu",
    backend: str = "auto",
    async_scheduling: bool | None = None,
    kv_cache_memory: int = 1 << 26,
) -> tuple[dict[str, RequestOutput], int, LLMEngine]:
    config = EngineConfig(
        model=str(model_path),
        device=device,
        dtype="float32",
        block_size=block_size,
        kv_cache_memory=kv_cache_memory,
        attention_backend=backend,
        profile_steps=True,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(config, proposer)
    for i, (prompt, p) in enumerate(zip(_prompts()[: len(params)], params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    done: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        done.update((o.request_id, o) for o in engine.step())
    assert engine.scheduler.kv.num_free_blocks == engine.runner.num_blocks
    return done, steps, engine


def _summary(outs: dict[str, RequestOutput]) -> dict[str, tuple]:
    return {rid: (o.token_ids, o.finish_reason, o.stop_reason) for rid, o in outs.items()}


@pytest.mark.parametrize("block_size", [4, 16])
def test_true_drafts_are_all_accepted_in_fewer_steps(model_path: Path, block_size: int) -> None:
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)] * 6
    want, base_steps, _ = _run(model_path, params, block_size=block_size)
    oracle = ContinuationProposer({r: o.token_ids for r, o in want.items()}, K)
    got, steps, engine = _run(model_path, params, oracle, block_size=block_size)
    assert _summary(got) == _summary(want)
    # The prefill samples token 1; each later step accepts K drafts plus the bonus token.
    assert base_steps == MAX_TOKENS
    assert steps == 1 + -(-(MAX_TOKENS - 1) // (K + 1))
    stats = engine.scheduler.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_wrong_drafts_are_all_rejected_and_change_nothing(model_path: Path) -> None:
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)] * 6
    want, base_steps, _ = _run(model_path, params)
    wrong = ContinuationProposer({r: o.token_ids for r, o in want.items()}, K, wrong=True)
    got, steps, engine = _run(model_path, params, wrong)
    assert _summary(got) == _summary(want)
    assert steps == base_steps
    assert engine.scheduler.stats.num_accepted_tokens == 0
    assert engine.scheduler.stats.num_draft_tokens > 0


def test_seeded_sampling_and_stops_match_without_drafts(model_path: Path) -> None:
    """Seeded rows draw each token from (seed, output position): with the true continuation
    as drafts they give the same tokens. Stop ids and EOS met mid-draft end the row there."""
    probe, _, _ = _run(model_path, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0)] * 6)
    params = []
    for i in range(6):
        tokens = probe[f"r{i}"].token_ids
        kwargs = {"seed": 100 + i, "temperature": 0.8, "top_p": 0.9, "top_k": 40}
        if i % 3 == 1:
            kwargs = {"temperature": 0, "stop_token_ids": (tokens[7],)}
        params.append(SamplingParams(max_tokens=MAX_TOKENS, **kwargs))
    want, base_steps, _ = _run(model_path, params)
    oracle = ContinuationProposer({r: o.token_ids for r, o in want.items()}, K)
    got, steps, _ = _run(model_path, params, oracle)
    assert _summary(got) == _summary(want)
    assert steps < base_steps
    assert any(o.finish_reason == "stop" for o in got.values())


def test_drafts_accepted_past_a_stop_are_not_counted(model_path: Path) -> None:
    """A row whose stop token id is an accepted draft ends there: the drafts accepted after
    it are not output, so they saved no step and are not counted as accepted (one row: its
    tokens are its steps plus the drafts counted)."""
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    probe, _, _ = _run(model_path, [SamplingParams(**greedy)])
    tokens = probe["r0"].token_ids
    end = next(j for j in (1, 2) if tokens[j] not in tokens[:j])  # a draft of step 2
    oracle = ContinuationProposer({"r0": tokens}, K)  # drafts past the stop, all accepted
    params = [SamplingParams(**greedy, stop_token_ids=(tokens[end],))]
    got, steps, engine = _run(model_path, params, oracle)
    assert got["r0"].token_ids == tokens[: end + 1] and got["r0"].finish_reason == "stop"
    assert steps == 2  # the prefill, then one drafted step that meets the stop
    stats = engine.scheduler.stats
    assert stats.num_draft_tokens == K
    assert stats.num_accepted_tokens == len(got["r0"].token_ids) - steps == end - 1


def test_drafts_accepted_past_a_stop_string_are_not_counted(model_path: Path) -> None:
    """As a stop id's, a stop string completed by an accepted draft ends the row at that
    token: the tokens the step accepted after it are cut off, and the drafts among them are
    not counted as accepted either (one row: its tokens are its steps plus the drafts)."""
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    probe, _, engine = _run(model_path, [SamplingParams(**greedy)])
    tokens, decode = probe["r0"].token_ids, engine.tokenizer.decode

    def stop_at(j: int) -> str | None:  # the character token j completes, new to the text
        text, before = decode(tokens[: j + 1]), decode(tokens[:j])
        new = text[-1] if len(text) > len(before) else ""
        return new if new not in ("", "\ufffd") and new not in before else None

    # a draft of step 2 (the prefill samples token 0) with the step's tokens after it
    end = next(j for j in range(1, K + 1) if stop_at(j) is not None)
    oracle = ContinuationProposer({"r0": tokens}, K)  # drafts past the stop, all accepted
    params = [SamplingParams(**greedy, stop=[stop_at(end)])]
    got, steps, engine = _run(model_path, params, oracle)
    assert got["r0"].token_ids == tokens[: end + 1] and got["r0"].finish_reason == "stop"
    assert got["r0"].text == decode(tokens[:end])
    assert steps == 2  # the prefill, then one drafted step that meets the stop string
    stats = engine.scheduler.stats
    assert stats.num_draft_tokens == K
    assert stats.num_accepted_tokens == len(got["r0"].token_ids) - steps == end - 1


def test_acceptance_takes_the_leading_matches() -> None:
    drafts = np.array([[5, 6, 7], [5, 6, 7], [5, -1, -1], [-1, -1, -1]])
    lengths = draft_lengths(drafts)
    assert lengths.tolist() == [3, 3, 1, 0]
    sampled = np.array([[5, 6, 7, 8], [5, 9, 7, 8], [5, 6, 0, 0], [4, 0, 0, 0]])
    assert accepted_counts(sampled, drafts, lengths).tolist() == [3, 1, 1, 0]


def test_triton_decode_kernel_takes_drafts(model_path: Path) -> None:
    """The Triton backend (in the interpreter here) runs drafted decode rows through its
    decode kernel, several query tokens a row, with the torch backend's tokens."""
    params = [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)] * 3
    want, _, _ = _run(model_path, params, block_size=16, backend="torch")
    oracle = ContinuationProposer({r: o.token_ids for r, o in want.items()}, K)
    got, steps, _ = _run(model_path, params, oracle, block_size=16, backend="triton")
    assert _summary(got) == _summary(want)
    assert steps == 1 + -(-(9 - 1) // (K + 1))
    wrong = ContinuationProposer({r: o.token_ids for r, o in want.items()}, K, wrong=True)
    got, _, _ = _run(model_path, params, wrong, block_size=16, backend="triton")
    assert _summary(got) == _summary(want)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["true", "wrong", "ahead", "ahead-flaky", "ngram", "device-ngram"])
def test_gpu_drafted_steps_replay_cuda_graphs(model_path: Path, kind: str) -> None:
    """On CUDA (Triton attention, CUDA graphs): decode steps with drafts replay the graphs
    captured for 1 + K tokens a row (rows with fewer drafts left-padded), with the tokens
    of a run without drafts; drafted ahead (async scheduling, the default there), the
    device moves each row where its last step's acceptance put it before the replay (the
    test proposers, and the n-gram one on the tiny model's outputs)."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)] * 6
    want, _, _ = _run(model_path, params, device="cuda", block_size=16)
    truth = {r: o.token_ids for r, o in want.items()}
    if kind == "ngram":
        oracle = NgramProposer(K)
    elif kind == "device-ngram":  # (its search on the device, on a stream of its own)
        oracle = DeviceNgramProposer(K, device="cuda")
    elif kind.startswith("ahead"):
        oracle = AheadProposer(truth, K, flaky=kind == "ahead-flaky")
    else:
        oracle = ContinuationProposer(truth, K, wrong=kind == "wrong")
    got, steps, engine = _run(model_path, params, oracle, device="cuda", block_size=16)
    assert _summary(got) == _summary(want)
    stats = engine.scheduler.stats
    if kind == "true":
        assert steps == 1 + -(-(MAX_TOKENS - 1) // (K + 1))
    if kind.startswith("ahead"):
        assert engine.scheduler.config.drafts_ahead
        assert engine.step_profile()["synchronous_steps"] == 0
        assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    if kind.endswith("ngram"):
        assert engine.scheduler.config.drafts_ahead
        assert engine.step_profile()["synchronous_steps"] == 0
    decode = engine.step_profile()["decode"]
    assert decode["graph_steps"] == decode["steps"] > 0


@pytest.mark.parametrize("kind", ["true", "wrong", "flaky"])
def test_drafts_ahead_keep_async_scheduling(model_path: Path, kind: str) -> None:
    """With async scheduling and a proposer that predicts ahead, drafted steps overlap like
    plain ones: a row drafts while its previous step is in flight, and the device starts
    it where that step's acceptance put it. Tokens as without drafts, whatever is accepted;
    true drafts take every step 1 + K tokens."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)] * 6
    want, _, _ = _run(model_path, params)
    truth = {r: o.token_ids for r, o in want.items()}
    oracle = AheadProposer(truth, K, wrong=kind == "wrong", flaky=kind == "flaky")
    got, _, engine = _run(model_path, params, oracle, async_scheduling=True)
    assert engine.scheduler.config.drafts_ahead
    assert _summary(got) == _summary(want)
    stats = engine.scheduler.stats
    assert oracle.predicted > 0 and stats.num_draft_tokens > 0
    assert engine.step_profile()["synchronous_steps"] == 0
    if kind == "true":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        # As synchronous drafting, plus a step the rows run while their last one is in
        # flight (had it rejected drafts, they would go on) and the empty one that drains.
        assert stats.num_steps == 1 + -(-(MAX_TOKENS - 1) // (K + 1)) + 2
    elif kind == "wrong":
        assert stats.num_accepted_tokens == 0
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_drafts_ahead_with_stops_seeds_and_preemption(model_path: Path) -> None:
    """Drafted ahead under KV pressure (rows preempted and recomputed), with stop token ids
    met mid-draft, a seeded row and one with penalties (which sample by output position and
    history, so never draft ahead): the tokens of a run without drafts."""
    probe, _, _ = _run(model_path, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0)] * 6)
    params = []
    for i in range(6):
        tokens = probe[f"r{i}"].token_ids
        kwargs = {"temperature": 0, "ignore_eos": True}
        if i % 3 == 1:
            kwargs = {"temperature": 0, "stop_token_ids": (tokens[9],)}
        if i == 4:
            kwargs = {"seed": 104, "temperature": 0.8, "top_p": 0.9}
        if i == 5:
            kwargs = {"temperature": 0, "presence_penalty": 2.0, "frequency_penalty": 2.0}
        params.append(SamplingParams(max_tokens=MAX_TOKENS, **kwargs))
    small = 24 * 1024  # 24 blocks of 4 tokens (1 KiB each); the rows need up to 11 each
    want, _, _ = _run(model_path, params, kv_cache_memory=small)
    oracle = AheadProposer({r: o.token_ids for r, o in want.items()}, K, flaky=True)
    got, _, engine = _run(model_path, params, oracle, async_scheduling=True, kv_cache_memory=small)
    assert _summary(got) == _summary(want)
    assert any(o.finish_reason == "stop" for o in got.values())
    assert engine.scheduler.stats.num_accepted_tokens > 0
    assert engine.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize("method", ["ngram", "suffix", "lookahead"])
def test_rows_near_the_context_end_beside_rows_with_more_drafts(
    model_path: Path, method: str
) -> None:
    """A drafted step whose rows end a few tokens short of max_model_len, beside a row that
    takes more drafts than they have room for: the step's drafts are read row by row within
    the context (they were read k wide for every row, past the token table's end)."""
    from tokenmill import LLM

    limit = 64
    prompts = [([121, 39, 151, 66] * 20)[: limit - 7], ([179, 69] * 40)[: limit - 5]]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    off = LLM(str(model_path), device="cpu", dtype="float32", max_model_len=limit)
    spec = LLM(
        str(model_path),
        device="cpu",
        dtype="float32",
        max_model_len=limit,
        speculative={"method": method, "max_tokens": 3 if method == "lookahead" else 7},
    )
    want = [(o.token_ids, o.finish_reason) for o in off.generate(prompts, params)]
    got = [(o.token_ids, o.finish_reason) for o in spec.generate(prompts, params)]
    assert [len(t) for t, _ in want] == [7, 5]
    assert got == want


def test_a_batch_of_rows_that_take_no_drafts_keeps_its_steps_async(model_path: Path) -> None:
    """Rows that ask for logprobs take no drafts: a batch of only those drafted nothing, yet
    each step with a proposer ran synchronously (the step in flight processed first), losing
    the overlap with the device for nothing. Such steps now stay async, outputs unchanged."""
    params = [SamplingParams(max_tokens=12, temperature=0, logprobs=1)] * 3
    want, _, _ = _run(model_path, params, async_scheduling=True)
    outputs = {rid: list(o.token_ids) for rid, o in want.items()}
    got, _, engine = _run(
        model_path, params, ContinuationProposer(outputs, K), async_scheduling=True
    )
    assert _summary(got) == _summary(want)
    assert engine.scheduler.stats.num_drafted_rows == 0
    assert engine.step_profile()["synchronous_steps"] == 0
