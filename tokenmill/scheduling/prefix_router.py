"""PrefixRouter: which replica runs a row, so that rows sharing a prompt prefix share a cache.

Each replica has its own prefix cache; a prefix computed on one replica is no use to
another. Routing rows by their leading KV blocks sends rows that share those blocks (a
long system prompt, a document asked many questions, few-shot examples) to one replica,
which then prefills them once. A key that alone would overload its replica spills to the
next replicas, so load stays within a bound (consistent hashing with bounded loads):

    ring: each replica at ``VNODES`` pseudo-random points on a circle of 2^64 positions
    row ─► key = its first ``prefix_blocks`` full KV blocks of token ids
        ─► a key seen before: the replica its last row went to, while that one's
           load + weight <= capacity
        ─► a new key (or one over capacity): walk clockwise from BLAKE2b(key)'s point to
           the first replica that fits; a new key fits at most at the mean load
    capacity = ceil(load_bound * (total load + weight) / replicas)
    mean     = ceil((total load + weight) / replicas)

With unit weights and every replica available some replica always fits (the least loaded
has at most floor(total / replicas), and capacity is at least one more), so after every
assignment each replica's load is at most ``ceil(load_bound * total / replicas)``: with
1.25, within 25% of the mean (plus one row). With weights (rows' predicted work), or while
a replica is unavailable (restarting), a row no replica has room for goes to the least
loaded one. A key's rows stay together once one spilled (early in a job capacity
is small, and spills are common): the router remembers where each of the last
``remembered_keys`` keys went. New keys go only where the load is at most the mean, which
leaves the headroom up to ``load_bound`` to the keys already placed: their later rows then
rarely have to spill (40 prefixes of 10 rows, 4 replicas: 37 to 40 prefixes on one replica
each, against 23 to 33 when new keys may fill a replica up to the bound).

Stable: a key's point and the ring are hashes of bytes (not Python's salted ``hash``), so
a prefix's first-choice replica is the same in every run, process and machine. Which
replica a spilled row gets depends on the loads, hence on the order rows come and go in:
the same stream gives the same routes. Loads are what the caller says: call ``release``
when a row finishes to balance rows in flight, or never to balance rows assigned.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Collection, Sequence

from tokenmill.io.rows import InputRow

__all__ = ["PrefixRouter", "prefix_key", "row_prefix_key", "text_prefix_key"]

PREFIX_CHARS = 8 * 16 * 4  # 8 KV blocks of 16 tokens, at about 4 characters a token
VNODES = 64  # points per replica: spreads keys evenly (load within ~1/sqrt(VNODES) unspilled)


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_key(prompt_ids: Sequence[int], block_size: int, prefix_blocks: int) -> bytes:
    """The routing key of a tokenized prompt: its first ``prefix_blocks`` full KV blocks of
    ``block_size`` tokens (the blocks the engine's prefix cache shares), or the whole prompt
    when it has no full block. Raises ValueError for a non-positive size."""
    if block_size < 1 or prefix_blocks < 1:
        raise ValueError(
            f"block_size and prefix_blocks must be >= 1, got {block_size}, {prefix_blocks}"
        )
    full = min(len(prompt_ids) // block_size, prefix_blocks) * block_size
    head = prompt_ids[:full] if full else prompt_ids
    return b"T" + array("q", head).tobytes()


def text_prefix_key(text: str, prefix_chars: int) -> bytes:
    """The routing key of a prompt not yet tokenized (a Ray driver routes text): its first
    ``prefix_chars`` characters; about ``prefix_blocks * block_size * 4`` for English text.
    For a conversation pass the text the chat template would render, or a stable
    serialisation of the messages, system message first."""
    if prefix_chars < 1:
        raise ValueError(f"prefix_chars must be >= 1, got {prefix_chars}")
    return b"S" + text[:prefix_chars].encode("utf-8", "surrogatepass")


def row_prefix_key(row: InputRow, prefix_chars: int = PREFIX_CHARS) -> bytes:
    """The routing key of an input row before tokenizing (what a Ray driver holds): the
    first ``prefix_chars`` characters of its prompt, or of its conversation written out
    message by message (role, then content), which is the order the chat template renders.
    A prompt given as token ids: its first ``prefix_chars // 4`` ids (``prefix_key``)."""
    if row.prompt_token_ids is not None:
        return prefix_key(row.prompt_token_ids, max(prefix_chars // 4, 1), 1)
    if row.messages is None:
        return text_prefix_key(row.prompt or "", prefix_chars)
    parts = []
    for message in row.messages:
        content = message.get("content")
        text = content if isinstance(content, str) else repr(content)  # (repr: parts lists)
        parts.append(f"{message.get('role')}\0{text}")
    return text_prefix_key("\0".join(parts), prefix_chars)


class PrefixRouter:
    """Routes keys (``prefix_key``, ``text_prefix_key``) to ``replicas`` replicas; see the
    module docstring. ``load_bound`` >= 1: how far above the mean a replica's load may go
    (1.25: 25%). ``loads`` are the replicas' current loads. ``remembered_keys`` bounds the
    memory of where keys went (least recently routed forgotten first)."""

    def __init__(
        self, replicas: int, load_bound: float = 1.25, remembered_keys: int = 65_536
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if not load_bound >= 1.0:
            raise ValueError(f"load_bound must be >= 1, got {load_bound}")
        if remembered_keys < 0:
            raise ValueError(f"remembered_keys must be >= 0, got {remembered_keys}")
        self.replicas = replicas
        self.load_bound = load_bound
        self.loads = [0.0] * replicas
        self.remembered_keys = remembered_keys
        self._last: OrderedDict[bytes, int] = OrderedDict()  # key -> where its last row went
        points = sorted(
            (_point(f"replica {r} point {v}".encode()), r)
            for r in range(replicas)
            for v in range(VNODES)
        )
        self._points = [p for p, _ in points]
        self._owners = [r for _, r in points]

    @property
    def total(self) -> float:
        return sum(self.loads)

    def preferred(self, key: bytes) -> int:
        """The replica ``key`` goes to when no replica is loaded: stable across runs."""
        return self._owners[self._start(key)]

    def assign(
        self, key: bytes, weight: float = 1.0, available: Collection[int] | None = None
    ) -> int:
        """The replica for a row of ``key`` and ``weight`` (1 a row, or its predicted work),
        counted in its load. ``available``: the replicas that may take it now (one being
        restarted may not); all when None. Raises ValueError for a negative weight or no
        replica available."""
        if weight < 0:
            raise ValueError(f"weight must be >= 0, got {weight}")
        usable = range(self.replicas) if available is None else available
        if not any(0 <= r < self.replicas for r in usable):
            raise ValueError(f"no replica available among {self.replicas}: {available!r}")
        capacity = math.ceil(self.load_bound * (self.total + weight) / self.replicas)
        chosen = self._last.get(key)
        if chosen is None or chosen not in usable:
            mean = math.ceil((self.total + weight) / self.replicas)
            chosen = self._walk(key, weight, mean if chosen is None else capacity, usable)
        elif self.loads[chosen] + weight > capacity:
            chosen = self._walk(key, weight, capacity, usable)
        self.loads[chosen] += weight
        self._last[key] = chosen
        self._last.move_to_end(key)
        while len(self._last) > self.remembered_keys:
            self._last.popitem(last=False)
        return chosen

    def _walk(self, key: bytes, weight: float, capacity: float, usable: Collection[int]) -> int:
        """The first usable replica clockwise from ``key``'s point with room for ``weight``;
        the least loaded usable one when none has."""
        start = self._start(key)
        tried: set[int] = set()
        for i in range(len(self._points)):
            replica = self._owners[(start + i) % len(self._points)]
            if replica in tried:
                continue
            if replica in usable and self.loads[replica] + weight <= capacity:
                return replica
            tried.add(replica)
            if len(tried) == self.replicas:
                break
        # with weights, or with replicas unavailable: none has room
        candidates = [r for r in range(self.replicas) if r in usable]
        return min(candidates, key=lambda r: (self.loads[r], r))

    def release(self, replica: int, weight: float = 1.0) -> None:
        """A row of ``weight`` on ``replica`` finished: it no longer counts in its load."""
        self.loads[replica] = max(0.0, self.loads[replica] - weight)

    def _start(self, key: bytes) -> int:
        return bisect.bisect_left(self._points, _point(key)) % len(self._points)
