"""How a list of tensors is laid out in one contiguous byte region.

Both transports move one region per ``put`` (one NIXL descriptor, one object),
so the layout is shared: each tensor starts at an ``ALIGN``-byte boundary,
which lets the reader view its slice as any dtype without a copy.
"""

from __future__ import annotations

import torch

from schemas.tensors import TensorSpec

# 256 covers every dtype's alignment and keeps regions apart on cache lines.
ALIGN = 256


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def layout(tensors: list[torch.Tensor]) -> tuple[list[TensorSpec], int]:
    """Specs with offsets, and the packed size in bytes."""
    specs: list[TensorSpec] = []
    end = 0
    for t in tensors:
        offset = align_up(end)
        specs.append(TensorSpec(dtype=dtype_name(t.dtype), shape=list(t.shape), offset=offset))
        end = offset + nbytes_of(t)
    return specs, end


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    # reshape(-1) first: a 0-dim tensor cannot be viewed as another dtype.
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack_into(dst: torch.Tensor, tensors: list[torch.Tensor], specs: list[TensorSpec]) -> None:
    """Copy ``tensors`` into the 1-D uint8 ``dst`` at their specs' offsets."""
    for t, spec in zip(tensors, specs, strict=True):
        n = nbytes_of(t)
        if n:
            dst[spec.offset : spec.offset + n].copy_(as_bytes(t))


def unpack(buf: torch.Tensor, specs: list[TensorSpec]) -> list[torch.Tensor]:
    """Views of the 1-D uint8 ``buf`` as the tensors in ``specs``.

    They share ``buf``'s storage: the caller owns it, and it lives as long as
    any of them does.
    """
    out: list[torch.Tensor] = []
    for spec in specs:
        dtype = to_dtype(spec.dtype)
        numel = 1
        for d in spec.shape:
            numel *= d
        n = numel * dtype.itemsize
        if spec.offset < 0 or spec.offset + n > buf.numel():
            raise ValueError(f"tensor spec {spec} lies outside a region of {buf.numel()} bytes")
        out.append(buf[spec.offset : spec.offset + n].view(dtype).view(spec.shape))
    return out


def check_specs(specs: list[TensorSpec], nbytes: int) -> None:
    """Reject a ref whose specs do not fit its region before any memory moves."""
    for spec in specs:
        dtype = to_dtype(spec.dtype)
        numel = 1
        for d in spec.shape:
            if d < 0:
                raise ValueError(f"negative dimension in tensor spec {spec}")
            numel *= d
        if spec.offset < 0 or spec.offset % ALIGN or spec.offset + numel * dtype.itemsize > nbytes:
            raise ValueError(f"tensor spec {spec} does not fit a region of {nbytes} bytes")
