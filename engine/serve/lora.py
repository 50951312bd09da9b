"""Chapter 43: many LoRA adapters served in one flattened batch.

A LoRA adapter changes a linear layer W [out, in] into W + s * B @ A with A [r, in],
B [out, r] and s = alpha / r. Merging B @ A into W would give one adapter per copy of the
model. Instead the base weights stay shared and the low-rank part is computed per ROW of the
flattened batch, each row with the adapter of the request it belongs to (Punica, S-LoRA):

    shrink   t = x @ A[slot]^T          [N, in]  -> [N, r]
    expand   y = y + s[slot] * t @ B[slot]^T   [N, r] -> [N, out]

All adapters of the bank are stacked into one tensor per projection, zero-padded to the
largest rank, so both steps are one batched gather + matmul over the whole batch, whatever
mix of adapters it holds. Slot 0 is all zeros: the rows of requests without an adapter.

The bank reaches the model through forward hooks on the seven projections of each layer
(q, k, v, o, gate, up, down): the FlatModel's forward loop and its modules stay untouched.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .flat_model import FlatModel

# Where each projection lives inside a decoder layer: (submodule, projection).
TARGETS: dict[str, str] = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# A PEFT tensor name: ...layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight
PEFT_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


@dataclass
class LoraAdapter:
    """One adapter: weights[(layer, projection)] = (A [r, in], B [out, r]), float32."""
    name: str
    rank: int
    alpha: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def load_peft_adapter(path: str | Path, name: str | None = None) -> LoraAdapter:
    """Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors).

    Only what this engine computes is accepted: plain LoRA (no DoRA, no rsLoRA, no trained
    biases, no fully trained extra modules) on the seven projections of a decoder layer.
    Anything else is a ValueError naming the file and the setting, never silently ignored."""
    from safetensors.torch import load_file
    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise ValueError(f"{folder}: a PEFT LoRA adapter needs {needed.name}")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_file}: peft_type {config.get('peft_type')!r} is not LORA")
    for key in ("use_dora", "use_rslora", "fan_in_fan_out", "modules_to_save"):
        if config.get(key):
            raise ValueError(f"{config_file}: {key}={config[key]!r} is not supported (plain LoRA only)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{config_file}: bias={config['bias']!r} is not supported (plain LoRA only)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{config_file}: per-module ranks (rank_pattern/alpha_pattern) are not supported")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        match = PEFT_KEY.search(key)
        if match is None or TARGETS.get(match[3]) != match[2]:
            raise ValueError(f"{weights_file}: tensor {key!r} is not LoRA on a decoder layer's projection")
        pairs.setdefault((int(match[1]), match[3]), {})[match[4]] = tensor.float()
    weights = {}
    for where, found in pairs.items():
        if set(found) != {"A", "B"}:
            raise ValueError(f"{weights_file}: layer {where[0]} {where[1]} lacks lora_A or lora_B")
        if found["A"].shape[0] != rank or found["B"].shape[1] != rank:
            raise ValueError(f"{weights_file}: layer {where[0]} {where[1]} is not rank {rank}")
        weights[where] = (found["A"], found["B"])
    return LoraAdapter(name or folder.name, rank, alpha, weights)


# --- the two batched kernels ----------------------------------------------------------------

def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Project every row down to its own adapter's rank space.  (Your engine: Chapter 43)

    x [N, in] (the projection's input rows, any float dtype); lora_a [S, R, in] (every slot's
    A matrix, zero-padded to the bank's largest rank R); slots [N] int64, slots[i] in
    [0, S): the slot of row i's request (0 is the all-zero slot of rows without adapter).
    Returns t [N, R] in x's dtype with t[i] = lora_a[slots[i]] @ x[i].
    One batched computation for the whole batch: no Python loop over rows or requests.
    """
    raise NotImplementedError("Your engine: Chapter 43: lora_shrink")


def lora_expand(base: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
    """Add each row's low-rank update to the base projection's output.  (Your engine: Chapter 43)

    base [N, out] (the frozen layer's output); shrunk [N, R] (lora_shrink's result);
    lora_b [S, out, R]; scaling [S] float (alpha / r of each slot, 0 for slot 0); slots [N]
    int64. Returns a NEW tensor [N, out] in base's dtype:
    out[i] = base[i] + scaling[slots[i]] * (lora_b[slots[i]] @ shrunk[i]).
    `base` itself is left unchanged (it may be a view the caller still reads), and rows
    of slot 0 come back equal to base.
    """
    raise NotImplementedError("Your engine: Chapter 43: lora_expand")


# --- the bank ---------------------------------------------------------------------------------

class AdapterBank:
    """Every adapter the engine may serve, stacked per projection, hooked into a FlatModel.

    `add(adapter)` gives it a slot (1, 2, ...); `key(name)` is what goes into the block
    hash of a request that uses it; `activate(slots)` sets the per-row slots of one forward
    pass. Outside `activate`, the hooks do nothing: the base model runs unchanged."""

    def __init__(self, flat: FlatModel) -> None:
        self.flat = flat
        weight = next(flat.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.names: list[str] = [""]                       # slot -> adapter name; slot 0: none
        self.rank = 0                                      # R: the largest rank added so far
        self.scaling = torch.zeros(1, device=self.device)
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for index, layer in enumerate(flat.layers):
            for target, parent in TARGETS.items():
                module = getattr(getattr(layer, parent), target, None)
                if isinstance(module, nn.Linear):
                    self.stacks[(index, target)] = (
                        torch.zeros(1, 0, module.in_features, device=self.device, dtype=self.dtype),
                        torch.zeros(1, module.out_features, 0, device=self.device, dtype=self.dtype))
                    module.register_forward_hook(self._hook(index, target))
        self.active: torch.Tensor | None = None
        flat.adapters = self                 # where the runner finds the bank

    def __len__(self) -> int:
        return len(self.names) - 1

    def slot(self, name: str) -> int:
        """The slot of adapter `name`; ValueError if it was never added."""
        if name not in self.names[1:]:
            raise ValueError(f"adapter {name!r} is not loaded (loaded: {self.names[1:]})")
        return self.names.index(name)

    @staticmethod
    def key(name: str) -> tuple[str, str]:
        """The block-hash key of an adapter: requests of two adapters never share a block."""
        return ("lora", name)

    def add(self, adapter: LoraAdapter) -> int:
        """Stack `adapter` into a new slot and return it. All checks come first: a
        ValueError leaves the bank as it was."""
        if not adapter.name or adapter.name in self.names:
            raise ValueError(f"adapter name {adapter.name!r} is empty or already loaded")
        for where, (a, b) in adapter.weights.items():
            if where not in self.stacks:
                raise ValueError(f"adapter {adapter.name!r}: this model has no layer {where[0]} {where[1]}")
            stack_a, stack_b = self.stacks[where]
            if a.shape != (adapter.rank, stack_a.shape[2]) or b.shape != (stack_b.shape[1], adapter.rank):
                raise ValueError(f"adapter {adapter.name!r}: layer {where[0]} {where[1]} has A {tuple(a.shape)} "
                                 f"and B {tuple(b.shape)}, which do not fit the model at rank {adapter.rank}")
        rank = max(self.rank, adapter.rank)
        for where, (stack_a, stack_b) in self.stacks.items():
            a = torch.zeros(1, rank, stack_a.shape[2], device=self.device, dtype=self.dtype)
            b = torch.zeros(1, stack_b.shape[1], rank, device=self.device, dtype=self.dtype)
            if where in adapter.weights:
                a[0, :adapter.rank], b[0, :, :adapter.rank] = adapter.weights[where]
            # Zero-padding the rank changes nothing: padded rows of A meet padded columns of B.
            grow = rank - self.rank
            stack_a = torch.nn.functional.pad(stack_a, (0, 0, 0, grow))
            stack_b = torch.nn.functional.pad(stack_b, (0, grow))
            self.stacks[where] = torch.cat([stack_a, a]), torch.cat([stack_b, b])
        self.rank = rank
        self.scaling = torch.cat([self.scaling, torch.tensor([adapter.scaling], device=self.device)])
        self.names.append(adapter.name)
        return len(self.names) - 1

    @contextmanager
    def activate(self, slots: torch.Tensor | None) -> Iterator[None]:
        """Run the enclosed forward pass with row i using adapter slots[i] ([N] int64)."""
        self.active = slots if slots is not None and bool(slots.any()) else None
        try:
            yield
        finally:
            self.active = None

    def _hook(self, layer: int, target: str) -> Any:
        def add_update(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> Any:
            if self.active is None:
                return None                                # keep the base output
            lora_a, lora_b = self.stacks[(layer, target)]
            shrunk = lora_shrink(inputs[0], lora_a, self.active)
            return lora_expand(output, shrunk, lora_b, self.scaling, self.active)
        return add_update


def adapter_inputs(flat: FlatModel, request_id: str, lora: object) -> tuple[int, tuple[tuple[str, str]]]:
    """What add_request stores for a request of adapter `lora` (a loaded adapter's name):
    its slot (request.lora_slot) and its block-hash key. ValueError when it cannot be served."""
    bank = flat.adapters
    if bank is None:
        raise ValueError(f"request {request_id!r}: asks for adapter {lora!r} but the engine has no AdapterBank "
                         f"(build it with EngineCore(..., adapters=[load_peft_adapter(path), ...]))")
    if not isinstance(lora, str):
        raise ValueError(f"request {request_id!r}: lora names a loaded adapter (a string), got {lora!r}")
    try:
        slot = bank.slot(lora)
    except ValueError as exc:
        raise ValueError(f"request {request_id!r}: {exc}") from None
    return slot, (bank.key(lora),)
