"""What mmpipe hands vLLM for media, without vLLM: the prompt inputs of
embeddings (image, video, audio) and of encoder outputs a vLLM encode hop left in
the encoder-cache folder, and the keys that ride in the message."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from pipeline.launcher import check_mode, role_settings
from pipeline.serve import WorkerSettings
from pipeline.settings.kinds import UpSettings
from pipeline.transport.base import TensorGone
from schemas.errors import UnsupportedMedia
from schemas.processed import EncodedItem, MediaItem, MediaKind, ProcessedRequest, VllmEncoded
from schemas.request import GenerateRequest, SamplingParams
from stages.families import MediaEmbedding
from stages.vllm_engine.media import RemoteEmbedding, ec_file, encoded_items, mm_prompt, remote_media


def test_images_and_videos_become_embeds_and_grids() -> None:
    image = MediaEmbedding(torch.ones(6, 4), (1, 4, 6), MediaKind.IMAGE)
    video = MediaEmbedding(torch.zeros(12, 4), (2, 4, 6), MediaKind.VIDEO)
    other = MediaEmbedding(torch.ones(2, 4), (1, 2, 4), MediaKind.IMAGE)
    prompt = mm_prompt([1, 2, 3], [image, video, other])
    assert prompt["prompt_token_ids"] == [1, 2, 3]
    data = prompt["multi_modal_data"]
    assert data["image"]["image_embeds"].shape == (8, 4)
    assert data["image"]["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 4]]
    assert torch.equal(data["video"]["video_embeds"], video.embeddings)
    assert data["video"]["video_grid_thw"].tolist() == [[2, 4, 6]]
    assert "multi_modal_uuids" not in prompt
    assert mm_prompt([5], []) == {"prompt_token_ids": [5]}


def test_remote_items_are_grids_and_hashes_only() -> None:
    items = [
        RemoteEmbedding(torch.empty(6, 0), (1, 4, 6), mm_hash="a"),
        RemoteEmbedding(torch.empty(2, 0), (1, 2, 4), mm_hash="b"),
    ]
    prompt = mm_prompt([1], list(items))
    assert set(prompt["multi_modal_data"]["image"]) == {"image_grid_thw"}
    assert prompt["multi_modal_uuids"] == {"image": ["a", "b"]}
    assert items[0].num_tokens == 6


def test_audios_become_a_list_of_embeds() -> None:
    one = MediaEmbedding(torch.ones(3, 4), (3,), MediaKind.AUDIO)
    two = MediaEmbedding(torch.zeros(5, 4), (5,), MediaKind.AUDIO)
    data = mm_prompt([1, 2], [one, two])["multi_modal_data"]
    assert list(data) == ["audio"] and list(data["audio"]) == ["audio_embeds"]
    # One tensor per audio: vLLM reads a single [rows, hidden] tensor as rows audios.
    assert [t.shape for t in data["audio"]["audio_embeds"]] == [(3, 4), (5, 4)]


def test_remote_audio_and_timed_videos_are_unsupported() -> None:
    with pytest.raises(UnsupportedMedia):  # vLLM encoder-only encodes images only
        mm_prompt([1], [RemoteEmbedding(torch.empty(3, 0), (3,), MediaKind.AUDIO, mm_hash="a")])
    with pytest.raises(UnsupportedMedia):  # Qwen2.5-VL: vLLM would drop second_per_grid_ts
        mm_prompt([1], [MediaEmbedding(torch.ones(3, 4), (2, 2, 2), MediaKind.VIDEO, seconds_per_grid=0.5)], True)


def test_encoder_report_maps_to_items_in_prompt_order() -> None:
    # vLLM reports an image given twice once, at both indices.
    params = {
        "h1": {"item_indices": [0, 2], "metadata": {"image_grid_thw": [1, 4, 6]}},
        "h2": {"item_indices": [1], "metadata": {"image_grid_thw": [1, 2, 2]}},
    }
    got = encoded_items(params, 3, merge=2)
    assert got.mm_hashes == ["h1", "h2", "h1"]
    assert [i.num_tokens for i in got.items] == [6, 1, 6]
    with pytest.raises(RuntimeError):
        encoded_items(params, 4, merge=2)


def _request(hashes: list[str]) -> ProcessedRequest:
    request = GenerateRequest(request_id="r1", model="m", messages=[], sampling=SamplingParams(), created=0.0)
    media = [MediaItem(MediaKind.IMAGE, "https://x/a.png", i) for i in range(len(hashes))]
    items = [EncodedItem(6, [1, 4, 6]) for _ in hashes]
    return ProcessedRequest(
        request=request,
        prompt_token_ids=[1, 2],
        media=media,
        route=["encode", "prefill+decode"],
        max_tokens=4,
        seed=0,
        hop_index=1,
        vllm_encoded=VllmEncoded(hashes, items),
    )


def test_remote_media_needs_the_files(tmp_path: Path) -> None:
    req = _request(["h1", "h2"])
    ec_file(tmp_path, "h1").parent.mkdir(parents=True)
    ec_file(tmp_path, "h1").write_bytes(b"x")
    with pytest.raises(TensorGone):  # h2 missing: the request starts again from encode
        remote_media(req, tmp_path)
    ec_file(tmp_path, "h2").parent.mkdir(parents=True)
    ec_file(tmp_path, "h2").write_bytes(b"x")
    os.utime(ec_file(tmp_path, "h2"), (1.0, 1.0))
    got = remote_media(req, tmp_path)
    assert [m.mm_hash for m in got if isinstance(m, RemoteEmbedding)] == ["h1", "h2"]
    assert ec_file(tmp_path, "h2").stat().st_mtime > time.time() - 60  # used now: the pruner keeps it
    with pytest.raises(UnsupportedMedia):  # a worker with no folder configured
        remote_media(req, None)
    assert req.restarted().vllm_encoded is None


def test_vllm_encoder_reaches_the_roles_that_use_it(tmp_path: Path) -> None:
    check_mode("vllm", "e-pd", vllm_encoder=True)
    check_mode("vllm", "e-p-d", vllm_encoder=True)
    for engine, mode in (("torch", "e-pd"), ("vllm", "epd"), ("vllm", "ep-d")):
        with pytest.raises(SystemExit):
            check_mode(engine, mode, vllm_encoder=True)
    worker, on = WorkerSettings(engine="vllm", vllm_storage_ttl_s=30.0), UpSettings(vllm_encoder=True)
    ec = str(tmp_path / "vllm-ec")
    encode = role_settings("encode", worker, on, tmp_path, 0)
    assert (encode.engine, encode.vllm_ec_path, encode.vllm_storage_ttl_s) == ("vllm", ec, 30.0)
    # Apart, decode reads the encoder cache too (the prompt's tail it computes may hold an image).
    for role in ("prefill+decode", "prefill", "decode"):
        assert (role_settings(role, worker, on, tmp_path, 0).vllm_ec_path, role) == (ec, role)
    processor = role_settings("processor", worker, on, tmp_path, 0)
    assert (processor.engine, processor.vllm_ec_path) == ("torch", "")
    # Without --vllm-encoder the encode role runs mmpipe's encoder and nobody reads a cache.
    off = UpSettings()
    assert role_settings("encode", worker, off, tmp_path, 0).engine == "torch"
    assert role_settings("prefill+decode", worker, off, tmp_path, 0).vllm_ec_path == ""
