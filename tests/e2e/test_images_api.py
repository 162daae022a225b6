"""``POST /v1/images/generations`` through ``mmpipe up --image-model tiny-sd``
(every worker its own process, a generate-image worker beside the model's),
called with the official openai client: the images are the bytes diffusers'
own pipeline draws from the same seed; bad requests get OpenAI-style 400s
and the stack goes on serving."""

from __future__ import annotations

import base64
import signal
from pathlib import Path

import openai
import pytest

from schemas.request import ImageParams
from stages.image_engine.checkpoint import TINY_TEXT_TO_IMAGE, image_model_path
from tests.e2e.processes import Processes
from tests.e2e.test_up import _free_port
from tests.stages.test_image_stage import _reference


@pytest.mark.e2e
def test_images_come_from_the_image_stage_as_diffusers_draws_them(tmp_path: Path, mmpipe_home: Path) -> None:
    port = _free_port()
    procs = Processes(tmp_path, mmpipe_home)
    up = procs.start("up", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--image-model", "tiny-sd")
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
            assert got == _reference(image_model_path(TINY_TEXT_TO_IMAGE), params, 21)
            assert drawn.size == "64x48" and drawn.output_format == "png"

            for bad, says in [
                ({"size": "60x60"}, "width 60"),
                ({"n": 0}, "n is 0"),
                ({"prompt": " "}, "needs a prompt"),
                ({"response_format": "url"}, "response_format 'url'"),
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
    finally:
        code = up.stop(signal.SIGINT)
        procs.stop_all()
    assert code == 0, up.text()[-3000:]
    assert "Traceback" not in up.text()
