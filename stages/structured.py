"""Structured output: what an answer must match (a JSON schema, any JSON
object, a regular expression, one of a few strings, an EBNF grammar) as a
grammar of xgrammar's, which the built-in engine turns into a token mask at
each step. vLLM takes the same request (its ``StructuredOutputsParams``).

The processor builds the grammar once to refuse what cannot be compiled (a
400 naming the problem) before any worker sees the request.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING

from schemas.errors import InvalidRequest
from schemas.request import StructuredOutput

if TYPE_CHECKING:
    import xgrammar

# Whitespace between JSON tokens: free, as vLLM leaves it, but at most this
# many characters in a row, so that a model that keeps choosing spaces (random
# weights do) still has to make progress through the structure.
MAX_JSON_WHITESPACE = 64

# xgrammar's messages start "[hh:mm:ss] /path/file.cc:123: ".
_LOCATION = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


def grammar(spec: StructuredOutput) -> xgrammar.Grammar:
    """``spec`` as an xgrammar Grammar; InvalidRequest naming the problem
    where it cannot be compiled."""
    return _grammar(spec.kind, spec.text, spec.compact)


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, text: str, compact: bool) -> xgrammar.Grammar:
    import xgrammar as xgr

    try:
        if kind in ("json", "json_object"):
            # json_object: any object, not any JSON value (as vLLM compiles it).
            schema = text if kind == "json" else '{"type": "object"}'
            if compact:
                return _json_strings(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
            return _json_strings(
                xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(json.loads(text)))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
    except RuntimeError as exc:
        message = _LOCATION.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        raise InvalidRequest(f"{_NAMES[kind]} cannot be compiled: {message}") from None
    raise InvalidRequest(f"unknown structured output kind {kind!r}")


# xgrammar (0.2.8, 0.2.9) writes a string with minLength or maxLength as
# characters of this class: raw control characters pass (a tab in a name),
# and JSON parsers refuse them. Its plain strings exclude them, as JSON does.
_LENGTH_BOUNDED_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def _json_strings(grammar: xgrammar.Grammar) -> xgrammar.Grammar:
    """``grammar`` with its length-bounded strings' characters as JSON's."""
    import xgrammar as xgr

    text = str(grammar)
    if _LENGTH_BOUNDED_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LENGTH_BOUNDED_CHAR, _JSON_STRING_CHAR))


_NAMES = {
    "json": "the JSON schema",
    "json_object": "the JSON grammar",
    "regex": "the regular expression",
    "choice": "the choice",
    "grammar": "the grammar",
}


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar of exactly one of ``choices``, each a literal string."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequest("choice: a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)
