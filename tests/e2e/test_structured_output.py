"""Structured output through the official openai client: OpenAI's
``response_format`` and vLLM's ``structured_outputs`` / ``guided_*``, the
built-in engine masking each step by the request's grammar. Greedy answers
equal ``generate()`` with xgrammar's own logits processor; sampled answers
of random weights always parse and validate."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest

from pipeline.config import PipelineConfig
from schemas.request import StructuredOutput
from stages.models import ModelSpec
from tests.e2e.conftest import Stack, client, start_stack

MODEL = "tiny-qwen2-vl"

# Every part bounded: random weights would otherwise run an unbounded string
# or list on to max_tokens (a cut answer, finish_reason "length").
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["calm", "stormy", "bright"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "mood", "tags", "ok"],
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(params=["epd", "e-p-d"])
async def mode_stack(
    request: pytest.FixtureRequest, pipeline_config: PipelineConfig, model_spec: ModelSpec
) -> AsyncIterator[Stack]:
    """E/P/D too: the decode worker's grammar takes over from the token prefill chose."""
    config = PipelineConfig(nats_url=pipeline_config.nats_url, namespace=pipeline_config.namespace, mode=request.param)
    s, stop = await start_stack(config, model_spec)
    yield s
    await stop()


@pytest.mark.e2e
async def test_json_schema_answers_of_random_weights_parse_and_validate_every_time(stack: Stack) -> None:
    """50 sampled answers at once (the batched step masks them together)."""

    async def one(seed: int) -> tuple[str, str | None]:
        done = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Describe person {seed} as JSON."}],
            response_format=JSON_SCHEMA,  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            max_tokens=400,
        )
        return done.choices[0].message.content or "", done.choices[0].finish_reason

    async with client(stack) as c:
        answers = await asyncio.gather(*(one(seed) for seed in range(50)))
    for text, finish in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, _ in answers}) > 25  # sampled, not one answer forced


@pytest.mark.e2e
async def test_each_kind_equals_generate_with_xgrammars_processor(mode_stack: Stack) -> None:
    """Greedy, each kind by each way of asking: exactly generate()'s tokens
    under the same grammar (xgrammar's logits processor for transformers)."""
    from transformers import AutoTokenizer

    from stages.torch_engine.reference import load_reference_model, reference_structured

    model_dir = mode_stack.spec.path
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_reference_model(model_dir)
    ids = tokenizer("An answer in the form asked for:")["input_ids"]
    regex = r"[a-z]{3}-[0-9]{2}"
    ebnf = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
    cases: list[tuple[dict[str, Any], StructuredOutput, Any]] = [
        ({"extra_body": {"response_format": JSON_SCHEMA}}, StructuredOutput("json", json.dumps(SCHEMA)), None),
        ({"extra_body": {"response_format": {"type": "json_object"}}}, StructuredOutput("json_object"), None),
        ({"extra_body": {"structured_outputs": {"regex": regex}}}, StructuredOutput("regex", regex), regex),
        (
            {"extra_body": {"guided_choice": ["sea", "mountain", "sky"]}},
            StructuredOutput("choice", json.dumps(["sea", "mountain", "sky"])),
            "sea|mountain|sky",
        ),
        (
            {"extra_body": {"structured_outputs": {"grammar": ebnf}}},
            StructuredOutput("grammar", ebnf),
            r"(yes|no) \d\d?",
        ),
        ({"extra_body": {"guided_json": SCHEMA}}, StructuredOutput("json", json.dumps(SCHEMA)), None),
        (
            {"extra_body": {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}},
            StructuredOutput("json", json.dumps(SCHEMA), compact=True),
            None,
        ),
    ]
    async with client(mode_stack) as c:
        for fields, spec, pattern in cases:
            want = reference_structured(model_dir, ids, 400, spec, model=model)
            text = tokenizer.decode(want, skip_special_tokens=True)
            done = await c.completions.create(model=MODEL, prompt=ids, max_tokens=400, temperature=0, **fields)
            # Any JSON object can run on past max_tokens (random weights nest deep): cut there, as generate() is.
            finish = "length" if len(want) == 400 else "stop"
            assert (done.choices[0].text, done.choices[0].finish_reason) == (text, finish), fields
            if finish == "length":
                assert spec.kind == "json_object" and text.lstrip().startswith("{")
            elif pattern is None:
                parsed = json.loads(text)
                if spec.kind == "json":
                    jsonschema.validate(parsed, SCHEMA)
                else:
                    assert isinstance(parsed, dict)
            else:
                assert re.fullmatch(pattern, text), text
        # Streamed chat, the same grammar: the same answer as the reference's.
        chat = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Pick one."}],
            extra_body={"guided_choice": ["sea", "mountain", "sky"]},
            temperature=0,
            stream=True,
        )
        streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in chat if chunk.choices])
        assert streamed in ("sea", "mountain", "sky")


@pytest.mark.e2e
async def test_what_cannot_be_compiled_is_a_400_naming_it(stack: Stack) -> None:
    # Completions: the openai client sends response_format only as an extra field there.
    kw: dict[str, Any] = {"model": MODEL, "prompt": "x", "max_tokens": 4}
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            'the JSON schema cannot be compiled: Unsupported type "strin"',
        ),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "the regular expression cannot be compiled"),
        ({"extra_body": {"guided_grammar": 'root ::= "a" |'}}, "the grammar cannot be compiled"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema is required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type 'yaml'"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
            "ask for one structured output: json_object, regex",
        ),
        ({"extra_body": {"structured_outputs": {"xml": "<a/>"}}}, "structured_outputs: xml not supported"),
        ({"extra_body": {"guided_json": "{not json"}}, "guided_json is not JSON"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"min_tokens": 2}},
            "min_tokens cannot be used with structured output",
        ),
    ]
    async with client(stack) as c:
        for fields, says in cases:
            extra = {k: v for k, v in fields.items() if k != "extra_body"} | fields.get("extra_body", {})
            with pytest.raises(openai.BadRequestError) as refused:
                await c.completions.create(**kw, extra_body=extra)
            body = refused.value.body
            assert isinstance(body, dict) and says in body["message"], (fields, body)
            assert body["code"] == "invalid_request"
        # The worker still serves.
        done = await c.completions.create(**kw, extra_body={"guided_choice": ["yes", "no"]}, temperature=0)
        assert done.choices[0].text in ("yes", "no")
