"""Which JetStream answers provisioning retries: "not now" ones (a cluster
still forming, a node down) until the deadline, anything else at once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from nats.js.errors import APIError, BadRequestError

from pipeline.streams import retrying


def _failing(errors: list[APIError]) -> tuple[list[int], Callable[[], Awaitable[str]]]:
    calls: list[int] = []

    async def call() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return "created"

    return calls, call


async def test_no_suitable_peers_while_a_cluster_forms_is_retried() -> None:
    peer_offline = BadRequestError(
        code=400, err_code=10005, description="no suitable peers for placement, peer offline"
    )
    calls, call = _failing([peer_offline, peer_offline])
    assert await retrying("S", call, timeout_s=5.0) == "created"
    assert len(calls) == 3


async def test_a_refusal_for_good_is_raised_at_once() -> None:
    in_use = BadRequestError(code=400, err_code=10058, description="stream name already in use")
    calls, call = _failing([in_use])
    with pytest.raises(BadRequestError) as raised:
        await retrying("S", call, timeout_s=5.0)
    assert raised.value.err_code == 10058 and len(calls) == 1


async def test_not_now_stops_at_the_deadline() -> None:
    peer_offline = BadRequestError(
        code=400, err_code=10005, description="no suitable peers for placement, peer offline"
    )
    calls, call = _failing([peer_offline] * 100)
    with pytest.raises(BadRequestError):
        await retrying("S", call, timeout_s=0.5)
    assert 2 <= len(calls) < 10
