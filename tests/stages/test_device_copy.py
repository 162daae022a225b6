"""Host tensors onto a GPU through one pinned staging ring: the ring's
bookkeeping (on any machine), and on --engine-device cuda copies that wrap
it while the GPU is busy, each arriving whole."""

from __future__ import annotations

import pytest
import torch

from stages import device_copy
from stages.device_copy import StagingRing, to_device


class FakeCopy:
    """A copy in flight: finished when the test says so."""

    def __init__(self, finished: bool = False) -> None:
        self.finished = finished
        self.waited = False

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.waited = True
        self.finished = True


def test_the_ring_hands_out_aligned_bytes_in_order() -> None:
    ring = StagingRing(1024)
    first = ring.reserve(100)
    ring.used(first, 100, FakeCopy())
    second = ring.reserve(10)
    ring.used(second, 10, FakeCopy())
    assert (first, second) == (0, 128)
    with pytest.raises(ValueError, match="do not fit"):
        ring.reserve(2048)


def test_bytes_are_reused_only_once_the_copy_reading_them_has_run() -> None:
    ring = StagingRing(1024)
    copies = []
    for _ in range(3):  # 0..300, 320..620, 640..940
        start = ring.reserve(300)
        copies.append(FakeCopy())
        ring.used(start, 300, copies[-1])
    # 400 bytes from 960 do not fit: from 0 again, over the first two copies' bytes.
    assert ring.reserve(400) == 0
    assert [c.waited for c in copies] == [True, True, False]


def test_copies_already_run_are_not_waited_for() -> None:
    ring = StagingRing(1024)
    done = FakeCopy(finished=True)
    ring.used(ring.reserve(1000), 1000, done)
    assert ring.reserve(500) == 0 and not done.waited


def test_copies_wrapping_the_ring_behind_a_busy_gpu_arrive_whole(engine_device: str) -> None:
    device = torch.device(engine_device)
    if device.type != "cuda":
        pytest.skip("pinned staging is for copies to a GPU")
    piece = device_copy.STAGING_BYTES // 8
    sources = [torch.full((piece // 4,), float(i), dtype=torch.float32) for i in range(24)]  # three laps
    torch.cuda._sleep(200_000_000)  # the copies queue behind a long kernel
    moved = [to_device(src, device) for src in sources]
    torch.cuda.synchronize()
    for i, tensor in enumerate(moved):
        assert torch.equal(tensor.cpu(), sources[i]), i


def test_a_host_copy_is_contiguous_and_its_own(engine_device: str) -> None:
    """What the embedding cache keeps: a copy that waited for the kernels
    writing its source (queued behind a long one on a GPU), laid out
    contiguously, sharing no memory with the source."""
    device = torch.device(engine_device)
    base = torch.arange(24, dtype=torch.float32, device=device).reshape(4, 6)
    if device.type == "cuda":
        torch.cuda._sleep(200_000_000)
    source = (base * 2).t()  # written by a kernel still queued; not contiguous
    host = device_copy.to_host(source)
    assert host.device.type == "cpu" and host.is_contiguous()
    assert host.is_pinned() == (device.type == "cuda")
    assert torch.equal(host, (torch.arange(24, dtype=torch.float32).reshape(4, 6) * 2).t())
    if device.type == "cpu":
        source.add_(1)
        assert host[0, 0] == 0  # its own memory
