"""An http(s) input whose server sends no Content-Length (a streamed or generated response):
fsspec then knows no size and its file claims to seek but cannot. Such a run failed with exit
1 ("rerun to resume", which could never help), and a plain .jsonl one at preflight (exit 2,
"Cannot seek streaming HTTP file")."""

from __future__ import annotations

import functools
import gzip
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jobs.job_helpers import read_jsonl_dir
from tokenmill.io.readers.input_fingerprint import EDGE_BYTES, _file_entry
from tokenmill.jobs.cli import main as cli_main

BIG_ROWS = 2_000  # ~1.5 MiB: past the fingerprint's first and last MiB
ROWS = 60  # for the jobs


class _NoLength(http.server.SimpleHTTPRequestHandler):
    """Serves the folder's files as HTTP/1.0 responses without a Content-Length."""

    def do_GET(self) -> None:
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if self.command == "GET":
            try:
                self.wfile.write(path.read_bytes())
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client read what it wanted (the head of a file) and left

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


class _Plain(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def _serve(handler: type, folder: Path) -> tuple[http.server.HTTPServer, str]:
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(folder))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(no-length server, normal server) over a folder with big.jsonl(.gz) and
    rows.jsonl(.gz)."""
    folder = tmp_path / "srv"
    folder.mkdir()
    for name, rows, pad in (("big", BIG_ROWS, "x" * 700), ("rows", ROWS, "")):
        lines = [json.dumps({"prompt": f"row {i} {pad}"}) for i in range(rows)]
        data = ("\n".join(lines) + "\n").encode()
        (folder / f"{name}.jsonl").write_bytes(data)
        (folder / f"{name}.jsonl.gz").write_bytes(gzip.compress(data))
    assert (folder / "big.jsonl").stat().st_size > EDGE_BYTES
    started = [_serve(_NoLength, folder), _serve(_Plain, folder)]
    yield started[0][1], started[1][1]
    for server, _ in started:
        server.shutdown()


def test_the_fingerprint_is_the_same_with_or_without_a_length(
    servers: tuple[str, str],
) -> None:
    no_length, plain = servers
    for name in ("big.jsonl", "big.jsonl.gz", "rows.jsonl"):
        streamed, _ = _file_entry(f"{no_length}/{name}", {})
        sized, _ = _file_entry(f"{plain}/{name}", {})
        assert streamed[1:] == sized[1:]  # size, head and tail hashes (the URLs differ)


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz"])
def test_a_job_reads_an_http_input_sent_without_a_length(
    tiny_model: Path, tmp_path: Path, servers: tuple[str, str], name: str
) -> None:
    url = f"{servers[0]}/{name}"
    out = tmp_path / "out"
    common = ["--model", str(tiny_model), "--input", url, "--output", str(out), "--quiet"]
    settings = ["--set", "sampling.max_tokens=1", "--set", "output.format=jsonl"]
    assert cli_main([*common, "--dry-run"]) == 0
    assert cli_main([*common, *settings]) == 0
    assert len(read_jsonl_dir(out / "shards")) == ROWS
    assert cli_main([*common, *settings]) == 0  # the same fingerprint: resumes, all done
    assert len(read_jsonl_dir(out / "shards")) == ROWS
