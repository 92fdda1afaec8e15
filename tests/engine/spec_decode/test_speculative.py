"""Speculative decoding through the public surface: ``LLM(..., speculative=...)`` and
job.yaml's ``engine.speculative``. Greedy output is token-identical with it on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine_config import EngineConfig, EngineSettingError, SpeculativeConfig
from tokenmill.jobs.cli import main as cli_main


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("spec") / "m")


def _copy_prompts(count: int) -> list[list[int]]:
    """Prompts that repeat a random passage (what extraction and rewriting rows look like),
    so the n-gram lookup finds something to draft; lengths vary."""
    g = torch.Generator().manual_seed(7)
    prompts = []
    for i in range(count):
        passage = torch.randint(5, 280, (4 + i % 13,), generator=g).tolist()
        filler = torch.randint(5, 280, (i % 5,), generator=g).tolist()
        prompts.append(passage + filler + passage + passage[: 1 + i % 3])
    return prompts


def _llm(model_path: Path, method: str, **settings) -> LLM:
    """The tiny model on CPU in fp32, block size 4, up to 4 drafts a row with ``method``."""
    settings.setdefault("max_num_seqs", 8)
    return LLM(str(model_path), device="cpu", dtype="float32", block_size=4,
               kv_cache_memory=1 << 26, speculative={"method": method, "max_tokens": 4},
               **settings)  # fmt: skip


@pytest.fixture(scope="module")
def off_run(model_path: Path) -> tuple[list[list[int]], dict]:
    return _run_120(model_path, "off")


def _run_120(
    model_path: Path, method: str, ahead_below: int | None = None, **settings
) -> tuple[list[list[int]], dict]:
    """Greedy outputs of 120 copy prompts and the engine's step profile (``ahead_below``:
    the engine's ``draft_ahead_below``, if given)."""
    prompts = _copy_prompts(120)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm = _llm(model_path, method, max_num_seqs=32, profile_steps=True, **settings)
    if ahead_below is not None:
        llm.engine.draft_ahead_below = ahead_below
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    profile = llm.engine.step_profile()
    profile["steps"] = llm.engine.scheduler.stats.num_steps
    profile["observe_seconds"] = llm.engine.scheduler.stats.observe_seconds
    return outs, profile


@pytest.mark.parametrize("method", ["ngram", "suffix", "lookahead", "auto"])
def test_greedy_output_equals_off_on_120_prompts(model_path: Path, off_run, method) -> None:
    want, off = off_run
    got, profile = _run_120(model_path, method)
    assert got == want
    stats = profile["speculative"]
    assert "speculative" not in off
    if method == "auto":  # it drafts where it measures a gain: here, maybe nowhere
        assert stats["policy"], stats  # what it measured, per batch bucket
    else:  # drafting on every step: accepted drafts are decode steps saved
        assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats
        assert profile["steps"] < off["steps"], (profile["steps"], off["steps"], stats)
    assert stats["proposer_ms_per_step"] > 0, stats  # its host time over every step
    if method in ("suffix", "lookahead"):  # learning from outputs counts in it
        assert profile["observe_seconds"] > 0, profile


@pytest.mark.parametrize(("method", "ahead_below"), [("ngram", 99), ("suffix", 99), ("ngram", 8)])
def test_drafted_ahead_greedy_output_equals_off_on_120_prompts(
    model_path: Path, off_run, method: str, ahead_below: int
) -> None:
    """With async scheduling (forced on CPU) these proposers draft ahead of the step in
    flight while fewer than ``draft_ahead_below`` rows run (every step here with 99; with
    8, the batch's tail, after synchronous drafted steps of up to 32 rows): the tokens are
    those of speculation off."""
    want, off = off_run
    got, profile = _run_120(model_path, method, ahead_below, async_scheduling=True)
    assert got == want
    stats = profile["speculative"]
    assert stats["accepted_tokens"] > 0, profile
    if ahead_below == 99:
        assert profile["synchronous_steps"] == 0, profile
    else:  # both kinds
        assert 0 < profile["synchronous_steps"] < profile["steps"], profile
    assert profile["steps"] < off["steps"], (profile["steps"], off["steps"], stats)


@pytest.mark.parametrize(
    ("given", "key", "expected"),
    [
        ({"method": "medusa"}, "speculative.method", "one of off, ngram, suffix, lookahead, auto"),
        (
            {"method": "lookahead", "max_tokens": 7, "lookahead_window": 5},
            "speculative.lookahead_candidates",
            "x max_tokens <= 63",
        ),
        ({"method": "ngram", "max_tokens": 8}, "speculative.max_tokens", "from 1 to 7"),
        ({"max_tokens": True}, "speculative.max_tokens", "from 1 to 7"),
        ({"ngram_min": 3, "ngram_max": 2}, "speculative.ngram_max", "from ngram_min (3)"),
        ({"k": 3}, "speculative.k", "unknown key (the keys: lookahead_candidates,"),
        ("ngram", "speculative", "a mapping"),
    ],
)
def test_bad_settings_name_the_key(given, key: str, expected: str) -> None:
    with pytest.raises(EngineSettingError) as info:
        EngineConfig(model="m", speculative=given)
    assert info.value.key == key and expected in str(info.value)


@pytest.mark.parametrize("method", ["ngram", "suffix", "auto"])
def test_the_most_drafts_need_no_lookahead_settings(method: str) -> None:
    """Lookahead's tree size limit binds only lookahead: other methods take k = 7 with the
    lookahead defaults left as they are."""
    config = EngineConfig(model="m", speculative={"method": method, "max_tokens": 7})
    assert config.speculative.max_tokens == 7


def test_mapping_and_object_give_the_same_config() -> None:
    a = EngineConfig(model="m", speculative={"method": "ngram", "max_tokens": 2})
    b = EngineConfig(model="m", speculative=SpeculativeConfig(method="ngram", max_tokens=2))
    assert a == b and isinstance(a.speculative, SpeculativeConfig)


def test_job_yaml_bad_speculative_value_exits_2_naming_the_key(tmp_path: Path, capsys) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text('{"id": "a", "prompt": "hi"}\n')
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "model": {"source": "smollm2-135m-instruct"},
                "input": {"path": str(data)},
                "output": {"path": str(tmp_path / "out")},
                "engine": {"speculative": {"method": "ngram", "max_tokens": 0}},
            }
        )
    )
    assert cli_main([str(job)]) == 2
    err = capsys.readouterr().err
    assert "  engine.speculative.max_tokens: expected an integer from 1 to 7, got 0" in err, err


def test_an_unquoted_off_in_job_yaml_or_set_is_off() -> None:
    """YAML reads ``method: off`` (and ``--set engine.speculative.method=off``) as false."""
    from tokenmill.jobs.spec import JobSpec

    text = "model: {source: m}\ninput: {path: in.jsonl}\noutput: {path: out}\n"
    spec = JobSpec.from_dict(yaml.safe_load(text + "engine: {speculative: {method: off}}"))
    assert spec.engine.speculative == SpeculativeConfig(method="off")
    with pytest.raises(EngineSettingError, match="speculative.method: expected one of"):
        SpeculativeConfig.from_mapping({"method": True})


class _Alternate:
    """A scripted policy: draft on every third step (and remember what it was told, and at
    which of its calls)."""

    def __init__(self) -> None:
        self.calls = 0
        self.samples = []
        self.heard_at = []  # the call during which each sample came
        self.charged_at = []  # the calls that charged their launch to drafting
        self.charged_right_bucket = []  # each charge named the drafted step's rows

    def wants_drafts(self, batch: int, slowest_yield: float | None = None) -> bool:
        self.calls += 1
        return self.calls % 3 == 0

    def record(self, sample) -> None:
        self.samples.append(sample)
        self.heard_at.append(self.calls)

    def charge_switch_back(self, batch: int, wall_ms: float) -> None:
        self.charged_at.append(self.calls)
        last_drafted = next(s for s in reversed(self.samples) if s.drafted)
        self.charged_right_bucket.append(batch == last_drafted.batch)

    def estimates(self) -> dict:
        return {}


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_drafted_steps_between_plain_steps_keep_the_output(
    model_path: Path, async_scheduling: bool
) -> None:
    """Drafted steps run synchronously between plain ones, which keep async scheduling (the
    step in flight is finished first): the tokens are those of a run without drafts."""
    prompts = _copy_prompts(24)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    settings = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=8,
                    kv_cache_memory=1 << 26, async_scheduling=async_scheduling)  # fmt: skip
    want = [o.token_ids for o in LLM(str(model_path), **settings).generate(prompts, params)]
    llm = LLM(str(model_path), speculative={"method": "auto", "max_tokens": 3}, **settings)
    policy = _Alternate()
    llm.engine.policy = policy
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    drafted = [s for s in policy.samples if s.drafted]
    assert drafted and len(drafted) < len(policy.samples)
    # The policy hears of decode-only steps (steps that admit prompts would skew its times).
    assert 0 < sum(s.accepted for s in drafted) <= llm.engine.scheduler.stats.num_accepted_tokens
    # A plain step right after a synchronous drafted one (of draft_ahead_below rows or
    # more) has nothing of its own to time under async scheduling (only its launch): the
    # policy does not hear of it. (An async plain step is heard of in the call after its
    # own, once processed.)
    launched_at = [c - async_scheduling for c in policy.heard_at]
    after_drafted = [c for s, c in zip(policy.samples, launched_at, strict=True)
                     if not s.drafted and (c - 1) % 3 == 0
                     and s.batch >= llm.engine.draft_ahead_below]  # fmt: skip
    assert (not after_drafted) == async_scheduling, after_drafted
    # ... its time is charged to the drafted step instead, right after one
    assert all((c - 1) % 3 == 0 for c in policy.charged_at)
    assert all(policy.charged_right_bucket)
    assert bool(policy.charged_at) == async_scheduling


class _Always(_Alternate):
    """A scripted policy that drafts every step, and notes what the engine told it of the
    slowest row and whether requests were waiting then."""

    def __init__(self, scheduler) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.told: list[tuple[bool, float | None, float | None]] = []

    def wants_drafts(self, batch: int, slowest_yield: float | None = None) -> bool:
        s = self.scheduler.slots
        order = self.scheduler._order
        steps = s.drafted_steps[order]
        seen = steps >= 2
        mine = (
            1 + float((s.accepted_drafts[order][seen] / steps[seen]).min()) if seen.any() else None
        )
        self.told.append((bool(self.scheduler.waiting), slowest_yield, mine))
        return True


def test_the_policy_hears_of_the_slowest_row_once_nothing_waits(model_path: Path) -> None:
    """While requests wait the policy weighs drafts by their rate; once none waits (the
    drain) it is told the fewest tokens a drafted step gives any running row, from each
    row's drafted steps and accepted drafts since its admission."""
    llm = _llm(model_path, "auto", max_num_seqs=8)
    policy = _Always(llm.engine.scheduler)
    llm.engine.policy = policy
    prompts = _copy_prompts(24)
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    waiting = [slowest for waits, slowest, _ in policy.told if waits]
    drain = [(slowest, mine) for waits, slowest, mine in policy.told if not waits]
    assert waiting and all(slowest is None for slowest in waiting)
    assert drain and all(slowest == mine for slowest, mine in drain)
    told = [slowest for slowest, _ in drain if slowest is not None]
    assert told and all(1.0 <= y <= 5.0 for y in told), told
    assert min(told) < max(told)  # rows differ, and the slowest changes as rows finish


def test_penalties_follow_the_drafts(model_path: Path) -> None:
    """Presence, frequency and repetition penalties at a draft position count the drafts
    before it as output: greedy output with penalties is the same with drafts."""
    prompts = _copy_prompts(30)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, presence_penalty=0.2,
                            frequency_penalty=0.1, repetition_penalty=1.05)  # fmt: skip
    outs = {}
    for method in ("off", "ngram"):
        llm = _llm(model_path, method)
        outs[method] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["ngram"] == outs["off"]
    assert llm.engine.scheduler.stats.num_accepted_tokens > 0


def test_suffix_greedy_output_equals_off_and_drafts_from_earlier_rows(model_path: Path) -> None:
    """Rows finish one batch after another (max_num_seqs 4), so later rows find earlier
    rows' outputs in the corpus; the output is the same as without drafts."""
    prompts = [p[:6] for p in _copy_prompts(40)] * 2  # each prompt twice: a second row
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)  # copies its twin
    outs = {}
    for method in ("off", "suffix"):
        llm = _llm(model_path, method, max_num_seqs=4)
        outs[method] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["suffix"] == outs["off"]
    stats = llm.engine.scheduler.stats
    # The second copy of each prompt drafts its twin's output from the corpus once its own
    # first 3 tokens match there: most of its 12.
    assert stats.num_accepted_tokens >= 40 * 5, stats


def test_seeded_sampling_is_the_same_with_drafts(model_path: Path) -> None:
    """A seeded row draws each token from its own (seed, output position) stream, so with
    temperature, top-k and top-p its tokens do not depend on drafts; runs repeat exactly."""
    prompts = _copy_prompts(30)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=i,
                             ignore_eos=True) for i in range(30)]  # fmt: skip
    outs = []
    for method in ("off", "suffix", "suffix"):
        llm = _llm(model_path, method)
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outs[1] == outs[0] and outs[2] == outs[1]
    assert llm.engine.scheduler.stats.num_draft_tokens > 0


def test_seeded_and_penalized_rows_beside_drafts_ahead(model_path: Path) -> None:
    """Async scheduling with drafted steps of 8 rows synchronous and smaller ones drafted
    ahead: rows that sample by output position (a seed) or history (penalties) draft only
    in the synchronous steps, whose positions the host knows; every row's tokens equal
    those of speculation off."""
    prompts = _copy_prompts(24)
    params = []
    for i in range(24):
        kind = i % 3
        if kind == 0:
            params.append(SamplingParams(max_tokens=16 + i % 7, temperature=0, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=i,
                                         ignore_eos=True))  # fmt: skip
        else:
            params.append(SamplingParams(max_tokens=16, temperature=0, presence_penalty=2.0,
                                         frequency_penalty=2.0, ignore_eos=True))  # fmt: skip
    outs = []
    for method in ("off", "ngram"):
        llm = _llm(model_path, method, async_scheduling=True)
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outs[1] == outs[0]
    profile = llm.engine.step_profile()
    assert profile["speculative"]["accepted_tokens"] > 0
    assert 0 < profile["synchronous_steps"] < llm.engine.scheduler.stats.num_steps
    # Seeded rows alone, 12 of them: every drafted step is synchronous, and they draft there
    # (near-greedy, so that their outputs repeat their prompts as the greedy rows' do).
    seeded = [SamplingParams(max_tokens=16, temperature=0.01, seed=i) for i in range(12)]
    llm = _llm(model_path, "ngram", async_scheduling=True, max_num_seqs=12)
    llm.generate(prompts[: len(seeded)], seeded)
    assert llm.engine.scheduler.stats.num_drafted_rows > 0


@pytest.mark.parametrize(
    ("method", "async_scheduling"),
    [("off", False), ("off", True), ("ngram", False), ("ngram", True)],
    ids=["sync", "async", "drafted", "drafted-ahead"],
)
def test_a_next_turn_reuses_the_cached_output_blocks_and_gets_fresh_tokens(
    model_path: Path, method: str, async_scheduling: bool
) -> None:
    """A request's output blocks are cached when it finishes (with steps in flight and
    drafts rejected along the way, drafted ahead included): a next turn repeating prompt and
    output hits them, and the tokens it gets are those of an engine computing it afresh."""
    prompts = _copy_prompts(12)
    llm = _llm(model_path, method, async_scheduling=async_scheduling)
    llm.engine.draft_ahead_below = 99  # with async scheduling: draft ahead on every step
    first = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    turns = [p + o.token_ids + [5, 6, 7] for p, o in zip(prompts, first, strict=True)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    again = llm.generate(turns, params)
    fresh = _llm(model_path, "off", enable_prefix_caching=False).generate(turns, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in fresh]
    # past each prompt's own full blocks: the outputs' blocks were hit too
    assert all(
        o.num_cached_tokens > len(p) // 4 * 4 for o, p in zip(again, prompts, strict=True)
    ), [(o.num_cached_tokens, len(p)) for o, p in zip(again, prompts, strict=True)]


@pytest.mark.parametrize(
    ("method", "async_scheduling"),
    [("ngram", False), ("suffix", False), ("lookahead", False), ("ngram", True)],
)
def test_stop_strings_and_min_tokens_end_where_they_do_without_drafts(
    model_path: Path, method: str, async_scheduling: bool
) -> None:
    """A stop string completed by a drafted step's second or later accepted token ends the
    output at that token (the tokens after it are not output), and ``min_tokens`` counts to
    the token: text, tokens and finish reasons equal the run without drafts."""
    prompts = _copy_prompts(30)
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    texts = [o.text for o in _llm(model_path, "off").generate(prompts, plain)]
    params = [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                       stop=[text[6:8]] if len(text) >= 8 else [], min_tokens=(0, 5, 9)[i % 3])
        for i, text in enumerate(texts)
    ]  # fmt: skip
    runs = {}
    for name in ("off", method):
        llm = _llm(model_path, name, async_scheduling=async_scheduling)
        outs = llm.generate(prompts, params)
        runs[name] = [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in outs]
    assert runs[method] == runs["off"]
    assert sum(reason == "stop" for _, _, reason, _ in runs["off"]) >= 10
    assert llm.engine.scheduler.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "drafts-ahead"])
def test_min_tokens_lifts_its_stop_token_ban_at_the_same_token_with_drafts(
    model_path: Path, async_scheduling: bool
) -> None:
    """min_tokens bans the stop tokens by output position; a row drafting ahead of a step in
    flight does not know its position on the host, so it drafts only once min_tokens is
    reached (an EOS pushed up by a bias then comes at the same token as without drafts)."""
    prompts = _copy_prompts(12)
    runs = {}
    for method in ("off", "ngram"):
        llm = _llm(model_path, method, max_num_seqs=4, async_scheduling=async_scheduling)
        eos = llm.engine.model_config.eos_token_ids[0]
        params = [
            SamplingParams(max_tokens=24, temperature=0, min_tokens=3 + i, logit_bias={eos: 8})
            for i in range(len(prompts))
        ]
        runs[method] = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
    assert runs["ngram"] == runs["off"]
    assert sum(reason == "stop" for _, reason in runs["off"]) >= 6


def test_the_proposers_learning_counts_in_its_host_time() -> None:
    """The step profile counted only the proposing: the suffix corpus and Lookahead's pool
    learning from outputs (about a third of Lookahead's host time) were left out."""
    from tokenmill.engine.core.scheduler_output import SchedulerStats

    stats = SchedulerStats(num_steps=10, num_propose_calls=4)
    stats.propose_seconds, stats.observe_seconds = 0.004, 0.006
    summary = stats.speculative()
    assert summary["propose_ms_per_step"] == 1.0  # per step that asked for drafts
    assert summary["proposer_ms_per_step"] == 1.0  # (4 + 6) ms over all 10 steps


def test_lookahead_at_a_large_batch_is_warned_about(
    model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Lookahead's step carries its whole tree a row (30 drafts at the defaults), which
    costs the GPU at hundreds of rows: past 16 rows the engine says so."""
    with caplog.at_level("WARNING", logger="tokenmill.engine.llm_engine"):
        _llm(model_path, "lookahead", max_num_seqs=16)
        assert "lookahead" not in caplog.text
        _llm(model_path, "lookahead", max_num_seqs=256)
    assert "speculative.method lookahead with max_num_seqs 256" in caplog.text
