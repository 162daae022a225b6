"""The official openai client against the bridge, over a real nats-server and
the real tiny model; every answer must equal transformers ``generate()``."""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import aiohttp
import openai
import pytest
from PIL import Image

from pipeline import metrics
from pipeline.config import PipelineConfig
from pipeline.health import LIVE_PATH, READY_PATH
from schemas.codec import Decoder
from schemas.control import DeadLetter
from stages.models import ModelSpec
from tests.e2e.conftest import N, Stack, ask, client, gradient, image_content, png_data_url, start_stack


@pytest.mark.e2e
async def test_image_by_data_url_streamed_and_not_equals_generate(stack: Stack, reference: Any) -> None:
    image = gradient(64, 48, 1)
    content = image_content(png_data_url(image))
    _, expected = reference(content, [image])
    async with client(stack) as c:
        assert await ask(c, content, stream=True) == (expected, N)
        assert await ask(c, content, stream=False) == (expected, N)


@pytest.mark.e2e
async def test_image_by_http_url_and_text_only(stack: Stack, reference: Any, image_server: str) -> None:
    image = gradient(40, 56, 0)  # what image_server serves as /img0.png
    content = image_content(f"{image_server}/img0.png")
    _, expected = reference(content, [image])
    _, expected_text = reference("Say something.", [])
    async with client(stack) as c:
        assert await ask(c, content, stream=True) == (expected, N)
        assert await ask(c, "Say something.", stream=False) == (expected_text, N)


@pytest.mark.e2e
async def test_eight_concurrent_requests_get_their_own_answers(stack: Stack, reference: Any, image_server: str) -> None:
    contents, expected = [], []
    for i in range(8):
        image = gradient(40 + 16 * i, 56 + 8 * i, i)
        content = image_content(f"{image_server}/img{i}.png", f"Picture {i}?")
        contents.append(content)
        expected.append((reference(content, [image])[1], N))
    async with client(stack) as c:
        got = await asyncio.gather(*(ask(c, content, stream=i % 2 == 0) for i, content in enumerate(contents)))
    assert got == expected
    assert len(set(expected)) > 1  # the images really differ in what they give


def _bad(url: str) -> list[dict[str, Any]]:
    return image_content(url)


def _gif() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="GIF")
    return "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.e2e
async def test_bad_input_gets_its_status_and_code_and_the_worker_keeps_serving(
    pipeline_config: PipelineConfig, model_spec: ModelSpec, reference: Any
) -> None:
    stack, stop = await start_stack(pipeline_config, model_spec, allow_internal=False)
    cases: list[tuple[str, Any, dict[str, Any], int, str]] = [
        ("malformed base64", _bad("data:image/png;base64,@@not-base64@@"), {}, 400, "invalid_media"),
        (
            "not an image",
            _bad("data:image/png;base64," + base64.b64encode(b"hello world" * 10).decode()),
            {},
            400,
            "invalid_media",
        ),
        ("gif", _bad(_gif()), {}, 422, "unsupported_media"),
        ("private address", _bad("http://127.0.0.1:9/x.png"), {}, 400, "url_not_allowed"),
        ("private https", _bad("https://10.1.2.3/x.png"), {}, 400, "url_not_allowed"),
        ("max_tokens beyond context", "hi", {"max_tokens": 10**7}, 400, "context_length_exceeded"),
        ("temperature", "hi", {"temperature": 7.0}, 400, "invalid_request"),
        (
            "video not enabled",
            [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}],
            {},
            422,
            "unsupported_media",
        ),
        (
            "audio not enabled",
            [{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}],
            {},
            422,
            "unsupported_media",
        ),
    ]
    try:
        async with client(stack) as c:
            for name, content, kw, status, code in cases:
                with pytest.raises(openai.APIStatusError) as info:
                    await c.chat.completions.create(
                        model="tiny-qwen2-vl",
                        messages=[{"role": "user", "content": content}],
                        **{"max_tokens": 4, **kw},
                    )
                assert (info.value.status_code, info.value.body["code"]) == (status, code), name  # type: ignore[index]
            with pytest.raises(openai.NotFoundError) as nf:
                await c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
            assert nf.value.body["code"] == "model_not_found"  # type: ignore[index]
            # Still serving, and right.
            _, expected = reference("Say something.", [])
            assert await ask(c, "Say something.", stream=True) == (expected, N)
        js = stack.nc.jetstream()
        info = await js.stream_info(pipeline_config.subjects.dead_stream)
        decoder = Decoder(DeadLetter)
        dead = [
            decoder.decode((await js.get_msg(pipeline_config.subjects.dead_stream, s)).data)
            for s in range(info.state.first_seq, info.state.last_seq + 1)
        ]
        # Each bad request was dead-lettered exactly once, after one delivery.
        assert len(dead) == len(cases) and len({d.request_id for d in dead}) == len(cases)
        assert all(d.deliveries == 1 for d in dead)
        for role in ("processor", "encode+prefill+decode"):
            state = (await js.stream_info(pipeline_config.subjects.stream(role))).state
            assert state.messages == 0, role
    finally:
        await stop()


@pytest.mark.e2e
async def test_client_disconnect_cancels_generation(stack: Stack) -> None:
    stage = stack.workers[1].stage
    async with client(stack) as c:
        s = await c.chat.completions.create(
            model="tiny-qwen2-vl",
            messages=[{"role": "user", "content": "Tell a long story."}],
            max_tokens=2000,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in s:
            break
        await s.close()
    js = stack.nc.jetstream()
    hop_stream = stack.config.subjects.stream("encode+prefill+decode")
    for _ in range(200):
        # Cancelled work leaves the decode loop and is acked, not redelivered.
        pending = (await js.stream_info(hop_stream)).state.messages
        if stage.engine.scheduler.active == 0 and pending == 0:  # type: ignore[attr-defined]
            break
        await asyncio.sleep(0.05)
    assert stage.engine.scheduler.active == 0  # type: ignore[attr-defined]
    assert pending == 0
    tokens = metrics.TOKENS.labels("encode+prefill+decode")._value.get()
    await asyncio.sleep(0.3)
    assert metrics.TOKENS.labels("encode+prefill+decode")._value.get() == tokens  # nothing is generated any more


@pytest.mark.e2e
async def test_a_model_by_name_and_errors_for_routes_and_methods_it_does_not_serve(stack: Stack) -> None:
    async with client(stack) as c:
        model = await c.models.retrieve("tiny-qwen2-vl")
        assert (model.id, model.object) == ("tiny-qwen2-vl", "model")
        with pytest.raises(openai.NotFoundError) as missing:
            await c.models.retrieve("gpt-4o")
        assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    async with aiohttp.ClientSession() as http:
        # OpenAI error objects, not aiohttp's plain text, so a client can read them.
        async with http.post(f"{stack.base_url}/v1/embeddings", json={"input": "x"}) as r:
            body = await r.json()
            assert (
                r.status == 404
                and body["error"]["code"] == "not_found"
                and "/v1/embeddings" in body["error"]["message"]
            )
        async with http.get(f"{stack.base_url}/v1/chat/completions") as r:
            body = await r.json()
            assert r.status == 405 and body["error"]["code"] == "method_not_allowed"
            assert r.headers["Allow"] == "POST"
        async with http.get(f"{stack.base_url}/metrics") as r:
            scraped = await r.text()
    # Counted by route: a made-up path is no series of its own.
    assert 'path="unmatched",status="404"' in scraped and "/v1/embeddings" not in scraped
    assert 'path="/v1/models/{model}",status="404"' in scraped


@pytest.mark.e2e
async def test_models_health_and_metrics(stack: Stack) -> None:
    async with client(stack) as c:
        models = await c.models.list()
    assert [m.id for m in models.data] == ["tiny-qwen2-vl"]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.base_url}/health") as r:
            body = await r.json()
            assert r.status == 200 and body["status"] == "ready"
        async with http.get(f"{stack.base_url}/metrics") as r:
            assert r.status == 200 and "mmpipe_http_requests_total" in await r.text()
        async with http.post(f"{stack.base_url}/v1/chat/completions", data=b"{not json") as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_request"
        async with http.post(
            f"{stack.base_url}/v1/chat/completions", json={"model": "tiny-qwen2-vl", "messages": [], "bogus": 1}
        ) as r:
            assert r.status == 400 and "bogus" in (await r.json())["error"]["message"]
    # With no worker of the route alive, health says so; the bridge stays
    # ready (in a load balancer's pool) and answers an OpenAI-style 503 itself.
    for worker in stack.workers:
        worker.stop()
    await asyncio.sleep(1.5)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.base_url}/health") as r:
            assert r.status == 503
        for path in (READY_PATH, LIVE_PATH):
            async with http.get(f"{stack.base_url}{path}") as r:
                assert r.status == 200, path
    async with client(stack) as c:
        with pytest.raises(openai.APIStatusError) as refused:
            await c.chat.completions.create(
                model="tiny-qwen2-vl", messages=[{"role": "user", "content": "Hello?"}], max_tokens=2
            )
    assert refused.value.status_code == 503
    assert refused.value.body["code"] == "no_workers"  # type: ignore[index]


@pytest.mark.e2e
async def test_completions_take_a_prompt_as_it_is_with_generates_tokens(stack: Stack) -> None:
    """``/v1/completions`` through the official client: the prompt's own
    tokens (no chat template), as text or ids, streamed or not, echoed on
    request; exactly generate()'s tokens."""
    from transformers import AutoTokenizer

    from stages.torch_engine.reference import reference_generate

    model_dir = stack.spec.path
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = "The sea and the mountains are"
    ids = tokenizer(prompt)["input_ids"]
    text = tokenizer.decode(reference_generate(model_dir, ids, [], N, min_new_tokens=N), skip_special_tokens=True)
    kw: dict[str, Any] = {"model": "tiny-qwen2-vl", "max_tokens": N, "temperature": 0, "extra_body": {"min_tokens": N}}
    async with client(stack) as c:
        done = await c.completions.create(prompt=prompt, **kw)
        assert (done.object, done.choices[0].text, done.choices[0].finish_reason) == ("text_completion", text, "length")
        assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), N)
        pieces, usage = [], None
        async for chunk in await c.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw
        ):
            pieces += [choice.text for choice in chunk.choices]
            usage = chunk.usage or usage
        assert "".join(pieces) == text and usage is not None and usage.completion_tokens == N
        # vLLM's continuous usage: the usage so far on every chunk, then the usage chunk.
        counts, prompts = [], set()
        async for chunk in await c.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw
        ):
            assert chunk.usage is not None
            counts.append(chunk.usage.completion_tokens)
            prompts.add(chunk.usage.prompt_tokens)
            assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        assert counts == [*range(1, N + 1), N] and prompts == {len(ids)}
        # The same prompt as token ids, and as a list of one.
        assert (await c.completions.create(prompt=ids, **kw)).choices[0].text == text
        assert (await c.completions.create(prompt=[prompt], **kw)).choices[0].text == text
        assert (await c.completions.create(prompt=prompt, echo=True, **kw)).choices[0].text == prompt + text
        for bad, says in [
            ({"prompt": []}, "non-empty list"),
            ({"prompt": prompt, "n": 0}, "between 1 and 128"),
            ({"prompt": [prompt, prompt], "n": 65}, "between 1 and 128; it is 130"),
            ({"prompt": prompt, "n": 2, "best_of": 3}, "best_of"),
            ({"prompt": [10**9]}, "outside the vocabulary"),
            ({"prompt": ids, "echo": True}, "echo takes a text prompt"),
        ]:
            with pytest.raises(openai.BadRequestError) as refused:
                await c.completions.create(**{**kw, **bad})
            assert refused.value.body["code"] == "invalid_request" and says in refused.value.body["message"]  # type: ignore[index]
        # A chat message's name is taken (the template has it); what mmpipe cannot do yet is refused, not dropped.
        messages: Any = [{"role": "user", "content": "Hello", "name": "ann"}]
        assert (await c.chat.completions.create(messages=messages, user="u-1", **kw)).choices[0].message.content
        # continuous_usage_stats without include_usage: no usage at all, as in vLLM.
        async for chunk in await c.chat.completions.create(
            messages=messages, stream=True, stream_options={"continuous_usage_stats": True}, **kw
        ):
            assert chunk.usage is None


@pytest.mark.e2e
async def test_several_choices_and_prompts_in_one_request(stack: Stack, reference: Any) -> None:
    """``n`` choices and a list of prompts, as vLLM's clients send them: one
    queued request a choice, choice ``i * n + j`` the ``j``-th of prompt
    ``i``, each exactly generate()'s answer, the usage counting each prompt
    once; with a seed, choice ``k`` samples as a request of ``seed + k``."""
    from transformers import AutoTokenizer

    from stages.torch_engine.metrics import PREFILL_FORKS
    from stages.torch_engine.reference import reference_generate

    model_dir = stack.spec.path
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = ["The sea and the mountains are", "Once upon a time"]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    texts = [
        tokenizer.decode(reference_generate(model_dir, i, [], N, min_new_tokens=N), skip_special_tokens=True)
        for i in ids
    ]
    assert texts[0] != texts[1]
    kw: dict[str, Any] = {"model": "tiny-qwen2-vl", "max_tokens": N, "temperature": 0, "extra_body": {"min_tokens": N}}
    async with client(stack) as c:
        done = await c.completions.create(prompt=prompts, n=2, **kw)
        assert [(ch.index, ch.text) for ch in done.choices] == list(enumerate([texts[0]] * 2 + [texts[1]] * 2))
        assert done.usage is not None
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids[0]) + len(ids[1]), 4 * N)
        # Streamed: each choice's pieces under its index, the usage chunk after all of them.
        pieces: dict[int, str] = {}
        usage = None
        async for chunk in await c.completions.create(
            prompt=[ids[1], prompts[0]], stream=True, stream_options={"include_usage": True}, echo=False, **kw
        ):
            for ch in chunk.choices:
                pieces[ch.index] = pieces.get(ch.index, "") + ch.text
            usage = chunk.usage or usage
        assert pieces == {0: texts[1], 1: texts[0]}
        assert usage is not None and usage.completion_tokens == 2 * N
        # Echo, per prompt.
        echoed = await c.completions.create(prompt=prompts, echo=True, **kw)
        assert [ch.text for ch in echoed.choices] == [p + t for p, t in zip(prompts, texts, strict=True)]

        # Chat: n choices of one conversation, streamed, the role on each choice's first delta.
        content, expected = "Say something.", reference("Say something.", [])[1]
        roles: dict[int, str] = {}
        said: dict[int, str] = {}
        async for chunk in await c.chat.completions.create(
            messages=[{"role": "user", "content": content}], n=3, stream=True, **kw
        ):
            for ch in chunk.choices:
                said[ch.index] = said.get(ch.index, "") + (ch.delta.content or "")
                if ch.delta.role:
                    roles[ch.index] = ch.delta.role
        assert said == {0: expected, 1: expected, 2: expected} and roles == dict.fromkeys(range(3), "assistant")

        # Sampled with a seed: choice k is what a request of seed + k gives.
        sampled: dict[str, Any] = {**kw, "temperature": 0.8, "max_tokens": 12, "extra_body": {"min_tokens": 12}}
        forks = PREFILL_FORKS._value.get()
        many = await c.completions.create(prompt=prompts[0], n=4, seed=7, **sampled)
        # The one worker took the four together: one prefill, three forks of it.
        assert PREFILL_FORKS._value.get() - forks == 3
        alone = [
            (await c.completions.create(prompt=prompts[0], seed=7 + k, **sampled)).choices[0].text for k in range(4)
        ]
        assert [ch.text for ch in many.choices] == alone
        assert len(set(alone)) > 1  # the seeds really differ


@pytest.mark.e2e
async def test_logprobs_are_generates_own(stack: Stack) -> None:
    """Each token's logprob and its step's most likely tokens, as
    transformers' raw logits give them (vLLM's default raw logprobs), in
    chat's shape and in the text completion's legacy one, streamed or not,
    for every choice."""
    from transformers import AutoTokenizer

    from stages.torch_engine.reference import reference_logprobs

    model_dir = stack.spec.path
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer("The sea and the mountains are")["input_ids"]
    tokens, want, top3 = reference_logprobs(model_dir, ids, N, 3)
    kw: dict[str, Any] = {"model": "tiny-qwen2-vl", "max_tokens": N, "temperature": 0, "extra_body": {"min_tokens": N}}
    async with client(stack) as c:
        done = await c.completions.create(prompt=ids, logprobs=3, n=2, **kw)
        for choice in done.choices:
            lp = choice.logprobs
            assert lp is not None and lp.tokens == [tokenizer.decode([t]) for t in tokens]
            assert lp.token_logprobs == pytest.approx(want, abs=1e-5)
            assert lp.top_logprobs is not None
            assert [list(top) for top in lp.top_logprobs] == [[tokenizer.decode([t]) for t in ts] for ts in top3]
            starts = [0]
            for token in lp.tokens[:-1]:
                starts.append(starts[-1] + len(token))
            assert lp.text_offset == starts
        # Chat, streamed: the same logprobs, token by token, with their bytes.
        content: list[Any] = []
        async for chunk in await c.chat.completions.create(
            messages=[{"role": "user", "content": "Say something."}], logprobs=True, top_logprobs=2, stream=True, **kw
        ):
            for choice in chunk.choices:
                if choice.logprobs is not None and choice.logprobs.content:
                    content += choice.logprobs.content
        assert len(content) == N
        for entry in content:
            assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the best is the one taken
        # Not asked for: none.
        plain = await c.completions.create(prompt=ids, **kw)
        assert plain.choices[0].logprobs is None
        for bad, says in [
            ({"logprobs": 21}, "between 0 and 20"),
        ]:
            with pytest.raises(openai.BadRequestError) as refused:
                await c.completions.create(**{"prompt": ids, **kw, **bad})
            assert says in refused.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
            await c.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], top_logprobs=2, **kw)


@pytest.mark.e2e
async def test_echo_with_logprobs_gives_the_prompts_own(stack: Stack) -> None:
    """``echo`` with ``logprobs``: the prompt's tokens first, each after the
    first with its logprob under one forward of the prompt (transformers'
    logits), then the answer's, offsets running over the whole text; the
    same in the first streamed chunk."""
    from transformers import AutoTokenizer

    from stages.torch_engine.reference import reference_logprobs, reference_prompt_logprobs

    model_dir = stack.spec.path
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = "The sea and the mountains are"
    ids = tokenizer(prompt)["input_ids"]
    said, best = reference_prompt_logprobs(model_dir, ids, 2)
    tokens, want, _ = reference_logprobs(model_dir, ids, N, 2)
    kw: dict[str, Any] = {"model": "tiny-qwen2-vl", "max_tokens": N, "temperature": 0, "extra_body": {"min_tokens": N}}

    def check(lp: Any) -> None:
        assert lp.tokens == [tokenizer.decode([t]) for t in [*ids, *tokens]]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx([*said, *want], abs=1e-5)
        assert [list(top) for top in lp.top_logprobs[1 : len(ids)]] == [
            [tokenizer.decode([t]) for t in ts] for ts in best
        ]
        starts = [0]
        for token in lp.tokens[:-1]:
            starts.append(starts[-1] + len(token))
        assert lp.text_offset == starts

    async with client(stack) as c:
        done = await c.completions.create(prompt=prompt, echo=True, logprobs=2, **kw)
        assert done.choices[0].text == prompt + tokenizer.decode(tokens, skip_special_tokens=True)
        check(done.choices[0].logprobs)
        merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        async for chunk in await c.completions.create(prompt=prompt, echo=True, logprobs=2, stream=True, **kw):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    for key, values in merged.items():
                        values += getattr(choice.logprobs, key)
        check(type("Merged", (), merged)())
        # Echo without logprobs: no logprobs at all; logprobs without echo: the answer's only.
        plain = await c.completions.create(prompt=prompt, echo=True, **kw)
        assert plain.choices[0].logprobs is None
        answer = await c.completions.create(prompt=prompt, logprobs=2, **kw)
        assert answer.choices[0].logprobs is not None and len(answer.choices[0].logprobs.tokens or []) == N
        with pytest.raises(openai.BadRequestError, match="text prompt"):
            await c.completions.create(prompt=ids, echo=True, logprobs=1, **kw)


@pytest.mark.e2e
async def test_penalties_and_logit_bias_are_generates_with_the_same_processors(stack: Stack) -> None:
    """OpenAI's presence and frequency penalties (on the tokens generated so
    far) and ``logit_bias``: exactly the tokens of ``generate()`` with a
    logits processor of the same formula and its own ``sequence_bias``."""
    from transformers import AutoTokenizer

    from stages.torch_engine.reference import load_reference_model, reference_penalized

    count = 48  # long enough for greedy decoding of random weights to repeat a token
    model_dir = stack.spec.path
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_reference_model(model_dir)
    ids = tokenizer("The sea and the mountains are")["input_ids"]
    plain = reference_penalized(model_dir, ids, count, model=model)
    favoured, banned = plain[1] + 7, plain[0]
    cases: list[tuple[dict[str, Any], list[int]]] = [
        (
            {"frequency_penalty": 1.5, "presence_penalty": 0.5},
            reference_penalized(model_dir, ids, count, 0.5, 1.5, model=model),
        ),
        (
            {"presence_penalty": -2.0, "frequency_penalty": -1.0},
            reference_penalized(model_dir, ids, count, -2.0, -1.0, model=model),
        ),
        (
            {"logit_bias": {str(favoured): 3.0, str(banned): -100}},
            reference_penalized(model_dir, ids, count, bias={favoured: 3.0, banned: -100.0}, model=model),
        ),
    ]
    kw: dict[str, Any] = {"model": "tiny-qwen2-vl", "max_tokens": count, "temperature": 0}
    async with client(stack) as c:
        for fields, want in cases:
            assert want != plain, fields  # the knob changes the answer
            body = {"min_tokens": count, **({"logit_bias": fields["logit_bias"]} if "logit_bias" in fields else {})}
            sampling = {k: v for k, v in fields.items() if k != "logit_bias"}
            done = await c.completions.create(prompt=ids, extra_body=body, **sampling, **kw)
            assert done.choices[0].text == tokenizer.decode(want, skip_special_tokens=True), fields
        for bad, says in [
            ({"frequency_penalty": 2.5}, "frequency_penalty must be within [-2, 2]"),
            ({"extra_body": {"logit_bias": {"x": 1}}}, "is not a token id"),
            ({"extra_body": {"logit_bias": {"5": 101}}}, "within [-100, 100]"),
            ({"extra_body": {"logit_bias": {str(10**9): 1}}}, "outside the vocabulary"),
        ]:
            with pytest.raises(openai.BadRequestError) as refused:
                await c.completions.create(prompt=ids, **{**kw, **bad})
            assert says in refused.value.body["message"]  # type: ignore[index]


@pytest.mark.e2e
async def test_repetition_penalty_min_p_and_stop_token_ids_are_generates(stack: Stack) -> None:
    """vLLM's ``repetition_penalty`` (over the prompt and the output) is
    generate()'s own; ``min_p`` 1 keeps only the most likely token, so a
    sample at temperature 1 is the greedy answer; ``stop_token_ids`` end the
    answer as generate() ends it with them among its EOS ids, the stop token
    not in the text, and are masked below ``min_tokens``."""
    from transformers import AutoTokenizer

    from stages.torch_engine.reference import load_reference_model, reference_penalized, reference_stopped

    count = 48
    model_dir = stack.spec.path
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_reference_model(model_dir)
    ids = tokenizer("The sea and the mountains are")["input_ids"]
    plain = reference_penalized(model_dir, ids, count, model=model)
    kw: dict[str, Any] = {"model": "tiny-qwen2-vl", "max_tokens": count}

    def text(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=True)

    async with client(stack) as c:
        for penalty in (1.3, 0.6):
            want = reference_penalized(model_dir, ids, count, repetition=penalty, model=model)
            assert want != plain, penalty
            done = await c.completions.create(
                prompt=ids, temperature=0, extra_body={"min_tokens": count, "repetition_penalty": penalty}, **kw
            )
            assert done.choices[0].text == text(want), penalty
        sampled = {"temperature": 1.0, "seed": 11, "extra_body": {"min_tokens": count}}
        free = await c.completions.create(prompt=ids, **sampled, **kw)  # type: ignore[arg-type]
        assert free.choices[0].text != text(plain)  # sampling alone strays from greedy
        narrowed = await c.completions.create(
            prompt=ids, temperature=1.0, seed=11, extra_body={"min_tokens": count, "min_p": 1.0}, **kw
        )
        assert narrowed.choices[0].text == text(plain)

        unstopped = reference_stopped(model_dir, ids, count, [], model=model)
        eos = set(unstopped[-1:]) if len(unstopped) < count else set()
        at = next(i for i in range(1, len(unstopped)) if unstopped[i] not in unstopped[:i] and unstopped[i] not in eos)
        stop = unstopped[at]
        want = reference_stopped(model_dir, ids, count, [stop], model=model)
        assert want == unstopped[: at + 1]
        done = await c.completions.create(prompt=ids, temperature=0, extra_body={"stop_token_ids": [stop]}, **kw)
        assert (done.choices[0].text, done.choices[0].finish_reason) == (text(want[:-1]), "stop")
        assert done.usage is not None and done.usage.completion_tokens == len(want)
        streamed = ""
        async for chunk in await c.completions.create(
            prompt=ids, temperature=0, stream=True, extra_body={"stop_token_ids": [stop]}, **kw
        ):
            streamed += "".join(choice.text for choice in chunk.choices)
        assert streamed == text(want[:-1])
        later = reference_stopped(model_dir, ids, count, [stop], min_new_tokens=at + 2, model=model)
        assert len(later) > at + 1
        done = await c.completions.create(
            prompt=ids, temperature=0, extra_body={"stop_token_ids": [stop], "min_tokens": at + 2}, **kw
        )
        ended = later[:-1] if later[-1] == stop else later
        assert done.choices[0].text == text(ended)
        assert done.usage is not None and done.usage.completion_tokens == len(later)
        for bad, says in [
            ({"repetition_penalty": 0.0}, "repetition_penalty must be within (0, 2]"),
            ({"min_p": 1.5}, "min_p must be within [0, 1]"),
            ({"stop_token_ids": [10**9]}, "stop_token_ids: token ids outside the vocabulary"),
        ]:
            with pytest.raises(openai.BadRequestError) as refused:
                await c.completions.create(prompt=ids, extra_body=bad, **kw)
            assert says in refused.value.body["message"]  # type: ignore[index]
