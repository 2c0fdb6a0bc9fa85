"""LoRA weights as the executor uses them: a bank of stacked served versions, and trainable live copies.

`LoraBank` holds, per (layer, target module), the A and B matrices of every resident adapter *version*
stacked along a slot dimension (`A: [slots, R, in]`, `B: [slots, out, R]`, B pre-multiplied by the
version's scaling, ranks below R zero-padded), as Punica and S-LoRA do. A forward pass applies to each
token the A/B of its slot, so requests of many adapters and of the base model share one batch. A slot is
written once per version and never changed while a request reads it (the engine guarantees that); the
write is a copy of a few MB.

`LiveLora` is the trainable copy of one adapter (parameters with gradients) that a training job updates;
it converts to and from the blob format of `collm_common.lora`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from collm_common.lora import AdapterWeights, LoraSpec, lora_key

MODULE_PATHS = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterMismatch(ValueError):
    """An adapter blob that does not fit this base model or this bank (shape, rank, module, layer)."""


def module_shapes(model: object) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-targetable projection of a decoder layer."""
    layer = model.model.layers[0]  # type: ignore[attr-defined]
    shapes = {}
    for name, path in MODULE_PATHS.items():
        parent, attr = path.split(".")
        lin = getattr(getattr(layer, parent), attr)
        shapes[name] = (int(lin.in_features), int(lin.out_features))
    return shapes


def parse_adapter(
    weights: AdapterWeights, n_layers: int, shapes: dict[str, tuple[int, int]], targets: tuple[str, ...]
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Validate a decoded blob against the model; returns {(layer, module): (A [r,in], B [out,r])}."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in weights.tensors.items():
        m = _KEY.match(key)
        if not m:
            raise AdapterMismatch(f"unexpected tensor {key!r} in adapter blob")
        layer, module, which = int(m.group(1)), m.group(3), m.group(4)
        if module not in MODULE_PATHS:
            raise AdapterMismatch(f"adapter targets unknown module {module!r}")
        if module not in targets:
            raise AdapterMismatch(f"adapter targets {module!r}; this replica serves {','.join(targets)}")
        if layer >= n_layers:
            raise AdapterMismatch(f"adapter has layer {layer}; the base model has {n_layers} layers")
        found.setdefault((layer, module), {})[which] = t
    r = weights.spec.r
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise AdapterMismatch(f"layer {layer} {module}: needs both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (r, fan_in) or tuple(b.shape) != (fan_out, r):
            raise AdapterMismatch(
                f"layer {layer} {module}: A {tuple(a.shape)} / B {tuple(b.shape)} do not match "
                f"r={r}, in={fan_in}, out={fan_out}"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterMismatch(f"layer {layer} {module}: non-finite weights")
        out[(layer, module)] = (a, b)
    if not out:
        raise AdapterMismatch("adapter blob holds no LoRA tensors")
    return out


class LoraBank:
    """Stacked A/B of resident adapter versions, indexed by slot (see module docstring)."""

    def __init__(
        self,
        n_slots: int,
        n_layers: int,
        shapes: dict[str, tuple[int, int]],
        targets: tuple[str, ...],
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.n_slots = n_slots
        self.n_layers = n_layers
        self.shapes = shapes
        self.targets = targets
        self.max_rank = max_rank
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(n_layers):
            for mod in targets:
                fan_in, fan_out = shapes[mod]
                self.a[(layer, mod)] = torch.zeros(n_slots, max_rank, fan_in, dtype=dtype, device=device)
                self.b[(layer, mod)] = torch.zeros(n_slots, fan_out, max_rank, dtype=dtype, device=device)
        # Which (layer, module) pairs each slot's version actually targets (skips zero work), and its rank.
        self.active: list[set[tuple[int, str]]] = [set() for _ in range(n_slots)]
        self.ranks: list[int] = [0] * n_slots
        # Grouped form of the slots of a batch, per (layer, module): (A_cat [k*r, in], B_cat [k*r, out]).
        self._grouped: dict[
            tuple[tuple[int, ...], int], dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
        ] = {}

    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Copy one version into `slot` (validated first, so a bad blob never half-writes a slot)."""
        if weights.spec.r > self.max_rank:
            raise AdapterMismatch(f"adapter rank {weights.spec.r} exceeds this replica's max {self.max_rank}")
        parsed = parse_adapter(weights, self.n_layers, self.shapes, self.targets)
        self.write_parsed(slot, parsed, weights.spec.scaling)

    def write_parsed(
        self, slot: int, parsed: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], scaling: float
    ) -> None:
        self.clear(slot)
        for key, (a, b) in parsed.items():
            r = a.shape[0]
            self.a[key][slot, :r].copy_(a)
            self.b[key][slot, :, :r].copy_(b * scaling)
            self.ranks[slot] = max(self.ranks[slot], r)
        self.active[slot] = set(parsed)

    def clear(self, slot: int) -> None:
        for key in self.active[slot]:
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()
        self.active[slot] = set()
        self.ranks[slot] = 0
        self._grouped = {k: v for k, v in self._grouped.items() if slot not in k[0]}

    def _single(self, slot: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """One slot's A [r, in] and B^T [r, out], contiguous at its real rank (cached until rewritten)."""
        key = ((slot,), self.ranks[slot])
        cached = self._grouped.get(key)
        if cached is None:
            r = max(1, self.ranks[slot])
            cached = {
                mk: (a_all[slot, :r].contiguous(), self.b[mk][slot, :, :r].T.contiguous())
                for mk, a_all in self.a.items()
            }
            self._grouped[key] = cached
        return cached

    def grouped(self, slots: tuple[int, ...]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """The slots' A and B^T concatenated along the rank, each padded to the group's rank (the two most
        recent groups are cached: a steady batch keeps its group for many iterations)."""
        if len(slots) == 1:
            return self._single(slots[0])
        r = self.rank_of(slots)
        key = (slots, r)
        cached = self._grouped.get(key)
        if cached is None:
            singles = [self._single(s) for s in slots]
            cached = {}
            for mk in self.a:
                parts_a, parts_b = [], []
                for one in singles:
                    a, bt = one[mk]
                    if a.shape[0] < r:  # pad a lower-rank slot with zero rows
                        a = torch.cat([a, a.new_zeros(r - a.shape[0], a.shape[1])])
                        bt = torch.cat([bt, bt.new_zeros(r - bt.shape[0], bt.shape[1])])
                    parts_a.append(a)
                    parts_b.append(bt)
                cached[mk] = (torch.cat(parts_a), torch.cat(parts_b))
            groups = [k for k in self._grouped if len(k[0]) > 1]
            for old in groups[:-1]:
                del self._grouped[old]
            self._grouped[key] = cached
        return cached

    def rank_of(self, slots: tuple[int, ...]) -> int:
        return max(1, max(self.ranks[s] for s in slots))

    def apply_grouped(
        self,
        layer: int,
        module: str,
        x: torch.Tensor,
        out: torch.Tensor,
        slots: tuple[int, ...],
        mask: torch.Tensor,
    ) -> None:
        """Punica-style for decode batches: every token times the concatenated A of the batch's slots,
        masked to its own slot's block, times the concatenated B (two small matmuls per module)."""
        key = (layer, module)
        if key not in self.a:
            return
        a_cat, b_cat = self.grouped(slots)[key]
        out += ((x @ a_cat.T) * mask) @ b_cat

    def apply(
        self,
        layer: int,
        module: str,
        x: torch.Tensor,
        out: torch.Tensor,
        segments: list[tuple[int, int, int]],
    ) -> None:
        """out[s:e] += x[s:e] @ A[slot]^T @ B[slot]^T for each (slot, s, e) segment (slot -1: base)."""
        key = (layer, module)
        if key not in self.a:
            return
        for slot, s, e in segments:
            if slot < 0 or key not in self.active[slot]:
                continue
            a_cat, b_cat = self.grouped((slot,))[key]  # contiguous, unpadded rank
            out[s:e] += (x[s:e] @ a_cat.T) @ b_cat


@dataclass
class LiveLora:
    """A trainable LoRA copy: {(layer, module): (A, B)} parameters and its spec."""

    params: dict[tuple[int, str], tuple[torch.nn.Parameter, torch.nn.Parameter]]
    spec: LoraSpec
    base_model: str

    @classmethod
    def init_new(
        cls,
        spec: LoraSpec,
        n_layers: int,
        shapes: dict[str, tuple[int, int]],
        base_model: str,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> LiveLora:
        """PEFT's default init: A Kaiming-uniform, B zero (the adapter starts as the base model)."""
        g = torch.Generator().manual_seed(seed)
        params = {}
        for layer in range(n_layers):
            for mod in spec.target_modules:
                fan_in, fan_out = shapes[mod]
                bound = math.sqrt(6.0 / ((1 + 5.0) * fan_in))  # kaiming_uniform_(a=sqrt(5))
                a = (torch.rand(spec.r, fan_in, generator=g) * 2 - 1) * bound
                b = torch.zeros(fan_out, spec.r)
                params[(layer, mod)] = (
                    torch.nn.Parameter(a.to(device=device, dtype=dtype)),
                    torch.nn.Parameter(b.to(device=device, dtype=dtype)),
                )
        return cls(params, spec, base_model)

    @classmethod
    def from_weights(
        cls,
        weights: AdapterWeights,
        n_layers: int,
        shapes: dict[str, tuple[int, int]],
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> LiveLora:
        parsed = parse_adapter(weights, n_layers, shapes, tuple(MODULE_PATHS))
        params = {
            key: (
                torch.nn.Parameter(a.detach().to(device=device, dtype=dtype).clone()),
                torch.nn.Parameter(b.detach().to(device=device, dtype=dtype).clone()),
            )
            for key, (a, b) in parsed.items()
        }
        return cls(params, weights.spec, weights.base_model)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for ab in self.params.values() for p in ab]

    def snapshot(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """A detached copy (what a shadow refresh or an update publishes)."""
        return {k: (a.detach().clone(), b.detach().clone()) for k, (a, b) in self.params.items()}

    def to_weights(self, extra: dict[str, str] | None = None) -> AdapterWeights:
        tensors = {}
        for (layer, mod), (a, b) in self.params.items():
            tensors[lora_key(layer, MODULE_PATHS[mod], "A")] = a.detach().float().cpu().clone()
            tensors[lora_key(layer, MODULE_PATHS[mod], "B")] = b.detach().float().cpu().clone()
        return AdapterWeights(
            tensors=tensors, spec=self.spec, base_model=self.base_model, extra=dict(extra or {})
        )
