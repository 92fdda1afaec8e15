"""How long ``Manifest.load`` takes over a journal of many records, on S3 (moto) or locally.

A 64,000-shard job keeps up to 1,000 records in its manifest's journal
(``<job>.manifest.d/<shard>.json``) between compactions; every ``run-job`` start, resume,
status or dry run loads them all. This builds such an output, the manifest file holding
``--shards`` records and the journal ``--records`` more, then times ``Manifest.load`` and
counts the S3 requests it makes, by operation (s3fs's ``_call_s3``: one a request sent,
botocore's own retries not counted).

S3 is moto's threaded server on 127.0.0.1, started here in this process (its request
handling then shares the GIL with the client: ~9 ms a GET), or ``--endpoint``, one started
apart (``python -m moto.server -p 5000``: ~1.5 ms a GET); a real object store takes 10-50
ms a GET. ``--latency-ms`` adds that much to
every request (an ``asyncio.sleep`` before it is sent, which overlaps as real network waits
do) to see what the load costs against one.

    PYTHONPATH=. .venv/bin/python bench/manifest_load.py [--records 1000] [--shards 64000]
        [--latency-ms 0] [--repeats 3] [--store s3|local] [--endpoint http://127.0.0.1:5000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import statistics
import tempfile
import time
from collections import Counter
from typing import Any

from bench.moto_env import MOTO_ENV
from tokenmill.io.storage import OutputStore
from tokenmill.jobs.manifest import Manifest, ShardRecord

JOB = "bench"


def record(index: int) -> ShardRecord:
    return ShardRecord(
        first_row=index * 1000,
        end_row=(index + 1) * 1000,
        ok=1000,
        errors=0,
        data=f"shards/part-{index:05d}.parquet",
        error_file=None,
        data_bytes=123_456,
        error_bytes=None,
    )


def build(store: OutputStore, shards: int, records: int) -> None:
    """The manifest file with ``shards - records`` records, the journal the last ``records``."""
    manifest = Manifest(job=JOB, fingerprint="f" * 64, rows_per_shard=1000)
    for index in range(shards - records):
        manifest.shards[index] = record(index)
    manifest.save(store)
    journal = {
        manifest._journal_entry(i): json.dumps(vars(record(i))).encode()
        for i in range(shards - records, shards)
    }
    if store.is_local:
        for name, data in journal.items():
            store.write_atomic(name, data)
    else:  # one concurrent upload: building is not what is measured
        store.fs.pipe({store._fs_path(name): data for name, data in journal.items()})


def count_requests(latency_s: float) -> Counter[str]:
    """Count every S3 request s3fs sends from now on by operation, each delayed by
    ``latency_s``."""
    import s3fs.core

    counts: Counter[str] = Counter()
    call = s3fs.core.S3FileSystem._call_s3

    async def counting_call(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        counts[method] += 1
        if latency_s:
            await asyncio.sleep(latency_s)
        return await call(self, method, *args, **kwargs)

    s3fs.core.S3FileSystem._call_s3 = counting_call
    return counts


def time_loads(url: str, options: dict[str, Any], repeats: int, shards: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        store = OutputStore(url, options)  # a new filesystem each time: nothing cached
        started = time.perf_counter()
        manifest = Manifest.load(store, JOB)
        seconds.append(time.perf_counter() - started)
        if manifest is None or sorted(manifest.shards) != list(range(shards)):
            raise SystemExit("the loaded manifest does not hold every shard")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1000, help="journal records")
    parser.add_argument("--shards", type=int, default=64_000, help="shards in all")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="added to each request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--store", choices=("s3", "local"), default="s3")
    parser.add_argument("--endpoint", help="an S3 (moto) already running, instead of one here")
    args = parser.parse_args()
    if not 0 < args.records <= args.shards:
        parser.error("--records must be between 1 and --shards")

    if args.store == "local":
        with tempfile.TemporaryDirectory(prefix="manifest-load-") as tmp:
            build(OutputStore(os.path.join(tmp, "out")), args.shards, args.records)
            seconds = time_loads(os.path.join(tmp, "out"), {}, args.repeats, args.shards)
        print(json.dumps({"store": "local", "records": args.records, "seconds": seconds}))
        return 0

    os.environ.update(MOTO_ENV)  # moto only
    os.environ.pop("AWS_PROFILE", None)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = None
    endpoint = args.endpoint
    if endpoint is None:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
    try:
        options = {
            "endpoint_url": endpoint,
            "key": "testing",
            "secret": "testing",
            "skip_instance_cache": True,
        }
        url = f"s3://manifest-load-{secrets.token_hex(4)}/out"
        store = OutputStore(url, options)
        store.fs.mkdir(store.root.split("/")[0])
        build(store, args.shards, args.records)
        counts = count_requests(args.latency_ms / 1000)
        seconds = time_loads(url, options, args.repeats, args.shards)
    finally:
        if server is not None:
            server.stop()
    result = {
        "store": "s3 (moto, in this process)" if server else f"s3 ({endpoint})",
        "records": args.records,
        "latency_ms": args.latency_ms,
        "seconds": [round(s, 3) for s in seconds],
        "median_s": round(statistics.median(seconds), 3),
        "requests_per_load": {k: v // args.repeats for k, v in sorted(counts.items())},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
