"""References to tensors held by another worker.

Large tensors (media embeddings, KV cache) never ride a NATS message: the
worker that made them keeps them (the holder) and the message carries a small
``TensorRef``; the next worker reads them with the transport named in the ref.
A list of tensors is packed into one contiguous region, so one transfer moves
them all.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class TensorSpec(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """One tensor inside a held region."""

    # torch dtype name without the "torch." prefix: "float32", "bfloat16", "int64".
    dtype: str
    shape: list[int]
    # Byte offset of the tensor's first element inside the region.
    offset: int = 0


class TensorRef(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Where a packed list of tensors is held, and until when."""

    transport: Literal["nixl", "nats"]
    # The holder's name: a NIXL agent name, or the NATS-store client name.
    holder: str
    # Unique id of the held region; never reused.
    key: str
    nbytes: int
    tensors: list[TensorSpec]
    # Unix seconds after which the holder frees the region unread.
    expires: float
    # Address of the region in the holder's registered memory (NIXL only).
    addr: int = 0
    mem: Literal["DRAM", "VRAM"] = "DRAM"
    # CUDA device index for VRAM; 0 for DRAM.
    device_id: int = 0
    # False: the bytes were still being copied (queued on the holder's GPU
    # behind the work that made them) when the ref went out. The holder then
    # grants a lease only once they have landed, so a reader posts its READ
    # after the grant, never beside the request.
    landed: bool = True


class LeaseRequest(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Reader to NIXL holder (core NATS request): may I read ``key`` now,
    under ``lease``? The reader picks the lease id (0: the holder does), so a
    READ posted before the reply can name it in its notification.

    With ``abort`` set, the reader gives back a lease it never used (no READ
    was posted), so another reader need not wait for the lease to lapse.
    """

    key: str
    abort: bool = False
    lease: int = 0
    # How long the reader waits for this reply: a holder whose copy has not
    # landed answers "landing" before then rather than leave it to time out.
    wait_s: float = 0.0


class LeaseReply(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Holder's answer: ``lease`` > 0 means the region is pinned for the
    reader for ``lease_s`` seconds from when the holder granted it (at or
    after the request's arrival, so a reader counting from its sending
    undercounts, never over)."""

    lease: int = 0
    lease_s: float = 0.0
    # Why no lease was granted: "unknown", "expired", "claimed", "released";
    # "landing": the bytes are still being copied on the holder's GPU, ask again.
    reason: str = ""
