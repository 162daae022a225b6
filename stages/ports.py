"""A free TCP port for an engine's own side channel (vLLM's NIXL side
channel, SGLang's bootstrap server), taken when the worker starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now, on every interface."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
