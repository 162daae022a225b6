"""``POST /v1/images/generations`` through ``mmpipe up --image-model tiny-sd``
(every worker its own process, a generate-image worker beside the model's),
called with the official openai client: the images are the bytes diffusers'
own pipeline draws from the same seed; bad requests get OpenAI-style 400s
and the stack goes on serving. Then the two-stage route: a chat naming the
image model gets generate()'s text, then the image diffusers draws from
exactly that text, streamed or not."""

from __future__ import annotations

import asyncio
import base64
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from pipeline.connection import connect
from pipeline.replies import stored_chunks
from pipeline.subjects import Subjects
from schemas.chunk import ImageChunk
from schemas.codec import CONTENT_TYPE, MSGPACK, encode
from schemas.processed import ProcessedRequest
from schemas.request import GenerateRequest, ImageParams
from schemas.routes import GENERATE_IMAGE
from stages.image_engine.checkpoint import TINY_TEXT_TO_IMAGE, image_model_path
from tests.e2e.conftest import N
from tests.e2e.engine_crash import kill_tree, start_nats
from tests.e2e.processes import Processes
from tests.e2e.test_up import _free_port
from tests.stages.test_image_stage import _decoded, _reference

INLINE = 4096


def _png(url: str) -> tuple[str, tuple[int, int], bytes]:
    """A data: URL's PNG, read back: its mode, size and pixels."""
    head, _, data = url.partition(",")
    assert head == "data:image/png;base64"
    return _decoded(base64.b64decode(data))


@pytest.mark.e2e
def test_images_come_from_the_image_stage_as_diffusers_draws_them(
    tmp_path: Path, mmpipe_home: Path, reference: Any
) -> None:
    port = _free_port()
    procs = Processes(tmp_path, mmpipe_home)
    # Images over INLINE bytes go by reference (every 64x64 noise PNG is over it).
    flags = ["--data-dir", str(tmp_path / "data"), "--image-model", "tiny-sd", "--image-inline-bytes", str(INLINE)]
    up = procs.start("up", "--port", str(port), *flags)
    try:
        up.wait_for("mmpipe ready")
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as client:
            assert TINY_TEXT_TO_IMAGE in [m.id for m in client.models.list()]
            drawn = client.images.generate(
                model=TINY_TEXT_TO_IMAGE,
                prompt="a lighthouse at night",
                n=2,
                size="64x48",  # type: ignore[arg-type]
                response_format="b64_json",
                extra_body={"seed": 21, "num_inference_steps": 2, "guidance_scale": 6.0},
            )
            got = [base64.b64decode(image.b64_json or "") for image in drawn.data or []]
            params = ImageParams(prompt="a lighthouse at night", n=2, width=64, height=48, steps=2, guidance=6.0)
            assert [_decoded(g) for g in got] == _reference(image_model_path(TINY_TEXT_TO_IMAGE), params, 21)
            assert drawn.size == "64x48" and drawn.output_format == "png"
            # Over the inline limit (--image-inline-bytes, 1 MiB at most): the worker holds the
            # image and the bridge reads it through the tensor transport.
            big = client.images.generate(prompt="noise", extra_body={"seed": 4, "num_inference_steps": 1})
            [large] = [base64.b64decode(image.b64_json or "") for image in big.data or []]
            assert len(large) > INLINE
            assert [_decoded(large)] == _reference(
                image_model_path(TINY_TEXT_TO_IMAGE), ImageParams("noise", 1, 64, 64, 1, 7.5), 4
            )
            assert '"put_s"' in up.text()  # the worker's trace: the image went by reference
            # By URL: kept in the deployment's object store, fetched without the API key (its name is the secret).
            by_url = client.images.generate(
                model=TINY_TEXT_TO_IMAGE,
                prompt="a lighthouse at night",
                n=2,
                size="64x48",  # type: ignore[arg-type]
                response_format="url",
                extra_body={"seed": 21, "num_inference_steps": 2, "guidance_scale": 6.0},
            )
            urls = [image.url or "" for image in by_url.data or []]
            assert all(u.startswith(f"http://127.0.0.1:{port}/v1/images/files/") for u in urls) and len(set(urls)) == 2
            assert [urllib.request.urlopen(u, timeout=10).read() for u in urls] == got
            with pytest.raises(urllib.error.HTTPError) as gone:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/images/files/{'0' * 32}.png", timeout=10)
            assert gone.value.code == 404 and b'"not_found"' in gone.value.read()

            for bad, says in [
                ({"size": "60x60"}, "width 60"),
                ({"n": 0}, "n is 0"),
                ({"prompt": " "}, "needs a prompt"),
                ({"quality": "hd"}, "quality"),
                ({"size": "big"}, "size 'big'"),
            ]:
                body = {"model": TINY_TEXT_TO_IMAGE, "prompt": "a cat", **bad}
                with pytest.raises(openai.BadRequestError) as refused:
                    client.post("/images/generations", body=body, cast_to=dict)
                assert refused.value.status_code == 400 and says in refused.value.message, (bad, refused.value)
            with pytest.raises(openai.NotFoundError):
                client.images.generate(model="no-such-painter", prompt="a cat")
            # Still serving, the chat model too.
            again = client.images.generate(prompt="a cat", extra_body={"seed": 1, "num_inference_steps": 1})
            assert again.data and len(again.data) == 1
            chat = client.chat.completions.create(
                model="tiny-qwen2-vl", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
            )
            assert chat.choices[0].message.content is not None

            # The image model named in a chat: the served model writes the answer, the image stage draws it.
            ask: dict[str, Any] = {
                "model": TINY_TEXT_TO_IMAGE,
                "messages": [{"role": "user", "content": "Describe a painting of the sea."}],
                "max_tokens": N,
                "temperature": 0,
                "seed": 5,
                "extra_body": {"min_tokens": N},
            }
            text = reference("Describe a painting of the sea.", [], N)[1]
            want = _reference(image_model_path(TINY_TEXT_TO_IMAGE), ImageParams(text, 1, 64, 64, 30, 7.5), 5)[0]
            whole = client.chat.completions.create(**ask)
            assert whole.model == TINY_TEXT_TO_IMAGE and whole.choices[0].finish_reason == "length"
            said, drawn_part = whole.choices[0].message.content  # type: ignore[misc]
            assert said == {"type": "text", "text": text}
            assert drawn_part["type"] == "image_url"
            assert _png(drawn_part["image_url"]["url"]) == want
            streamed = list(client.chat.completions.create(**ask, stream=True))
            deltas = [c.choices[0].delta.content for c in streamed if c.choices]
            assert "".join(d for d in deltas if isinstance(d, str)) == text
            *texts, last = deltas
            assert all(isinstance(d, str) for d in texts) and isinstance(last, list)
            assert [_png(part["image_url"]["url"]) for part in last] == [want]
            finishes = [c.choices[0].finish_reason for c in streamed if c.choices]
            assert finishes[-1] == "length" and set(finishes[:-1]) == {None}  # the text's reason, on the image
            # How it is drawn, as vLLM-Omni's chat takes it: extras beside the chat's own fields.
            drawing = {"width": 64, "height": 48, "num_inference_steps": 2, "guidance_scale": 6.0}
            sized = client.chat.completions.create(**{**ask, "extra_body": {"min_tokens": N, **drawing}})
            _, sized_part = sized.choices[0].message.content  # type: ignore[misc]
            want = _reference(image_model_path(TINY_TEXT_TO_IMAGE), ImageParams(text, 1, 64, 48, 2, 6.0), 5)[0]
            assert _png(sized_part["image_url"]["url"]) == want
            for bad, says in [
                ({"model": "tiny-qwen2-vl", "width": 64}, "only for a chat naming the image model"),
                ({"num_inference_steps": 0}, "num_inference_steps is 0"),
            ]:
                with pytest.raises(openai.BadRequestError) as refused:
                    body = {**{k: v for k, v in ask.items() if k != "extra_body"}, "min_tokens": N, **bad}
                    client.post("/chat/completions", body=body, cast_to=dict)
                assert says in refused.value.message, (bad, refused.value)
    finally:
        code = up.stop(signal.SIGINT)
        procs.stop_all()
    assert code == 0, up.text()[-3000:]
    assert "Traceback" not in up.text()


@pytest.mark.e2e
async def test_a_killed_image_worker_s_request_is_drawn_once_by_another(tmp_path: Path, mmpipe_home: Path) -> None:
    """The generate-image worker SIGKILLed while it draws: JetStream gives
    the hop to another worker once its ack wait passes; the reply stream
    holds each image once, the bytes diffusers draws from that seed."""
    procs = Processes(tmp_path, mmpipe_home)
    subjects = Subjects("default")
    try:
        url = await start_nats(procs, str(tmp_path / "nats"))
        image_worker = ("worker", GENERATE_IMAGE, "--nats-url", url, "--ack-wait", "3", "--device", "cpu")
        first = procs.start(*image_worker)
        await asyncio.to_thread(first.wait_for, "worker_started")
        nc, js = await connect(url, "test-client")
        try:
            params = ImageParams(prompt="a slow drawing", n=2, width=128, height=128, steps=30, guidance=5.0)
            asked = GenerateRequest("killed-draw", TINY_TEXT_TO_IMAGE, [], image=params)
            hop = ProcessedRequest(asked, [], [], [GENERATE_IMAGE], max_tokens=0, seed=13)
            headers = {CONTENT_TYPE: MSGPACK, "Nats-Msg-Id": "killed-draw:0:0"}
            await js.publish(subjects.work(GENERATE_IMAGE), encode(hop), headers=headers)
            queue = subjects.stream(GENERATE_IMAGE)

            async def drawing() -> bool:
                return any(c.num_ack_pending == 1 for c in await js.consumers_info(queue))

            deadline = time.monotonic() + 60
            while not await drawing():
                assert time.monotonic() < deadline, first.text()[-2000:]
                await asyncio.sleep(0.05)
            kill_tree(first)
            second = procs.start(*image_worker)
            chunks: list[ImageChunk] = []
            deadline = time.monotonic() + 240
            while len({c.index for c in chunks}) < 2:
                assert time.monotonic() < deadline, second.text()[-2000:]
                await asyncio.sleep(0.2)
                chunks = [c for c in await stored_chunks(js, subjects, "killed-draw") if isinstance(c, ImageChunk)]
        finally:
            await nc.close()
        assert sorted(c.index for c in chunks) == [0, 1]  # each image once
        assert [_decoded(c.data) for c in sorted(chunks, key=lambda c: c.index)] == _reference(
            image_model_path(TINY_TEXT_TO_IMAGE), params, 13
        )
        assert '"hop_trace"' in second.text() and '"hop_trace"' not in first.text()
    finally:
        await asyncio.to_thread(procs.stop_all)
