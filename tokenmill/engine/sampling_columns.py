"""SamplingColumns: requests' sampling settings as preallocated numpy columns, one row each.

A row is written once, when its request takes a batch slot; a step gathers the rows it samples
with one fancy index per column instead of reading ``SamplingParams`` objects one by one:

    set_row(slot, params)                       at admission (once per request)
    gather(slots) ─► SamplingRows               every step: [S] arrays, vectorized

Each row also gets a ``setting_ids`` entry: one small int per distinct setting (the same id
for every request sampling the same way, as a job's rows without overrides all do), so a
step can tell in two numpy calls that all its rows sample alike (sampling_reuse.py). Rows
with a logit bias, and settings past the first ``MAX_SETTINGS``, get ``NO_SETTING_ID``.

Numpy only (no torch): the scheduler's slot table owns one, and ``SamplingMetadata`` turns
the gathered rows into device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.engine.sampling_params import SamplingParams

__all__ = ["SamplingColumns", "SamplingRows"]

NO_LOGPROBS = -1
NO_SETTING_ID = -1
MAX_SETTINGS = 1024  # distinct settings given an id; later ones get NO_SETTING_ID
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingRows:
    """The sampling settings of the rows of one step, [S] each, in logits-row order.

    ``top_k`` holds the raw request value (<= 0 means off); ``SamplingMetadata`` clamps it to
    the vocabulary. ``seed`` is the request's seed modulo 2**64 (all ``seeds.row_seed`` depends on)
    where ``has_seed``; ``logprobs`` is ``NO_LOGPROBS`` where unset.
    """

    greedy: np.ndarray  # bool
    temperature: np.ndarray  # float32 (the request's; unused on greedy rows)
    top_k: np.ndarray  # int64
    top_p: np.ndarray  # float32
    min_p: np.ndarray  # float32
    presence_penalty: np.ndarray  # float32
    frequency_penalty: np.ndarray  # float32
    repetition_penalty: np.ndarray  # float32
    has_seed: np.ndarray  # bool
    seed: np.ndarray  # uint64
    logprobs: np.ndarray  # int32
    structured: np.ndarray  # bool: the request has a grammar (structured_output)
    # object: None, or the request's logit_bias as (token ids [K] int64, biases [K] float32)
    logit_bias: np.ndarray

    def __len__(self) -> int:
        return len(self.greedy)


_DTYPES = {
    "greedy": np.bool_,
    "temperature": np.float32,
    "top_k": np.int64,
    "top_p": np.float32,
    "min_p": np.float32,
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
    "repetition_penalty": np.float32,
    "has_seed": np.bool_,
    "seed": np.uint64,
    "logprobs": np.int32,
    "structured": np.bool_,
    "logit_bias": np.object_,
}


class SamplingColumns:
    """``capacity`` rows of sampling settings; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        self.columns = {name: np.zeros(capacity, dtype=dt) for name, dt in _DTYPES.items()}
        self.columns["logit_bias"][:] = None  # object zeros are 0s
        self.version = 0  # bumped by every set_row: gathered rows are unchanged while it is
        self.setting_ids = np.full(capacity, NO_SETTING_ID, dtype=np.int64)
        self._ids: dict[tuple, int] = {}  # the values set_row writes (bias excepted) -> id

    @classmethod
    def of(cls, params: list[SamplingParams]) -> SamplingColumns:
        """Columns holding ``params`` in rows 0..len(params)-1 (tests and one-off batches)."""
        cols = cls(len(params))
        for i, p in enumerate(params):
            cols.set_row(i, p)
        return cols

    def set_rows(self, rows: list[int], params: list[SamplingParams]) -> None:
        """``set_row(rows[i], params[i])`` for each i, each distinct params object's values
        written once and copied to its other rows (an admission's requests mostly share
        one: a row's 13 column writes and setting lookup took 6 us under cProfile, CPU)."""
        first: dict[int, int] = {}  # id(params) -> its first row
        copies: dict[int, list[int]] = {}  # that first row -> the params' other rows
        for row, p in zip(rows, params, strict=True):
            at = first.setdefault(id(p), row)
            if at == row:
                self.set_row(row, p)
            else:
                copies.setdefault(at, []).append(row)
        for at, others in copies.items():
            for column in self.columns.values():
                if column.dtype == object:  # (a bias tuple would be spread over the rows)
                    for row in others:
                        column[row] = column[at]
                else:
                    column[others] = column[at]
            self.setting_ids[others] = self.setting_ids[at]

    def set_row(self, row: int, params: SamplingParams) -> None:
        self.version += 1
        c = self.columns
        c["greedy"][row] = params.greedy
        c["temperature"][row] = params.temperature
        c["top_k"][row] = params.top_k
        c["top_p"][row] = params.top_p
        c["min_p"][row] = params.min_p
        c["presence_penalty"][row] = params.presence_penalty
        c["frequency_penalty"][row] = params.frequency_penalty
        c["repetition_penalty"][row] = params.repetition_penalty
        c["has_seed"][row] = params.seed is not None
        c["seed"][row] = 0 if params.seed is None else params.seed & _MASK64
        c["logprobs"][row] = NO_LOGPROBS if params.logprobs is None else params.logprobs
        c["structured"][row] = params.structured_output is not None
        c["logit_bias"][row] = _bias_arrays(params.logit_bias)
        self.setting_ids[row] = self._setting_id(params)

    def _setting_id(self, params: SamplingParams) -> int:
        """The id of the setting ``params`` writes into a row, given on its first sight (see
        the module docstring)."""
        if params.logit_bias:
            return NO_SETTING_ID
        key = (
            params.greedy,
            params.temperature,
            params.top_k,
            params.top_p,
            params.min_p,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
            params.seed,
            params.logprobs,
            params.structured_output is not None,
        )
        found = self._ids.get(key)
        if found is None:
            if len(self._ids) >= MAX_SETTINGS:
                return NO_SETTING_ID
            found = self._ids[key] = len(self._ids)
        return found

    def gather(self, rows: np.ndarray | slice) -> SamplingRows:
        """The settings of ``rows`` ([S] int indices, or a slice), as new arrays."""
        return SamplingRows(**{name: col[rows] for name, col in self.columns.items()})


def _bias_arrays(bias: dict[int, float] | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(token ids [K] int64, biases [K] float32) of a logit_bias, made once per request so a
    step only concatenates the rows' arrays."""
    if not bias:
        return None
    ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    return ids, np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
