"""What happens to a work message once a stage is done with it."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.errors import MmpipeError


@dataclass(frozen=True)
class Ack:
    """Done: every output is stored."""


@dataclass(frozen=True)
class Nak:
    """Give it back for another try after ``delay_s``."""

    error: MmpipeError
    delay_s: float


@dataclass(frozen=True)
class Reject:
    """Never retry: terminate, tell the client, record on the dead subject."""

    error: MmpipeError


Outcome = Ack | Nak | Reject


def retry_delay(deliveries: int, base_s: float = 0.5, cap_s: float = 10.0) -> float:
    return min(cap_s, base_s * 2 ** max(0, deliveries - 1))


def outcome_for(error: MmpipeError, deliveries: int, max_deliver: int) -> Nak | Reject:
    if error.retryable and deliveries < max_deliver:
        return Nak(error, retry_delay(deliveries))
    return Reject(error)
