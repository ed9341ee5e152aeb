"""The layer spec a GPT model is built from (`core.model.build_model`): Transformer Engine's on CUDA with TE,
Megatron-Core's local (pure PyTorch) one otherwise, and the cookbook's classes swapped into it.

- Every layer is a `SeededTransformerLayer` (seeded by its global layer number, experts by their global index), so
  one seed builds one model at every TP/PP/VPP/EP layout.
- On the local spec: the core attention on PyTorch's fused kernel (`core.attention.SDPAttention`), self-attention
  keeping rotated keys in the static KV cache and rotating without Megatron-Core's extra copies in training
  (`core.attention.rotated_key_cache_attention`), dense MLPs computing SwiGLU as one autograd function
  (`core.glu`, adopted by the layer), and the layers, the attention and the linears with a short forward where no
  gradient is recorded (`core.lean_layer`, `core.linear`); with emulated FP8 the linears are `core.fp8`'s.
"""

from __future__ import annotations

import torch

from pai_cookbook.core.config import ModelConfig
from pai_cookbook.core.runtime import DeviceInfo


def _seeded_layer_class():
    """TransformerLayer whose weights are drawn from a stream seeded by its *global* layer number.

    With CPU initialisation each pipeline stage would otherwise draw its layers from the start of one
    RNG stream, so layer 3 would get different weights at PP=1 and PP=2. Seeding each layer from
    (init_seed, global layer number) makes a seed mean one model at every TP/PP/virtual-PP layout.
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

    class SeededTransformerLayer(TransformerLayer):
        def __init__(self, config, submodules, layer_number: int = 1, *args, vp_stage=None, **kwargs):
            global_number = layer_number + get_transformer_layer_offset(config, vp_stage)
            torch.random.default_generator.manual_seed(config.init_seed * LAYER_SEED_STRIDE + global_number)
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
            # What the layer builds next (shared expert) draws from a stream that is the same at every EP.
            torch.random.default_generator.manual_seed(layer_seed * _EXPERT_SEED_STRIDE + config.num_moe_experts)

    return SeededExperts


def layer_spec(model: ModelConfig, config, device: DeviceInfo, vp_stage: int | None = None):
    """Transformer Engine spec on CUDA with TE, Megatron-Core's local spec otherwise (and with emulated FP8,
    whose linears are the local ones with FP8 numerics: core/fp8.py).

    Layers are swapped for `SeededTransformerLayer` (same parameters and forward, seeded init); on the local spec,
    with `core.lean_layer`'s short forward where no gradient is recorded, and the linears for `core.linear`'s
    (Megatron-Core's forward, shortened where no gradient is recorded at TP=1).
    """
    use_te = device.is_cuda and device.has_transformer_engine
    fp8 = getattr(config, "cookbook_fp8", None)
    emulated_fp8 = fp8 is not None and fp8.resolve_backend(device) == "emulated"
    if emulated_fp8:
        use_te = False  # the emulated FP8 linears are Megatron-Core's local ones
    spec = _layer_spec(model, config, device, vp_stage, use_te)
    if emulated_fp8:
        from pai_cookbook.core import fp8 as fp8_numerics

        swap_classes(spec, fp8_numerics.emulated_linears())
    elif not use_te:
        from pai_cookbook.core import linear

        swap_classes(spec, linear.LEAN)
    return spec


def swap_classes(spec, swapped: dict[type, type]) -> None:
    """Replace every module class in a layer or block spec (submodules and experts included) that is a key of
    `swapped` with its value, in place."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    def walk(node, seen):
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, ModuleSpec):
            if node.module in swapped:
                node.module = swapped[node.module]
            walk(node.submodules, seen)
        elif isinstance(node, type):  # a class is a leaf (a dataclass *class* is not a submodules instance)
            return
        elif hasattr(node, "__dataclass_fields__"):
            for name in node.__dataclass_fields__:
                value = getattr(node, name)
                if isinstance(value, type) and value in swapped:
                    setattr(node, name, swapped[value])
                else:
                    walk(value, seen)
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item, seen)

    walk(spec, set())


def _layer_spec(model: ModelConfig, config, device: DeviceInfo, vp_stage: int | None, use_te: bool):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    seeded = _seeded_layer_class()
    if not use_te:
        from pai_cookbook.core.lean_layer import lean_layer_class

        seeded = lean_layer_class(seeded)
    if model.is_moe:
        # The block spec places MoE and dense layers by moe_layer_freq.
        block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                 normalization=model.normalization, vp_stage=vp_stage)
        from megatron.core.transformer.moe.experts import SequentialMLP

        for spec in block.layer_specs:
            spec.module = seeded
            _choose_attention(spec, model)
            experts = getattr(spec.submodules.mlp.submodules, "experts", None)
            if experts is not None and experts.module is SequentialMLP:
                experts.module = _seeded_experts_class(SequentialMLP)
        return block
    if use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_layernorm)
    else:
        spec = specs.get_gpt_layer_local_spec(qk_layernorm=model.qk_layernorm, normalization=model.normalization)
    spec.module = seeded
    _choose_attention(spec, model)
    return spec


def _choose_attention(spec, model: ModelConfig) -> None:
    """The local spec's core attention on PyTorch's fused kernel (`core.attention`) unless the model asks for
    Megatron-Core's unfused one; Transformer Engine's attention is left as it is. Self-attention keeps rotated
    keys in the static inference cache on either spec (`core.attention.rotated_key_cache_attention`)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from pai_cookbook.core.attention import SDPAttention, rotated_key_cache_attention

    self_attention = spec.submodules.self_attention
    if self_attention.module is SelfAttention:
        self_attention.module = rotated_key_cache_attention(SelfAttention)
    attention = self_attention.submodules
    if attention.core_attention is DotProductAttention and model.attention_backend == "sdpa":
        attention.core_attention = SDPAttention
