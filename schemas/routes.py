"""Roles, hops and deployment modes. A mode is nothing but the route a
request takes: the list of hops, each run by a worker role."""

from __future__ import annotations

PROCESSOR = "processor"
HOP_ROLES = (
    "encode",
    "prefill",
    "decode",
    "encode+prefill",
    "prefill+decode",
    "encode+prefill+decode",
)
# The image-generation stage's role (a diffusion pipeline; stages/image_engine).
GENERATE_IMAGE = "generate-image"
# Roles whose workers take hops from a work queue of their own.
STAGE_ROLES = (*HOP_ROLES, GENERATE_IMAGE)
ROLES = (PROCESSOR, *STAGE_ROLES)

MODES: dict[str, tuple[str, ...]] = {
    "epd": ("encode+prefill+decode",),
    "e-pd": ("encode", "prefill+decode"),
    "e-p-d": ("encode", "prefill", "decode"),
    "ep-d": ("encode+prefill", "decode"),
}


def moves_tensors(role: str) -> bool:
    """A hop role that ends before decode, or starts after encode, hands
    tensors to (or takes them from) another hop; the processor and the
    aggregated role never do."""
    steps = role.split("+")
    return role in HOP_ROLES and not (steps[0] == "encode" and steps[-1] == "decode")


def holds_kv(role: str) -> bool:
    """Whether a role's workers hold KV cache (and so may publish KV events)."""
    return "prefill" in role or "decode" in role


def route_for(mode: str, has_media: bool) -> list[str]:
    """Hops for a request; text-only requests skip a hop that only encodes."""
    try:
        hops = list(MODES[mode])
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}") from None
    if not has_media and hops[0] == "encode":
        hops = hops[1:]
    return hops
