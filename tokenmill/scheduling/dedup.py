"""Dedup: a row identical to another (same prompt, same sampling) is computed once.

Identical means the same prompt token ids (or, before tokenizing, the same prompt text or
conversation) and equal SamplingParams, and only where the result is reproducible: greedy
(temperature 0), or sampled with a seed (the engine draws a seeded row's samples from its
own generator, whatever shares its batch; a job's ``sampling.seed`` gives each row a seed
of its own, jobs/requests.py, so only rows that bring the same seed match). Such a row's
result is what computing it again would give, so its twin's result is copied under its own
identity (row index, id, custom_id, passthrough, file:line): each copy is written to its
own row's shard, and an OpenAI Batch line id, derived from the row index and id, is its
own. A row sampled without a seed is never deduplicated: two of them are two independent
draws.

    row ─► key ─► a twin's result is cached ───────────► copy it now           (Cached)
              ├─► a twin is queued or running (primary) ─► hold until it ends  (HELD)
              └─► neither ───────────────────────────────► run it: the primary (RUN)
    primary's result ─► copies for the held twins; kept in the cache (the last ``max_cached``)

Memory is bounded: at most ``max_held`` rows wait for a twin (past that a row just runs),
``max_cached`` results are kept (least recently used dropped), and one key per primary still
running. Keys are 16-byte BLAKE2b digests: two different rows share one with probability
about n^2 / 2^129 for n distinct rows, far below any hardware error rate.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Generic, TypeVar

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.io.rows import InputRow, ResultRow

__all__ = [
    "HELD",
    "RUN",
    "Cached",
    "DedupKeys",
    "Deduplicator",
    "copy_result",
    "dedup_key",
    "text_prompt_bytes",
    "token_prompt_bytes",
]

T = TypeVar("T")
R = TypeVar("R")

# What a result carries over from its input row: the fields both records have (the error
# aside: a row that reached dedup has none). A field added to both is carried over too.
IDENTITY_FIELDS = tuple(
    sorted(({f.name for f in fields(ResultRow)} & {f.name for f in fields(InputRow)}) - {"error"})
)


_FLOAT_FIELDS = frozenset(f.name for f in fields(SamplingParams) if f.type == "float")


def reproducible(params: SamplingParams) -> bool:
    """Whether computing a row twice gives one result: greedy, or sampled with a seed."""
    return params.greedy or params.seed is not None


def token_prompt_bytes(prompt_ids: Sequence[int]) -> bytes:
    """A tokenized prompt as dedup hashes it."""
    return b"T" + array("q", prompt_ids).tobytes()


def text_prompt_bytes(row: InputRow) -> bytes:
    """An untokenized row's prompt as dedup hashes it: the prompt text, or its conversation
    (role and content of each message, in order, with any other message fields, and the
    row's own chat template variables and ending). The same text always tokenizes to the
    same ids, so equal bytes mean equal prompts (the converse may fail, e.g. for a
    message's keys in another order: then the rows just both run).
    A prompt given as token ids is hashed as ``token_prompt_bytes``."""
    if row.prompt_token_ids is not None:
        return token_prompt_bytes(row.prompt_token_ids)
    if row.messages is not None:
        own = repr(sorted(row.chat_template_kwargs.items())) if row.chat_template_kwargs else ""
        if (row.add_generation_prompt, row.continue_final_message) != (None, None):
            own += f"|{row.add_generation_prompt}|{row.continue_final_message}"
        return b"M" + (repr(row.messages) + own).encode("utf-8", "surrogatepass")
    return b"P" + (row.prompt or "").encode("utf-8", "surrogatepass")


def _params_bytes(params: SamplingParams) -> bytes:
    """``params`` as dedup hashes them: every field, float fields as floats (a row's
    ``temperature: 0`` is the job's ``0.0``)."""
    values = []
    for f in fields(params):
        value = getattr(params, f.name)
        values.append((f.name, float(value) if f.name in _FLOAT_FIELDS else value))
    return repr(values).encode("utf-8", "surrogatepass")


def dedup_key(prompt: bytes, params: SamplingParams) -> bytes | None:
    """The dedup key of a row: its prompt's bytes (``token_prompt_bytes`` or
    ``text_prompt_bytes``) and its sampling parameters; None when its result is not
    reproducible (sampled without a seed)."""
    return _key(prompt, params, _params_bytes(params))


def _key(prompt: bytes, params: SamplingParams, params_bytes: bytes) -> bytes | None:
    if not reproducible(params):
        return None
    digest = hashlib.blake2b(params_bytes, digest_size=16)
    digest.update(b"\0")
    digest.update(prompt)
    return digest.digest()


class DedupKeys:
    """``dedup_key`` for a stream of rows, the parameters' bytes kept for the last
    SamplingParams object: the rows of a job mostly share one (its sampling section), and
    writing its fields out is most of a key's cost."""

    def __init__(self) -> None:
        self._params: SamplingParams | None = None
        self._params_bytes = b""

    def key(self, prompt: bytes, params: SamplingParams) -> bytes | None:
        if params is not self._params:
            self._params, self._params_bytes = params, _params_bytes(params)
        return _key(prompt, params, self._params_bytes)


def copy_result(result: ResultRow, row: InputRow) -> ResultRow:
    """``result`` (a twin's) as ``row``'s own: its identity fields, and an error message
    under its own file:line that says whose it is (a copy of a Ray poison row's error said
    the row "failed every engine replica that ran it", run by none)."""
    copy = replace(result, **{name: getattr(row, name) for name in IDENTITY_FIELDS})
    if result.error is not None:
        message = result.error.removeprefix(f"{result.source}: ")
        copy = replace(
            copy,
            error=f"{row.source}: {message} (the error of the identical row at "
            f"{result.source}: this row was not run again)",
        )
    return copy


class _Claim(Enum):
    RUN = "run"  # compute the row (it may be the primary of later twins)
    HELD = "held"  # a twin is queued or running: the row waits for its result


RUN = _Claim.RUN
HELD = _Claim.HELD


@dataclass(frozen=True)
class Cached(Generic[R]):
    """A twin's result is known: write a copy of it, the row need not run."""

    result: R


@dataclass
class _Group(Generic[T]):
    key: bytes
    held: list[T]


class Deduplicator(Generic[T, R]):
    """Pairs rows with identical ones (by key); see the module docstring. ``T`` is what is
    kept of a held row, ``R`` a result. Counts: ``held`` rows wait now."""

    def __init__(self, max_held: int, max_cached: int) -> None:
        if max_held < 0 or max_cached < 0:
            raise ValueError(f"max_held and max_cached must be >= 0, got {max_held}, {max_cached}")
        self.max_held = max_held
        self.max_cached = max_cached
        self.held = 0
        self._running: dict[bytes, int] = {}  # key -> its primary's row index
        self._groups: dict[int, _Group[T]] = {}  # primary's row index -> its held twins
        self._cache: OrderedDict[bytes, R] = OrderedDict()

    def claim(self, key: bytes, row_index: int, row: T) -> _Claim | Cached[R]:
        """What to do with the row ``row_index`` of ``key``: RUN it (it becomes the key's
        primary unless there is one), it is HELD (``row`` kept until its twin's result), or
        its twin's result is Cached."""
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return Cached(cached)
        primary = self._running.get(key)
        if primary is None:
            self._running[key] = row_index
            self._groups[row_index] = _Group(key, [])
            return RUN
        if self.held >= self.max_held:
            return RUN  # no room to hold it: computed again, as without dedup
        self._groups[primary].held.append(row)
        self.held += 1
        return HELD

    def finished(self, row_index: int, result: R) -> list[T]:
        """Row ``row_index`` has ``result``: the rows held for it (copy the result to each),
        and the result cached for later twins. A row that is no primary has none."""
        group = self._groups.pop(row_index, None)
        if group is None:
            return []
        del self._running[group.key]
        self.held -= len(group.held)
        if self.max_cached:
            self._cache[group.key] = result
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return group.held
