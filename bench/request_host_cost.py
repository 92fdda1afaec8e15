"""Host cost per request of admission and finish on the engine thread, tiny model, CPU.

On a GPU with a small model the engine thread's host time per step bounds throughput, and
each request's admission and finish take some of it: at ~414 running rows, ~7 admitted and
~7 finished a step, their per-request cost is a large share of a ~1.7 ms step. This runs an
``LLMEngine`` on a random tiny Llama (tests/tiny_models.py) on CPU with async scheduling,
``max_num_seqs`` 256, prompts of random ids and lengths (8-200 tokens, all distinct:
no prefix-cache hits unless ``--shared-prefix``) and ``max_tokens`` (8-100,
``ignore_eos``): a warm-up round of ``--requests``, then ``--rounds`` times as many queued at
once, so that rows finish and are admitted all run long, a few a step, as in a batch job.
Wall-clock wrappers installed here (not in the engine; a renamed method fails loudly) time

    admit_us    ``Scheduler._admit``, per request admitted
    finish_us   ``Scheduler._finish_ended`` + ``LLMEngine._finish``, per request finished
    schedule_rest_us / process_rest_us   the rest of ``Scheduler.schedule`` and of
                ``LLMEngine._process``, per step

and count ``evicted_blocks``: cached blocks the block pool's ``allocate`` dropped from the
prefix cache during the measured rounds. The default KV cache (``--kv-cache-memory`` unset:
twice what ``max_num_seqs`` full-length requests hold) is never full, so nothing is evicted;
on a GPU the cache is full of cached free blocks and every allocation evicts. A small
``--kv-cache-memory`` in bytes makes admission and decode growth evict as there: 30000000
gives 3,662 blocks of 8 KiB, room for the running rows (no preemption: as many steps as the
default) but not for the ~12,000 blocks the measured rounds fill, so ~8,500 are evicted,
every allocation once the warm-up round has left no block unused. Too small a cache
preempts and runs far more steps: compare ``steps``.

Other work on the machine moves these numbers by 10-20%: compare runs alternated with the
code under test, and take medians.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/request_host_cost.py --rounds 4
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenmill import SamplingParams  # noqa: E402
from tokenmill.engine.engine_config import EngineConfig  # noqa: E402
from tokenmill.engine.frozen_heap import frozen_heap  # noqa: E402
from tokenmill.engine.llm_engine import LLMEngine  # noqa: E402


def count_evictions(engine: LLMEngine) -> Callable[[], int]:
    """Count the cached blocks the pool's ``allocate`` evicts (it only ever uncaches: the
    drop in ``num_cached_blocks`` across a call, cascaded descendants included); returns a
    reader of the count. A wrapper on the pool instance, as ``Clocks`` wraps methods."""
    pool = engine.scheduler.kv.pool
    inner = pool.allocate
    evicted = [0]

    def allocate(num_blocks: int) -> list:
        before = pool.num_cached_blocks
        try:
            return inner(num_blocks)
        finally:
            evicted[0] += before - pool.num_cached_blocks

    pool.allocate = allocate
    return lambda: evicted[0]


class Clocks:
    """Wall seconds, the calling thread's CPU seconds and calls per timed method (a wrapper
    costs about a microsecond a call)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)  # time.thread_time: waits not counted
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: object, name: str, label: str | None = None) -> None:
        """Replace the instance attribute ``owner.name`` with a timed call, counted under
        ``label`` (default: ``name``)."""
        inner: Callable = getattr(owner, name)
        key = name if label is None else label

        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.cpu[key] += time.thread_time() - cpu
                self.seconds[key] += time.perf_counter() - start
                self.calls[key] += 1

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.cpu.clear()
        self.calls.clear()


def run_round(
    engine: LLMEngine, rng: random.Random, count: int, shared: list[int], tag: str
) -> tuple[int, int]:
    """Queue ``count`` requests and run them all to the end; returns (engine steps,
    outputs)."""
    vocab = engine.model_config.vocab_size
    for i in range(count):
        length = rng.randint(8, 200)
        prompt = shared + [rng.randrange(3, vocab) for _ in range(length - len(shared))]
        params = SamplingParams(max_tokens=rng.randint(8, 100), temperature=0.0, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps = outputs = 0
    while engine.has_unfinished():
        outputs += len(engine.step())
        steps += 1
    return steps, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=4, help="requests measured: rounds x requests"
    )
    parser.add_argument("--requests", type=int, default=256, help="per round")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--shared-prefix", type=int, default=0, help="leading prompt tokens all requests share"
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="KV cache bytes; small enough that allocations evict cached blocks (see above)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        from tests.tiny_models import save_tiny_model

        model = save_tiny_model("llama", Path(tmp) / "tiny-llama", max_position_embeddings=1024)
        engine = LLMEngine(
            EngineConfig(
                model=str(model),
                device="cpu",
                async_scheduling=True,
                max_num_seqs=args.max_num_seqs,
                kv_cache_memory=args.kv_cache_memory,
            )
        )
        num_blocks = engine.scheduler.kv.num_blocks
        evictions = count_evictions(engine)
        shared = [
            rng.randrange(3, engine.model_config.vocab_size) for _ in range(args.shared_prefix)
        ]
        clocks = Clocks()
        for name in ("schedule", "_admit", "_finish_ended"):
            clocks.wrap(engine.scheduler, name)
        for name in ("_process", "_finish"):
            clocks.wrap(engine, name)
        # as LLM runs it: no full collection (~250 ms here) lands in a timed function
        with frozen_heap():
            run_round(engine, rng, args.requests, shared, "warm")
            clocks.clear()
            evicted_before = evictions()
            start = time.perf_counter()
            steps, outputs = run_round(engine, rng, args.rounds * args.requests, shared, "run")
            seconds = time.perf_counter() - start
            evicted = evictions() - evicted_before
    engine.close()
    us, requests = clocks.seconds, args.rounds * args.requests
    if outputs != requests:
        raise RuntimeError(f"{outputs} outputs for {requests} requests")
    print(
        json.dumps(
            {
                "requests": requests,
                "steps": steps,
                "num_blocks": num_blocks,
                "evicted_blocks": evicted,
                "admit_us": round(us["_admit"] * 1e6 / requests, 1),
                "finish_us": round((us["_finish_ended"] + us["_finish"]) * 1e6 / requests, 1),
                "schedule_rest_us": round((us["schedule"] - us["_admit"]) * 1e6 / steps, 1),
                "process_rest_us": round(
                    (us["_process"] - us["_finish_ended"] - us["_finish"]) * 1e6 / steps, 1
                ),
                "wall_s": round(seconds, 2),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
