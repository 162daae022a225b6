"""Structured output's grammars (stages/structured.py), with xgrammar's
own matcher over a small byte-level vocabulary."""

from __future__ import annotations

import json

import pytest

from schemas.errors import InvalidRequest
from schemas.request import StructuredOutput
from stages import structured

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}}, "required": ["name"]}


def _matcher(spec: StructuredOutput) -> object:
    import xgrammar as xgr

    vocab = [chr(c) for c in range(32, 127)] + ["\t", "\n", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(structured.grammar(spec)))


@pytest.mark.parametrize("compact", [False, True])
def test_a_length_bounded_string_takes_no_raw_control_character(compact: bool) -> None:
    """xgrammar alone writes such strings' characters as anything but a
    quote, a backslash or a line break: a raw tab would pass, and JSON
    parsers refuse it. The grammar given to the engine takes JSON's."""
    matcher = _matcher(StructuredOutput("json", json.dumps(SCHEMA), compact))
    assert matcher.accept_string('{"name": "ab')  # type: ignore[attr-defined]
    assert not matcher.accept_string("\t")  # type: ignore[attr-defined]
    assert matcher.accept_string('c"}')  # type: ignore[attr-defined]


def test_what_cannot_be_compiled_names_the_problem() -> None:
    with pytest.raises(InvalidRequest, match='the JSON schema cannot be compiled: Unsupported type "strin"'):
        structured.grammar(StructuredOutput("json", json.dumps({"type": "strin"})))
    with pytest.raises(InvalidRequest, match="the regular expression cannot be compiled"):
        structured.grammar(StructuredOutput("regex", "a(b"))
    with pytest.raises(InvalidRequest, match="choice: a non-empty list of strings"):
        structured.grammar(StructuredOutput("choice", "[]"))
