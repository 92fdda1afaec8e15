"""SamplingReuse: a step's sampling metadata is reused only while it would come out the same,
and an engine that reuses it samples exactly what one that rebuilds it every step does."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine import model_runner, sampling_reuse
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_columns import SamplingColumns
from tokenmill.engine.sampling_metadata import SamplingMetadata
from tokenmill.engine.sampling_reuse import SamplingReuse
from tokenmill.engine.upload_ring import UploadRing

CPU = torch.device("cpu")
VOCAB = 50


def _build(columns: SamplingColumns, rows: np.ndarray, ring: UploadRing) -> SamplingMetadata:
    return SamplingMetadata.from_rows(
        columns.gather(rows),
        np.full(len(rows), 3, dtype=np.int64),
        lambda: ([[1, 2]] * len(rows), [[4, 5, 6]] * len(rows)),
        vocab_size=VOCAB,
        device=CPU,
        upload_many=ring.upload,
    )


def _columns(*params: SamplingParams) -> SamplingColumns:
    return SamplingColumns.of(list(params))


def test_metadata_whose_rows_changed_while_it_was_built_is_not_kept() -> None:
    """A slot given to a new request while the metadata was built (beside a step's grammar
    masks) leaves it describing the old request: it is not kept, under the rows or under
    their setting."""
    ring = UploadRing(CPU)
    cols = _columns(SamplingParams(temperature=0), SamplingParams(temperature=0))
    reuse = SamplingReuse(ring)
    rows = np.array([0, 1], dtype=np.int64)
    version = cols.version
    meta = _build(cols, rows, ring)
    cols.set_row(1, SamplingParams(temperature=1.0, seed=7))  # admitted during the build
    reuse.keep(cols, rows, meta, version)
    assert reuse.get(cols, rows) is None
    assert reuse.get(cols, np.array([0])) is None


def test_reused_for_the_same_rows_until_a_slot_changes() -> None:
    ring = UploadRing(CPU)
    cols = _columns(
        SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9, top_k=5)
    )
    reuse = SamplingReuse(ring)
    rows = np.array([1, 0], dtype=np.int64)
    meta = _build(cols, rows, ring)
    reuse.keep(cols, rows, meta, cols.version)
    again = reuse.get(cols, rows.copy())
    assert again is not None
    for name in ("temperature", "greedy", "top_k", "top_p", "min_p", "repetition_penalty"):
        assert torch.equal(getattr(again, name), getattr(meta, name)), name
    assert reuse.get(cols, rows) is again  # its own columns now: handed out as they are
    assert reuse.get(cols, np.array([0, 1])) is None  # other order
    assert reuse.get(cols, np.array([1])) is None  # a row fewer
    assert reuse.get(_columns(SamplingParams(), SamplingParams()), rows) is None
    cols.set_row(0, SamplingParams(temperature=0))  # slot 0 given to another request
    assert reuse.get(cols, rows) is None


def _same(a: SamplingMetadata, b: SamplingMetadata) -> None:
    """Every field of ``a`` equals ``b``'s (tensors by value)."""
    for field in dataclasses.fields(SamplingMetadata):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and torch.equal(x, y), field.name
        else:
            assert x == y, field.name


@pytest.mark.parametrize(
    "setting",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05),
        SamplingParams(temperature=0, logprobs=3),
    ],
)
def test_rows_that_sample_alike_get_the_first_rows_of_the_widest_kept(
    setting: SamplingParams,
) -> None:
    ring = UploadRing(CPU)
    other = SamplingParams(temperature=0.3)
    cols = _columns(*([setting] * 5), other, SamplingParams(**vars(setting)))  # 6: equal, apart
    reuse = SamplingReuse(ring)
    wide = np.array([4, 0, 2, 1], dtype=np.int64)
    reuse.keep(cols, wide, _build(cols, wide, ring), cols.version)
    ring.upload([np.zeros(4000)] * 8)  # the kept columns are its own: the ring may move on
    for rows in ([3, 1], [6, 0, 3], [1, 2, 3, 4], [6]):  # other slots, other orders, fewer
        rows = np.array(rows, dtype=np.int64)
        got = reuse.get(cols, rows)
        assert got is not None, rows
        _same(got, _build(cols, rows, UploadRing(CPU)))
    assert reuse.get(cols, np.arange(5)) is None  # more rows than kept: built
    assert reuse.get(cols, np.array([0, 5])) is None  # two settings
    assert reuse.get(_columns(setting, setting), np.array([0, 1])) is None  # other columns


def test_rows_with_a_logit_bias_never_share_a_setting() -> None:
    biased = SamplingParams(temperature=0, logit_bias={3: 2.0})
    cols = _columns(biased, biased)
    assert (cols.setting_ids == -1).all()
    ring = UploadRing(CPU)
    reuse = SamplingReuse(ring)
    rows = np.array([0, 1], dtype=np.int64)
    reuse.keep(cols, rows, _build(cols, rows, ring), cols.version)
    assert reuse.get(cols, np.array([1])) is None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=7),  # drawn from a seed and its position
        SamplingParams(temperature=0, presence_penalty=0.5),  # counts grow every step
        SamplingParams(temperature=0, repetition_penalty=1.2),
    ],
)
def test_metadata_that_depends_on_the_step_is_never_kept(params: SamplingParams) -> None:
    ring = UploadRing(CPU)
    cols = _columns(SamplingParams(temperature=0), params)
    reuse = SamplingReuse(ring)
    rows = np.array([0, 1], dtype=np.int64)
    meta = _build(cols, rows, ring)
    assert not sampling_reuse.reusable(meta)
    reuse.keep(cols, rows, meta, cols.version)
    assert reuse.get(cols, rows) is None


def test_columns_whose_ring_views_expired_are_a_miss() -> None:
    class ExpiringRing(UploadRing):
        def views_valid(self, call: int) -> bool:
            return self.calls - call < 2

    ring = ExpiringRing(CPU)
    # two settings: not kept as rows that sample alike (whose columns are copied at once)
    cols = _columns(SamplingParams(temperature=0), SamplingParams(temperature=0.5))
    rows = np.array([0, 1], dtype=np.int64)
    reuse = SamplingReuse(ring)
    reuse.keep(cols, rows, _build(cols, rows, ring), cols.version)
    ring.upload([np.zeros(1)])  # one call since: still valid
    assert reuse.get(cols, rows) is not None
    reuse.keep(cols, rows, _build(cols, rows, ring), cols.version)
    ring.upload([np.zeros(1)])
    ring.upload([np.zeros(1)])  # two since: expired
    assert reuse.get(cols, rows) is None


@pytest.mark.gpu
def test_on_cuda_the_reused_columns_outlive_the_ring_slots_they_came_from() -> None:
    cuda = torch.device("cuda")
    ring = UploadRing(cuda, depth=3)
    cols = _columns(*[SamplingParams(temperature=0.1 * i, top_k=i) for i in range(40)])
    rows = np.arange(40, dtype=np.int64)[::-1].copy()
    meta = SamplingMetadata.from_rows(
        cols.gather(rows), np.zeros(40, dtype=np.int64), lambda: ([], []), VOCAB, cuda,
        upload_many=ring.upload,
    )  # fmt: skip
    want = {n: getattr(meta, n).cpu() for n in ("temperature", "top_k", "greedy", "top_p")}
    reuse = SamplingReuse(ring)
    reuse.keep(cols, rows, meta, cols.version)
    ring.upload([np.zeros(4000, dtype=np.float32)])
    got = reuse.get(cols, rows)
    for _ in range(6):  # every slot of the ring written over with other data
        ring.upload([np.full(4000, 7, dtype=np.int64), np.ones(9, dtype=bool)])
    torch.cuda.synchronize()
    assert got is not None and reuse.get(cols, rows) is got
    for name, value in want.items():
        assert torch.equal(getattr(got, name).cpu(), value), name


def reused_and_rebuilt(
    monkeypatch: pytest.MonkeyPatch, generate: Callable[[], list[RequestOutput]]
) -> tuple[tuple[list[RequestOutput], int], tuple[list[RequestOutput], int]]:
    """``generate()`` (on a fresh engine each call) twice: as the engine runs (metadata
    reused), then building the metadata every step; each with its metadata build count."""

    def run() -> tuple[list[RequestOutput], int]:
        builds = 0
        original = SamplingMetadata.from_rows.__func__

        def counted(cls, *args, **kwargs):
            nonlocal builds
            builds += 1
            return original(cls, *args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(SamplingMetadata, "from_rows", classmethod(counted))
            outs = generate()
        return outs, builds

    reused = run()
    with monkeypatch.context() as m:
        m.setattr(model_runner.SamplingReuse, "get", lambda self, columns, rows: None)
        rebuilt = run()
    return reused, rebuilt


def _reused_and_rebuilt(
    model_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    prompts: list[list[int]],
    params: list[SamplingParams],
    max_num_seqs: int,
) -> tuple[tuple[list[list[int]], int], tuple[list[list[int]], int]]:
    """Each request's tokens and the metadata builds, reused and rebuilt (above)."""

    def generate() -> list[RequestOutput]:
        llm = LLM(str(model_path), device="cpu", dtype="float32", seed=5, max_num_seqs=max_num_seqs)
        return llm.generate(prompts, params)

    (reused, reused_builds), (rebuilt, rebuilt_builds) = reused_and_rebuilt(monkeypatch, generate)
    return ([o.token_ids for o in reused], reused_builds), (
        [o.token_ids for o in rebuilt],
        rebuilt_builds,
    )


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("reuse") / "m")


def test_an_engine_reusing_metadata_samples_what_one_rebuilding_it_does(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[(31 * i + 11 * t) % 250 + 5 for t in range(6 + i % 5)] for i in range(10)]
    params = [
        SamplingParams(max_tokens=12 + i, temperature=0.9 * (i % 3), seed=i if i % 4 == 1 else None)
        for i in range(10)
    ]
    params[3] = SamplingParams(max_tokens=20, temperature=0, presence_penalty=0.4)
    (reused, reused_builds), (rebuilt, rebuilt_builds) = _reused_and_rebuilt(
        model_path, monkeypatch, prompts, params, max_num_seqs=4
    )
    assert reused == rebuilt
    assert reused_builds < rebuilt_builds  # the runs between admissions and finishes


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rows_finishing_at_different_steps_reuse_the_metadata_of_their_setting(
    model_path: Path, monkeypatch: pytest.MonkeyPatch, temperature: float
) -> None:
    """Every row samples alike and one finishes every step or two (max_tokens varies, as
    EOS would vary it): the same rows rarely repeat, the setting always does."""
    prompts = [[(17 * i + 5 * t) % 250 + 5 for t in range(4 + i % 3)] for i in range(12)]
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=temperature) for i in range(12)]
    (reused, reused_builds), (rebuilt, rebuilt_builds) = _reused_and_rebuilt(
        model_path, monkeypatch, prompts, params, max_num_seqs=8
    )
    assert reused == rebuilt
    assert reused_builds <= 2 < rebuilt_builds  # built for the widest batch only
