"""list_input_files: files, directories (recursive), globs, and missing paths."""

from __future__ import annotations

import re

import pytest

from tokenmill.io.readers import InputConfig, list_input_files
from tokenmill.io.readers.file_listing import display_names, warn_hidden_matches


def _touch(path, text="{}\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_single_file(tmp_path):
    f = _touch(tmp_path / "in.jsonl")
    assert list_input_files(InputConfig(path=str(f))) == [str(f)]


def test_directory_is_recursive_sorted_and_skips_markers(tmp_path):
    for name in ["b.jsonl", "a.parquet", "sub/c.ndjson", "x.json", "notes.txt", "_SUCCESS",
                 ".hidden.jsonl", "_temporary/part-0.jsonl", "sub/.a.jsonl.crc", "README.md",
                 "sub/README.txt", "LICENSE", "card.yaml", "look.ipynb", "authors.jsonl",
                 "license.parquet", "readme.jsonl.gz"]:  # fmt: skip
        _touch(tmp_path / name)
    found = list_input_files(InputConfig(path=str(tmp_path)))
    names = [p[len(str(tmp_path)) + 1 :] for p in found]
    # notes.txt is listed: its format is input.format's to say (auto refuses it by name);
    # documentation (README.*, LICENSE, .md, .yaml, .ipynb) is left out with a warning,
    # never a data file whatever its name (a table export's authors.jsonl)
    assert names == ["a.parquet", "authors.jsonl", "b.jsonl", "license.parquet", "notes.txt",
                     "readme.jsonl.gz", "sub/c.ndjson", "x.json"]  # fmt: skip


def test_glob_keeps_every_match_sorted(tmp_path):
    for name in ["p2.jsonl", "p1.jsonl", "q.jsonl"]:
        _touch(tmp_path / name)
    found = list_input_files(InputConfig(path=str(tmp_path / "p*.jsonl")))
    assert found == [str(tmp_path / "p1.jsonl"), str(tmp_path / "p2.jsonl")]


def test_file_url_keeps_protocol(tmp_path):
    f = _touch(tmp_path / "in.jsonl")
    assert list_input_files(InputConfig(path=f"file://{f}")) == [f"file://{f}"]


@pytest.mark.parametrize(
    ("relative", "message"),
    [
        ("missing.jsonl", "does not exist"),
        ("nothing*.jsonl", "matches no files"),
        ("empty", "no files in it"),
    ],
)
def test_nothing_found_names_the_path(tmp_path, relative, message):
    (tmp_path / "empty").mkdir()
    _touch(tmp_path / "empty" / "_SUCCESS")
    _touch(tmp_path / "empty" / ".hidden.jsonl")
    path = str(tmp_path / relative)
    with pytest.raises(FileNotFoundError, match=message) as e:
        list_input_files(InputConfig(path=path))
    assert path in str(e.value)


@pytest.mark.parametrize("relative", ["data/missing.jsonl", "data/nothing*.jsonl"])
def test_a_relative_path_not_found_says_where_it_was_looked_for(tmp_path, monkeypatch, relative):
    """Run from another directory (cron, Airflow), the message named only data/in.jsonl and
    not the working directory it was looked for under."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        list_input_files(InputConfig(path=relative))
    assert str(tmp_path / relative) in str(e.value)
    assert "working directory" in str(e.value)


def test_display_names_are_relative_to_the_common_directory():
    assert display_names(["/d/a.jsonl"]) == ["a.jsonl"]
    assert display_names(["s3://b/p/a.jsonl", "s3://b/p/c.jsonl"]) == ["a.jsonl", "c.jsonl"]
    assert display_names(["/d/x/part-0.jsonl", "/d/y/part-0.jsonl"]) == [
        "x/part-0.jsonl",
        "y/part-0.jsonl",
    ]


def test_display_names_of_urls_differing_only_in_their_query_differ():
    """An HTTP folder listing two versions of one object (``rows.jsonl?versionId=1``, ``=2``):
    with their queries left out (a signature must not land in row ids) both were
    ``rows.jsonl``, so the second file's rows, given the same ``rows.jsonl:<line>`` ids, were
    all refused as duplicates. The later ones are numbered; no query value is shown."""
    urls = [
        "https://h/d/rows.jsonl?versionId=1&sig=S3CR1",
        "https://h/d/rows.jsonl?versionId=2&sig=S3CR2",
        "https://h/d/other.jsonl?sig=S3CR3",
    ]
    names = display_names(urls)
    assert names == ["rows.jsonl", "rows.jsonl~2", "other.jsonl"]
    assert not any("S3CR" in n or "versionId" in n for n in names)
    # a real file of the numbered name keeps it; the copy takes the next free one
    assert display_names(["/d/a.jsonl~2", "/d/b.jsonl"]) == ["a.jsonl~2", "b.jsonl"]
    taken = ["https://h/a.jsonl?v=1", "https://h/a.jsonl?v=2", "https://h/a.jsonl~2"]
    assert display_names(taken) == ["a.jsonl", "a.jsonl~3", "a.jsonl~2"]


def test_a_glob_keeps_links_to_files_and_dangling_links(tmp_path):
    """Links matched by a glob are files to read (their rows went missing without a word);
    a dangling one is kept so that reading it fails naming it; a link to a folder is not."""
    _touch(tmp_path / "in" / "a.jsonl")
    _touch(tmp_path / "elsewhere" / "b.jsonl")
    (tmp_path / "elsewhere" / "sub").mkdir()
    (tmp_path / "in" / "b.jsonl").symlink_to(tmp_path / "elsewhere" / "b.jsonl")
    (tmp_path / "in" / "c.jsonl").symlink_to(tmp_path / "elsewhere" / "gone.jsonl")
    (tmp_path / "in" / "d.jsonl").symlink_to(tmp_path / "elsewhere" / "sub")
    found = list_input_files(InputConfig(path=str(tmp_path / "in" / "*.jsonl")))
    assert [p.rsplit("/", 1)[1] for p in found] == ["a.jsonl", "b.jsonl", "c.jsonl"]


def test_a_folder_reads_the_files_below_its_links_to_folders(tmp_path):
    """fsspec's find listed a link to a folder (``latest -> v3/``) as a file: the job
    failed on it ("cannot tell the format of .../more", or "Is a directory" with a format
    set); now its files are read as find -L and Spark read them, and a link back to a
    folder holding it is refused by name."""
    _touch(tmp_path / "in" / "a.jsonl")
    _touch(tmp_path / "elsewhere" / "sub" / "b.jsonl")
    (tmp_path / "in" / "more").symlink_to(tmp_path / "elsewhere")
    found = list_input_files(InputConfig(path=str(tmp_path / "in")))
    assert found == [str(tmp_path / "in" / "a.jsonl"), str(tmp_path / "in/more/sub/b.jsonl")]
    (tmp_path / "elsewhere" / "sub" / "up").symlink_to(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}/in/more/sub/up is a link to a")):
        list_input_files(InputConfig(path=str(tmp_path / "in")))


def test_a_glob_matches_files_below_links_to_folders_as_a_folder_input_does(tmp_path):
    """fsspec's glob never entered a link to a folder: ``in/**`` and ``in/*/*.jsonl`` left
    out ``in/more/b.jsonl`` (``more -> ../other/``) without a word, where the folder input
    and Python's glob read it; a link to a folder holding it is refused by name, once the
    pattern reaches below it."""
    _touch(tmp_path / "in" / "a.jsonl")
    _touch(tmp_path / "other" / "b.jsonl")
    _touch(tmp_path / "other" / ".h" / "c.jsonl")
    (tmp_path / "in" / "more").symlink_to("../other")
    folder = list_input_files(InputConfig(path=str(tmp_path / "in")))
    everything = sorted([*folder, str(tmp_path / "in/more/.h/c.jsonl")])  # (a glob keeps those)
    assert list_input_files(InputConfig(path=str(tmp_path / "in" / "**"))) == everything
    assert list_input_files(InputConfig(path=str(tmp_path / "in/**/*.jsonl"))) == everything
    below = list_input_files(InputConfig(path=str(tmp_path / "in/*/*.jsonl")))
    assert below == [str(tmp_path / "in/more/b.jsonl")]
    assert list_input_files(InputConfig(path=str(tmp_path / "*/m*/*"))) == below
    (tmp_path / "other" / "up").symlink_to(tmp_path)
    assert list_input_files(InputConfig(path=str(tmp_path / "in/*/*.jsonl"))) == below
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}/in/more/up is a link to a")):
        list_input_files(InputConfig(path=str(tmp_path / "in" / "**")))


def test_a_file_a_link_names_twice_is_listed_once_with_a_warning(tmp_path, caplog):
    """``latest -> v3/`` beside ``v3/`` (and a link to a file beside it) listed one file
    under each name: its rows were read two or three times, each copy in the output (or,
    with ids, every later copy's rows duplicate-id errors). The file's own path is kept."""
    real = _touch(tmp_path / "in" / "v3" / "a.jsonl")
    other = _touch(tmp_path / "in" / "v3" / "b.jsonl")
    (tmp_path / "in" / "latest").symlink_to("v3")
    (tmp_path / "in" / "c.jsonl").symlink_to("v3/a.jsonl")
    _touch(tmp_path / "elsewhere" / "d.jsonl")
    (tmp_path / "in" / "d1.jsonl").symlink_to(tmp_path / "elsewhere" / "d.jsonl")
    (tmp_path / "in" / "d2.jsonl").symlink_to(tmp_path / "elsewhere" / "d.jsonl")
    once = [str(real), str(other), str(tmp_path / "in" / "d1.jsonl")]
    with caplog.at_level("WARNING", logger="tokenmill.io.readers.file_listing"):
        assert list_input_files(InputConfig(path=str(tmp_path / "in"))) == sorted(once)
    assert "left out 4 file(s) that a link makes a second name of a file" in caplog.text
    assert f"{tmp_path}/in/latest/a.jsonl is {real}" in caplog.text
    assert list_input_files(InputConfig(path=str(tmp_path / "in/**/*.jsonl"))) == sorted(once)


def test_an_existing_file_whose_name_looks_like_a_glob_is_that_file(tmp_path):
    wanted = _touch(tmp_path / "batch[1].jsonl")
    _touch(tmp_path / "batch1.jsonl")  # what the pattern batch[1] matches
    assert list_input_files(InputConfig(path=str(wanted))) == [str(wanted)]


@pytest.mark.parametrize(
    ("log_file", "kind"),
    [
        ("_delta_log/00000000000000000001.json", "a Delta Lake table's (a folder with _delta_log/"),
        ("metadata/v2.metadata.json", "an Iceberg table's (a folder with metadata/*.metadata"),
    ],
)
@pytest.mark.parametrize("given", ["table", "parent", "glob", "partition", "file"])
def test_a_tables_files_are_refused(tmp_path, log_file, kind, given):
    """A Delta Lake table's folder read as Parquet ran the rows the table had deleted or
    overwritten (9 rows of a 2-row table), with no word: only its log tells them apart. The
    table found whether the path is its folder, a folder above it, a glob, a partition
    folder or one file of it."""
    _touch(tmp_path / "lake" / "t" / "date=1" / "part-0.parquet")
    _touch(tmp_path / "lake" / "t" / log_file)
    path = {
        "table": "lake/t",
        "parent": "lake",
        "glob": "lake/*/*/*.parquet",
        "partition": "lake/t/date=1",
        "file": "lake/t/date=1/part-0.parquet",
    }[given]
    with pytest.raises(ValueError, match=re.escape(f"its files are {kind}")):
        list_input_files(InputConfig(path=str(tmp_path / path)))


def test_a_folder_named_metadata_is_not_a_table(tmp_path):
    _touch(tmp_path / "in" / "metadata" / "notes.json")
    _touch(tmp_path / "in" / "part-0.jsonl")
    found = list_input_files(InputConfig(path=str(tmp_path / "in")))
    assert [p.rsplit("/", 1)[1] for p in found] == ["notes.json", "part-0.jsonl"]


def test_a_glob_matching_hidden_folders_says_so(tmp_path, caplog, monkeypatch):
    """A ** glob kept .ipynb_checkpoints/ (a stale copy of the data) and Spark's _temporary/,
    which a folder input leaves out: it still does, and the checks before a run say so."""
    for name in ["part-0.jsonl", ".ipynb_checkpoints/part-0-checkpoint.jsonl"]:
        _touch(tmp_path / name)
    cfg = InputConfig(path=str(tmp_path / "**" / "*.jsonl"))
    found = list_input_files(cfg)
    assert len(found) == 2
    with caplog.at_level("WARNING"):
        warn_hidden_matches(cfg, found)
    assert "matches 1 file(s) below a name starting with '.' or '_'" in caplog.text
    assert ".ipynb_checkpoints/part-0-checkpoint.jsonl" in caplog.text
    caplog.clear()
    monkeypatch.chdir(tmp_path.parent)  # a relative pattern: its matches are absolute paths
    cfg = InputConfig(path=f"{tmp_path.name}/**/*.jsonl")
    with caplog.at_level("WARNING"):
        warn_hidden_matches(cfg, list_input_files(cfg))
    assert "matches 1 file(s) below a name starting with '.' or '_'" in caplog.text
    caplog.clear()
    cfg = InputConfig(path=str(tmp_path / "*.jsonl"))
    with caplog.at_level("WARNING"):
        warn_hidden_matches(cfg, list_input_files(cfg))
    assert not caplog.text


def test_a_request_the_http_client_refuses_is_not_a_missing_file():
    """A URL with a password beside an Authorization header: aiohttp refuses to send the
    request and fsspec's HTTP ``info`` turns that into FileNotFoundError, so the job said
    "input.path ... does not exist" (an audit). It says the client refused, secrets masked;
    no request leaves (port 9: nothing listens there, and it is never asked)."""
    cfg = InputConfig(
        path="http://alice:pw-SECRET@127.0.0.1:9/rows.jsonl",
        storage_options={"headers": {"Authorization": "Bearer x"}},
    )
    with pytest.raises(ValueError, match="the storage client refused the request") as err:
        list_input_files(cfg)
    assert "Cannot combine AUTHORIZATION header" in str(err.value)
    assert "pw-SECRET" not in str(err.value) and "does not exist" not in str(err.value)


def test_a_partition_folder_starting_with_an_underscore_is_read_as_spark_reads_it(tmp_path):
    """Spark leaves out names starting with "_" unless they hold "=": a Hive partition of a
    column named _col (``_col=1/``) is data. Its files were left out as hidden, rows lost
    without a word; ``_SUCCESS`` and ``_temporary/`` still are."""
    for name in ["_col=1/part-0.jsonl", "_col=2/part-0.jsonl", "_temporary/part-0.jsonl",
                 "_col=3/_SUCCESS", "_col=3/.part-0.jsonl.crc", "_SUCCESS"]:  # fmt: skip
        _touch(tmp_path / name)
    found = list_input_files(InputConfig(path=str(tmp_path)))
    assert [f[len(str(tmp_path)) + 1 :] for f in found] == [
        "_col=1/part-0.jsonl",
        "_col=2/part-0.jsonl",
    ]
