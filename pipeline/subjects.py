"""Subject, stream and consumer names for one namespace."""

from __future__ import annotations

import re
from dataclasses import dataclass

from schemas.routes import PROCESSOR, ROLES

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def check_token(value: str, what: str) -> str:
    """Subject tokens may not hold '.', '*', '>' or spaces."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must match {_TOKEN.pattern}")
    return value


def role_token(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    # '+' is legal in a subject but not wanted in stream and consumer names.
    return role.replace("+", "_")


@dataclass(frozen=True)
class Subjects:
    namespace: str = "default"

    def __post_init__(self) -> None:
        check_token(self.namespace, "namespace")

    @property
    def prefix(self) -> str:
        return f"mmpipe.{self.namespace}"

    @property
    def requests(self) -> str:
        return f"{self.prefix}.requests"

    def work(self, role: str) -> str:
        """The work-queue subject a role consumes: the processor reads requests."""
        if role == PROCESSOR:
            return self.requests
        return f"{self.prefix}.hop.{role_token(role)}"

    def reply(self, request_id: str) -> str:
        return f"{self.prefix}.reply.{request_id}"

    @property
    def replies(self) -> str:
        return f"{self.prefix}.reply.>"

    def restart(self, request_id: str) -> str:
        """Where the bridge holding a request takes its restarts (core NATS request/reply)."""
        return f"{self.prefix}.restart.{request_id}"

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}.cancel.{request_id}"

    @property
    def cancels(self) -> str:
        return f"{self.prefix}.cancel.>"

    @property
    def dead(self) -> str:
        return f"{self.prefix}.dead"

    def spans(self, process: str) -> str:
        """Where a process publishes its finished trace spans (--trace-nats)."""
        return f"{self.prefix}.spans.{check_token(process.replace('+', '_'), 'process')}"

    @property
    def all_spans(self) -> str:
        return f"{self.prefix}.spans.>"

    @property
    def cache_reset(self) -> str:
        """Every worker of the namespace: forget your prefix cache (request, one reply each)."""
        return f"{self.prefix}.cache.reset"

    def routed(self, role: str, worker_id: str) -> str:
        """One worker's own subject in its role's work queue: a hop a router
        sends to the worker that holds its prefix."""
        return f"{self.work(role)}.{check_token(worker_id, 'worker id')}"

    def all_routed(self, role: str) -> str:
        return f"{self.work(role)}.*"

    def routed_durable(self, role: str, worker_id: str) -> str:
        return f"mmpipe-{role_token(role)}-{check_token(worker_id, 'worker id')}"

    def kv_events(self, worker_id: str) -> str:
        """A worker's KV events relayed from its ZMQ publisher (vLLM's msgpack batches)."""
        return f"{self.prefix}.kv_events.{check_token(worker_id, 'worker id')}"

    @property
    def all_kv_events(self) -> str:
        return f"{self.prefix}.kv_events.*"

    def embeddings(self, worker_id: str) -> str:
        """Which media's embeddings an encoding worker holds (EmbeddingsHeld)."""
        return f"{self.prefix}.embeddings.{check_token(worker_id, 'worker id')}"

    @property
    def all_embeddings(self) -> str:
        return f"{self.prefix}.embeddings.*"

    def load(self, worker_id: str) -> str:
        return f"{self.prefix}.load.{check_token(worker_id, 'worker id')}"

    @property
    def all_loads(self) -> str:
        return f"{self.prefix}.load.*"

    def ping(self, role: str) -> str:
        return f"{self.prefix}.ping.{role_token(role)}"

    def lora(self, role: str) -> str:
        """Every worker of a role: load or unload a LoRA adapter (``LoraCommand``; one ``LoraState`` reply each)."""
        return f"{self.prefix}.lora.{role_token(role)}"

    @property
    def lora_bucket(self) -> str:
        """The key-value bucket of the LoRA adapters served (name -> ``LoraAdapter``)."""
        return f"MMPIPE_{self.namespace}_LORA"

    @property
    def images_bucket(self) -> str:
        """The object store bucket of images answered by URL (``response_format`` url)."""
        return f"MMPIPE_{self.namespace}_IMAGES"

    def sleep(self, role: str) -> str:
        """Every worker of a role: sleep at a level, or wake (``Sleep``; one ``SleepState`` reply each)."""
        return f"{self.prefix}.sleep.{role_token(role)}"

    def stream(self, role: str) -> str:
        return f"MMPIPE_{self.namespace}_{role_token(role).upper()}"

    @property
    def reply_stream(self) -> str:
        return f"MMPIPE_{self.namespace}_REPLY"

    @property
    def dead_stream(self) -> str:
        return f"MMPIPE_{self.namespace}_DEAD"

    def durable(self, role: str) -> str:
        return f"mmpipe-{role_token(role)}"
