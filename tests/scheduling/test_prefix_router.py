"""PrefixRouter: rows sharing leading KV blocks go to one replica, loads stay within the
bound however skewed the prefixes, and routes are the same in every process."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.io.rows import InputRow
from tokenmill.scheduling.prefix_router import (
    PrefixRouter,
    prefix_key,
    row_prefix_key,
    text_prefix_key,
)

BLOCK = 16
REPO = Path(__file__).resolve().parents[2]


def _prompt(prefix: int, suffix: int, prefix_len: int = 4 * BLOCK) -> list[int]:
    """A prompt of a shared prefix (``prefix_len`` tokens, chosen by ``prefix``) and a
    unique tail."""
    rng = random.Random(prefix)
    head = [rng.randrange(32_000) for _ in range(prefix_len)]
    tail = random.Random(10_000 + suffix).sample(range(32_000), 40)
    return head + tail


def test_the_key_is_the_leading_full_blocks() -> None:
    a = list(range(100))
    assert prefix_key(a, BLOCK, 2) == prefix_key(a[:32] + [7] * 50, BLOCK, 2)
    assert prefix_key(a, BLOCK, 2) != prefix_key([1000] + a[1:], BLOCK, 2)
    assert prefix_key(a, BLOCK, 10) == prefix_key(a[:96], BLOCK, 10)  # 6 full blocks: 96
    assert prefix_key(a[:5], BLOCK, 2) != prefix_key(a[:6], BLOCK, 2)  # no full block
    assert text_prefix_key("You are helpful. Q1", 16) == text_prefix_key("You are helpful. Q2", 16)
    with pytest.raises(ValueError, match="block_size"):
        prefix_key(a, 0, 2)


def test_untokenized_rows_are_keyed_by_their_leading_text() -> None:
    system = {"role": "system", "content": "You answer questions about the report. " * 20}

    def chat(i: int, question: str) -> InputRow:
        return InputRow(
            i, f"r{i}", f"f:{i}", messages=[system, {"role": "user", "content": question}]
        )

    assert row_prefix_key(chat(0, "Who?")) == row_prefix_key(chat(1, "When?"))
    assert row_prefix_key(chat(0, "Who?"), prefix_chars=2000) != row_prefix_key(
        chat(1, "When?"), prefix_chars=2000
    )
    plain = InputRow(2, "p", "f:3", prompt="You answer questions about the report.")
    assert row_prefix_key(plain) != row_prefix_key(chat(0, "Who?"))
    # Text content is keyed as it is: an apostrophe past the key's window changed the quote
    # a repr chose at its start, and split rows sharing their first 900 characters.
    doc = system["content"]
    asks = [
        InputRow(i, f"q{i}", "f", messages=[{"role": "user", "content": doc + q}])
        for i, q in enumerate(["What's the year?", "Which year?"])
    ]
    assert row_prefix_key(asks[0]) == row_prefix_key(asks[1])
    ids = InputRow(5, "t", "f:6", prompt_token_ids=tuple(range(1, 300)))
    assert row_prefix_key(ids) == row_prefix_key(
        InputRow(6, "u", "f:7", prompt_token_ids=(*range(1, 129), 7, 7))
    )  # token-id prompts: their first 128 ids


def test_rows_sharing_a_prefix_go_to_one_replica() -> None:
    """40 prefixes, 10 rows each, in shuffled order: each prefix's rows land together."""
    router = PrefixRouter(replicas=4)
    rows = [(p, s) for p in range(40) for s in range(10)]
    random.Random(0).shuffle(rows)
    placed: dict[int, set[int]] = {}
    for p, s in rows:
        key = prefix_key(_prompt(p, s), BLOCK, prefix_blocks=4)
        placed.setdefault(p, set()).add(router.assign(key))
    together = sum(len(replicas) == 1 for replicas in placed.values())
    assert together >= 35  # a few prefixes spill while their replica is over the bound
    assert max(router.loads) <= math.ceil(1.25 * 400 / 4)


def test_loads_stay_within_the_bound_with_skewed_prefixes() -> None:
    """Half the rows share one prefix, the rest come from a long tail: after every
    assignment each replica holds at most ceil(1.25 * total / replicas) rows."""
    rng = random.Random(1)
    router = PrefixRouter(replicas=5, load_bound=1.25)
    for i in range(3000):
        prefix = 0 if rng.random() < 0.5 else rng.randrange(1, 2000)
        router.assign(prefix_key(_prompt(prefix, i), BLOCK, 4))
        assert max(router.loads) <= math.ceil(1.25 * router.total / 5)
    assert min(router.loads) >= 3000 / 5 / 2  # the hot prefix was spread, not piled up


def test_release_balances_rows_in_flight() -> None:
    router = PrefixRouter(replicas=3, load_bound=1.0)
    key = text_prefix_key("the same system prompt", 64)
    first = [router.assign(key) for _ in range(3)]
    assert sorted(first) == [0, 1, 2]  # a bound of 1.0: one row each
    router.release(first[0])
    assert router.assign(key) == first[0]  # the freed replica takes the next one
    assert router.loads == [1.0, 1.0, 1.0]


def test_a_replica_that_is_down_gets_no_rows() -> None:
    """A replica being restarted is left out; back up, it takes rows again as soon as the
    others are over the bound."""
    router = PrefixRouter(replicas=3)
    keys = [text_prefix_key(f"prefix {i}", 64) for i in range(30)]
    home = {key: router.preferred(key) for key in keys}
    moved = [k for k in keys if home[k] == 1]
    assert moved  # some keys prefer replica 1
    for key in keys:
        assert router.assign(key, available={0, 2}) in (0, 2)
    assert router.loads[1] == 0
    for key in keys:
        router.assign(key)
    assert 0 < router.loads[1] and max(router.loads) <= math.ceil(1.25 * router.total / 3)
    with pytest.raises(ValueError, match="no replica available"):
        router.assign(keys[0], available=set())


def test_weighted_rows_that_fit_nowhere_go_to_the_least_loaded() -> None:
    router = PrefixRouter(replicas=2, load_bound=1.0)
    key = text_prefix_key("x", 8)
    heavy = router.assign(key, weight=10)
    assert router.assign(text_prefix_key("y", 8), weight=30) != heavy or router.loads[heavy] == 40
    assert sum(router.loads) == 40
    with pytest.raises(ValueError, match="weight"):
        router.assign(key, weight=-1)
    with pytest.raises(ValueError, match="load_bound"):
        PrefixRouter(replicas=2, load_bound=0.5)


_ROUTES = """
import json, random
from tokenmill.scheduling.prefix_router import PrefixRouter, prefix_key
router = PrefixRouter(replicas=6)
rng = random.Random(7)
routes = [router.assign(prefix_key([rng.randrange(1000) % (k + 3) for k in range(40)], 16, 2))
          for _ in range(300)]
print(json.dumps({"routes": routes, "preferred": router.preferred(b"T" + bytes(32))}))
"""


def test_routes_are_the_same_in_every_process() -> None:
    """Python salts its str/bytes hash per process; the router hashes bytes with BLAKE2b, so
    two processes with different salts route the same stream the same way."""
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        proc = subprocess.run(
            [sys.executable, "-c", _ROUTES], env=env, capture_output=True, text=True, check=True
        )
        outs.append(json.loads(proc.stdout))
    assert outs[0] == outs[1]
    assert len(set(outs[0]["routes"])) == 6
