"""A password written into an input, output or model URL is never shown: not in error files,
the dry run, messages, logs or the report; a refused password exits 2, not 75."""

from __future__ import annotations

import base64
import functools
import http.server
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jobs.job_helpers import read_jsonl_dir
from tokenmill.io.url_secrets import HideUrlSecrets, hide_url_secrets
from tokenmill.jobs.cli import main as cli_main

SECRET = "S3CRETPW"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("http://alice:pw@h:1/a.jsonl:2: bad", "http://alice:***@h:1/a.jsonl:2: bad"),
        ("see 'https://TOKEN@github.com/x'", "see 'https://***@github.com/x'"),
        ("model https:/u:pw@hf.co/m", "model https:/u:***@hf.co/m"),  # a path-normalized URL
        ("s3://bucket/a@b.jsonl and mail a@b.c", "s3://bucket/a@b.jsonl and mail a@b.c"),
        ("http://u:p@h/x and http://v:q@k/y", "http://u:***@h/x and http://v:***@k/y"),
        ("http://h/x failed for a@b", "http://h/x failed for a@b"),
        # A secret runs to the "@" before the host, whatever it holds: an AWS secret key's
        # "/", a quote, a space or an "@" (each showed the secret, whole or in part)
        ("'s3://AKIAK:SEC/RET@inb/in.jsonl' failed", "'s3://***@inb/in.jsonl' failed"),
        ("'http://alice:SE'C@h:1/in.jsonl' x", "'http://alice:***@h:1/in.jsonl' x"),
        ('"http://alice:SE"C@h/in.jsonl"', '"http://alice:***@h/in.jsonl"'),
        ("http://alice:SE C@h/in.jsonl:2: bad", "http://alice:***@h/in.jsonl:2: bad"),
        ("http://alice:SE@C@h/in.jsonl:2: bad", "http://alice:***@h/in.jsonl:2: bad"),
        ("file://u:pw@localhost/tmp/o", "file://***@localhost/tmp/o"),
        # A presigned URL's query string holds its signature, key id and session token
        (
            "https://b.s3.amazonaws.com/a.jsonl?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=5e1"
            "&X-Amz-Security-Token=IQo+b/c= failed",
            "https://b.s3.amazonaws.com/a.jsonl?X-Amz-Credential=***&X-Amz-Signature=***"
            "&X-Amz-Security-Token=*** failed",
        ),
        ("'http://u:pw@h/a.jsonl?sig=S3CR'", "'http://u:***@h/a.jsonl?sig=***'"),
        ("http://h/a.jsonl?TOKEN:2: bad", "http://h/a.jsonl?***:2: bad"),  # a row's source
        ("http://h/a.jsonl?sig=S:2: bad", "http://h/a.jsonl?sig=***:2: bad"),
        ("s3://bucket/a?b.jsonl:2: bad", "s3://bucket/a?b.jsonl:2: bad"),  # an object's name
    ],
)
def test_url_secrets_are_masked(text: str, shown: str) -> None:
    assert hide_url_secrets(text) == shown


def test_log_records_leave_masked(caplog: pytest.LogCaptureFixture) -> None:
    caplog.handler.addFilter(HideUrlSecrets())
    log = logging.getLogger("tokenmill.test")
    try:
        raise OSError("http://u:pw@h/x failed")
    except OSError:
        log.exception("reading %s", "http://u:pw@h/x")
    assert "pw" not in caplog.text and "u:***@h" in caplog.text


class _Auth(http.server.SimpleHTTPRequestHandler):
    def do_GET(self) -> None:
        want = "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()
        if self.headers.get("Authorization") == want:
            super().do_GET()
        else:
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    """An http://127.0.0.1 server with basic auth over a folder holding ``rows.jsonl`` (its
    second line bad); yields its address."""
    folder = tmp_path / "srv"
    folder.mkdir()
    (folder / "rows.jsonl").write_text('{"prompt": "hello"}\n{"prompt": "x", "bad": \n')
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Auth, directory=str(folder))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _run(model: Path | str, url: str, out: Path | str, *extra: str) -> int:
    return cli_main([
        "--model", str(model), "--input", url, "--output", str(out), "--quiet",
        "--set", "input.id_column=null", "--set", "sampling.max_tokens=2", *extra,
    ])  # fmt: skip


def test_a_password_in_the_input_url_stays_out_of_what_the_job_writes_and_says(
    tiny_model: Path, tmp_path: Path, served: str, capfd: pytest.CaptureFixture[str]
) -> None:
    url = f"http://alice:{SECRET}@{served}/rows.jsonl"
    assert _run(tiny_model, url, tmp_path / "dry", "--dry-run") == 0
    assert _run(tiny_model, url, tmp_path / "out") == 0
    errors = read_jsonl_dir(tmp_path / "out" / "errors")
    assert [e["error"].split(": ")[0] for e in errors] == [
        f"http://alice:***@{served}/rows.jsonl:2"
    ]
    text = capfd.readouterr()
    written = b"".join(p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert SECRET not in text.out + text.err and SECRET.encode() not in written
    assert "alice:***@" in text.out  # the dry run names the bad row, password masked


def test_a_presigned_urls_signature_and_token_stay_out_of_what_the_job_writes_and_says(
    tiny_model: Path, tmp_path: Path, served: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """The row ids built from the file's name, the dry run's bad-row lines, the error files
    and the messages showed a presigned URL's query string whole: its signature, access key
    id and STS session token (an audit)."""
    query = f"X-Amz-Credential=AKIAKEYID&X-Amz-Signature={SECRET}&X-Amz-Security-Token=TOKN"
    url = f"http://alice:{SECRET}@{served}/rows.jsonl?{query}"
    # No input.format: the name without its query says JSONL (it was "cannot tell the
    # format"), and the "?" starts no pattern (an unreachable host "matched no files", 2).
    assert _run(tiny_model, url, tmp_path / "dry", "--dry-run") == 0
    assert _run(tiny_model, url, tmp_path / "out") == 0
    gone = url.replace(f"{served}/", "127.0.0.1:1/")  # a store that cannot be reached
    assert _run(tiny_model, gone, tmp_path / "gone") == 75
    errors = read_jsonl_dir(tmp_path / "out" / "errors")
    shown = "X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Security-Token=***"
    assert [e["error"].split(": ")[0] for e in errors] == [
        f"http://alice:***@{served}/rows.jsonl?{shown}:2"
    ]
    text = capfd.readouterr()
    said = text.out + text.err
    written = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    for secret in (SECRET, "AKIAKEYID", "TOKN"):
        assert secret not in said and secret.encode() not in written, secret
    assert f"rows.jsonl?{shown}:2" in text.out  # the dry run names the bad row
    assert f"127.0.0.1:1/rows.jsonl?{shown}'" in text.err
    assert {e["id"] for e in errors} == {"rows.jsonl:2"}


def test_a_refused_password_exits_2_without_showing_it(
    tiny_model: Path, tmp_path: Path, served: str, capfd: pytest.CaptureFixture[str]
) -> None:
    wrong = _run(tiny_model, f"http://alice:{SECRET[::-1]}@{served}/rows.jsonl", tmp_path / "o")
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hello"}\n')
    out = _run(tiny_model, str(src), f"http://bob:{SECRET}@{served}/out")
    model = _run(f"https://user:{SECRET}@hf.co/org/m", str(src), tmp_path / "o")
    assert (wrong, out, model) == (2, 2, 2)
    err = capfd.readouterr().err
    assert (
        SECRET not in err
        and "alice:***@" in err
        and "bob:***@" in err
        and "can only be read" in err
    )


def test_credentials_in_an_object_store_url_are_refused_up_front_and_masked(
    tiny_model: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """s3fs took ``key:secret@bucket`` for a bucket name and repeated it in its error, the
    secret unmasked, and the run exited 75 (retry) for what no retry fixes."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hello"}\n')
    codes = (
        _run(tiny_model, f"s3://AKIAKEY:{SECRET}@bucket/in.jsonl", tmp_path / "o"),
        _run(tiny_model, str(src), f"gs://AKIAKEY:{SECRET}@bucket/out"),
        # An AWS secret key holding "/": it was not seen as credentials, and s3fs's error
        # (exit 75) showed the key and the secret.
        _run(tiny_model, f"s3://AKIAKEY:{SECRET}/x@bucket/in.jsonl", tmp_path / "o"),
        # A local file takes none: the folder was made, named with the password.
        _run(tiny_model, str(src), f"file://u:{SECRET}@localhost{tmp_path}/o2"),
    )
    assert codes == (2, 2, 2, 2)
    err = capfd.readouterr().err
    assert SECRET not in err and "AKIAKEY" not in err
    assert "input.path 's3://***@bucket/in.jsonl' carries credentials" in err
    assert "output.path 'gs://***@bucket/out' carries credentials" in err
    assert "output.storage_options" in err
    assert "which file:// does not take (a local file has none)" in err
