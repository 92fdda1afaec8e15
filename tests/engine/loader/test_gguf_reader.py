"""tokenmill's GGUF reader against the gguf package's own: the same metadata values and
types, the same tensor table and data, on tiny files of every architecture and block type
and on the embedded SmolLM2; damaged files are refused."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.engine.loader.cases import TINY_CASES
from tests.engine.loader.tiny_gguf import tokenizer_metadata, write_tiny_gguf
from tokenmill.engine.loader.gguf_reader import read_gguf
from tokenmill.engine.loader.model_source import resolve_model_source

TinyPath = Callable[[str], Path]


def _assert_same(path: Path) -> None:
    ours, ref = read_gguf(path), gguf.GGUFReader(path)
    want = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert sorted(ours.fields) == sorted(want)
    for key, field in want.items():
        got = ours.fields[key]
        assert got.types == field.types, key
        assert got.contents() == field.contents(), key
    assert ours.data_offset == ref.data_offset
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(b.shape))
        assert (a.data_offset, a.n_bytes) == (b.data_offset, b.n_bytes), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize("case", TINY_CASES)
def test_tiny_files_read_as_the_gguf_package_reads_them(case: str, tiny_gguf: TinyPath) -> None:
    _assert_same(tiny_gguf(case))


@pytest.mark.parametrize("linear_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_types_and_tokenizer_arrays(
    linear_type: str, tiny_hf_dir: TinyPath, tmp_path: Path
) -> None:
    hf = tiny_hf_dir("llama")
    path = write_tiny_gguf(hf, tmp_path / "t.gguf", extra=tokenizer_metadata(hf),
                           linear_type=linear_type)  # fmt: skip
    _assert_same(path)


def test_the_embedded_model_reads_as_the_gguf_package_reads_it() -> None:
    _assert_same(resolve_model_source("smollm2-135m-instruct").path)


def test_damaged_files_are_refused(tiny_gguf: TinyPath, tmp_path: Path) -> None:
    data = tiny_gguf("llama").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ValueError, match="ends inside its header"):
        read_gguf(cut)
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:-100])  # the last tensor's bytes are missing
    with pytest.raises(ValueError, match=r"tensor .* needs bytes"):
        read_gguf(short)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="does not start with GGUF"):
        read_gguf(other)


def _header(fields: list[tuple[str, int, bytes]]) -> bytes:
    """A GGUF v3 header with no tensors and ``fields`` (name, value type, encoded value)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields))
    for name, vtype, value in fields:
        out += struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", vtype) + value
    return out


@pytest.mark.parametrize("align", [0, -32, 48])
def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path: Path, align: int) -> None:
    path = tmp_path / "align.gguf"
    path.write_bytes(_header([("general.alignment", 5, struct.pack("<i", align))]))  # INT32
    with pytest.raises(ValueError, match="power of two"):
        read_gguf(path)


def test_deeply_nested_metadata_arrays_are_refused(tmp_path: Path) -> None:
    array, uint8 = 9, 0
    nested = struct.pack("<IQ", uint8, 1) + b"\x07"
    for _ in range(10_000):
        nested = struct.pack("<IQ", array, 1) + nested
    path = tmp_path / "nested.gguf"
    path.write_bytes(_header([("x", array, nested)]))
    with pytest.raises(ValueError, match="nested over"):
        read_gguf(path)


def _with_tensors(
    tensors: list[tuple[str, tuple[int, ...], int]], data: int = 256, kind: int = 0
) -> bytes:
    """A GGUF v3 file of tensors (name, dims, offset) of type ``kind`` (0: f32) and ``data``
    bytes of data."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 0)
    for name, dims, offset in tensors:
        out += struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset)
    return out + b"\0" * (-len(out) % 32) + b"\0" * data


def test_metadata_of_millions_of_arrays_is_refused_before_it_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header of 5 million empty arrays (60 MB) took 22 s and 730 MB to read; the items
    are counted (here against a cap of 1,000) before any is made."""
    from tokenmill.engine.loader import gguf_reader

    monkeypatch.setattr(gguf_reader, "_MAX_ITEMS", 1_000)
    array = 9
    empties = struct.pack("<IQ", array, 600) + struct.pack("<IQ", 5, 0) * 600
    path = tmp_path / "many.gguf"
    path.write_bytes(_header([("a", array, empties), ("b", array, empties)]))
    with pytest.raises(ValueError, match="over 1,000 strings and arrays"):
        read_gguf(path)
    path.write_bytes(_header([("a", array, empties)]))  # 600: read
    assert len(read_gguf(path).fields["a"].contents()) == 600


@pytest.mark.parametrize(
    ("tensors", "refusal"),
    [
        ([("a", (4,), 0), ("a", (4,), 32)], "tensor a is listed twice"),
        ([("a", (16,), 0), ("b", (4,), 32)], "tensors a and b have overlapping data"),
        ([("a", (4,), 0), ("b", (4,), 40)], "b's data offset 40 is not a multiple of"),
        ([("a", (), 0)], "tensor a has no dimensions"),
    ],
)
def test_an_inconsistent_tensor_table_is_refused(
    tmp_path: Path, tensors: list, refusal: str
) -> None:
    """A bit flip in a tensor's offset, or a name given twice, loaded another tensor's bytes
    (or the last copy) as the weights, unnoticed; a 0-dim tensor raised an IndexError."""
    path = tmp_path / "table.gguf"
    path.write_bytes(_with_tensors(tensors))
    with pytest.raises(ValueError, match=refusal):
        read_gguf(path)
    path.write_bytes(_with_tensors([("a", (4,), 0), ("b", (4,), 32)]))
    assert [t.name for t in read_gguf(path).tensors] == ["a", "b"]


def test_a_metadata_key_given_twice_is_refused(tmp_path: Path) -> None:
    """The second value (a second chat template, say) silently replaced the first."""
    one = struct.pack("<I", 7)
    path = tmp_path / "twice.gguf"
    path.write_bytes(_header([("general.alignment", 4, one), ("general.alignment", 4, one)]))
    with pytest.raises(ValueError, match="metadata key general.alignment is given twice"):
        read_gguf(path)


def test_numeric_arrays_stay_views_of_the_file(tmp_path: Path) -> None:
    """Each number of an array became a Python int: a 64 MiB array took 709 MiB, kept in the
    open files' cache."""
    count = 1 << 20
    items = np.arange(count, dtype="<i4")
    value = struct.pack("<IQ", 5, count) + items.tobytes()  # an array of INT32
    path = tmp_path / "array.gguf"
    path.write_bytes(_header([("test.numbers", 9, value)]))
    field = read_gguf(path).fields["test.numbers"]
    assert isinstance(field.value, np.ndarray) and not field.value.flags.owndata
    assert len(field) == count and field.contents()[:3] == [0, 1, 2]


@pytest.mark.parametrize(("kind", "name"), [(2, "Q4_0"), (3, "Q4_1"), (8, "Q8_0")])
def test_a_block_tensor_of_rows_not_whole_blocks_is_refused_naming_it(
    tmp_path: Path, kind: int, name: str
) -> None:
    """It read as a corrupt file ("cannot reshape array of size 4644 into shape (64,72)")."""
    path = tmp_path / "blocks.gguf"
    path.write_bytes(_with_tensors([("ffn", (129, 2), 0)], data=1024, kind=kind))
    with pytest.raises(
        ValueError, match=f"tensor ffn \\({name}\\) has rows of 129 values, not whole blocks of 32"
    ):
        read_gguf(path)
    path.write_bytes(_with_tensors([("ffn", (128, 2), 0)], data=1024, kind=kind))
    assert read_gguf(path).tensors[0].shape == (128, 2)
