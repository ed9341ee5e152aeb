"""The layer spec a GPT model is built from (`core.modeling.model.build_model`), by the one decision of which layers run
here (`DeviceInfo.layers`, `core.machine.build.choose_layers`):

- `transformer-engine`: Megatron-Core's Transformer Engine spec, as upstream ships it.
- `local`: Megatron-Core's local (pure PyTorch) spec, as upstream ships it, with the swaps that serve a GPU without
  Transformer Engine too (`core.machine.build.LOCAL_SWAPS`): the core attention on PyTorch's fused kernel
  (`core.modeling.attention.SDPAttention`, unless the model asks for the unfused one) and self-attention keeping rotated keys
  in the static KV cache, which left-pads batches of prompts of different lengths
  (`core.modeling.attention.LeftPaddedSelfAttention`).
- `local+cpu`: the local path plus the cookbook's CPU converters, which the caller hands in (`Converters`: the
  workers pass `pai_cookbook.cpu`), so the engine never imports the CPU package.

On every path each layer is a `SeededTransformerLayer` (seeded by its global layer number, experts by their global
index), so one seed builds one model at every TP/PP/VPP/EP layout; its forward is upstream's. With emulated FP8 the
linears are `core.modeling.fp8`'s (Megatron-Core's local ones with FP8 numerics) on any path.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pai_cookbook.core.configs.config import FP8Config, ModelConfig
from pai_cookbook.core.machine.runtime import DeviceInfo
from pai_cookbook.core.modeling.specs import swap_classes


def _seeded_layer_class(seed: int):
    """TransformerLayer whose weights are drawn from a stream seeded by (`seed`, its *global* layer number).

    With CPU initialisation each pipeline stage would otherwise draw its layers from the start of one
    RNG stream, so layer 3 would get different weights at PP=1 and PP=2. Seeding each layer from
    (seed, global layer number) makes a seed mean one model at every TP/PP/virtual-PP layout.
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

    class SeededTransformerLayer(TransformerLayer):
        def __init__(self, config, submodules, layer_number: int = 1, *args, vp_stage=None, **kwargs):
            global_number = layer_number + get_transformer_layer_offset(config, vp_stage)
            torch.random.default_generator.manual_seed(seed * LAYER_SEED_STRIDE + global_number)
            super().__init__(config, submodules, layer_number, *args, vp_stage=vp_stage, **kwargs)

    return SeededTransformerLayer


LAYER_SEED_STRIDE = 100_003  # a prime above any layer count: distinct (seed, layer) -> distinct streams
_EXPERT_SEED_STRIDE = 10_007  # a prime above any expert count: distinct (layer seed, expert) -> distinct streams


def _seeded_experts_class(base):
    """Experts module whose expert e is drawn from a stream seeded by (layer seed, *global* index e).

    SequentialMLP draws its local experts one after the other from the layer's stream, so at EP=2 rank 1
    would give global expert 2 the weights that EP=1 gives expert 0. Seeding each expert's first linear
    (the first thing its MLP draws) by its global index, and the stream after the experts by the expert
    count, makes a seed mean one MoE model at every EP layout (expert-TP already splits a whole drawn
    weight). Grouped experts (GPU) initialise all local experts at once and are not re-seeded.
    """
    import dataclasses

    class SeededExperts(base):
        def __init__(self, num_local_experts, config, submodules, *args, **kwargs):
            from megatron.core import parallel_state

            layer_seed = torch.random.default_generator.initial_seed()  # set by SeededTransformerLayer
            first = parallel_state.get_expert_model_parallel_rank() * num_local_experts
            experts = iter(range(first, first + num_local_experts))

            class SeededFirstLinear(submodules.linear_fc1):
                def __init__(self, *a, **k):
                    torch.random.default_generator.manual_seed(layer_seed * _EXPERT_SEED_STRIDE + next(experts))
                    super().__init__(*a, **k)

            seeded = dataclasses.replace(submodules, linear_fc1=SeededFirstLinear)
            super().__init__(num_local_experts, config, seeded, *args, **kwargs)
            for expert in getattr(self, "local_experts", []):
                _expert_output_bias(expert.linear_fc2)
            # What the layer builds next (shared expert) draws from a stream that is the same at every EP.
            torch.random.default_generator.manual_seed(layer_seed * _EXPERT_SEED_STRIDE + config.num_moe_experts)

    return SeededExperts


def _expert_output_bias(fc2) -> None:
    """An expert's output projection with a bias (GPT-OSS's), set right on Megatron-Core's local spec:

    - Its bias is not sequence-parallel: upstream marks it so under sequence parallelism, as a dense layer's, and the
      gradients are then summed over the tensor-parallel group, whose ranks hold other experts (measured: TP=2 with
      sequence parallelism and EP=2 drifted 4e-4 from one process by step 2; each expert's gradient is whole already,
      its tokens dispatched to it from every rank).
    - On one expert-TP rank and no expert parallelism, it is marked as doing its own communication, as it is at EP > 1
      (there is none to do): `MLP.forward` adds an expert's bias to the projection's output in place, and that output
      was the tensor-parallel reduce's over one rank, which hands its input back as a view that autograd forbids
      changing in place (training failed at the first step)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.utils import get_pg_size

    if not isinstance(fc2, RowParallelLinear) or fc2.bias is None:  # Transformer Engine's experts: as upstream builds them
        return
    fc2.bias.sequence_parallel = False
    if get_pg_size(fc2.tp_group) == 1 and not fc2.explicit_expert_comm:
        fc2.explicit_expert_comm = True


class Converters(Protocol):
    """What the CPU path adds to a spec and to the output layer (`pai_cookbook.cpu` is one)."""

    def convert_spec(self, spec, linears: bool = True) -> None: ...

    def convert_output_layer(self, output_layer) -> None: ...


def layer_spec(model: ModelConfig, config, device: DeviceInfo, vp_stage: int | None = None, *, seed: int,
               fp8: FP8Config | None = None, converters: Converters | None = None):
    """The layer (or, for MoE, decoder-block) spec of `device.layers` (module doc), its layers seeded from `seed`;
    with emulated FP8 (`fp8`, decided by the launcher) the local spec, whose linears carry FP8 numerics
    (core/modeling/fp8.py); on the CPU path `converters` applied (required there, refused elsewhere)."""
    if device.cpu_converters != (converters is not None):
        raise ValueError(f"the {device.layers!r} layers take " + ("the CPU converters (the workers pass "
                         "pai_cookbook.cpu)" if device.cpu_converters else "no CPU converters") + f"; got {converters!r}.")
    emulated_fp8 = fp8 is not None and fp8.decided_backend == "emulated"
    use_te = device.transformer_engine
    if use_te and emulated_fp8:  # the emulated FP8 linears are Megatron-Core's local ones
        raise ValueError("emulated FP8 builds the local spec; the launcher narrows the layers to it "
                         "(core.launching.job.decided), and this device was not: build from the decided job and device.")
    spec = _layer_spec(model, config, vp_stage, use_te, seed)
    if emulated_fp8:
        from pai_cookbook.core.modeling import fp8 as fp8_numerics

        swap_classes(spec, fp8_numerics.emulated_linears(fp8))
    if converters is not None:
        converters.convert_spec(spec, linears=not emulated_fp8)
    return spec


def _layer_spec(model: ModelConfig, config, vp_stage: int | None, use_te: bool, seed: int):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    seeded = _seeded_layer_class(seed)
    if model.is_moe:
        # The block spec places MoE and dense layers by moe_layer_freq.
        block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                 normalization=model.normalization, vp_stage=vp_stage)
        from megatron.core.transformer.moe.experts import SequentialMLP

        for spec in block.layer_specs:
            spec.module = seeded
            if not use_te:
                _local_swaps(spec, model)
                _latent_norm_keys(spec, model)
        swap_classes(block, {SequentialMLP: _seeded_experts_class(SequentialMLP)})  # grouped experts: not re-seeded
        return block
    mla = model.multi_latent_attention
    if use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_layernorm,
                                                                multi_latent_attention=mla)
    else:
        spec = specs.get_gpt_layer_local_spec(qk_layernorm=model.qk_layernorm, normalization=model.normalization,
                                              multi_latent_attention=mla)
    spec.module = seeded
    if not use_te:
        _local_swaps(spec, model)
        _latent_norm_keys(spec, model)
    return spec


# Checkpoint keys of multi-latent attention's norms in Transformer Engine's spec, which fuses them into the next linear;
# the local spec (which keeps them apart) names them so too, as upstream's local spec does for the input norms of other
# layers, so one checkpoint loads on either path.
_TE_LATENT_NORM_KEYS = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                        "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}


def _latent_norm_keys(spec, model: ModelConfig) -> None:
    """A local multi-latent-attention layer spec's checkpoint keys made Transformer Engine's (`_TE_LATENT_NORM_KEYS`, and
    a dense layer's pre-MLP norm fused into its first linear there)."""
    if not model.multi_latent_attention:
        return
    from megatron.core.transformer.mlp import MLP

    from pai_cookbook.core.modeling.specs import builder_class

    keys = spec.submodules.sharded_state_dict_keys_map
    keys.update(_TE_LATENT_NORM_KEYS)
    mlp = builder_class(spec.submodules.mlp)
    if isinstance(mlp, type) and issubclass(mlp, MLP):
        keys.setdefault("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")


def _local_swaps(spec, model: ModelConfig) -> None:
    """The local path's swaps (`core.machine.build.LOCAL_SWAPS`): self-attention keeping rotated keys in the static KV cache
    (`left_padded_kv_cache`), and the core attention on PyTorch's fused kernel (`sdpa_core_attention`) unless the model
    asks for Megatron-Core's unfused one, which takes multi-latent attention's head widths (`latent_attention`); and
    multi-latent attention with its rotary key's gradient summed over TP (`latent_attention`)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from pai_cookbook.core.modeling.attention import (
        LatentSelfAttention,
        LeftPaddedSelfAttention,
        SDPAttention,
        SplitWidthAttention,
    )

    self_attention = spec.submodules.self_attention
    if self_attention.module is SelfAttention:
        self_attention.module = LeftPaddedSelfAttention
    elif self_attention.module is MLASelfAttention:
        self_attention.module = LatentSelfAttention
    attention = self_attention.submodules
    if attention.core_attention is DotProductAttention:
        if model.attention_backend == "sdpa":
            attention.core_attention = SDPAttention
        elif model.multi_latent_attention or model.attention_sinks:
            # upstream's takes no head widths of its own (`latent_attention`) and draws sinks per rank
            attention.core_attention = SplitWidthAttention
