"""Media decoded where the request is processed (``--frontend-decode``).

As NVIDIA Dynamo's vLLM backend can decode media at its frontend, the
process that processes a request (the bridge, or a processor worker) may
fetch and decode its media itself and hand the pixels, frames and samples
to the encoding hop by the tensor transport. The encode worker, on a GPU,
then runs no decoder on the cores its engine thread needs, and the
messages between hops stop carrying the inline image (the frontend keeps
what it decoded until the encoder has read it).

The tensors are exactly what the encoder's own decoding makes (the same
functions run, only elsewhere), so the tokens do not change. A request
with media sent as embeddings is left to the encoder, which reads those
itself.
"""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import torch
from PIL import Image

from schemas.errors import InvalidMedia
from schemas.processed import DecodedItem, DecodedMedia, MediaItem, MediaKind, ProcessedRequest
from stages.contract import HopContext, TensorStore
from stages.media.audio import DecodedAudio
from stages.media.cache import item_digest_off_loop
from stages.media.decode_pool import DecodePool, decode_item
from stages.media.decoded import Decoded, DecodedMediaCache
from stages.media.fetch import MediaFetcher
from stages.media.policy import MediaPolicy
from stages.media.video import DecodedVideo, VideoOptions, video_options


class FrontendDecoder:
    """Fetches and decodes a processed request's media and puts them in
    ``tensors`` for the encoding hop. One per process, on its event loop."""

    def __init__(self, policy: MediaPolicy, tensors: TensorStore, video_frame_multiple: int = 1) -> None:
        self.policy = policy
        self.tensors = tensors
        self.video_frame_multiple = video_frame_multiple
        self.fetcher = MediaFetcher(policy)
        # Threads unless --media-processes asks for processes: PIL and PyAV
        # let go of the GIL in their C work, and the processing process has
        # no engine thread to keep it for.
        self.pool = DecodePool(policy.decode_processes) if policy.decode_processes else None
        self.cache = DecodedMediaCache(policy.decoded_cache_bytes) if policy.decoded_cache_bytes else None

    async def decode(self, req: ProcessedRequest, ctx: HopContext | None = None) -> ProcessedRequest:
        """``req`` with its media decoded and held for the encoder
        (``req.decoded``); as it is when it has none, or has embeddings."""
        if not req.media or any(m.embeds for m in req.media):
            return req
        ctx = ctx or HopContext()
        options = [self._options(m) for m in req.media]  # a bad sampling request fails before any download
        with ctx.timed("media_fetch", items=len(req.media)):
            datas = list(
                await asyncio.gather(*(self.fetcher.fetch(req.media_url(m), max_bytes=self._cap(m)) for m in req.media))
            )
        pairs = list(zip(req.media, datas, strict=True))
        digests = list(await asyncio.gather(*(item_digest_off_loop(m, d) for m, d in pairs)))
        with ctx.timed("media_decode", items=len(req.media)):
            decoded = await asyncio.gather(
                *(
                    self._decoded(m, d, o, digest)
                    for m, d, o, digest in zip(req.media, datas, options, digests, strict=True)
                )
            )
        tensors, items = [], []
        for media, digest in zip(decoded, digests, strict=True):
            tensor, item = as_tensor(media, digest)
            tensors.append(tensor)
            items.append(item)
        with ctx.timed("media_put", items=len(items)):
            ref = await self.tensors.put(tensors, owner=req.request.request_id)
        return msgspec.structs.replace(req, decoded=DecodedMedia(ref, items))

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        await self.fetcher.close()

    async def _decoded(self, item: MediaItem, data: bytes, options: VideoOptions | None, digest: str) -> Decoded:
        if self.cache is None:
            return await self._decode(item, data, options)
        return await self.cache.get_or_decode(digest, lambda: self._decode(item, data, options))

    async def _decode(self, item: MediaItem, data: bytes, options: VideoOptions | None) -> Decoded:
        fmt = item.format or None
        if self.pool is not None:
            return await self.pool.decode(item.kind, data, self.policy, options, fmt)
        return await asyncio.to_thread(decode_item, item.kind, data, self.policy, options, fmt)

    def _cap(self, item: MediaItem) -> int:
        return self.policy.max_bytes_of(item.kind)

    def _options(self, item: MediaItem) -> VideoOptions | None:
        return video_options(item, self.video_frame_multiple)


def as_tensor(media: Decoded, digest: str) -> tuple[torch.Tensor, DecodedItem]:
    """A decoded item as the tensor that travels and what goes beside it."""
    if isinstance(media, DecodedVideo):
        frames = torch.from_numpy(np.stack([np.asarray(_rgb(f)) for f in media.frames]))
        item = DecodedItem(
            MediaKind.VIDEO,
            digest,
            timestamps=list(media.timestamps),
            fps=media.fps,
            duration_s=media.duration_s,
            frame_indices=list(media.frame_indices),
            total_frames=media.total_frames,
            source_fps=media.source_fps,
        )
        return frames, item
    if isinstance(media, DecodedAudio):
        samples = torch.from_numpy(np.array(media.samples, dtype=np.float32))
        return samples, DecodedItem(
            MediaKind.AUDIO, digest, duration_s=media.duration_s, sampling_rate=media.sampling_rate
        )
    return torch.from_numpy(np.array(_rgb(media))), DecodedItem(MediaKind.IMAGE, digest)


def from_tensor(item: DecodedItem, tensor: torch.Tensor) -> Decoded:
    """The decoded item again, as the encoder's own decoding gives it.
    InvalidMedia for a tensor that cannot be one of its kind."""
    kind = item.kind
    want = (torch.float32, 1) if kind is MediaKind.AUDIO else (torch.uint8, 4 if kind is MediaKind.VIDEO else 3)
    if (tensor.dtype, tensor.dim()) != want or (kind is not MediaKind.AUDIO and tensor.shape[-1] != 3):
        raise InvalidMedia(f"a decoded {kind.value} of {tensor.dtype} {list(tensor.shape)}: not what decoding makes")
    array = tensor.cpu().numpy()
    if kind is MediaKind.AUDIO:
        return DecodedAudio(array, item.duration_s, item.sampling_rate)
    if kind is MediaKind.IMAGE:
        return Image.fromarray(array)
    if len(item.timestamps) != len(array):
        raise InvalidMedia(f"a decoded video of {len(array)} frames with {len(item.timestamps)} timestamps")
    return DecodedVideo(
        frames=[Image.fromarray(frame) for frame in array],
        timestamps=list(item.timestamps),
        fps=item.fps,
        duration_s=item.duration_s,
        frame_indices=list(item.frame_indices),
        total_frames=item.total_frames,
        source_fps=item.source_fps,
    )


def _rgb(image: Image.Image) -> Image.Image:
    return image if image.mode == "RGB" else image.convert("RGB")
