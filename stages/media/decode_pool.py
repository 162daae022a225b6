"""Media decoding in processes of their own (``--media-processes``).

Decoding a PNG or a video frame is C work, but PIL and PyAV come back to
Python between chunks, and every return takes the GIL. On a GPU worker
the GIL and the cores are also what the engine's one thread needs between
its kernel launches: under 64 clients (2B preset, 448×448 PNGs, an H100
host) every engine call took about four times as long as alone while media
threads, the event loop and the engine took turns. Decoded in another
process, an image costs this one only its pickled pixels (35.2 against
31.8 requests/s with threads, same run).

A child that dies (a decoder crash, a kill) breaks the pool: the next
decode starts a new one, and the input that was being decoded is tried
once more on it; a second death is that input's fault (``InvalidMedia``).
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import structlog
from PIL import Image

from schemas.errors import InvalidMedia
from schemas.processed import MediaKind
from stages.media.audio import DecodedAudio, decode_audio
from stages.media.image import decode_image
from stages.media.policy import MediaPolicy
from stages.media.video import DecodedVideo, VideoOptions, decode_video

log = structlog.get_logger(__name__)

Decoded = Image.Image | DecodedVideo | DecodedAudio


def decode_item(
    kind: MediaKind, data: bytes, policy: MediaPolicy, options: VideoOptions | None, fmt: str | None
) -> Decoded:
    """One media item from its bytes, as the encoder takes it (any process)."""
    if kind is MediaKind.VIDEO:
        return decode_video(data, policy, options)
    if kind is MediaKind.AUDIO:
        return decode_audio(data, policy, fmt)
    return decode_image(data, policy)


class DecodePool:
    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError(f"a decode pool of {processes} processes: one at least")
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self.restarts = 0

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # Spawned, not forked: the worker holds CUDA state and threads a fork would copy half of.
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    async def decode(
        self, kind: MediaKind, data: bytes, policy: MediaPolicy, options: VideoOptions | None, fmt: str | None
    ) -> Decoded:
        loop = asyncio.get_running_loop()
        pool = self._executor()
        try:
            return await loop.run_in_executor(pool, decode_item, kind, data, policy, options, fmt)
        except BrokenProcessPool:
            self._replace(pool, kind, len(data))
        pool = self._executor()
        try:
            return await loop.run_in_executor(pool, decode_item, kind, data, policy, options, fmt)
        except BrokenProcessPool:
            self._replace(pool, kind, len(data))
            raise InvalidMedia(f"the {kind.value} decoder's process died twice decoding this input") from None

    async def warm(self, data: bytes, policy: MediaPolicy) -> None:
        """Every process started, its imports done, each decoding ``data``
        (a small image): a fresh pool spawns them at its first decodes,
        which wait for them."""
        loop = asyncio.get_running_loop()
        pool = self._executor()
        # Submitted together, none finds an idle process: each starts one.
        image = MediaKind.IMAGE
        await asyncio.gather(
            *(loop.run_in_executor(pool, decode_item, image, data, policy, None, None) for _ in range(self.processes))
        )

    def _replace(self, broken: ProcessPoolExecutor, kind: MediaKind, nbytes: int) -> None:
        """The next decode starts a new pool; the first to see this one broken says so."""
        if self._pool is broken:
            self._pool = None
            self.restarts += 1
            broken.shutdown(wait=False, cancel_futures=True)
            log.warning("media_decode_pool_restarted", kind=kind.value, bytes=nbytes)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
