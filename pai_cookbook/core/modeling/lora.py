"""LoRA adapters on Megatron-Core's parallel linears, sharded as the layer they adapt (`LoRALinear`, `add_adapters`),
and what turns them into weights (`merge`).

A linear y = W x of a tensor-parallel layer gets y = W x + (alpha / r) B (A x), W frozen:
- a **column-parallel** layer (QKV, FC1) splits W by its output rows over TP, so B is split the same way
  ([out / TP, r] per rank) and A is whole on every rank ([r, in]). A's output is the same on every rank; its gradient
  sums every rank's B part (`copy_to_tensor_model_parallel_region`: identity forward, all-reduce backward). With
  sequence parallelism the layer's input is a slice of the sequence: A runs on the slice, and its output is gathered
  over the sequence (backward: reduce-scattered) before B; A's gradient then differs per rank and is summed over TP
  after the step (`sequence_parallel`, as Megatron-Core does for the norms).
- a **row-parallel** layer (attention output, FC2) splits W by its input columns, so A is split the same way
  ([r, in / TP]) and B is whole ([out, r]): A's partial products are all-reduced (with sequence parallelism
  reduce-scattered over the sequence, B's gradient then summed over TP).
The full A is drawn from a stream seeded by (seed, global layer, target), as PEFT draws it (Kaiming-uniform with
a = sqrt(5)), then split: one seed gives the same adapters at every TP/PP layout. B starts at zero, so a model with
fresh adapters computes what the base computes.

The adapters' checkpoint entries sit beside the base layer's own, under the same prefix (`lora_A`, `lora_B`), sharded
as above, so Megatron-Core's checkpointing reshards them like any weight; `ADAPTER_MARK` picks them out.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from pai_cookbook.core.configs.lora import LoRAConfig

ADAPTER_MARK = ".lora_"
"""What every adapter's checkpoint key holds (`decoder.layers.0.self_attention.linear_qkv.lora_A`)."""
COLUMN, ROW = "column", "row"
KINDS = {"linear_qkv": COLUMN, "linear_fc1": COLUMN, "linear_proj": ROW, "linear_fc2": ROW}
_TARGET_STRIDE = 101  # seeds of one layer's targets; layers are _LAYER_STRIDE apart
_LAYER_STRIDE = 7919


def is_adapter_key(key: str) -> bool:
    return ADAPTER_MARK in key


class LoRALinear(torch.nn.Module):
    """A Megatron-Core parallel linear (`base`, frozen) with a low-rank adapter beside it; returns what `base` returns
    ((output, bias)), the adapter's part added to the output. Attributes the model reads from its linears (`weight`,
    `bias`, ...) are the base's."""

    def __init__(self, base: torch.nn.Module, kind: str, config: LoRAConfig, full_a: torch.Tensor, gated: bool = False):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        if kind not in (COLUMN, ROW):
            raise ValueError(f"kind {kind!r}: {COLUMN!r} or {ROW!r}")
        self.base, self.kind, self.scale, self.gated = base, kind, config.scale, gated
        self.dropout = torch.nn.Dropout(config.dropout) if config.dropout else torch.nn.Identity()
        tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and tp > 1
        weight = base.weight
        out_local, in_local = weight.shape
        # column: A whole, B split like W's rows; row: A split like W's columns, B whole (B is W's rows either way)
        a = full_a if kind == COLUMN else full_a[:, tp_rank * in_local:(tp_rank + 1) * in_local]
        self.lora_A = torch.nn.Parameter(a.to(weight.dtype).contiguous().to(weight.device))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, config.rank, dtype=weight.dtype).to(weight.device))
        sharded = self.lora_B if kind == COLUMN else self.lora_A
        set_tensor_model_parallel_attributes(sharded, True, 0 if kind == COLUMN else 1, 1)
        if self.sequence_parallel:  # each rank's gradient covers its slice of the sequence: summed over TP
            (self.lora_A if kind == COLUMN else self.lora_B).sequence_parallel = True

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)

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
        return out + self.scale * F.linear(h, self.lora_B), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The base layer's entries under its own names, and the adapter's beside them, sharded over TP as above."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        adapters = {"lora_A": self.lora_A, "lora_B": self.lora_B}
        axis = {"lora_B": 0} if self.kind == COLUMN else {"lora_A": 1}
        mine = make_sharded_tensors_for_checkpoint(adapters, prefix, axis, sharded_offsets)
        if self.gated:  # B's rows are [gate; up] per rank, as FC1's: stored as FC1's weight is, gate then up whole
            mine[f"{prefix}lora_B"] = _swiglu_factory(mine[f"{prefix}lora_B"], sharded_offsets, metadata)
        state.update(mine)
        return state

    def delta(self) -> torch.Tensor:
        """This rank's share of scale x B A, shaped as the base weight's shard."""
        return self.scale * (self.lora_B.float() @ self.lora_A.float())


def _swiglu_factory(sharded, sharded_offsets: tuple, metadata: dict | None):
    """Megatron-Core's own split of a gated FC1 tensor into its gate and up halves for the checkpoint, as `MLP` applies
    it to FC1's weight (its signature takes the process groups from some release on: passed where it does)."""
    import inspect

    from megatron.core import parallel_state
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    singleton = (metadata or {}).get("singleton_local_shards", False)
    groups = {}
    if "tp_group" in inspect.signature(apply_swiglu_sharded_factory).parameters:
        dp = (metadata or {}).get("dp_cp_group") or parallel_state.get_data_parallel_group(with_context_parallel=True)
        groups = {"tp_group": parallel_state.get_tensor_model_parallel_group(), "dp_group": dp}
    return apply_swiglu_sharded_factory(sharded, sharded_offsets, singleton, **groups)


def full_a(config: LoRAConfig, seed: int, layer: int, target: str, in_features: int) -> torch.Tensor:
    """The whole A of one target of one global layer (1-based): Kaiming-uniform with a = sqrt(5), as PEFT draws its
    lora_A (bound 1 / sqrt(in_features)), from a stream of its own."""
    generator = torch.Generator().manual_seed(seed * _LAYER_STRIDE * _TARGET_STRIDE + layer * _TARGET_STRIDE
                                              + list(KINDS).index(target) + 1)
    bound = 1.0 / math.sqrt(in_features)
    drawn = torch.rand(config.rank, in_features, generator=generator, dtype=torch.float64, device="cpu")
    return drawn.mul_(2 * bound).sub_(bound).float()


def add_adapters(chunks: list[torch.nn.Module], config: LoRAConfig, seed: int) -> int:
    """Freeze every parameter of `chunks` and put an adapter on each target linear of every transformer layer (the
    dense MLPs; an MoE layer's experts are left as they are). Returns how many adapters were added; the only
    parameters left trainable are theirs."""
    for chunk in chunks:
        for parameter in chunk.parameters():
            parameter.requires_grad = False
    from megatron.core import parallel_state

    tp, added = parallel_state.get_tensor_model_parallel_world_size(), 0
    for chunk in chunks:
        for layer in _layers(chunk):
            for target in config.targets:
                parent = _parent_of(layer, target)
                if parent is None:
                    continue
                base = getattr(parent, target)
                kind = KINDS[target]
                in_features = base.weight.shape[1] * (tp if kind == ROW else 1)
                a = full_a(config, seed, layer.layer_number, target, in_features)
                gated = target == "linear_fc1" and parent.config.gated_linear_unit
                setattr(parent, target, LoRALinear(base, kind, config, a, gated))
                added += 1
    return added


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
