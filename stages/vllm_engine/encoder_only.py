"""The ``encode`` role on vLLM encoder-only (``--engine vllm`` on ``encode``).

vLLM runs the checkpoint's vision tower only (``mm_encoder_only``, derived
from the ``ec_producer`` role of its encoder-cache connector) and writes each
image's encoder output to the connector's storage (ECExampleConnector: one
safetensors file per item in a folder the prefill workers see too), keyed by
vLLM's multimodal hash of the item. The request to vLLM is the processor's
prompt (one placeholder per image) with the decoded images and a one-token
budget: vLLM stops it once the prompt is consumed, and its
``ec_transfer_params`` name each item's hash and patch grid. Those ride on in
mmpipe's message (``VllmEncoded``), never a tensor; the vLLM prefill worker
(an ``ec_consumer`` on the same folder) gives vLLM the grid and the hash and
vLLM loads the encoder output instead of encoding.

Against the built-in encoder (which hands embeddings over mmpipe's tensor
transport and works with a torch or a vLLM prefill): vLLM's own image
processing and vision kernels, no torch copy of the model beside vLLM; but
images only, no embedding cache of mmpipe's (vLLM's storage is keyed by
content, so an image seen again is found by the consumer anyway), and the
storage is a folder vLLM never cleans up (the encode worker prunes it by
age: storage.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path
from typing import Any

import structlog

from schemas.errors import TensorGone, UnsupportedMedia
from schemas.processed import MediaKind, ProcessedRequest
from stages.contract import HopContext
from stages.families import MediaEmbedding
from stages.hop import HopStage
from stages.media import MediaFetcher, MediaPolicy
from stages.media.image import decode_image
from stages.vllm_engine.args import STORAGE_TTL_S
from stages.vllm_engine.engine import VllmEngine
from stages.vllm_engine.hop_engine import VllmHopEngine
from stages.vllm_engine.media import ec_transfer_config, encoded_items, remote_embeddings, touch_ec_file

log = structlog.get_logger(__name__)


class VllmEncoderEngine(VllmEngine):
    """VllmEngine as an encoder-cache producer: one call per request's images."""

    async def encode(self, request_id: str, prompt_token_ids: list[int], images: list[Any]) -> dict[str, Any]:
        """Encode ``images`` (PIL, in prompt order) into the connector's
        storage; returns vLLM's ``ec_transfer_params`` for them."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        assert self._llm is not None, "start() the engine first"
        params = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        prompt = {"prompt_token_ids": list(prompt_token_ids), "multi_modal_data": {"image": images}}
        got: dict[str, Any] = {}
        finished = False
        try:
            async for out in self._llm.generate(prompt, params, request_id):
                finished = bool(out.finished)
                got = dict(out.ec_transfer_params or {})
        finally:
            if not finished:
                await self.abort(request_id)
        return got


class VllmImageEncoder:
    """The encode step on vLLM encoder-only: a request's images → the keys
    and grids of their encoder outputs in the connector's storage (as
    ``RemoteEmbedding``s; ``VllmHopEngine.send_media`` sends the keys on)."""

    def __init__(self, engine: VllmEncoderEngine, policy: MediaPolicy, merge_size: int, ec_path: str) -> None:
        self.engine = engine
        self.policy = policy
        self.fetcher = MediaFetcher(policy)
        self.merge_size = merge_size
        self.ec_path = ec_path

    async def encode(self, req: ProcessedRequest, ctx: HopContext) -> list[MediaEmbedding]:
        if not req.media:
            return []
        if req.decoded is not None:
            # vLLM decodes the images it encodes from their bytes: the request again as it arrived.
            raise TensorGone("vLLM's encoder reads no media decoded by the processor (--frontend-decode)")
        for item in req.media:
            if item.kind is not MediaKind.IMAGE or item.embeds:
                what = "precomputed embeddings" if item.embeds else f"{item.kind.value}s"
                raise UnsupportedMedia(
                    f"the vLLM encoder (--engine vllm on encode) takes images, not {what}; "
                    "the built-in encoder takes them"
                )
        loop = asyncio.get_running_loop()
        started = loop.time()
        datas = await asyncio.gather(
            *(self.fetcher.fetch(req.media_url(m), max_bytes=self.policy.max_bytes) for m in req.media)
        )
        images = await asyncio.gather(*(asyncio.to_thread(decode_image, d, self.policy) for d in datas))
        vllm_id = f"{req.request.request_id}-enc-{uuid.uuid4().hex[:8]}"
        params = await self.engine.encode(vllm_id, req.prompt_token_ids, list(images))
        encoded = encoded_items(params, len(images), self.merge_size)
        for mm_hash in set(encoded.mm_hashes):  # vLLM found an output it had written before: used now
            with contextlib.suppress(FileNotFoundError):  # (the prefill hop tells a missing one)
                touch_ec_file(self.ec_path, mm_hash)
        ctx.trace["encode_s"] = loop.time() - started
        log.info("vllm_encoded", request_id=req.request.request_id, mm_hashes=encoded.mm_hashes)
        return remote_embeddings(encoded, req.media)


def build_vllm_encode_stage(
    model_dir: Path,
    served_name: str,
    engine_args: dict[str, Any],
    ec_path: str,
    policy: MediaPolicy,
    storage_ttl_s: float = STORAGE_TTL_S,
) -> HopStage:
    """The ``encode`` role on vLLM encoder-only; vLLM itself starts in
    ``start()``, and the worker prunes ``ec_path`` (``storage_ttl_s``)."""
    from transformers import AutoConfig

    if not ec_path:
        raise ValueError("--engine vllm on encode needs --vllm-ec-path: the folder its prefill workers read too")
    config = AutoConfig.from_pretrained(str(model_dir))
    merge = int(getattr(getattr(config, "vision_config", None), "spatial_merge_size", 0) or 0)
    if not merge:
        raise ValueError(f"the vLLM encoder serves Qwen-VL checkpoints; {model_dir} has no vision_config")
    Path(ec_path).mkdir(parents=True, exist_ok=True)
    args = {"ec_transfer_config": ec_transfer_config(True, ec_path), **engine_args}
    engine = VllmEncoderEngine(model_dir, args, storage_ttl_s=storage_ttl_s)
    return HopStage(
        "encode", VllmHopEngine("encode", engine, encoder=VllmImageEncoder(engine, policy, merge, ec_path)), served_name
    )
