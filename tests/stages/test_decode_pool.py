"""Media decoded in processes of their own (--media-processes): the same
pixels as in the worker, errors that reach the request as they would, a
pool whose child died replaced without losing the input, and the encoder's
embeddings unchanged by where its media were decoded."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from schemas.errors import InvalidMedia
from schemas.processed import MediaKind
from stages.contract import HopContext
from stages.encoder import MediaEncoder, decode_processes
from stages.media import MediaFetcher, MediaPolicy, decode_image
from stages.media.decode_pool import DecodePool
from stages.torch_engine.engine import TorchEngine
from stages.torch_engine.scheduler import EngineThread
from tests.stages.inline_images import image_request, png

POLICY = MediaPolicy()


@pytest.fixture
def pool() -> Iterator[DecodePool]:
    pool = DecodePool(2)
    yield pool
    pool.close()


async def test_an_image_decoded_in_the_pool_is_the_image_decoded_here(pool: DecodePool) -> None:
    data = png(3, (64, 48))
    there = await pool.decode(MediaKind.IMAGE, data, POLICY, None, None)
    here = decode_image(data, POLICY)
    assert there.size == here.size == (64, 48) and there.mode == here.mode
    assert np.array_equal(np.asarray(there), np.asarray(here))


async def test_bad_bytes_fail_as_invalid_media_and_the_pool_goes_on(pool: DecodePool) -> None:
    with pytest.raises(InvalidMedia):
        await pool.decode(MediaKind.IMAGE, b"\x89PNG\r\n\x1a\n not a png at all", POLICY, None, None)
    assert (await pool.decode(MediaKind.IMAGE, png(4), POLICY, None, None)).size == (40, 30)
    assert pool.restarts == 0


async def test_a_dead_child_is_replaced_and_the_input_decoded_on_the_next_pool(pool: DecodePool) -> None:
    await pool.decode(MediaKind.IMAGE, png(5), POLICY, None, None)  # the pool's processes are up
    children = multiprocessing.active_children()
    assert children
    for child in children:
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
    for child in children:
        child.join(10)
    decoded = await pool.decode(MediaKind.IMAGE, png(6), POLICY, None, None)
    assert decoded.size == (40, 30)
    assert pool.restarts == 1


def test_unset_means_processes_on_a_gpu_worker_and_threads_on_a_cpu_one() -> None:
    assert decode_processes(POLICY, torch.device("cpu")) == 0
    assert 1 <= decode_processes(POLICY, torch.device("cuda")) <= 4
    assert decode_processes(MediaPolicy(decode_processes=3), torch.device("cpu")) == 3
    assert decode_processes(MediaPolicy(decode_processes=0), torch.device("cuda")) == 0
    with pytest.raises(ValueError, match="decode_processes"):
        MediaPolicy(decode_processes=-1)


async def test_embeddings_do_not_depend_on_where_the_media_were_decoded(tiny_model_dir: Path) -> None:
    thread = EngineThread()
    thread.decoding = lambda: True  # an engine at work: the pool decodes
    engine = TorchEngine(tiny_model_dir)
    encoders = []
    try:
        for processes in (0, 2):
            # No decoded-media cache: each encoder decodes for itself.
            policy = MediaPolicy(decode_processes=processes, decoded_cache_bytes=0)
            encoders.append(MediaEncoder(engine, thread, MediaFetcher(policy), policy))
        assert encoders[0].decode_pool is None and encoders[1].decode_pool is not None
        request = image_request(png(7), png(8, (50, 70)))
        here, there = [await e.encode(request, HopContext()) for e in encoders]
        assert [e.grid_thw for e in there] == [e.grid_thw for e in here]
        for a, b in zip(here, there, strict=True):
            assert torch.equal(a.embeddings, b.embeddings)
        assert encoders[1].decode_pool._pool is not None  # decoded there, not here
    finally:
        for encoder in encoders:
            encoder.close()
            await encoder.fetcher.close()
        thread.close()


@pytest.mark.parametrize("busy", [False, True])
async def test_the_pool_decodes_only_while_the_engine_has_work(tiny_model_dir: Path, busy: bool) -> None:
    """One request at a time the pool's round trip is on the first token's
    way and there is no engine work to keep the GIL for: a thread decodes."""
    thread = EngineThread()
    thread.decoding = lambda: busy
    policy = MediaPolicy(decode_processes=2, decoded_cache_bytes=0)
    encoder = MediaEncoder(TorchEngine(tiny_model_dir), thread, MediaFetcher(policy), policy)
    try:
        assert thread.quiet is not busy
        await encoder.encode(image_request(png(9)), HopContext())
        assert encoder.decode_pool is not None and (encoder.decode_pool._pool is not None) is busy
    finally:
        encoder.close()
        await encoder.fetcher.close()
        thread.close()


async def test_an_engine_thread_is_quiet_only_with_nothing_queued_running_or_decoding() -> None:
    thread = EngineThread()
    try:
        assert thread.quiet
        started, release = threading.Event(), threading.Event()

        def blocking() -> None:
            started.set()
            release.wait(10)

        running = asyncio.ensure_future(thread.call(blocking))
        assert await asyncio.to_thread(started.wait, 10)
        queued = asyncio.ensure_future(thread.call(lambda: None))
        await asyncio.sleep(0)
        assert not thread.quiet  # one running, one queued
        release.set()
        await asyncio.gather(running, queued)
        assert thread.quiet
        thread.decoding = lambda: True
        assert not thread.quiet
    finally:
        thread.close()
