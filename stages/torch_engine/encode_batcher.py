"""One encoder call for the media of several requests.

An encode worker works on several requests at once (its fetch batch). Each
of them alone makes one tower call per kind; on a GPU a call for one
448×448 image leaves the device mostly idle, while eight images in one call
cost little more than one. ``EncodeBatcher`` gathers the requests that
arrive while the encoder is busy and encodes them together in its next call:
no timer, so a lone request is never held back, and under load the batch
grows to what has queued up during one call (capped by ``max_items``).

Why it is off by default (``--encode-batch 1``): an encoder's numerics depend
on the set of items it runs over. Qwen-VL's tower concatenates the patches of
every image of a call, so a GEMM over a different number of rows can round
differently; on CPU one image in four came out different in its last bits.
generate() encodes a request's media alone, so the per-request call is what
keeps mmpipe's promise of generate()'s exact tokens. Batching across requests
is the throughput choice for GPU deployments that accept last-bit
differences in the embeddings, the same trade every batching server makes.
"""

from __future__ import annotations

from stages.families import Media, MediaEmbedding
from stages.torch_engine.call_batcher import CallBatcher
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.scheduler import EngineThread


class EncodeBatcher:
    def __init__(self, engine: TorchEngine, thread: EngineThread, max_items: int) -> None:
        self.engine = engine
        self._batcher: CallBatcher[list[Media], list[MediaEmbedding]] = CallBatcher(
            "encode", self._encode_together, thread, max_items, weight=len
        )

    @property
    def calls(self) -> int:
        """Encoder calls made so far."""
        return self._batcher.calls

    async def encode(self, media: list[Media]) -> list[MediaEmbedding]:
        """The embeddings of one request's media, made in a call shared with
        whatever other requests wait at the same time."""
        return await self._batcher.submit(list(media))

    def _encode_together(self, jobs: list[list[Media]]) -> list[list[MediaEmbedding]]:
        encoded = iter(self.engine.encode([m for job in jobs for m in job]))
        return [[next(encoded) for _ in job] for job in jobs]


__all__ = ["EncodeBatcher"]
