"""A worker's KV events on ZMQ, as vLLM publishes them
(``vllm.distributed.kv_events.ZmqEventPublisher``), for KV-aware routers.

A PUB socket sends each batch as three frames: the topic, the batch's
sequence number (8 bytes, big-endian, from 0) and the msgpack
``KVEventBatch`` (schemas/kv_events.py). As in vLLM, an endpoint with a
wildcard (``tcp://*:5557``), or an ``ipc://`` or ``inproc://`` one, is
bound, any other connected to. With a replay endpoint, a ROUTER socket
there answers a subscriber that missed batches: it sends the first
sequence number it wants (8 bytes, big-endian) and gets every batch still
buffered from there, each as ``(seq, payload)``, then ``(-1, b"")``.

One thread owns the sockets (ZMQ sockets are not thread-safe): it takes
what the engine's event log accumulated, at once when something is there,
and serves replay requests between batches.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from schemas.kv_events import KVEventBatch
from schemas.settings import setting
from stages.torch_engine.kv_event_log import KvEventLog

log = structlog.get_logger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# How long the thread waits for events before it looks at replay requests again.
_POLL_S = 0.05


@dataclass(frozen=True)
class KvEventsSettings:
    endpoint: str = setting(
        "",
        flag="kv-events-endpoint",
        help="publish the worker's KV cache events (blocks cached, forgotten, cleared) on ZMQ in vLLM's wire format: "
        "tcp://*:5557 binds, tcp://HOST:PORT connects (workers that hold a KV pool; mmpipe up gives its workers "
        "PORT, PORT+1, ... in order; unset: none)",
    )
    replay_endpoint: str = setting(
        "",
        flag="kv-events-replay-endpoint",
        help="with --kv-events-endpoint: where a subscriber asks for the batches it missed (a ROUTER, bound: "
        "tcp://*:5558; mmpipe up offsets it as the endpoint)",
    )
    topic: str = setting("", flag="kv-events-topic", help="with --kv-events-endpoint: the topic frame of each batch")


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or a local transport is bound; a host, connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str, offset: int) -> str:
    """``tcp://host:P`` as ``tcp://host:P+offset`` (one port per worker of an
    ``mmpipe up``); raises where ``endpoint`` is none ZMQ takes."""
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{base}:{int(port) + offset}" if offset else endpoint
    elif endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_{offset}" if offset else endpoint
    raise ValueError(f"KV events endpoint {endpoint!r}: tcp://HOST:PORT, ipc://PATH or inproc://NAME")


class KvEventPublisher:
    def __init__(
        self,
        events: KvEventLog,
        endpoint: str,
        replay_endpoint: str = "",
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self.events = events
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        import zmq

        self._ctx: Any = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        (self._pub.bind if binds(endpoint) else self._pub.connect)(endpoint)
        self._replay: Any = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._seq = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv_events", daemon=True)
        self._thread.start()
        log.info("kv_events_publishing", endpoint=endpoint, replay_endpoint=replay_endpoint or None, topic=topic)

    @property
    def published(self) -> int:
        """Batches sent so far (the next batch's sequence number)."""
        return self._seq

    def close(self) -> None:
        """Send what is left, then close the sockets."""
        self._running = False
        self.events.pending.set()
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            self.events.pending.wait(_POLL_S)
            # A publisher failing must not stop the worker: logged, and the next batch tried.
            try:
                self._serve_replay()
                self._publish(self.events.take())
            except Exception as exc:
                log.error("kv_events_publish_failed", error=repr(exc))
                time.sleep(_POLL_S)
            if not self._running:
                self._publish(self.events.take())
                return

    def _publish(self, events: list[Any]) -> None:
        if not events:
            return
        payload = self._encoder.encode(KVEventBatch(time.time(), events, self._rank))
        self._pub.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
        self._buffer.append((self._seq, payload))
        self._seq += 1

    def _serve_replay(self) -> None:
        replay = self._replay
        while replay is not None and replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3:
                log.warning("kv_events_bad_replay_request", frames=len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", END_SEQ, b""))
