"""Requests the engine-backed tests (tests/vllm, tests/sglang) both ask,
and what both check of the answers: structured output's cases, the
prompt's logprobs of an echo."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas.request import StructuredOutput

STRUCTURED_PROMPT = "An answer in the form asked for:"
REGEX = r"[a-z]{3}-[0-9]{2}"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "maximum": 99}},
    "required": ["name", "n"],
}
# The request's extra body, and the same grammar as mmpipe states it (for
# the reference: generate() under xgrammar's own processor).
GREEDY_KINDS: list[tuple[dict[str, Any], StructuredOutput]] = [
    ({"structured_outputs": {"regex": REGEX}}, StructuredOutput("regex", REGEX)),
    ({"guided_choice": ["sea", "sky"]}, StructuredOutput("choice", json.dumps(["sea", "sky"]))),
]
JSON_SCHEMA_BODY: dict[str, Any] = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
}


def assert_echoed(done: Any, prompt: str, ids: list[int], said: list[float]) -> None:
    """A completion's echo with logprobs: the prompt's text first, its first
    token without a logprob, the others' ``said`` (generate()'s) to 1e-3."""
    lp = done.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(said, abs=1e-3)
    assert done.choices[0].text.startswith(prompt)
