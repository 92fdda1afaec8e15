"""InputConfig validation."""

from __future__ import annotations

import pytest

from tokenmill.io.readers import InputConfig


def test_defaults_and_list_passthrough_becomes_tuple():
    cfg = InputConfig(path="data/", passthrough_columns=["a", "b"])  # type: ignore[arg-type]
    assert cfg.passthrough_columns == ("a", "b")
    assert (cfg.format, cfg.id_column, cfg.prompt_column) == ("auto", "id", "prompt")
    assert cfg.storage_options == {}


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"format": "csv"}, "input.format"),
        ({"passthrough_columns": "a"}, "input.passthrough_columns"),
        ({"passthrough_columns": ("a", "")}, "input.passthrough_columns"),
        ({"id_column": ""}, "input.id_column"),
        ({"format": "jsonl", "prompt_column": None}, "prompt_column"),
        ({"storage_options": ["x"]}, "input.storage_options"),
    ],
)
def test_invalid_values_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        InputConfig(path="data/", **kwargs)


def test_empty_path_is_refused():
    with pytest.raises(ValueError, match="input.path"):
        InputConfig(path=" ")
