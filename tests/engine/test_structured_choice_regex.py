"""Regex and choice constraints (llguidance): every constrained output matches its regex in
full or is one of its choices, greedy and sampled, beside JSON-schema and plain rows in one
batch; the forms the value takes (strings, StructuredOutputsParams, job/column mappings) and
the refusals of bad ones."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.engine.test_structured_output import TINY_SCHEMA, validate
from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.sampling_params import StructuredOutputsParams
from tokenmill.engine.structured_output_params import (
    check_structured_output,
    structured_output_setting,
)

CODE = r"[A-Z]{2}-[0-9]{3}"
ANIMAL = r"(cat|dog|bird)s?( x[1-9])?"
CHOICES = ["yes", "no", "yes please", 'say "hi" ✓']

# ---- the value --------------------------------------------------------------------------


def test_each_form_keeps_one_canonical_text() -> None:
    regex = f"regex:{CODE}"
    assert check_structured_output(regex) == regex
    assert check_structured_output(StructuredOutputsParams(regex=CODE)) == regex
    assert structured_output_setting({"regex": CODE}) == regex
    assert structured_output_setting(json.dumps({"regex": CODE})) == regex  # a text cell
    choice = 'choice:["yes","no","yes please","say \\"hi\\" ✓"]'
    assert check_structured_output(StructuredOutputsParams(choice=CHOICES)) == choice
    assert structured_output_setting({"choice": CHOICES}) == choice
    assert check_structured_output(choice) == choice  # reads back
    schema = json.dumps(TINY_SCHEMA, separators=(",", ":"))
    assert structured_output_setting({"json_schema": TINY_SCHEMA}) == schema
    assert check_structured_output(StructuredOutputsParams(json=TINY_SCHEMA)) == schema
    assert check_structured_output(StructuredOutputsParams(json_object=True)) == "json_object"
    assert SamplingParams(structured_output=StructuredOutputsParams(regex=CODE)) == (
        SamplingParams(structured_output=regex)
    )
    assert SamplingParams(structured_output={"choice": CHOICES}).structured_output == choice


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (StructuredOutputsParams(regex="(ab"), "regex '(ab': unclosed group"),
        (StructuredOutputsParams(regex="a(?=b)"), "look-around"),
        (StructuredOutputsParams(regex=r"(a)\1"), "backreferences are not supported"),
        (StructuredOutputsParams(regex=""), "non-empty regular expression"),
        ("regex:", "non-empty regular expression"),
        (StructuredOutputsParams(choice=[]), "choice must list at least one string"),
        (StructuredOutputsParams(choice=["a", 1]), "strings only, got 1"),
        (StructuredOutputsParams(choice="ab"), "must be a list of strings"),
        ("choice:[]", "at least one string"),
        ("choice:yes", "after 'choice:' comes a JSON list"),
        ({"regex": "(ab"}, "structured_output: regex: cannot compile this regex '(ab'"),
    ],
)
def test_bad_regex_or_choice_is_a_value_error_naming_it(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match="SamplingParams.structured_output") as info:
        SamplingParams(structured_output=value)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "value",
    [
        {"json": TINY_SCHEMA},
        {"json_object": True},
        {"regex": CODE, "choice": CHOICES},
        {"json": TINY_SCHEMA, "backend": "xgrammar"},
    ],
)
def test_a_mapping_of_params_fields_is_not_taken_for_a_schema(value: dict) -> None:
    # vLLM's StructuredOutputsParams fields given as a dict: read as a JSON schema, its keys
    # (none a schema keyword) constrained nothing
    with pytest.raises(ValueError, match="StructuredOutputsParams' fields, not a JSON schema"):
        SamplingParams(structured_output=value)
    assert check_structured_output({"json": 1, "type": "object"}) is not None  # a schema


def test_structured_outputs_params_takes_exactly_one() -> None:
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, json_object"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"regex": "(ab"}, "regex: cannot compile this regex '(ab'"),
        ({"choice": []}, "choice must list at least one string"),
        ({"regex": "a", "choice": ["a"]}, "a mapping with one key"),
        ({"pattern": "a"}, "got a mapping with keys ['pattern']"),
        ('{"choice": "ab"}', "choice must be a list of strings"),
        (7, "expected json_object or a mapping"),
    ],
)
def test_bad_settings_name_their_key(value: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        structured_output_setting(value)
    assert message in str(info.value)


# ---- the engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> LLM:
    path = save_tiny_model("llama", tmp_path_factory.mktemp("choice_regex") / "m")
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, kv_cache_memory=1 << 24)


def _prompts(n: int) -> list[list[int]]:
    return [[(37 * i + 13 * t) % 250 + 5 for t in range(5 + i % 7)] for i in range(n)]


def test_every_output_matches_its_regex_or_choice(tiny_llm: LLM) -> None:
    """One batch: two regexes, a choice and a JSON schema, each greedy and seeded, and a
    plain row."""
    kinds: list[tuple[str, Any]] = [
        ("code", StructuredOutputsParams(regex=CODE)),
        ("animal", f"regex:{ANIMAL}"),
        ("choice", StructuredOutputsParams(choice=CHOICES)),
        ("schema", TINY_SCHEMA),
    ]
    params, labels = [], []
    for i in range(8):
        label, constraint = kinds[i % 4]
        params.append(
            SamplingParams(
                max_tokens=40,
                temperature=0 if i < 4 else 1.0,
                seed=i,
                structured_output=constraint,
            )
        )
        labels.append(label)
    plain = SamplingParams(max_tokens=8, temperature=0.9, seed=3)
    outs = tiny_llm.generate(_prompts(9), [*params, plain])
    alone = tiny_llm.generate(_prompts(9)[-1:], plain)[0]
    for label, out in zip(labels, outs, strict=False):
        assert out.finish_reason == "stop", (label, out.text)
        if label == "code":
            assert re.fullmatch(CODE, out.text), out.text
        elif label == "animal":
            assert re.fullmatch(ANIMAL, out.text), out.text
        elif label == "choice":
            assert out.text in CHOICES
        else:
            validate(out.text, TINY_SCHEMA)
    assert outs[-1].token_ids == alone.token_ids  # the plain row is untouched
    assert len(tiny_llm.engine._grammars) == 0


def test_a_non_ascii_choice_is_generated_byte_by_byte(tiny_llm: LLM) -> None:
    """ "été" is several byte tokens of the byte-level tokenizer; a one-item choice forces
    them all, and the row beside it runs as usual."""
    outs = tiny_llm.generate(
        _prompts(2),
        [
            SamplingParams(max_tokens=20, structured_output='choice:["\\u00e9t\\u00e9"]'),
            SamplingParams(max_tokens=4, temperature=0),
        ],
    )
    assert outs[0].text == "été" and outs[0].finish_reason == "stop"
    assert outs[1].ok
