"""What xgrammar lets through that a constraint forbids is kept out: schemas and regexes it
does not enforce are refused naming what, special tokens and surrogate halves never get into
a constrained text, and an astral-plane choice is written as itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.tiny_models import save_tiny_tokenizer
from tokenmill.engine.structured_output_params import REJECTED, STOPPED, TAKEN
from tokenmill.engine.xgrammar_limits import (
    IPV6_PATTERN,
    UNENFORCED,
    check_schema,
    surrogate_edges,
    token_masks,
    xgrammar_false_properties,
    xgrammar_regex,
)


@pytest.mark.parametrize(
    ("schema", "what"),
    [
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "schema uses 'allOf'"),
        ({"type": "number", "multipleOf": 0.5}, "schema uses 'multipleOf'"),
        ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
         "schema.properties.a uses 'uniqueItems'"),
        ({"type": "object", "required": ["a"]}, "requires 'a' without listing it"),
        ({"type": "string", "format": "uri", "maxLength": 30}, "'format' with a length bound"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "'pattern' with a length bound"),
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a+$",
          "minLength": 2}}}, "schema.properties.a has 'pattern' with a length bound"),
        ({"$defs": {"x": {"not": {"type": "null"}}}}, "schema.$defs.x uses 'not'"),
        ({"type": "array", "items": {"format": "date"}}, "schema.items has 'format' without"),
        ({"type": "array", "items": {"pattern": "^a$"}}, "schema.items has 'pattern' without"),
    ],
)  # fmt: skip
def test_schemas_xgrammar_would_not_enforce_are_refused(schema: dict, what: str) -> None:
    with pytest.raises(ValueError, match="which xgrammar (does not enforce|ignores)") as info:
        check_schema(json.dumps(schema))
    assert what in str(info.value)


def test_keywords_as_property_names_and_values_are_fine() -> None:
    names = {k: {"type": "string"} for k in sorted(UNENFORCED)}
    check_schema(json.dumps({"type": "object", "properties": names, "required": sorted(names)}))
    check_schema(json.dumps({"enum": [{"allOf": 1}], "const": {"not": 2}}))
    check_schema(json.dumps({"type": "string", "format": "date"}))


def test_posix_classes_in_a_regex_are_refused() -> None:
    with pytest.raises(ValueError, match="POSIX class"):
        xgrammar_regex("[[:digit:]]{3}")
    assert xgrammar_regex(r"[\[\]x]{2}[0-9]") == r"[\[\]x]{2}[0-9]"


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"\Aab\z", r"uses \\A"),  # xgrammar matched "Aabz"
        (r"ab\Z", r"uses \\Z"),
        (r"[a-z&&[^b]]{2}", "'&&' in a class"),  # xgrammar wrote "h]]"
        (r"[a-z--b]", "'--' in a class"),
        (r"[a[bc]]", "a class inside a class"),
    ],
)
def test_regexes_xgrammar_reads_otherwise_are_refused(pattern: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        xgrammar_regex(pattern)


def test_a_dot_outside_a_class_takes_no_newline_on_xgrammar() -> None:
    """xgrammar's ``.`` takes a newline, the documented syntax's does not (a row wrote
    "\\ncccxx" for ``(.?c+c{2})(x|x)*|0``); escaped dots, dots in classes and the letters
    xgrammar knows stay as they are."""
    assert xgrammar_regex("(.?c+c{2})(x|x)*|0") == r"([^\n]?c+c{2})(x|x)*|0"
    assert xgrammar_regex(r"a\.b[.]\\.") == r"a\.b[.]\\[^\n]"
    assert xgrammar_regex(r"[^]a.]x.") == r"[^]a.]x[^\n]"
    assert xgrammar_regex(r"\d+\w\s\x41\u0041\n") == r"\d+\w\s\x41\u0041\n"


def test_token_masks_drop_special_surrogate_and_json_control_tokens() -> None:
    vocab = [b"<s>", b"</s>", b"ab", b"a\tb", b"\xed\xa0x", b"\xed", b"\xa0z", b"\xed\x9f"]
    json_mask, text_mask = token_masks(vocab, 10, stop_ids=[1], special_ids=[0, 1])

    def allowed(mask: np.ndarray) -> list[int]:
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        return np.flatnonzero(bits[:10]).tolist()

    # 0 special, 4 a surrogate half; 1 a stop token; 8, 9 past the vocabulary
    assert allowed(text_mask) == [1, 2, 3, 5, 6, 7, 8, 9]
    assert allowed(json_mask) == [1, 2, 5, 6, 7, 8, 9]  # 3 holds a tab
    ends, starts = surrogate_edges(vocab, 8)
    assert list(ends) == [0, 0, 0, 0, 0, 1, 0, 0] and list(starts) == [0, 0, 0, 0, 0, 0, 1, 0]


@pytest.fixture(scope="module")
def xgr_grammars(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    pytest.importorskip("xgrammar")
    from tokenmill.engine.grammar_xgrammar import XgrammarGrammars

    tokenizer = save_tiny_tokenizer(Path(tmp_path_factory.mktemp("xgr")) / "tok")
    return XgrammarGrammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], threads=1)


def test_a_surrogate_split_across_two_tokens_is_rejected(xgr_grammars) -> None:  # noqa: ANN001
    row = xgr_grammars.matcher('{"type":"string"}')
    ends, starts = xgr_grammars._ends_lead, xgr_grammars._continues
    lead, tail = int(np.flatnonzero(ends)[0]), starts.index(1)
    quote = next(t for t in range(len(ends)) if xgr_grammars.consume([row], [t])[0] == TAKEN)
    assert xgr_grammars.consume([row], [lead])[0] == TAKEN
    assert xgr_grammars.consume([row], [tail])[0] == REJECTED
    assert "surrogate" in xgr_grammars.error(row)
    xgr_grammars.release([row])
    assert not xgr_grammars._after_lead and not xgr_grammars._broken
    fresh = xgr_grammars.matcher('{"type":"string"}')
    assert quote is not None and xgr_grammars.consume([fresh], [quote])[0] == TAKEN


def test_an_astral_choice_is_written_as_itself(tmp_path: Path) -> None:
    pytest.importorskip("xgrammar")
    from tests.tiny_models import save_tiny_model
    from tokenmill import LLM, SamplingParams

    path = save_tiny_model("llama", tmp_path / "m")
    llm = LLM(str(path), device="cpu", dtype="float32", structured_output_backend="xgrammar")
    params = SamplingParams(
        max_tokens=16, temperature=1.0, seed=3, structured_output='choice:["😀","🎉"]'
    )
    outs = llm.generate([[11, 42, 73], [5, 6, 7]], params)
    assert {o.text for o in outs} <= {"😀", "🎉"} and {o.finish_reason for o in outs} == {"stop"}


IPV6 = {"::ffff:192.168.1.1": True, "::ffff:192.168.01.1": False, "::1.2.3.04": False,
        "1:2:3:4:5:6:1.2.3.4": True, "1:2:3:4:5:6:7::": True, "::2:3:4:5:6:7:8": True,
        "::": True, "::1": True, "ABCD:ef::0": True, "1::2::3": False, "12345::": False,
        "1:2:3:4:5:6:7:8:9": False, "::1.2.3.256": False, "1:2:3:4:5:6:7:1.2.3.4": False,
        "fe80::1%eth0": False, "1:2:3:4:5:6:7": False}  # fmt: skip


def test_the_ipv6_pattern_takes_what_jsonschema_takes() -> None:
    from jsonschema import Draft202012Validator

    checker = Draft202012Validator.FORMAT_CHECKER
    assert {v: bool(re.fullmatch(IPV6_PATTERN, v)) for v in IPV6} == IPV6
    assert {v: checker.conforms(v, "ipv6") for v in IPV6} == IPV6


def test_ipv6_takes_no_leading_zero_in_its_dotted_quad_on_xgrammar(xgr_grammars) -> None:  # noqa: ANN001
    """xgrammar's own ``format: ipv6`` took "::ffff:192.168.01.1", which jsonschema refuses
    (a dotted quad has no leading zeros), and refused "1:2:3:4:5:6:1.2.3.4"."""
    tokenizer = xgr_grammars._tokenizer
    spec = json.dumps({"type": "string", "format": "ipv6"})
    taken = {}
    for value in IPV6:
        row = xgr_grammars.matcher(spec)
        tokens = tokenizer.encode(json.dumps(value), add_special_tokens=False)
        status = [xgr_grammars.consume([row], [t])[0] for t in tokens]
        taken[value] = REJECTED not in status and status[-1] == STOPPED
        xgr_grammars.release([row])
    assert taken == IPV6


CLOSED = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": False},
    "required": ["a"],
    "additionalProperties": False,
}


def test_a_false_property_of_a_closed_object_is_forbidden_on_xgrammar(xgr_grammars) -> None:  # noqa: ANN001
    """``"b": false`` (valid JSON Schema: the key is forbidden) failed to compile on
    xgrammar ("Schema 'false' cannot accept any value", naming neither key nor path); on an
    object taking no other keys it is left out of properties, which forbids it the same."""
    from jsonschema import Draft202012Validator

    tokenizer = xgr_grammars._tokenizer

    def status(text: str) -> list[int]:
        row = xgr_grammars.matcher(json.dumps(CLOSED))
        tokens = tokenizer.encode(text, add_special_tokens=False)
        got = [xgr_grammars.consume([row], [t])[0] for t in tokens]
        xgr_grammars.release([row])
        return got

    taken = status('{"a":1}')
    assert REJECTED not in taken and taken[-1] == STOPPED
    assert Draft202012Validator(CLOSED).is_valid({"a": 1})
    assert REJECTED in status('{"a":1,"b":2}')
    assert not Draft202012Validator(CLOSED).is_valid({"a": 1, "b": 2})


@pytest.mark.parametrize(
    ("schema", "what"),
    [
        ({**CLOSED, "additionalProperties": True}, "schema.properties.b is false"),
        ({key: v for key, v in CLOSED.items() if key != "additionalProperties"},
         "set schema.additionalProperties to false"),
        ({**CLOSED, "patternProperties": {"^b$": {}}}, "without patternProperties"),
        ({**CLOSED, "required": ["a", "b"]}, "schema.required names 'b': no object can match"),
        ({"type": "object", "properties": {"x": {**CLOSED, "additionalProperties": {}}}},
         "schema.properties.x.properties.b is false"),
    ],
)  # fmt: skip
def test_a_false_property_xgrammar_cannot_keep_out_is_refused_naming_it(
    schema: dict, what: str
) -> None:
    with pytest.raises(ValueError, match="is false") as info:
        xgrammar_false_properties(json.dumps(schema))
    assert what in str(info.value)
