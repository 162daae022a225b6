"""LoRA adapters in PEFT's format on the engine's language model, each row
of a forward with its own adapter (or none).

An adapter is a directory as PEFT's ``save_pretrained`` writes it:
``adapter_config.json`` and ``adapter_model.safetensors``. It is read here
without the peft library, checked against the model the engine loaded (only
linear layers of the language model, shapes that fit) and kept in host
memory, so that it can be applied again to a model reloaded after a sleep.

Applied, each targeted ``nn.Linear`` is wrapped in a ``LoraLinear`` holding
every loaded adapter's A and B stacked by adapter slot (padded to the
largest rank; slot 0 is no adapter: zeros) and computes, for batch row i,
``base(x) + scale[id_i] * (x @ A[id_i]^T) @ B[id_i]^T`` with gathers and
batched matrix products, where ``id`` is read from ``LoraRows.current``: a
tensor of adapter slots, one per batch row, the engine points at before
every forward (None: every row without adapter, nothing added). The batch
decoder's steps read the decoder's own static row of slots, so a CUDA
graph replays with the slots of each step. The fused step and the graphed
prefill, which call concatenated weights instead of the modules, take the
same adapters stacked per fused projection (``LoraSet.fused``,
stages/torch_engine/fused_lora.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from schemas.errors import InvalidRequest, ModelNotFound
from stages.torch_engine.fused_lora import LayerLora, layer_loras

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT's key of a LoRA weight: the wrapped model's prefix, the module's path,
# lora_A or lora_B, and (in some writers) the adapter's name before "weight".
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<path>.+)\.lora_(?P<which>A|B)(?:\.[^.]+)?\.weight$")
# Where a language model's modules may sit in an adapter trained on another
# class or an older transformers layout (Qwen2-VL's ``model.layers``, LLaVA's
# ``language_model.model.layers`` before transformers 4.52).
_LM_PREFIXES = ("", "model", "language_model", "model.language_model", "language_model.model", "model.model")


@dataclass(frozen=True)
class LoraWeights:
    """One module's adapter, in host memory: A [r, in], B [out, r] and its scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter read and checked against the engine's model: its weights
    by the model's module names."""

    name: str
    path: Path
    modules: dict[str, LoraWeights]
    # Folded into its prompts' prefix keys: its cached blocks are its own.
    salt: str


def language_model(model: Any) -> tuple[str, Any] | None:
    """The language model inside ``model`` and its name there (None: none found)."""
    from stages.torch_engine.batch_decoder import _language_model

    lm = _language_model(model)
    lm_name = next((n for n, m in model.named_modules() if m is lm), None)
    return None if lm is None or lm_name is None else (lm_name, lm)


def language_linears(model: Any) -> dict[str, nn.Linear]:
    """The language model's linear layers (and the output head) by their
    names in ``model``, each a plain ``nn.Linear`` (a wrapper's base)."""
    out: dict[str, nn.Linear] = {}
    found = language_model(model)
    if found is None:
        return out
    lm_name, lm = found
    for name, module in lm.named_modules(prefix=lm_name):
        if isinstance(module, LoraLinear):
            out[name] = module.base
        elif isinstance(module, nn.Linear) and not name.endswith(".base"):
            out[name] = module
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    if isinstance(head, LoraLinear):
        head = head.base
    if isinstance(head, nn.Linear) and head_name is not None:
        out[head_name] = head
    return out


def read_adapter(name: str, path: str | Path, model: Any) -> LoraAdapter:
    """The adapter at ``path`` (PEFT's directory), its modules named as in
    ``model``; InvalidRequest for what it cannot be applied as."""
    where = Path(path)
    config_file, weights_file = where / CONFIG_FILE, where / WEIGHTS_FILE
    if not config_file.is_file():
        raise InvalidRequest(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {where}")
    if not weights_file.is_file():
        pickled = (where / "adapter_model.bin").exists()
        extra = " (adapter_model.bin is not read: save the adapter as safetensors)" if pickled else ""
        raise InvalidRequest(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {where}{extra}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"LoRA adapter {name!r}: {CONFIG_FILE} unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidRequest(f"LoRA adapter {name!r}: {CONFIG_FILE} is not an object")
    _check_config(name, config)
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(weights_file), device="cpu")
    except Exception as exc:  # safetensors raises its own error types for a bad file
        raise InvalidRequest(f"LoRA adapter {name!r}: {WEIGHTS_FILE} unreadable: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise InvalidRequest(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A or B weight of a linear layer")
        pairs.setdefault(match["path"], {})[match["which"]] = tensor
    if not pairs:
        raise InvalidRequest(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    linears = language_linears(model)
    names = {n for n, _ in model.named_modules()}
    alpha = float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora", False))
    modules: dict[str, LoraWeights] = {}
    for adapter_path, pair in pairs.items():
        target = _target(name, adapter_path, linears, names)
        if set(pair) != {"A", "B"}:
            raise InvalidRequest(f"LoRA adapter {name!r}: {adapter_path} has lora_{'A' if 'A' in pair else 'B'} only")
        a, b, linear = pair["A"], pair["B"], linears[target]
        rank = int(a.shape[0]) if a.dim() == 2 else 0
        want_a, want_b = (rank, linear.in_features), (linear.out_features, rank)
        if a.dim() != 2 or b.dim() != 2 or rank < 1 or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise InvalidRequest(
                f"LoRA adapter {name!r}: {adapter_path} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                f"the model's {target} ({linear.in_features} in, {linear.out_features} out) needs "
                f"[r, {linear.in_features}] and [{linear.out_features}, r]"
            )
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            raise InvalidRequest(f"LoRA adapter {name!r}: {adapter_path} holds NaN or infinite values")
        # PEFT's scaling, by each module's own rank (its rank_pattern's, where it has one).
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        modules[target] = LoraWeights(a.float(), b.float(), scale)
    digest = hashlib.sha256(weights_file.read_bytes()).hexdigest()[:16]
    return LoraAdapter(name, where.resolve(), modules, salt=f"lora:{name}:{digest}")


def _check_config(name: str, config: dict[str, Any]) -> None:
    """What of PEFT's LoRA options this engine does not compute: refused."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise InvalidRequest(f"LoRA adapter {name!r}: peft_type {kind!r}, not LORA")
    if config.get("bias", "none") != "none":
        raise InvalidRequest(f"LoRA adapter {name!r}: bias {config['bias']!r} (trained biases) is not supported")
    if config.get("modules_to_save"):
        raise InvalidRequest(
            f"LoRA adapter {name!r}: modules_to_save {config['modules_to_save']} (fully trained modules) "
            "is not supported"
        )
    if config.get("fan_in_fan_out"):
        raise InvalidRequest(f"LoRA adapter {name!r}: fan_in_fan_out (Conv1D layers) is not supported")
    for flag in ("use_dora", "lora_bias", "layer_replication", "target_parameters", "alpha_pattern"):
        if config.get(flag):
            raise InvalidRequest(f"LoRA adapter {name!r}: {flag} is not supported")
    if config.get("trainable_token_indices"):
        raise InvalidRequest(f"LoRA adapter {name!r}: trainable_token_indices is not supported")


def _target(name: str, path: str, linears: dict[str, nn.Linear], names: set[str]) -> str:
    """The model's module an adapter's module path names: the same path, or
    a language-model layout's prefix on the language model's own path."""
    if path in linears:
        return path
    if path in names or f"{path}.base" in names:
        raise InvalidRequest(
            f"LoRA adapter {name!r}: {path} is not a linear layer of the language model (a vision or audio "
            "tower's, an embedding or another layer): only the language model's linear layers take an adapter"
        )
    relative = {_relative(n): n for n in linears}
    for prefix in _LM_PREFIXES:
        if prefix and not path.startswith(prefix + "."):
            continue
        rest = path[len(prefix) + 1 :] if prefix else path
        if rest in relative:
            return relative[rest]
    raise InvalidRequest(f"LoRA adapter {name!r}: the model has no language-model linear layer {path}")


def _relative(name: str) -> str:
    # A language model's path without its place in the multimodal model: "layers.0.self_attn.q_proj".
    at = name.find("layers.")
    return name[at:] if at >= 0 else name.rsplit(".", 1)[-1]


class LoraRows:
    """The adapter slot of each row of the next forward (None: no adapter
    on any row), shared by an engine's ``LoraLinear`` modules."""

    def __init__(self) -> None:
        self.current: torch.Tensor | None = None


class LoraLinear(nn.Module):
    """A linear layer plus, per batch row, the LoRA update of that row's
    adapter slot (``rows``): gathered A and B, two batched products."""

    lora_a: torch.Tensor  # [slots, rank, in]
    lora_b: torch.Tensor  # [slots, out, rank]
    scale: torch.Tensor  # [slots]

    def __init__(self, base: nn.Linear, rows: LoraRows) -> None:
        super().__init__()
        self.base = base
        self.rows = rows
        weight = base.weight
        self.register_buffer("lora_a", torch.zeros(1, 1, base.in_features, dtype=weight.dtype, device=weight.device))
        self.register_buffer("lora_b", torch.zeros(1, base.out_features, 1, dtype=weight.dtype, device=weight.device))
        self.register_buffer("scale", torch.zeros(1, dtype=weight.dtype, device=weight.device))

    # What the models' code may read of the linear layer it called.
    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def set_adapters(self, weights: dict[int, LoraWeights], slots: int) -> None:
        """The stacks for ``slots`` adapter slots: ``weights`` by slot, zeros elsewhere."""
        weight = self.base.weight
        rank = max((w.rank for w in weights.values()), default=1)
        a = torch.zeros(slots, rank, self.base.in_features)
        b = torch.zeros(slots, self.base.out_features, rank)
        scale = torch.zeros(slots)
        for slot, w in weights.items():
            a[slot, : w.rank] = w.a
            b[slot, :, : w.rank] = w.b
            scale[slot] = w.scale
        self.lora_a = a.to(weight.device, weight.dtype)
        self.lora_b = b.to(weight.device, weight.dtype)
        self.scale = scale.to(weight.device, weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        ids = self.rows.current
        if ids is None:
            return out
        n = x.shape[0]
        ids = ids[:n]
        rows = x.reshape(n, -1, x.shape[-1]).to(self.lora_a.dtype)
        # PEFT's order: B(A(x)), then the scale, then added to the base's output.
        down = torch.bmm(rows, self.lora_a[ids].transpose(1, 2))
        delta = torch.bmm(down, self.lora_b[ids].transpose(1, 2)) * self.scale[ids][:, None, None]
        return out + delta.reshape(out.shape).to(out.dtype)


class LoraSet:
    """An engine's loaded adapters: their slots (1, 2, ...; a freed slot is
    reused), and their wrappers on the model."""

    def __init__(self) -> None:
        self.adapters: dict[str, LoraAdapter] = {}
        self.slots: dict[str, int] = {}
        self.rows = LoraRows()
        # Whether the model holds wrappers: the decoder's graphs then always run them.
        self.wrapped = False

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def slot(self, name: str | None) -> int:
        """The slot of adapter ``name`` (0: None); ModelNotFound if not loaded."""
        if name is None:
            return 0
        slot = self.slots.get(name)
        if slot is None:
            loaded = ", ".join(self.names()) or "none"
            raise ModelNotFound(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        return slot

    def salt(self, name: str | None) -> str | None:
        return None if name is None else self.adapters[name].salt

    def add(self, adapter: LoraAdapter) -> int:
        taken = set(self.slots.values())
        slot = next(i for i in range(1, len(taken) + 2) if i not in taken)
        self.adapters[adapter.name] = adapter
        self.slots[adapter.name] = slot
        return slot

    def remove(self, name: str) -> None:
        del self.adapters[name]
        del self.slots[name]

    def apply(self, model: Any) -> None:
        """Wrap each linear layer an adapter targets (once) and fill every
        wrapper's stacks with the loaded adapters, on the model's device."""
        for adapter in self.adapters.values():
            for target in adapter.modules:
                module = model.get_submodule(target)
                if isinstance(module, LoraLinear):
                    continue
                parent_name, _, child = target.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, child, LoraLinear(module, self.rows))
                self.wrapped = True
        slots = self._slot_count()
        for name, module in model.named_modules():
            if isinstance(module, LoraLinear):
                weights = {self.slots[a.name]: a.modules[name] for a in self.adapters.values() if name in a.modules}
                module.set_adapters(weights, slots)

    def fused(self, model: Any, reserved: tuple[int, int] | None = None) -> list[LayerLora] | None:
        """The loaded adapters as the fused layer step takes them
        (stages/torch_engine/fused_lora.py), on the model's device; None
        with none loaded. ``reserved``: (adapters, rank) the stacks have
        room for, made even with none loaded (``--max-loras``)."""
        found = language_model(model) if self.adapters or reserved else None
        if found is None:
            return None
        lm_name, lm = found
        sizes = {name: (linear.in_features, linear.out_features) for name, linear in language_linears(model).items()}
        layers = [f"{lm_name}.layers.{i}" if lm_name else f"layers.{i}" for i in range(len(lm.layers))]
        by_slot = {self.slots[name]: adapter for name, adapter in self.adapters.items()}
        weight = lm.layers[0].self_attn.o_proj.weight
        slots, rank = (reserved[0] + 1, reserved[1]) if reserved else (self._slot_count(), 0)
        return layer_loras(layers, sizes, by_slot, slots, weight.device, weight.dtype, rank)

    def _slot_count(self) -> int:
        # Slot 0 (no adapter) and every slot up to the highest taken.
        return max(self.slots.values(), default=0) + 1

    def forget_model(self) -> None:
        """The model went (a deep sleep): the next ``apply`` wraps a new one."""
        self.wrapped = False

    @contextlib.contextmanager
    def for_rows(self, slots: list[int], device: torch.device) -> Iterator[None]:
        """A forward whose batch rows run adapter slots ``slots``."""
        self.rows.current = torch.tensor(slots, dtype=torch.long, device=device) if any(slots) else None
        try:
            yield
        finally:
            self.rows.current = None

    @contextlib.contextmanager
    def for_step(self, static: torch.Tensor, slots: list[int], graphed: bool) -> Iterator[None]:
        """A batch decoder step, its rows' slots in ``static`` (its inputs):
        where the step may be captured as a graph, always read (a graph
        captured without the adapters would replay without them)."""
        self.rows.current = static if any(slots) or (graphed and self.wrapped) else None
        try:
            yield
        finally:
            self.rows.current = None
