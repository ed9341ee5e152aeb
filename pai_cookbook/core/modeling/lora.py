"""LoRA adapters on Megatron-Core's parallel linears, sharded as the layer they adapt (`LoRALinear`, `add_adapters`),
and what turns them into weights (`merge`).

A linear y = W x of a tensor-parallel layer gets y = W x + (alpha / r) B (A x), W frozen. Megatron-Core fuses some of
Hugging Face's linears into one (query, key and value into `linear_qkv`; gate and up into `linear_fc1`); each of the
fused projections gets its own adapter, as PEFT gives each Hugging Face module one, so that the cookbook and PEFT train
the same parameters step for step (`tests/test_lora.py`). A fused layer's A is the parts' A stacked ([parts x r, in],
one matrix product), and each part's B maps its r columns of A's output to that part's rows of the fused output, laid
out as Megatron-Core lays the fused weight out (query, key and value per query group; gate then up).
- a **column-parallel** layer (QKV, FC1) splits W by its output rows over TP, so each B is split the same way (each
  rank holds its query groups' rows, its share of gate and up) and A is whole on every rank. A's output is the same on
  every rank; its gradient sums every rank's B parts (`copy_to_tensor_model_parallel_region`: identity forward,
  all-reduce backward). With sequence parallelism the layer's input is a slice of the sequence: A runs on the slice,
  and its output is gathered over the sequence (backward: reduce-scattered) before B; A's gradient then differs per
  rank and is summed over TP after the step (`sequence_parallel`, as Megatron-Core does for the norms).
- a **row-parallel** layer (attention output, FC2) splits W by its input columns, so A is split the same way
  ([r, in / TP]) and B is whole ([out, r]): A's partial products are all-reduced (with sequence parallelism
  reduce-scattered over the sequence, B's gradient then summed over TP).
Each part's full A is drawn from a stream seeded by (seed, global layer, target, part), as PEFT draws it
(Kaiming-uniform with a = sqrt(5)), then split: one seed gives the same adapters at every TP/PP layout. B starts at
zero, so a model with fresh adapters computes what the base computes.

The adapters' checkpoint entries sit beside the base layer's own, under the same prefix (`lora_A`, `lora_B`, or
`lora_B_q`/`_k`/`_v`, `lora_B_gate`/`_up` for the fused layers' parts), sharded as above, so Megatron-Core's
checkpointing reshards them like any weight; `ADAPTER_MARK` picks them out.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from pai_cookbook.core.configs.lora import PARTS, LoRAConfig

ADAPTER_MARK = ".lora_"
"""What every adapter's checkpoint key holds (`decoder.layers.0.self_attention.linear_qkv.lora_A`)."""
COLUMN, ROW = "column", "row"
KINDS = {"linear_qkv": COLUMN, "linear_fc1": COLUMN, "linear_proj": ROW, "linear_fc2": ROW}
_PART_STRIDE = 11  # seeds of one target's parts; targets are _TARGET_STRIDE apart, layers _LAYER_STRIDE
_TARGET_STRIDE = 101
_LAYER_STRIDE = 7919


def is_adapter_key(key: str) -> bool:
    return ADAPTER_MARK in key


class LoRALinear(torch.nn.Module):
    """A Megatron-Core parallel linear (`base`, frozen) with one low-rank adapter per projection it fuses (`parts`:
    `PARTS[target]`, or one unnamed part); returns what `base` returns ((output, bias)), the adapters' part added to
    the output. `groups` is the number of query groups on this rank (QKV only: its rows are laid out per group).
    Attributes the model reads from its linears (`weight`, `bias`, ...) are the base's."""

    def __init__(self, base: torch.nn.Module, kind: str, config: LoRAConfig, full_a: torch.Tensor,
                 parts: tuple[str, ...] = ("",), groups: int = 1):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        if kind not in (COLUMN, ROW) or (kind == ROW and len(parts) > 1):
            raise ValueError(f"kind {kind!r} with parts {parts}: {COLUMN!r} (any parts) or {ROW!r} (one part)")
        self.base, self.kind, self.scale, self.parts, self.groups = base, kind, config.scale, parts, groups
        self.rank = config.rank
        self.dropout = torch.nn.Dropout(config.dropout) if config.dropout else torch.nn.Identity()
        tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and tp > 1
        weight = base.weight
        out_local, in_local = weight.shape
        # column: A whole, each B split like W's rows; row: A split like W's columns, B whole
        a = full_a if kind == COLUMN else full_a[:, tp_rank * in_local:(tp_rank + 1) * in_local]
        self.lora_A = torch.nn.Parameter(a.to(weight.dtype).contiguous().to(weight.device))
        for name, rows in zip(self.b_names, self.part_rows(out_local)):
            b = torch.nn.Parameter(torch.zeros(rows, config.rank, dtype=weight.dtype).to(weight.device))
            if kind == COLUMN:
                set_tensor_model_parallel_attributes(b, True, 0, 1)
            elif self.sequence_parallel:  # each rank's gradient covers its slice of the sequence: summed over TP
                b.sequence_parallel = True
            self.register_parameter(name, b)
        if kind == ROW:
            set_tensor_model_parallel_attributes(self.lora_A, True, 1, 1)
        elif self.sequence_parallel:
            self.lora_A.sequence_parallel = True

    @property
    def b_names(self) -> list[str]:
        return [f"lora_B_{p}" if p else "lora_B" for p in self.parts]

    def part_rows(self, out_local: int) -> list[int]:
        """Each part's rows of this rank's output: QKV's queries are the query heads per group, the key and value one
        head per group; gate and up are halves."""
        if self.parts == PARTS["linear_qkv"]:
            head_dim = self.base.config.kv_channels
            return [out_local - 2 * self.groups * head_dim, self.groups * head_dim, self.groups * head_dim]
        return [out_local // len(self.parts)] * len(self.parts)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)

    def fuse(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The parts' outputs (last axis: each part's rows) laid out as the fused layer's rows: QKV per query group
        ([q; k; v] of group 0, then of group 1, ...), gate then up, or the one part."""
        if self.parts != PARTS["linear_qkv"]:
            return torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]
        lead = pieces[0].shape[:-1]
        grouped = [p.reshape(*lead, self.groups, p.shape[-1] // self.groups) for p in pieces]
        return torch.cat(grouped, dim=-1).reshape(*lead, -1)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
        from megatron.core.tensor_parallel import mappings

        out, bias = self.base(x, *args, **kwargs)
        h = F.linear(self.dropout(x), self.lora_A)
        if self.kind == COLUMN:
            h = mappings.gather_from_sequence_parallel_region(h) if self.sequence_parallel else \
                mappings.copy_to_tensor_model_parallel_region(h)
        else:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel else \
                mappings.reduce_from_tensor_model_parallel_region(h)
        pieces = [F.linear(part, getattr(self, name)) for part, name in zip(h.split(self.rank, dim=-1), self.b_names)]
        return out + self.scale * self.fuse(pieces), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The base layer's entries under its own names, and the adapter's beside them, sharded over TP as above."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        adapters = {"lora_A": self.lora_A} | {name: getattr(self, name) for name in self.b_names}
        axis = {name: 0 for name in self.b_names} if self.kind == COLUMN else {"lora_A": 1}
        state.update(make_sharded_tensors_for_checkpoint(adapters, prefix, axis, sharded_offsets))
        return state

    def delta(self) -> torch.Tensor:
        """This rank's share of the adapters' update (scale x B A per part, laid out as the fused weight)."""
        a = self.lora_A.float().split(self.rank)
        parts = [(getattr(self, name).float() @ a_part).T for name, a_part in zip(self.b_names, a)]
        return self.scale * self.fuse(parts).T


def full_a(config: LoRAConfig, seed: int, layer: int, target: str, part: int, in_features: int) -> torch.Tensor:
    """The whole A of one part of one target of one global layer (1-based): Kaiming-uniform with a = sqrt(5), as PEFT
    draws its lora_A (bound 1 / sqrt(in_features)), from a stream of its own."""
    generator = torch.Generator().manual_seed(
        ((seed * _LAYER_STRIDE + layer) * _TARGET_STRIDE + list(KINDS).index(target)) * _PART_STRIDE + part + 1)
    bound = 1.0 / math.sqrt(in_features)
    drawn = torch.rand(config.rank, in_features, generator=generator, dtype=torch.float64, device="cpu")
    return drawn.mul_(2 * bound).sub_(bound).float()


def add_adapters(chunks: list[torch.nn.Module], config: LoRAConfig, seed: int) -> int:
    """Freeze every parameter of `chunks` and put an adapter on each target linear of every transformer layer (the
    dense MLPs; an MoE layer's experts are left as they are). Returns how many linears were adapted; the only
    parameters left trainable are the adapters'."""
    for chunk in chunks:
        for parameter in chunk.parameters():
            parameter.requires_grad = False
    from megatron.core import parallel_state

    tp, added = parallel_state.get_tensor_model_parallel_world_size(), 0
    for chunk in chunks:
        _recomputed_layers_get_a_gradient(chunk)
        for layer in _layers(chunk):
            for target in config.targets:
                parent = _parent_of(layer, target)
                if parent is None:
                    continue
                base = getattr(parent, target)
                kind = KINDS[target]
                in_features = base.weight.shape[1] * (tp if kind == ROW else 1)
                fused = target == "linear_qkv" or (target == "linear_fc1" and parent.config.gated_linear_unit)
                parts = PARTS[target] if fused else ("",)
                a = torch.cat([full_a(config, seed, layer.layer_number, target, i, in_features)
                               for i in range(len(parts))])
                groups = parent.config.num_query_groups // tp if target == "linear_qkv" else 1
                setattr(parent, target, LoRALinear(base, kind, config, a, parts, groups))
                added += 1
    return added


def _recomputed_layers_get_a_gradient(chunk: torch.nn.Module) -> None:
    """Under full recompute each group of layers runs in Megatron-Core's `CheckpointFunction`, whose output needs a
    gradient only when one of its inputs does: the frozen embedding's output does not, so no adapter inside would get a
    gradient (the run would train nothing). The embedding's output is marked as needing one, as Hugging Face's
    `enable_input_require_grads` does; it costs the first norm's saved input."""
    module = getattr(chunk, "module", chunk)
    embedding = getattr(module, "embedding", None)
    if embedding is not None and module.config.recompute_granularity == "full":
        embedding.register_forward_hook(lambda _module, _inputs, output: output.requires_grad_(True))


def _layers(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    module = getattr(chunk, "module", chunk)
    return list(module.decoder.layers)


def _parent_of(layer: torch.nn.Module, target: str) -> torch.nn.Module | None:
    """The module holding `target` in a transformer layer: self-attention for QKV and its output, the dense MLP for
    FC1 and FC2 (None in an MoE layer, whose experts take no adapter here)."""
    from megatron.core.transformer.mlp import MLP

    if target in ("linear_qkv", "linear_proj"):
        owner = layer.self_attention
    else:
        owner = layer.mlp
        if not isinstance(owner, MLP):
            return None
    return owner if isinstance(getattr(owner, target, None), torch.nn.Module) else None


def adapters(chunks: list[torch.nn.Module]) -> list[tuple[str, LoRALinear]]:
    """(name, adapter) of every adapter in `chunks`, in module order."""
    return [(name, module) for chunk in chunks for name, module in chunk.named_modules() if isinstance(module, LoRALinear)]


@torch.no_grad()
def merge(chunks: list[torch.nn.Module]) -> int:
    """Fold every adapter into its base weight (W += scale B A, per rank: each rank's shard of B A is its shard of
    W's update), and put the base layer back in its place; returns how many were merged."""
    merged = 0
    for chunk in chunks:
        for module in list(chunk.modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, LoRALinear):
                    child.base.weight.add_(child.delta().to(child.base.weight.dtype))
                    setattr(module, child_name, child.base)
                    merged += 1
    return merged
