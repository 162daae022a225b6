"""docs/serving-a-checkpoint.md's command on a checkpoint saved the way the
Hub's Qwen2-VL-7B-Instruct folder is (sharded safetensors with their index,
generation and preprocessor configs, the tokenizer with its chat template
in a file of its own), under that folder's name: `mmpipe up --model DIR`
serves it under the folder's name with generate()'s tokens."""

from __future__ import annotations

import json
import shutil
import signal
import socket
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import Qwen2VLForConditionalGeneration

from tests.e2e.conftest import gradient, make_reference, png_data_url
from tests.e2e.processes import Processes

N = 6
NAME = "Qwen2-VL-7B-Instruct"
# What the Hub's folder holds besides its weights.
FILES = ["chat_template.jinja", "generation_config.json", "preprocessor_config.json", "tokenizer.json"]


def _save_in_hub_layout(tiny: Path, out: Path) -> Path:
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(tiny), dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="10MB")  # shards and model.safetensors.index.json
    for name in [*FILES, "tokenizer_config.json"]:
        shutil.copy(tiny / name, out / name)
    # A real checkpoint is no built-in: nothing may take it for one.
    assert not (out / "mmpipe_builtin.json").exists()
    return out


@pytest.mark.e2e
def test_up_serves_a_local_checkpoint_in_the_hub_layout_under_its_folders_name(
    tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path
) -> None:
    checkpoint = _save_in_hub_layout(tiny_model_dir, tmp_path / "models" / NAME)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, as the 7B's five files
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    procs = Processes(tmp_path, mmpipe_home)
    up = procs.start("up", "--model", str(checkpoint), "--port", str(port), "--data-dir", str(tmp_path / "data"))
    try:
        up.wait_for("mmpipe ready")
        image = gradient(64, 48, 2)
        content: Any = [
            {"type": "image_url", "image_url": {"url": png_data_url(image)}},
            {"type": "text", "text": "What is in the picture?"},
        ]
        tokens, text = make_reference(checkpoint)(content, [image], N)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == [NAME]
            reply = client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": content}],
                max_tokens=N,
                temperature=0,
                extra_body={"min_tokens": N},
            )
        assert reply.choices[0].message.content == text and len(set(tokens)) > 1
    finally:
        code = up.stop(signal.SIGINT)
        procs.stop_all()
    assert code == 0, up.text()[-3000:]
