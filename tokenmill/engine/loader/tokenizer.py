"""Tokenizers for both model formats, built offline by transformers, never with remote code.

HF directories: ``AutoTokenizer`` reads tokenizer.json / tokenizer_config.json and the chat
template (tokenizer_config.json or chat_template.jinja). GGUF files: transformers rebuilds a
fast tokenizer from the ``tokenizer.ggml.*`` metadata; the chat template comes from
``tokenizer.chat_template`` and is set here if transformers did not.

A GGUF tokenizer is built by ``PreTrainedTokenizerFast`` itself, not ``AutoTokenizer``:
``AutoTokenizer`` first works out the model's config to choose a class, and for SmolLM2's
file that parses every metadata field with the ``gguf`` package (one numpy view per token),
11 s of the 11.5 s it took; the fast class reads only the tokenizer's fields (0.8 s) and
builds the same tokenizer (tests/engine/loader/test_smollm2_gguf.py compares the two). A
process keeps the last GGUF tokenizers it built, per (file, mtime, size), and hands each
caller a copy of its own: a second engine, a second job in one worker process, or a
notebook that builds LLM twice does not pay again.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = ["load_hf_tokenizer", "load_gguf_tokenizer"]


# Files one of which holds the vocabulary of an HF tokenizer. Without them transformers 5
# silently builds an empty tokenizer from the model type, so look before loading.
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "vocab.txt")


def load_hf_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in HF directory ``model_dir``. Raises ValueError naming it."""
    if not any((model_dir / name).is_file() for name in _VOCAB_FILES):
        raise ValueError(
            f"cannot load a tokenizer from {model_dir}: it has none of {', '.join(_VOCAB_FILES)}; "
            "copy the model's tokenizer files next to config.json"
        )
    # A tokenizer.json that its config names the generic class for needs no model-specific
    # class: build it directly. AutoTokenizer would first import transformers' model-config
    # machinery (2.8 s on a 2-core machine, every run-job process and Ray replica).
    loader = PreTrainedTokenizerFast if _generic_fast(model_dir) else AutoTokenizer
    try:
        tokenizer = loader.from_pretrained(
            str(model_dir), trust_remote_code=False, local_files_only=True
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"cannot load a tokenizer from {model_dir} ({type(e).__name__}: {e}); the directory "
            "needs tokenizer.json (or the files of a transformers tokenizer) and "
            "tokenizer_config.json, without custom tokenizer code"
        ) from e
    return _checked(tokenizer, model_dir)


# tokenizer_config.json's ``tokenizer_class`` for a plain tokenizer.json (transformers 4 wrote
# the first, 5 writes the second).
_GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _generic_fast(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a tokenizer.json that its tokenizer_config.json says the
    generic fast class loads (unreadable or absent config: False, AutoTokenizer decides),
    for a model type whose own class AutoTokenizer does not put in its place."""
    config = _json_object(model_dir / "tokenizer_config.json")
    named = config.get("tokenizer_class")
    if named not in _GENERIC_CLASSES or not (model_dir / "tokenizer.json").is_file():
        return False
    return _json_object(model_dir / "config.json").get("model_type") not in _own_class_types()


def _json_object(path: Path) -> dict:
    """The JSON object in ``path``; empty when it is absent, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


@functools.cache
def _own_class_types() -> frozenset[str]:
    """Model types whose hub configs name the generic class where AutoTokenizer loads the
    type's own (which sets its normalizer and pre-tokenizer: Qwen2's NFC, ...): built as
    named, a qwen2 directory's tokenizer split "á" (a + U+0301) where transformers joins it
    (an audit). transformers keeps the list; importing it costs ~1.3 s of AutoTokenizer's
    2.8 s, once a process."""
    from transformers.models.auto import tokenization_auto

    return frozenset(getattr(tokenization_auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", ()))


def load_gguf_tokenizer(gguf_path: Path, chat_template: str | None) -> PreTrainedTokenizerBase:
    """Build the tokenizer stored in GGUF file ``gguf_path`` (a copy of this process's cached
    one when the file is unchanged since).

    ``chat_template`` (the file's ``tokenizer.chat_template``) is set on the tokenizer when
    transformers left it unset. Raises ValueError naming the file.
    """
    stat = gguf_path.stat()
    built = _gguf_tokenizer(str(gguf_path.resolve()), stat.st_mtime_ns, stat.st_size)
    tokenizer = copy.deepcopy(built)
    if chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


@functools.lru_cache(maxsize=2)
def _gguf_tokenizer(path: str, mtime_ns: int, size: int) -> PreTrainedTokenizerBase:
    """The tokenizer of GGUF file ``path`` as of (mtime, size): a changed file is rebuilt.
    Callers take copies; this one is never handed out."""
    gguf_path = Path(path)
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            str(gguf_path.parent),
            gguf_file=gguf_path.name,
            trust_remote_code=False,
            local_files_only=True,
        )
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        AttributeError,
        NotImplementedError,
    ) as e:
        raise ValueError(
            f"cannot build a tokenizer from the tokenizer.ggml.* metadata of {gguf_path} "
            f"({type(e).__name__}: {e}); transformers supports GGUF tokenizers of the "
            "llama (SentencePiece) and gpt2 (BPE) kinds"
        ) from e
    return _checked(tokenizer, gguf_path)


def _checked(tokenizer: PreTrainedTokenizerBase, source: Path) -> PreTrainedTokenizerBase:
    if len(tokenizer) < 2:
        raise ValueError(
            f"the tokenizer loaded from {source} has an empty vocabulary; "
            "its tokenizer files are incomplete"
        )
    return tokenizer
