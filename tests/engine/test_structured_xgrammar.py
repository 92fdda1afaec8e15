"""Structured output on the xgrammar backend (``structured_output_backend="xgrammar"``):
the same constraints as the llguidance tests, every constrained row valid, async scheduling
gives the synchronous loop's outputs, and regex and choice rows (one language, so one
allowed-token set a step) give exactly llguidance's greedy outputs."""

from __future__ import annotations

import json

import pytest

from tests.engine.test_structured_async import (
    REGEX,
    _check_valid,
    _llm,
    _params,
    _prompts,
    _summary,
    tiny_path,  # noqa: F401  (the module's tiny model fixture)
)
from tokenmill import SamplingParams

pytest.importorskip("xgrammar")


@pytest.mark.parametrize("max_num_seqs", [16, 5], ids=["one-batch", "rows-come-and-go"])
def test_xgrammar_rows_are_valid_and_async_matches_sync(tiny_path, max_num_seqs) -> None:  # noqa: F811
    prompts, params = _prompts(12), _params(12)
    kwargs = dict(max_num_seqs=max_num_seqs, structured_output_backend="xgrammar")
    want = _llm(tiny_path, False, **kwargs).generate(prompts, params)
    llm = _llm(tiny_path, True, **kwargs)
    got = llm.generate(prompts, params)
    assert _summary(got) == _summary(want)
    _check_valid(got, params)
    finished = {o.finish_reason for o, p in zip(got, params, strict=True) if p.structured_output}
    assert "stop" in finished
    assert llm.engine._grammars.backend.name == "xgrammar"
    assert len(llm.engine._grammars) == 0 and llm.engine.step_profile()["synchronous_steps"] == 0


def test_regex_and_choice_rows_match_llguidance(tiny_path) -> None:  # noqa: F811
    prompts = _prompts(8)
    specs = ["choice:" + '["yes","no","maybe so"]', "regex:" + REGEX] * 4
    params = [SamplingParams(max_tokens=20, temperature=0, structured_output=s) for s in specs]
    outs = {
        backend: _llm(tiny_path, True, structured_output_backend=backend).generate(prompts, params)
        for backend in ("llguidance", "xgrammar")
    }
    assert _summary(outs["xgrammar"]) == _summary(outs["llguidance"])
    assert {o.finish_reason for o in outs["xgrammar"]} <= {"stop", "length"}
    _check_valid(outs["xgrammar"], params)


def test_a_constraint_xgrammar_cannot_compile_is_refused_naming_it(tiny_path) -> None:  # noqa: F811
    llm = _llm(tiny_path, False, structured_output_backend="xgrammar")
    case_insensitive = SamplingParams(structured_output="regex:(?i)abc")  # llguidance's syntax
    with pytest.raises(ValueError, match=r"xgrammar cannot use this regex: Regex parsing error"):
        llm.engine.add_request("bad", [5, 6], case_insensitive)
    assert not llm.engine.has_unfinished()


def test_an_unknown_backend_is_refused_naming_the_setting(tiny_path) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="structured_output_backend"):
        _llm(tiny_path, False, structured_output_backend="outlines")


BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["name", "note"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_sampled_strings_hold_no_raw_control_characters(tiny_path, backend) -> None:  # noqa: F811
    # xgrammar 0.2.9 writes a maxLength string as [^"\\\r\n]{0,n}: a raw tab or NUL passes
    # its mask. The tiny tokenizer has a token for every byte, and the random model samples
    # them at temperature 1: without the backend's control-byte filter most rows fail.
    # (xgrammar also lets an encoded surrogate through, three bytes that decode to three
    # U+FFFD and so break maxLength; no real model writes those: not checked here.)
    llm = _llm(tiny_path, True, structured_output_backend=backend)
    params = [
        SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured_output=BOUNDED_SCHEMA)
        for i in range(24)
    ]
    outs = llm.generate(_prompts(24), params)
    complete = [o for o in outs if o.finish_reason == "stop"]
    assert len(complete) >= 20
    for out in complete:
        assert set(json.loads(out.text)) == {"name", "note"}  # refuses raw control characters
    assert not any(min(out.text, default=" ") < " " for out in outs)


def test_compiled_grammars_stay_bounded_with_a_schema_a_row(tiny_path) -> None:  # noqa: F811
    """The newest 64 compiled grammars are kept; xgrammar's own compiler cache (unbounded by
    default: ~48 KB more per schema on the tiny vocabulary) is not used."""
    llm = _llm(tiny_path, False, structured_output_backend="xgrammar")
    grammars = llm.engine._grammars.backend
    for i in range(70):
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
        llm.engine.add_request(
            f"r{i}", [5, 6], SamplingParams(max_tokens=1, structured_output=schema)
        )
        llm.engine.abort_requests([f"r{i}"])
    assert len(grammars._compiled) == 64
    assert grammars._compiler.get_cache_size_bytes() == 0


@pytest.mark.parametrize("processes", [0, 2], ids=["in-process", "worker-processes"])
def test_a_row_whose_grammar_took_the_stop_token_gets_a_stop_only_mask(
    tiny_path,  # noqa: F811
    processes,
) -> None:
    """A regex that may go on after it matches ("leon", then ",12" or the end): the row
    samples the stop token, xgrammar's matcher terminates, and with async scheduling the
    row's next step, scheduled before its request ended, asks for a mask again. xgrammar
    fills none for a terminated matcher (it raised, ending the call); the row gets the stop
    tokens alone and gives the synchronous loop's output."""
    spec = "regex:[a-z]{1,4}(,[0-9]{2}){0,3}"
    params = [SamplingParams(max_tokens=25, temperature=1.0, seed=11, structured_output=spec)]
    kwargs = dict(max_num_seqs=16, structured_output_backend="xgrammar")
    want = _llm(tiny_path, False, **kwargs).generate([[5, 6, 7, 8]], params)
    assert want[0].text == "leon" and want[0].finish_reason == "stop"
    llm = _llm(tiny_path, True, structured_output_processes=processes, **kwargs)
    got = llm.generate([[5, 6, 7, 8]], params)
    assert _summary(got) == _summary(want)
    llm.engine.close()


def test_regex_rows_on_xgrammar_follow_the_documented_syntax(tiny_path) -> None:  # noqa: F811
    """xgrammar's ``.`` takes a newline (a row wrote "\\ncccxx" for the regex below, "stop"),
    and it reads ``\\A`` as the letter A: the first now matches as the syntax means, the
    second is refused when the request is added, naming the setting."""
    import re

    pattern = "(.?c+c{2})(x|x)*|0"
    params = SamplingParams(
        max_tokens=8, temperature=0.7, seed=510, min_tokens=2, presence_penalty=0.5,
        structured_output="regex:" + pattern,
    )  # fmt: skip
    llm = _llm(tiny_path, True, structured_output_backend="xgrammar")
    out = llm.generate([[5, 6, 7, 8]], [params])[0]
    assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text
    anchored = SamplingParams(structured_output=r"regex:\Aab\z")
    with pytest.raises(ValueError, match=r"structured_output.*xgrammar.*\\A"):
        llm.engine.add_request("anchored", [5, 6], anchored)
    llm.engine.close()


def test_an_object_without_additional_properties_takes_other_keys(tiny_path) -> None:  # noqa: F811
    """xgrammar's strict mode (its default) allowed no key past those listed where the
    schema leaves additionalProperties unset (JSON Schema, and llguidance, allow any), and
    refused minProperties past the properties listed as impossible."""
    import xgrammar
    from transformers import AutoTokenizer

    from tokenmill.engine.grammar_xgrammar import _built

    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tiny_path))
    compiler = xgrammar.GrammarCompiler(info)

    def accepts(schema: dict, text: str) -> bool:
        grammar = _built(json.dumps(schema), None, None, compiler.compile_json_schema)
        matcher = xgrammar.GrammarMatcher(grammar)
        return matcher.accept_string(text) and matcher.is_completed()

    listed = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert accepts(listed, '{"a":1,"b":2}') and accepts(listed, '{"a":1}')
    assert not accepts({**listed, "additionalProperties": False}, '{"a":1,"b":2}')
    llm = _llm(tiny_path, False, structured_output_backend="xgrammar")
    # (past 1, a minProperties no required key meets is refused on both backends: a key
    # not listed may repeat, llguidance_limits.py)
    one_key = SamplingParams(
        max_tokens=5, structured_output={"json_schema": {"type": "object", "minProperties": 1}}
    )
    llm.engine.add_request("one", [5, 6], one_key)  # was refused
    llm.engine.abort_requests(["one"])


def test_schema_patterns_are_read_as_written(tiny_path) -> None:  # noqa: F811
    """In a JSON schema's pattern xgrammar dropped the first character of an optional group
    whose end repeats ("^v(?:-[0-9]+)?$" took "v66331"; the engine's own time patterns took
    07:52:1315Z), and read \\A as the letter A: the first is written as it reads right, the
    second refused, naming the subschema."""
    import re

    import xgrammar
    from transformers import AutoTokenizer

    from tokenmill.engine.grammar_xgrammar import _built

    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tiny_path))
    compiler = xgrammar.GrammarCompiler(info)

    def accepts(schema: dict, value: str) -> bool:
        grammar = _built(json.dumps(schema), None, None, compiler.compile_json_schema)
        matcher = xgrammar.GrammarMatcher(grammar)
        return matcher.accept_string(json.dumps(value)) and matcher.is_completed()

    pattern = "^v(?:-[0-9]+)?(x)??$"
    version = {"type": "object", "properties": {"v": {"type": "string", "pattern": pattern}}}
    for value in ("v", "v-12", "v-1x", "vx", "v66331", "v1x", "v-", "-12"):
        assert accepts(version["properties"]["v"], value) == bool(re.fullmatch(pattern, value))
    for fmt, value, valid in (("time", "07:52:13.15Z", True), ("time", "07:52:1315Z", False),
                              ("date-time", "2024-02-29T16:33:33-06:00", True),
                              ("date-time", "2024-02-29T16:33:336-06:00", False)):  # fmt: skip
        assert accepts({"type": "string", "format": fmt}, value) == valid, value
    anchored = {"type": "object", "properties": {"a": {"type": "string", "pattern": r"\Aab"}}}
    with pytest.raises(ValueError, match=r"schema.properties.a.pattern: the regex uses \\A"):
        _built(json.dumps(anchored), None, None, compiler.compile_json_schema)


def test_ipv4_and_hostname_formats_are_enforced_on_xgrammar(tiny_path) -> None:  # noqa: F811
    """xgrammar's ``format: ipv4`` took leading zeros ("48.050.181.041" ended a job's row
    "stop"; jsonschema refuses it) and its ``hostname`` a 64-character label: both are given
    their patterns, which take what jsonschema's checker takes."""
    import xgrammar
    from transformers import AutoTokenizer

    from tokenmill.engine.grammar_xgrammar import _built

    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tiny_path))
    compiler = xgrammar.GrammarCompiler(info)

    def accepts(fmt: str, value: str) -> bool:
        schema = json.dumps({"type": "object", "properties": {"a": {"type": "string",
                                                                    "format": fmt}}})  # fmt: skip
        matcher = xgrammar.GrammarMatcher(_built(schema, None, None, compiler.compile_json_schema))
        return matcher.accept_string(json.dumps({"a": value}, separators=(",", ":"))) and (
            matcher.is_completed()
        )

    ipv4 = {"48.050.181.041": False, "1.2.3.04": False, "256.1.1.1": False, "1.2.3": False,
            "0.0.0.0": True, "255.249.10.199": True}  # fmt: skip
    for value, valid in ipv4.items():
        assert accepts("ipv4", value) == valid, value
    for value, valid in (("a" * 64, False), ("b" * 63 + ".a-b", True), ("-a", False),
                         ("a..b", False), ("a", True)):  # fmt: skip
        assert accepts("hostname", value) == valid, value
