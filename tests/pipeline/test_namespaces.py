"""Tensors move only between agents of one namespace: a worker refuses a
TensorRef whose holder is an agent of another namespace (or whose holder name
could not be one), with a clear error, and never asks that holder for it."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pipeline.connection import connect
from pipeline.nats_server import NatsServer
from pipeline.transport import ForeignTensorRef, TensorGone, TransportSettings
from pipeline.transport.nixl import NixlTransport


async def test_a_ref_from_another_namespace_is_refused(nats_server: NatsServer) -> None:
    nc, js = await connect(nats_server.url, "test-ns")
    settings = TransportSettings(budget_bytes=1 << 20)
    theirs = NixlTransport(nc, js, "tenant_a", settings, role="prefill")
    ours = NixlTransport(nc, js, "tenant_b", settings, role="decode")
    mine = NixlTransport(nc, js, "tenant_b", settings, role="prefill")
    await theirs.start()
    await ours.start()
    await mine.start()
    try:
        ref = await theirs.put([torch.arange(64, dtype=torch.float32)], owner="req-a")
        held = theirs.held_bytes
        with pytest.raises(ForeignTensorRef, match="not an agent of namespace 'tenant_b'") as refused:
            await ours.get(ref)
        assert not refused.value.retryable and refused.value.http_status == 400
        # Not read, not leased: still held by its owner in its own namespace.
        assert theirs.held_bytes == held
        assert (await theirs.get(ref)).__len__() == 1

        # A holder name that is no subject token is refused before any lookup.
        forged = msgspec.structs.replace(ref, holder="prefill-x.>")
        with pytest.raises(ForeignTensorRef, match="tensor holder"):
            await ours.get(forged)

        # An agent of our own namespace that is gone is still a lost tensor
        # (retryable: the request restarts from its first hop), not a foreign one.
        ref_b = await mine.put([torch.ones(8)], owner="req-b")
        await mine.close()
        with pytest.raises(TensorGone):
            await ours.get(ref_b)
    finally:
        for t in (theirs, ours, mine):
            await t.close()
        await nc.close()
