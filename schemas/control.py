"""Control-plane messages: cancel, dead letters, worker liveness."""

from __future__ import annotations

import msgspec

from schemas.errors import ErrorCode


class Cancel(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    request_id: str
    reason: str = "client disconnected"


class DeadLetter(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    subject: str
    code: ErrorCode
    message: str
    deliveries: int
    request_id: str = ""
    # The message as it arrived, so an operator can replay it.
    payload: bytes = b""
    # Set (to the message's size) instead of payload when the message and the
    # letter around it would not fit one NATS message.
    payload_omitted: int = 0


class WorkerInfo(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A worker's answer to a liveness ping on ``mmpipe.<ns>.ping.<role>``."""

    role: str
    worker_id: str
    models: list[str] = []
    inflight: int = 0
    max_inflight: int = 0
    # Where its KV cache events are published (ZMQ), if anywhere.
    kv_events_endpoint: str = ""
    # Its last canary health check failed (``problem`` says how): it takes no work.
    healthy: bool = True
    problem: str = ""
    # Asleep at this level (vLLM's sleep mode: 1 or 2), or on its way to sleep (-1): it takes no work.
    sleeping: int = 0


class CacheCleared(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A worker's answer on ``mmpipe.<ns>.cache.reset``: its prefix cache
    forgotten (``blocks`` were cached), or not held (``supported`` False:
    its role or engine keeps none)."""

    role: str
    worker_id: str
    supported: bool = True
    blocks: int = 0
    # Set where the engine failed to forget it.
    error: str = ""


class Sleep(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """To every worker of a role, on ``mmpipe.<ns>.sleep.<role>``: give the
    device's memory back at ``level`` (0: wake up). One ``SleepState`` each."""

    level: int


class SleepState(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A worker's answer to ``Sleep``: the level it sleeps at now (0:
    awake), the device bytes it held before and holds now (``held``: weights,
    kv_cache), or why it could not (``supported`` False: its engine has no
    sleep mode; ``error``: it failed)."""

    role: str
    worker_id: str
    sleeping: int = 0
    supported: bool = True
    held_before: dict[str, int] = {}
    held: dict[str, int] = {}
    error: str = ""


class LoraAdapter(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A LoRA adapter the deployment serves: its name (a request's ``model``)
    and its directory (PEFT's format), as every worker that runs the
    language model can read it. The value of its key in the adapters bucket."""

    name: str
    path: str


class LoraCommand(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """To every worker of a role, on ``mmpipe.<ns>.lora.<role>``: load
    (``path`` given) or unload an adapter now. One ``LoraState`` each."""

    name: str
    path: str = ""


class LoraState(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A worker's answer to a ``LoraCommand``: the adapters it holds now, or
    why it could not (``supported`` False: its engine takes none)."""

    role: str
    worker_id: str
    adapters: list[str] = []
    supported: bool = True
    error: str = ""


class Restart(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A hop's request, to the bridge holding a request as it arrived, to
    queue it again from its first hop as ``attempt`` (what an earlier hop
    made is gone, and the hop's message no longer carries the media)."""

    request_id: str
    attempt: int


class WorkerLoad(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """What a hop worker publishes every half second on
    ``mmpipe.<ns>.load.<worker_id>``: how busy it is, for a cache-aware
    router to weigh a cache hit against (NVIDIA Dynamo's active blocks).
    Its absence for a while says the worker is gone."""

    role: str
    worker_id: str
    inflight: int = 0
    max_inflight: int = 0
    # Routed messages taken but not yet started (waiting for a free slot).
    waiting: int = 0
    # KV blocks its running sequences hold, of its pool's; 0 of 0: unknown.
    active_blocks: int = 0
    total_blocks: int = 0
    # Stopping: it takes nothing more, routed or not.
    draining: bool = False
    # Its prefill takes a request whose media were not encoded where its
    # prefix cache holds their tokens (``ProcessedRequest.encode_skipped``).
    takes_cached_media: bool = False


class EmbeddingsHeld(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """What an encoding worker's embedding cache took in and let go, on
    ``mmpipe.<ns>.embeddings.<worker_id>``: each a request's media by
    content (``stages.media.media_set_key``), for a router to send the
    same media to the worker that holds their embeddings."""

    stored: list[str] = []
    removed: list[str] = []
