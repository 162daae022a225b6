"""``--engine sglang`` end to end: ``mmpipe up`` (embedded nats-server, the
processor, the workers of the mode as OS processes, the bridge) with SGLang
running the role that prefills and decodes, the official openai client
against the bridge. EPD: one worker encodes (mmpipe's encoder) and hands
SGLang the embeddings in memory; E/PD: mmpipe's own encode worker sends them
over the tensor transport. Every answer is exactly transformers
``generate()``'s tokens on the same float32 checkpoint, streamed or not,
text or images; a client that goes away aborts the SGLang request; what
SGLang is not given yet is a 400 with a stable code. One engine start per
mode (a module-scoped stack per mode)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import gradient, make_reference, png_data_url, reply_tokens
from tests.e2e.engine_cases import GREEDY_KINDS, JSON_SCHEMA_BODY, SCHEMA, STRUCTURED_PROMPT, assert_echoed
from tests.e2e.processes import Proc, Processes
from tests.polling import eventually, eventually_true

N = 10
MODEL = "tiny-qwen2-vl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SglangStack:
    mode: str
    base_url: str
    up: Proc
    nats_url: str = ""
    metrics: dict[str, str] = field(default_factory=dict)
    code: int | None = None

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0)


@contextlib.contextmanager
def sglang_up(tmp: Path, mmpipe_home: Path, mode: str, *flags: str) -> Iterator[SglangStack]:
    """``mmpipe up --engine sglang`` of ``mode`` until the block ends (SIGINT; its exit code in ``code``)."""
    port = _free_port()
    procs = Processes(tmp, mmpipe_home)
    up = procs.start(
        "up", "--mode", mode, "--engine", "sglang", "--model", MODEL, "--port", str(port),
        "--data-dir", str(tmp / "data"), "--transport", "nats", "--log-level", "INFO", *flags,
    )  # fmt: skip
    stack = SglangStack(mode, f"http://127.0.0.1:{port}", up)
    try:
        stack.nats_url, stack.metrics = up.up_ready()
        yield stack
    finally:
        stack.code = up.stop(signal.SIGINT, timeout_s=90)
        procs.stop_all()


@pytest.fixture(scope="module")
def model_dir(mmpipe_home: Path) -> Path:
    from stages.models import builtin_path

    return Path(builtin_path(MODEL))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    return make_reference(model_dir)


@pytest.fixture(scope="module", params=["epd", "e-pd", "e-p-d", "ep-d"])
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, mmpipe_home: Path
) -> Iterator[SglangStack]:
    with sglang_up(tmp_path_factory.mktemp(f"sglang-{request.param}"), mmpipe_home, request.param) as stack:
        yield stack
    assert stack.code == 0, stack.up.text()[-3000:]


async def _ask(stack: SglangStack, content: Any, stream: bool, n: int = N) -> tuple[list[int], str]:
    """(token ids as the reply stream holds them, text) of one greedy request of n tokens."""
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": n,
        "temperature": 0,
        "extra_body": {"min_tokens": n},
    }
    async with stack.client() as c:
        if stream:
            raw = await c.chat.completions.with_raw_response.create(stream=True, **kw)
            chunks = [chunk async for chunk in raw.parse()]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        else:
            raw = await c.chat.completions.with_raw_response.create(**kw)
            reply = raw.parse()
            text = reply.choices[0].message.content or ""
            assert reply.usage is not None and reply.usage.completion_tokens == n
    return await reply_tokens(stack.nats_url, raw.headers["x-request-id"]), text


def _image(seed: int) -> Any:
    return gradient(56 + 8 * seed, 48 + 16 * seed, seed)


def _image_content(image: Any, text: str = "What is in the picture?") -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": png_data_url(image)}}, {"type": "text", "text": text}]


async def test_text_streamed_and_not_equals_generate(stack: SglangStack, reference: Any) -> None:
    tokens, text = reference("Say something about the sea.", [], N)
    for stream in (True, False):
        assert await _ask(stack, "Say something about the sea.", stream) == (tokens, text)


async def test_an_image_streamed_and_not_equals_generate(stack: SglangStack, reference: Any) -> None:
    one = _image(1)
    tokens, text = reference(_image_content(one), [one], N)
    assert len(set(tokens)) > 1
    for stream in (True, False):
        assert await _ask(stack, _image_content(one), stream) == (tokens, text)


async def test_two_images_and_concurrent_requests(stack: SglangStack, reference: Any) -> None:
    """At once, streamed and not: a prompt of two images, one of the second
    alone, and one of text; each gets generate()'s tokens."""
    first, second = _image(2), _image(3)
    two = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": png_data_url(first)}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": png_data_url(second)}},
    ]
    contents: list[Any] = [two, _image_content(second, "And this?"), "Tell me a joke."]
    media = [[first, second], [second], []]
    expected = [reference(c, m, N) for c, m in zip(contents, media, strict=True)]
    got = await asyncio.gather(*(_ask(stack, c, stream=i % 2 == 0) for i, c in enumerate(contents)))
    assert got == expected


async def test_usage_counts_the_prompt_tokens_sglangs_prefix_cache_held(stack: SglangStack) -> None:
    """``usage.prompt_tokens_details.cached_tokens`` is SGLang's own count
    (RadixAttention, token by token): the first time a prompt is seen only
    what it shares with earlier prompts (the chat template's start), the
    second time nearly all of it (streamed, with the usage asked for)."""
    text = f"{stack.mode} cached: " + "The river runs past the mill and under the old stone bridge. " * 8

    async def ask() -> tuple[int, int]:
        async with stack.client() as c:
            chunks = await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": text}],
                max_tokens=2,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = [chunk async for chunk in chunks][-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return usage.prompt_tokens, int(usage.prompt_tokens_details.cached_tokens or 0)

    prompt_tokens, first = await ask()
    assert prompt_tokens > 64 and first < prompt_tokens // 2
    again, second = await ask()
    assert again == prompt_tokens and prompt_tokens - 2 <= second < prompt_tokens


async def test_a_client_going_away_aborts_the_sglang_request(stack: SglangStack) -> None:
    async with stack.client() as c:
        chunks = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Go on and on."}],
            max_tokens=2000,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        await anext(aiter(chunks))
        await chunks.close()
    await eventually(lambda: "sglang_request_aborted" in stack.up.text(), within=30)
    # The worker serves on after it.
    ids, _ = await _ask(stack, "Still there?", stream=False, n=2)
    assert len(ids) == 2


async def test_what_sglang_is_not_given_yet_is_a_400_with_a_code(stack: SglangStack, model_dir: Path) -> None:
    """Prompt embeddings are refused with the stable code, naming the engine;
    the prompt's logprobs (echo with logprobs) are SGLang's own where one
    worker prefills and decodes (generate()'s raw ones), a 400 where
    prefill and decode are apart."""
    import base64
    import io

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from stages.torch_engine.reference import reference_prompt_logprobs

    hidden = AutoConfig.from_pretrained(str(model_dir)).get_text_config().hidden_size
    embeds = io.BytesIO()
    torch.save(torch.zeros(3, hidden), embeds)
    async with stack.client() as c:
        with pytest.raises(openai.BadRequestError) as caught:
            await c.completions.create(
                model=MODEL,
                prompt="",
                max_tokens=2,
                extra_body={"prompt_embeds": base64.b64encode(embeds.getvalue()).decode()},
            )
    body = caught.value.body
    assert isinstance(body, dict) and body.get("code") == "invalid_request"
    assert re.search(r"prompt_embeds .*--engine sglang", str(body.get("message")))

    prompt = "The sea and the mountains are"
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer(prompt)["input_ids"]
    said, top = reference_prompt_logprobs(model_dir, ids, 1)
    echoed: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    echoed |= {"echo": True, "logprobs": 1}
    async with stack.client() as c:
        if stack.mode in ("epd", "e-pd"):
            done = await c.completions.create(**echoed)
            assert_echoed(done, prompt, ids, said)
            lp = done.choices[0].logprobs
            assert lp is not None and lp.top_logprobs is not None
            assert [list(best or {}) for best in lp.top_logprobs[1 : len(ids)]] == [
                [tokenizer.decode([t]) for t in ts] for ts in top
            ]
        else:
            with pytest.raises(openai.BadRequestError, match="prefills and decodes"):
                await c.completions.create(**echoed)


async def test_logprobs_penalties_bias_and_stop_ids_are_passed_to_sglang(stack: SglangStack, model_dir: Path) -> None:
    """SGLang's own logprobs (raw, as generate()'s logits give them),
    presence and frequency penalties with a logit bias, a repetition
    penalty and a stop token id, asked through mmpipe: generate()'s tokens
    with the same logits processors."""
    from transformers import AutoTokenizer

    from stages.torch_engine.reference import (
        load_reference_model,
        reference_logprobs,
        reference_penalized,
        reference_stopped,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_reference_model(model_dir)
    prompt = "The sea and the mountains are"
    ids = tokenizer(prompt)["input_ids"]
    tokens, want, top2 = reference_logprobs(model_dir, ids, N, 2, model=model)
    async with stack.client() as c:
        for stream in (False, True):
            kw: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": N, "temperature": 0, "logprobs": 2}
            kw["extra_body"] = {"min_tokens": N}
            if stream:
                parts = [chunk async for chunk in await c.completions.create(stream=True, **kw)]
                token_logprobs = [lp for p in parts if p.choices and p.choices[0].logprobs
                                  for lp in p.choices[0].logprobs.token_logprobs or []]  # fmt: skip
                assert token_logprobs == pytest.approx(want, abs=1e-3)
                continue
            done = await c.completions.create(**kw)
            lp = done.choices[0].logprobs
            assert lp is not None and lp.tokens == [tokenizer.decode([t]) for t in tokens]
            assert lp.token_logprobs == pytest.approx(want, abs=1e-3)
            assert lp.top_logprobs is not None
            assert [list(top) for top in lp.top_logprobs] == [[tokenizer.decode([t]) for t in ts] for ts in top2]
    count = 24
    penalized = reference_penalized(model_dir, ids, count, -2.0, -1.0, bias={ids[-1]: 2.0}, model=model)
    repeated = reference_penalized(model_dir, ids, count, repetition=1.3, model=model)
    unstopped = reference_stopped(model_dir, ids, count, [], model=model)
    stop = next(t for i, t in enumerate(unstopped[:-1]) if i and t not in unstopped[:i])  # not a final EOS
    stopped = reference_stopped(model_dir, ids, count, [stop], model=model)
    async with stack.client() as c:
        base: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": count, "temperature": 0}
        done = await c.completions.create(
            **base,
            presence_penalty=-2.0,
            frequency_penalty=-1.0,
            extra_body={"min_tokens": count, "logit_bias": {str(ids[-1]): 2.0}},
        )
        assert done.choices[0].text == tokenizer.decode(penalized, skip_special_tokens=True)
        done = await c.completions.create(**base, extra_body={"min_tokens": count, "repetition_penalty": 1.3})
        assert done.choices[0].text == tokenizer.decode(repeated, skip_special_tokens=True)
        done = await c.completions.create(**base, extra_body={"stop_token_ids": [stop]})
    assert (done.choices[0].text, done.choices[0].finish_reason) == (
        tokenizer.decode(stopped[:-1], skip_special_tokens=True),
        "stop",
    )
    # A stop string (mmpipe's, on the text) ends the answer before it and
    # aborts the SGLang request that would have gone on.
    whole = tokenizer.decode(unstopped, skip_special_tokens=True)
    word = whole[len(whole) // 2 : len(whole) // 2 + 3]
    aborted = stack.up.text().count('"sglang_request_aborted"')
    async with stack.client() as c:
        done = await c.completions.create(**base, stop=[word])
    assert (done.choices[0].text, done.choices[0].finish_reason) == (whole[: whole.index(word)], "stop")
    await eventually(lambda: stack.up.text().count('"sglang_request_aborted"') > aborted, within=30)


async def test_structured_output_is_passed_to_sglang(stack: SglangStack, model_dir: Path) -> None:
    """mmpipe's grammar of each kind (a regex, vLLM's choice, a JSON schema)
    as SGLang's EBNF: greedy, generate()'s tokens under xgrammar's own
    processor; the JSON answer parses and validates."""
    import jsonschema
    from transformers import AutoTokenizer

    from schemas.request import StructuredOutput
    from stages.torch_engine.reference import load_reference_model, reference_structured

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_reference_model(model_dir)
    ids = tokenizer(STRUCTURED_PROMPT)["input_ids"]
    kinds = [*GREEDY_KINDS, (JSON_SCHEMA_BODY, StructuredOutput("json", json.dumps(SCHEMA)))]
    async with stack.client() as c:
        for extra, spec in kinds:
            want = reference_structured(model_dir, ids, 64, spec, model=model)
            done = await c.completions.create(
                model=MODEL, prompt=STRUCTURED_PROMPT, max_tokens=64, temperature=0, extra_body=extra
            )
            assert done.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), extra
            if spec.kind == "json" and done.choices[0].finish_reason == "stop":
                jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)


def _sglang_metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The mmpipe_sglang_* samples on a worker's /metrics, by name and labels."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("mmpipe_sglang_")
    }


async def test_the_worker_metrics_count_sglangs_tokens_and_show_its_load(stack: SglangStack) -> None:
    """A request's prompt tokens (computed and RadixAttention's), its
    generated tokens and SGLang's load (its snapshots) on the worker's
    /metrics, by role."""
    role = {"epd": "encode+prefill+decode", "e-pd": "prefill+decode"}.get(stack.mode, "decode")
    url = stack.metrics[role]
    labels = (("role", role),)

    def value(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **extra: str) -> float:
        return metrics.get((name, tuple(sorted([*labels, *extra.items()]))), 0.0)

    before = await asyncio.to_thread(_sglang_metrics, url)
    assert ("mmpipe_sglang_kv_cache_usage", labels) in before
    prompt = f"{stack.mode} metrics: " + "Count the boats on the lake, one by one. " * 4
    async with stack.client() as c:
        reply = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=N,
            temperature=0,
            extra_body={"min_tokens": N},
        )
    assert reply.usage is not None
    prompt_tokens = reply.usage.prompt_tokens

    async def counted() -> bool:
        # Counted as SGLang's request ends, which may be just after the
        # answer's last chunk went out.
        after = await asyncio.to_thread(_sglang_metrics, url)
        name = "mmpipe_sglang_generation_tokens_total"
        generated = value(after, name) - value(before, name)
        prompt = sum(
            value(after, "mmpipe_sglang_prompt_tokens_total", source=source)
            - value(before, "mmpipe_sglang_prompt_tokens_total", source=source)
            for source in ("local_compute", "local_cache_hit")
        )
        return generated >= N and prompt >= prompt_tokens

    await eventually_true(counted, within=30, what="the request's tokens in SGLang's metrics")
    # The load gauges follow SGLang's snapshots: a request running shows.
    async with stack.client() as c:
        chunks = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Go on and on about the boats."}],
            max_tokens=2000,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        await anext(aiter(chunks))

        async def running() -> bool:
            metrics = await asyncio.to_thread(_sglang_metrics, url)
            return value(metrics, "mmpipe_sglang_running_requests") >= 1

        await eventually_true(running, within=30, what="SGLang's running request in the metrics")
        await chunks.close()
