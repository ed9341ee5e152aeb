"""Hybrid models (Nemotron-H): Megatron-Core's `HybridModel`, a stack of Mamba-2, attention and MLP layers in the order
of `ModelConfig.hybrid_pattern`, each one mixer after its own norm.

Upstream ships the stack's spec on Transformer Engine only (`hybrid_layer_specs.hybrid_stack_spec`: its norms fused
into the next linear, its final norm Transformer Engine's whatever the spec). `stack_spec` gives the same stack on
either path the layer decision takes (`DeviceInfo.layers`, as `core.modeling.layer_spec` does for GPT models):
- `transformer-engine`: upstream's spec as it ships.
- `local` (and `local+cpu`): Megatron-Core's local layers in the same places, the norms apart under the checkpoint
  keys Transformer Engine's fused ones have (`sharded_state_dict_keys_map`, as upstream's local GPT spec maps its
  input norms), the attention the cookbook's local one (`core.modeling.attention`), and a final norm of the local
  kind (`LocalHybridStack`), so one checkpoint loads on either path.
On every path each layer draws its weights from a stream seeded by (seed, its global layer number), so one seed is
one model at every TP/PP layout. The Mamba-2 mixer's kernels come from `mamba_ssm` on a GPU; where that package is
missing (a CPU) `core.machine.compat` puts the PyTorch ones of `core.machine.ssm` in their place.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from pai_cookbook.core.configs.config import ModelConfig
from pai_cookbook.core.modeling import delta_net
from pai_cookbook.core.modeling.layer_spec import LAYER_SEED_STRIDE


def _seeded(base, seed: int):
    """`base` (a layer class) drawing its weights from a stream seeded by (seed, global layer number); the hybrid
    stack numbers its layers globally already (`layer_number` counts the stages before). A Mamba layer's mixer draws
    its own parameters per tensor-parallel rank from the model-parallel stream: drawn again whole from the layer's
    stream and sliced (`_draw_mixer_whole`), they are one model at every TP."""
    from megatron.core.ssm.mamba_layer import MambaLayer

    class Seeded(base):
        def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs):
            stream = seed * LAYER_SEED_STRIDE + layer_number
            torch.random.default_generator.manual_seed(stream)
            with _model_parallel_stream_or_none():
                super().__init__(config, submodules, layer_number, *args, **kwargs)
            if config.perform_initialization and isinstance(self, MambaLayer):
                _draw_mixer_whole(self.mixer, torch.Generator().manual_seed(stream))
            elif config.perform_initialization and hasattr(getattr(self, "self_attention", None), "A_log"):
                delta_net.draw_whole(self.self_attention, torch.Generator().manual_seed(stream))

    Seeded.__name__ = Seeded.__qualname__ = f"Seeded{base.__name__}"
    return Seeded


@contextlib.contextmanager
def _model_parallel_stream_or_none():
    """Megatron-Core's Mamba mixer draws inside the model-parallel RNG stream, which a worker adds when it sets up its
    parallel state; a model built outside one (conversion's meta-device model: names and shapes, no values) has none,
    and draws from the default stream instead."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    if tracker.is_initialized():
        yield
        return
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        del tracker.fork


def _draw_mixer_whole(mixer, generator: torch.Generator) -> None:
    """The mixer's parameters whose rows TP splits per part drawn as upstream draws them for the whole model (the input
    projection normal with the init std, `MambaMixer.__init__`'s convolution Kaiming-uniform with its bias, time steps
    log-uniform in [1e-3, 1e-1] through softplus's inverse, A uniform in [1, 16]), then this rank's rows taken: a TP
    split of each of the projection's z, x, B, C and dt rows, of the convolution's x, B and C channels, and of the
    heads. (A column-parallel linear's own initialisation splits its rows in one piece, which takes other parts' rows
    at TP > 1.)"""
    import math

    tp, rank = mixer.pg_collection.tp.size(), mixer.pg_collection.tp.rank()
    heads, inner, bc = mixer.nheads, mixer.d_inner, mixer.ngroups * mixer.d_state
    projection = torch.empty(2 * inner + 2 * bc + heads, mixer.d_model).normal_(
        0.0, mixer.config.init_method_std, generator=generator)
    conv = torch.empty(inner + 2 * bc, 1, mixer.d_conv)
    torch.nn.init.kaiming_uniform_(conv, a=math.sqrt(5), generator=generator)
    bound = 1 / math.sqrt(mixer.d_conv)
    conv_bias = torch.empty(inner + 2 * bc).uniform_(-bound, bound, generator=generator)
    dt = torch.exp(torch.rand(heads, generator=generator) * (math.log(0.1) - math.log(0.001))
                   + math.log(0.001)).clamp(min=1e-4)
    a = torch.empty(heads).uniform_(1, 16, generator=generator)

    def rows(t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return delta_net.rank_parts(t, sizes, tp, rank)

    with torch.no_grad():
        for param, whole in ((mixer.in_proj.weight, rows(projection, [inner, inner, bc, bc, heads])),
                             (mixer.conv1d_weight, rows(conv, [inner, bc, bc])),
                             (mixer.conv1d_bias, rows(conv_bias, [inner, bc, bc])),
                             (mixer.dt_bias, rows(dt + torch.log(-torch.expm1(-dt)), [heads])),
                             (mixer.A_log, rows(torch.log(a), [heads]))):
            param.copy_(whole.to(param.dtype))


def _mixer_class():
    from megatron.core.ssm import mamba_mixer

    from pai_cookbook.core.machine import ssm
    from pai_cookbook.core.modeling.attention import padding_of

    class LeftPaddedMambaMixer(mamba_mixer.MambaMixer):
        """Megatron-Core's Mamba-2 mixer whose static-batching generation is right, for a batch of left-padded prompts
        too (what `LeftPaddedSelfAttention` is to attention; the local path's spec, on a GPU and a CPU):

        - One decode step: upstream hands its one-step kernels the projection as [1, batch, ...] where they take
          [batch, steps, ...], so a batch of b rows decodes as one row of b speculative tokens (the PyTorch lines
          assert), and its PyTorch lines gate the norm's [b, 1, d] input by a [b, d] gate, a [b, b, d] product (a
          batch of two prompts came out of the first Mamba layer two tokens long). Transposed for the kernels; where
          they are missing (a CPU), one PyTorch step (`_step`) of the same recurrence.
        - Prefill of a left-padded batch (the context's `LEFT_PADDING`): the padding's inputs to the convolution and to
          the scan are zeroed, so a row's state starts at its first real token from zero, as it would alone (what
          transformers does with the attention mask). The convolution is PyTorch's and the scan the one
          `mamba_chunk_scan_combined` names (`mamba_ssm`'s, or `core.machine.ssm`'s where it is missing)."""

        def forward(self, hidden_states, inference_context=None, **kwargs):
            self._padding = padding_of(inference_context, hidden_states.size(1))
            try:
                return super().forward(hidden_states, inference_context, **kwargs)
            finally:
                self._padding = None

        def _decode(self, hidden_states, conv_state, ssm_state, batch_indices=None):
            if batch_indices is not None:  # the dynamic engine's: laid out as upstream expects
                return super()._decode(hidden_states, conv_state, ssm_state, batch_indices)
            projected, _ = self.in_proj(hidden_states)  # [1, b, ...]
            if mamba_mixer.causal_conv1d_update is None or mamba_mixer.selective_state_update is None:
                y = self._step(projected[0], conv_state, ssm_state)
            else:
                y = self._ssm_decode(projected.transpose(0, 1), conv_state=conv_state, ssm_state=ssm_state)
            return self.out_proj(y.transpose(0, 1))

        def _step(self, projected, conv_state, ssm_state):
            """One new token of every row ([b, z | x B C | dt]): the convolution over its window (the state's last
            d_conv inputs), then the state decayed by exp(dt A) plus dt B x, read by C, plus D x; [b, 1, d_inner]."""
            rows, heads, bc = projected.size(0), self.nheads_local_tp, self.ngroups_local_tp * self.d_state
            z, xbc, dt = projected.split([self.d_inner_local_tp, self.d_inner_local_tp + 2 * bc, heads], dim=-1)
            conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
            conv_state[:, :, -1] = xbc
            xbc = torch.nn.functional.silu((conv_state * self.conv1d_weight.squeeze(1)).sum(-1) + self.conv1d_bias)
            x, b, c = xbc.float().split([self.d_inner_local_tp, bc, bc], dim=-1)
            per_group = heads // self.ngroups_local_tp
            b = b.view(rows, self.ngroups_local_tp, self.d_state).repeat_interleave(per_group, dim=1)
            c = c.view(rows, self.ngroups_local_tp, self.d_state).repeat_interleave(per_group, dim=1)
            dt = torch.nn.functional.softplus(dt.float() + self.dt_bias.float())  # [b, heads]
            x = x.view(rows, heads, self.headdim)
            state = (ssm_state.float() * torch.exp(dt * -torch.exp(self.A_log.float()))[..., None, None]
                     + (dt[..., None] * x)[..., None] * b[:, :, None, :])
            ssm_state.copy_(state)
            y = torch.einsum("bhpn,bhn->bhp", state, c) + self.D.float()[:, None] * x
            return self.norm(y.reshape(rows, 1, -1).to(projected.dtype), z[:, None])

        def _ssm_prefill(self, zxBCdt, conv_state, ssm_state, seq_idx=None, **kwargs):
            if seq_idx is not None or self.cp.cp_size > 1 or self.D_has_hdim:
                return super()._ssm_prefill(zxBCdt, conv_state, ssm_state, seq_idx=seq_idx, **kwargs)
            projected = zxBCdt.transpose(0, 1)  # [b, l, z | x B C | dt]
            rows, length = projected.shape[:2]
            bc = self.ngroups_local_tp * self.d_state
            z, xbc, dt = projected.split([self.d_inner_local_tp, self.d_inner_local_tp + 2 * bc,
                                          self.nheads_local_tp], dim=-1)
            keep = None
            if self._padding is not None:
                keep = (torch.arange(length, device=xbc.device)[None, :] >= self._padding[:, None])[..., None]
                xbc = xbc * keep
            if conv_state is not None:  # the last d_conv inputs (zeros before the start)
                conv_state.copy_(torch.nn.functional.pad(xbc.transpose(1, 2), (self.d_conv - length, 0)))
            xbc = ssm.causal_conv(xbc, self.conv1d_weight.squeeze(1), self.conv1d_bias, self.activation)
            if keep is not None:
                xbc = xbc * keep
            x, b, c = xbc.split([self.d_inner_local_tp, bc, bc], dim=-1)
            y = mamba_mixer.mamba_chunk_scan_combined(
                x.reshape(rows, length, self.nheads_local_tp, self.headdim), dt, -torch.exp(self.A_log.float()),
                b.reshape(rows, length, self.ngroups_local_tp, self.d_state),
                c.reshape(rows, length, self.ngroups_local_tp, self.d_state), self.chunk_size, D=self.D,
                dt_bias=self.dt_bias.float(), dt_softplus=True, return_final_states=ssm_state is not None)
            if ssm_state is not None:
                y, last = y
                ssm_state.copy_(last)
            return self.norm(y.reshape(rows, length, -1).transpose(0, 1), z.transpose(0, 1))

    return LeftPaddedMambaMixer


def _local_stack_class():
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron.core.transformer.torch_norm import WrappedTorchNorm as LocalNorm

    class LocalHybridStack(HybridStack):
        """Upstream's stack with its final norm of the local kind (upstream builds Transformer Engine's on every
        spec); the checkpoint key is the same, `decoder.final_norm.weight`."""

        def __init__(self, config, submodules, *args, post_layer_norm: bool = True, **kwargs):
            super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = LocalNorm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)

    return LocalHybridStack


def stack_spec(model: ModelConfig, use_te: bool, seed: int):
    """The hybrid stack's spec on Transformer Engine's layers (`use_te`) or the local ones, its layers seeded."""
    import copy

    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

    from pai_cookbook.core.modeling.layer_spec import _seeded_experts_class
    from pai_cookbook.core.modeling.specs import swap_classes

    mixer_params = {"d_conv": model.mamba_conv_kernel, "chunk_size": model.mamba_chunk_size}
    if use_te:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

        spec = copy.deepcopy(hybrid_stack_spec)
        subs = spec.submodules
        subs.mamba_layer.submodules.mixer.params = mixer_params
    else:
        spec = _local_spec(model, mixer_params)
        subs = spec.submodules
    layers = (("mamba_layer", MambaLayer), ("gdn_layer", TransformerLayer), ("attention_layer", TransformerLayer),
              ("mlp_layer", MLPLayer), ("moe_layer", MoETransformerLayer))
    for name, base in layers:
        getattr(subs, name).module = _seeded(base, seed)
    spec.submodules = HybridStackSubmodules(**{name: getattr(subs, name) for name, _ in layers})
    swap_classes(spec, {SequentialMLP: _seeded_experts_class(SequentialMLP)})  # grouped experts: not re-seeded
    return spec


def _local_spec(model: ModelConfig, mixer_params: dict):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm as LocalNorm
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from pai_cookbook.core.modeling.attention import LeftPaddedSelfAttention, SDPAttention

    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=LocalNorm,
        mixer=ModuleSpec(module=_mixer_class(), params=mixer_params, submodules=MambaMixerSubmodules(
            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add, sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"}))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=LocalNorm,
        self_attention=ModuleSpec(module=LeftPaddedSelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(
                                      linear_qkv=ColumnParallelLinear, core_attention=SDPAttention,
                                      linear_proj=RowParallelLinear,
                                      q_layernorm=LocalNorm if model.qk_layernorm else None,
                                      k_layernorm=LocalNorm if model.qk_layernorm else None)),
        self_attn_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}))
    delta_net_layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=LocalNorm,
        self_attention=ModuleSpec(module=delta_net.layer_class(), submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=delta_net.HeadNorm, out_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.in_proj.layer_norm_"}))
    experts = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=LocalNorm,
        mlp=get_moe_module_spec(use_te=False, num_experts=model.num_experts or 1, moe_grouped_gemm=False),
        mlp_bda=get_bias_dropout_add))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=LocalNorm,
        mlp=functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                               linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add, sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}))
    return ModuleSpec(module=_local_stack_class(), submodules=HybridStackSubmodules(
        mamba_layer=mamba, gdn_layer=delta_net_layer, attention_layer=attention, mlp_layer=mlp, moe_layer=experts))


def set_norm_epsilon(gpt: torch.nn.Module, epsilon: float) -> None:
    """Give every Mamba mixer's gated norm the model's epsilon (Megatron-Core builds them with 1e-5 whatever the
    config says; Nemotron-H's releases have 1e-5, a model with another would be normalised differently)."""
    from megatron.core.ssm.mamba_mixer import MambaMixer

    for module in gpt.modules():
        if isinstance(module, MambaMixer) and getattr(module, "norm", None) is not None:
            module.norm.eps = epsilon


def build(model: ModelConfig, config, device, seed: int, **stages):
    """This pipeline stage's `HybridModel` (`stages`: pre/post_process, vocab_size, max_sequence_length,
    share_embeddings_and_output_weights, vp_stage, as `core.modeling.model.build_model` passes GPTModel), its layers
    on `device.layers`' path. The CPU converters (`pai_cookbook.cpu`) reshape transformer layers; a hybrid's layers
    run as upstream's, and its output layer takes them as a GPT model's does."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    spec = stack_spec(model, device.transformer_engine, seed)
    gpt = HybridModel(config=config, hybrid_stack_spec=spec, hybrid_layer_pattern=model.hybrid_pattern,
                      position_embedding_type=model.position_embedding_type, rotary_percent=model.rotary_percent,
                      rotary_base=int(model.rotary_base), **stages)
    set_norm_epsilon(gpt, model.norm_epsilon)
    return gpt


def training_flops(model: ModelConfig, seq_length: int, frozen_weights: bool) -> float:
    """`training_flops_per_token` of a hybrid model, layer by kind: an attention layer's projections (the queries' gate
    too) and its scores over the sequence, an MLP layer's projections, an MoE layer's router, top-k experts and shared
    expert, a gated DeltaNet's projections, convolution and chunked delta rule, and a Mamba-2 layer's projections plus
    what is not a weight: its convolution (2 x kernel FLOPs per channel of x, B, C), and its chunked scan, per token
    and head 2 x chunk x (state + head_dim) for the within-chunk scores and their weighted sum, and 4 x head_dim x
    state to carry and read the state between chunks (Mamba-2's state-space duality; counted like the attention
    scores, without the causal half)."""
    h, pattern, gated = model.hidden_size, model.hybrid_pattern, 3 if model.gated else 2
    q, kv = model.num_attention_heads * model.head_dim, model.query_groups * model.head_dim
    heads, p, n = model.mamba_num_heads or 0, model.mamba_head_dim, model.mamba_state_dim
    inner, conv = model.mamba_inner, model.mamba_conv_channels
    v_heads, dk, dv = model.gdn_value_heads or 0, model.gdn_key_head_dim, model.gdn_value_head_dim
    qk, v = model.gdn_key_dim, model.gdn_value_dim
    queries = 2 * q if model.attention_output_gate else q  # and their gates
    weights = {"*": h * (queries + 2 * kv) + q * h, "-": gated * h * model.ffn_hidden_size,
               "M": h * (inner + conv + heads) + inner * h, "G": h * (2 * qk + 2 * v + 2 * v_heads) + v * h,
               "E": h * (model.num_experts or 0) + gated * h * (model.moe_router_topk * (model.moe_ffn_hidden_size or 0)
                                                                  + (model.moe_shared_expert_intermediate_size or 0))
               + h * model.moe_shared_expert_gate}
    # the gated DeltaNet's delta rule as Mamba-2's scan, in chunks of 64 positions (Megatron-Core's and fla's)
    others = {"*": 4 * seq_length * q, "-": 0, "E": 0,
              "M": 2 * model.mamba_conv_kernel * conv + heads * (2 * model.mamba_chunk_size * (n + p) + 4 * p * n),
              "G": 2 * model.gdn_conv_kernel * (2 * qk + v) + v_heads * (2 * 64 * (dk + dv) + 4 * dk * dv)}
    weight_flops = 2 * (sum(weights[k] for k in pattern) + h * model.vocab_size)
    return (2.0 if frozen_weights else 3.0) * weight_flops + 3.0 * sum(others[k] for k in pattern)
