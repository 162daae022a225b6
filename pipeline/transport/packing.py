"""How a list of tensors is laid out in one contiguous byte region.

Both transports move one region per ``put`` (one NIXL descriptor, one object),
so the layout is shared: each tensor starts at an ``ALIGN``-byte boundary,
which lets the reader view its slice as any dtype without a copy.
"""

from __future__ import annotations

import itertools

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


def contiguous_runs(target: torch.Tensor) -> list[tuple[int, int, int]]:
    """``target`` (possibly a strided view) as runs of contiguous bytes:
    (address, bytes, offset of the run in the tensor packed contiguously).
    A view of a slot of a larger cache ([1, heads, length, dim] out of
    [.., heads, max_len, dim]) is one run per head."""
    shape, strides = list(target.shape), list(target.stride())
    size = target.element_size()
    # The innermost dims laid out as a contiguous tensor's form one run.
    inner, run = len(shape), 1
    while inner > 0 and (shape[inner - 1] == 1 or strides[inner - 1] == run):
        inner -= 1
        run *= shape[inner]
    packed_strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        packed_strides[d] = packed_strides[d + 1] * shape[d + 1]
    runs = []
    base = target.data_ptr()
    for index in itertools.product(*(range(n) for n in shape[:inner])):
        address = base + sum(i * st for i, st in zip(index, strides, strict=False)) * size
        offset = sum(i * st for i, st in zip(index, packed_strides, strict=False)) * size
        runs.append((address, run * size, offset))
    return [r for r in runs if r[1]]


# What a get READs into, per tensor: one tensor (a strided view allowed), or
# its pieces along the first dimension, in order (a sequence's blocks of a
# paged KV cache, which lie wherever the pool had them free).
Target = torch.Tensor | list[torch.Tensor]


def pieces(target: Target) -> list[torch.Tensor]:
    return target if isinstance(target, list) else [target]


def _matches(target: Target, spec: TensorSpec, device: torch.device | None) -> bool:
    shape = list(spec.shape)
    if isinstance(target, list):
        if not shape or len(target) != shape[0]:
            return False
        shape = shape[1:]
    return all(
        t.dtype == to_dtype(spec.dtype) and list(t.shape) == shape and (device is None or t.device == device)
        for t in pieces(target)
    )


def check_targets(targets: list[Target], specs: list[TensorSpec], device: torch.device | None = None) -> None:
    """``targets`` take the tensors of ``specs`` as they are (no conversion)."""
    if len(targets) != len(specs) or not all(_matches(t, s, device) for t, s in zip(targets, specs, strict=False)):
        where = f" on {device}" if device is not None else ""
        raise ValueError(f"targets do not match the {len(specs)} tensors of the ref{where}")


def target_runs(target: Target) -> list[tuple[int, int, int]]:
    """``contiguous_runs`` of a target (its pieces one after the other),
    runs that continue one another in memory and in the packed tensor
    joined: blocks the pool gave out consecutively are one run."""
    runs: list[tuple[int, int, int]] = []
    base = 0
    for piece in pieces(target):
        for address, n, offset in contiguous_runs(piece):
            offset += base
            if runs and runs[-1][0] + runs[-1][1] == address and runs[-1][2] + runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + n, runs[-1][2])
            else:
                runs.append((address, n, offset))
        base += piece.numel() * piece.element_size()
    return runs


def copy_into(target: Target, tensor: torch.Tensor) -> None:
    """``tensor`` (the spec's shape) into a target."""
    if isinstance(target, list):
        for piece, part in zip(target, tensor.unbind(0), strict=True):
            piece.copy_(part)
    else:
        target.copy_(tensor)
