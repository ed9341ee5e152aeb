"""Build Megatron-Core GPT models from the cookbook's configs (the `model_provider` step).

The same function builds the CPU and the GPU model: the layer spec is the one `DeviceInfo.layers` decided
(`core.modeling.layer_spec`: Transformer Engine's, Megatron-Core's local one, or that plus the CPU converters, which the
workers hand in: `workers.models.build_model`). Weights are
initialised whole on the CPU and then split (`use_cpu_initialization`), each layer from its own seeded
stream, so one seed gives the same dense model at every TP/PP/virtual-PP layout: the basis of every
"this layout matches single-process" check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pai_cookbook.core.configs.config import MemoryConfig, ModelConfig, ParallelConfig, PrecisionConfig
from pai_cookbook.core.machine import device_guard
from pai_cookbook.core.machine.runtime import DeviceInfo
from pai_cookbook.core.modeling import gemma, hybrid
from pai_cookbook.core.modeling.layer_spec import LAYER_SEED_STRIDE, Converters, layer_spec

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(precision: PrecisionConfig) -> torch.dtype:
    return _DTYPES[precision.dtype]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with tanh's approximation (Gemma's `gelu_pytorch_tanh`): a function of its own, so Megatron-Core's fused
    bias-GELU, which computes the erf form, never takes it for `F.gelu`."""
    return F.gelu(x, approximate="tanh")


def activation_function(name: str):
    """The activation of `ModelConfig.activation` (for a gated MLP, the gate's)."""
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return {"swiglu": F.silu, "geglu": gelu_tanh, "quick_geglu": quick_gelu, "squared_relu": squared_relu}.get(name, F.gelu)


def transformer_config(model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig,
                       device: DeviceInfo, memory: MemoryConfig | None = None):
    """Translate the cookbook's configs into Megatron-Core's `TransformerConfig`.

    Megatron-Core's fused kernels (`core.machine.build.FUSED_KERNELS`: bias-activation, RoPE, gradient-accumulation
    fusion, ...) are on where the build plan says (`device.fused_kernels`: Transformer Engine's layers); they change
    speed, not the function computed.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    dtype = torch_dtype(precision)
    fused = device.fused_kernels
    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.gated,
        activation_func=activation_function(model.activation),
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tp,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision.dtype == "bf16",
        fp16=precision.dtype == "fp16",
        use_cpu_initialization=True,
        bias_activation_fusion=fused and model.activation == "swiglu",
        apply_rope_fusion=fused and model.yarn is None,  # Megatron-Core's fused rotary refuses YaRN's scale
        gradient_accumulation_fusion=fused,
        masked_softmax_fusion=fused,
        persist_layer_norm=fused,
        # Megatron-Core's grouped experts refuse biases with the fused bias-dropout-add (GPT-OSS on Transformer Engine)
        bias_dropout_fusion=fused and not (model.is_moe and model.add_bias_linear),
        deallocate_pipeline_outputs=True,
    )
    if model.sliding_window:  # Hugging Face's window W: a query sees itself and the W - 1 keys before it
        kwargs.update(window_size=(model.sliding_window - 1, 0), window_attn_skip_freq=model.sliding_window_layers)
    if model.is_hybrid:
        kwargs.update(mamba_num_heads=model.mamba_num_heads, mamba_head_dim=model.mamba_head_dim,
                      mamba_state_dim=model.mamba_state_dim, mamba_num_groups=model.mamba_num_groups,
                      linear_num_key_heads=model.gdn_key_heads, linear_num_value_heads=model.gdn_value_heads,
                      linear_key_head_dim=model.gdn_key_head_dim, linear_value_head_dim=model.gdn_value_head_dim,
                      linear_conv_kernel_dim=model.gdn_conv_kernel, attention_output_gate=model.attention_output_gate)
    if model.glu_clamp is not None:
        kwargs.update(activation_func_clamp_value=model.glu_clamp)
    if model.glu_linear_offset:
        kwargs.update(glu_linear_offset=model.glu_linear_offset)
    if model.attention_sinks:
        kwargs.update(softmax_type="learnable")
    if model.query_pre_attn_scalar is not None:
        kwargs.update(softmax_scale=model.query_pre_attn_scalar ** -0.5)
    if model.norm_plus_one and device.transformer_engine:  # Transformer Engine's norms take (1 + weight) so
        kwargs.update(layernorm_zero_centered_gamma=True)
    if memory is not None and memory.recompute_granularity is not None:
        kwargs.update(recompute_granularity=memory.recompute_granularity)
        if memory.recompute_granularity == "full":
            kwargs.update(recompute_method=memory.recompute_method, recompute_num_layers=memory.recompute_num_layers)
        else:
            kwargs.update(recompute_modules=list(memory.recompute_modules))
    if model.is_moe:
        kwargs.update(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
            moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=model.moe_shared_expert_gate,
            moe_router_pre_softmax=model.moe_router_pre_softmax,
            moe_router_score_function=model.moe_router_score_function,
            moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=model.moe_router_bias_update_rate,
            moe_router_num_groups=model.moe_router_num_groups,
            moe_router_group_topk=model.moe_router_group_topk,
            moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
            moe_expert_capacity_factor=model.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=model.moe_pad_expert_input_to_capacity,
            moe_layer_freq=model.moe_layer_freq,
            moe_router_load_balancing_type=model.moe_router_load_balancing_type,
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            moe_z_loss_coeff=model.moe_z_loss_coeff,
            moe_token_dispatcher_type=model.moe_token_dispatcher_type,
            moe_grouped_gemm=device.grouped_gemm if model.moe_grouped_gemm is None else model.moe_grouped_gemm,
            moe_permute_fusion=fused,
        )
    if precision.fp8 is not None and precision.fp8.decided_backend == "te":
        fp8 = precision.fp8
        kwargs.update(fp8=fp8.format, fp8_recipe=fp8.recipe, fp8_margin=fp8.margin,
                      fp8_amax_history_len=fp8.amax_history_len, fp8_amax_compute_algo=fp8.amax_compute_algo,
                      fp8_wgrad=fp8.wgrad, first_last_layers_bf16=fp8.first_last_layers_bf16,
                      num_layers_at_start_in_bf16=fp8.num_layers_at_start_in_bf16,
                      num_layers_at_end_in_bf16=fp8.num_layers_at_end_in_bf16)
    # The emulated backend (core/modeling/fp8.py) leaves Megatron-Core's fp8 fields off: the layer spec's linears
    # carry the FP8 numerics instead (`core.modeling.layer_spec`).
    if model.multi_latent_attention:
        kwargs["apply_rope_fusion"] = fused and model.yarn is not None  # Megatron-Core fuses MLA's YaRN rotary only
        return MLATransformerConfig(**kwargs, **_mla_fields(model))
    config = TransformerConfig(**kwargs)
    if model.yarn is not None:
        _yarn_fields(config, model.yarn)
    return config


def _yarn_fields(config, yarn: dict) -> None:
    """GPTModel's YaRN rotary (`position_embedding_type="yarn"`) and its attention read these from the config, which
    does not declare them: set on the instance. Read where missing, the attention's scale would silently be 1."""
    config.yarn_rotary_scaling_factor = yarn["factor"]
    config.yarn_original_max_position_embeddings = int(yarn["original_max_position_embeddings"])
    config.yarn_beta_fast, config.yarn_beta_slow = yarn["beta_fast"], yarn["beta_slow"]
    config.yarn_mscale, config.yarn_mscale_all_dim = yarn["mscale"], yarn["mscale_all_dim"]
    config.yarn_correction_range_round_to_int = bool(yarn.get("truncate", 1))


def position_embedding_type(model: ModelConfig) -> str:
    """GPTModel's position embedding: YaRN's rotary where the model scales it so (multi-latent attention builds its
    own), else the model's."""
    return "yarn" if model.yarn is not None and not model.multi_latent_attention else model.position_embedding_type


def _mla_fields(model: ModelConfig) -> dict:
    """Multi-latent attention's fields of `MLATransformerConfig`: the latents, the head parts, and the rotary the
    attention builds itself (plain, or YaRN with its factor and attention scale)."""
    yarn = model.yarn or {}
    return dict(q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_head_dim,
                qk_pos_emb_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim,
                rotary_base=model.rotary_base, rotary_percent=model.rotary_percent,
                rope_type="yarn" if model.yarn else "rope",
                # unused by plain rotary, except mscale_all_dim in the softmax scale: 0 keeps that at 1
                rotary_scaling_factor=yarn.get("factor", 1.0), mscale=yarn.get("mscale", 1.0),
                mscale_all_dim=yarn.get("mscale_all_dim", 0.0), beta_fast=yarn.get("beta_fast", 32.0),
                beta_slow=yarn.get("beta_slow", 1.0),
                original_max_position_embeddings=int(yarn.get("original_max_position_embeddings", 4096)))


HEADS = ("lm", "reward")


def build_model(model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig,
                device: DeviceInfo, seed: int, memory: MemoryConfig | None = None,
                head: str = "lm", initialize: bool = True, converters: Converters | None = None) -> list[torch.nn.Module]:
    """Build this rank's model chunks (one per virtual pipeline stage) on its device.

    Must run inside a worker after `runtime.init_distributed`.

    head: "lm", the language model's output layer (logits over the vocabulary); "reward", a `ScalarHead`
        in its place (one score per position, [batch, seq, 1] from the model), untied from the embedding.
    initialize: False where a checkpoint is loaded next: Megatron-Core's random initialisation is skipped and the
        weights start as uninitialised memory (a checkpoint load fills every parameter or fails).
    converters: the CPU path's (`device.cpu_converters`; required there, refused elsewhere): the workers pass
        `pai_cookbook.cpu` through `workers.models.build_model`.
    precision.fp8: decided by the launcher (`core.launching.job.decided`), read here as it was decided.

    Returns:
        A list of `GPTModel` chunks (length 1 unless virtual pipeline parallelism is on).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if head not in HEADS:
        raise ValueError(f"head {head!r}: one of {HEADS}")
    config = transformer_config(model, parallel, precision, device, memory)
    config.perform_initialization = initialize
    vpp = parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        # Embedding and output layer draw from here; layers reseed themselves (SeededTransformerLayer),
        # so what follows the last layer is the same stream at every layout.
        torch.random.default_generator.manual_seed(seed)
        stages = dict(pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                      post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                      vocab_size=model.padded_vocab_size(parallel.tensor_model_parallel_size),
                      max_sequence_length=model.max_position_embeddings,
                      share_embeddings_and_output_weights=model.tie_word_embeddings and head == "lm", vp_stage=vp_stage)
        if model.is_hybrid:
            gpt = hybrid.build(model, config, device, seed, **stages)
        else:
            gpt = GPTModel(
                config=config,
                transformer_layer_spec=layer_spec(model, config, device, vp_stage, seed=seed, fp8=precision.fp8,
                                                  converters=converters),
                position_embedding_type=position_embedding_type(model),
                rotary_percent=model.rotary_percent,
                rotary_base=int(model.rotary_base),
                rope_scaling=model.rope_scaling_factor is not None,
                rope_scaling_factor=model.rope_scaling_factor or 8.0,
                **stages,
            )
        if gemma.asked(model):
            gemma.apply(gpt, model, config, device.transformer_engine)
        if gpt.post_process and head == "reward":
            gpt.output_layer = ScalarHead(model.hidden_size, model.init_method_std, seed)
        _params_to(gpt, config.params_dtype)
        if gpt.post_process and head == "lm":
            if converters is not None:  # the layers' short linear forward, and oneDNN's packed weight while decoding
                converters.convert_output_layer(gpt.output_layer)
            mask_vocab_padding(gpt.output_layer, model.vocab_size)
        if device.is_cuda:
            gpt.cuda(torch.cuda.current_device())
        else:  # where the CPU emulates a GPU for CI (core.machine.device_guard), the model's tensors are the device's
            device_guard.place(gpt)
        chunks.append(gpt)
    fp8 = precision.fp8
    if fp8 is not None and fp8.first_last_layers_bf16 and fp8.decided_backend == "emulated":
        from pai_cookbook.core.modeling import fp8 as fp8_numerics

        fp8_numerics.keep_layers_in_bf16(chunks, fp8.num_layers_at_start_in_bf16, fp8.num_layers_at_end_in_bf16,
                                         model.num_layers)
    return chunks


class ScalarHead(torch.nn.Module):
    """A reward model's head in place of GPTModel's output layer: hidden states [seq, batch, hidden] -> one
    score per position [seq, batch, 1] (Hugging Face's `...ForSequenceClassification.score` with one label).

    One [1, hidden] weight, replicated on every tensor-parallel rank: the final norm's output it reads is
    whole on each of them (sequence parallelism, which would split it, is refused for reward models), so
    every rank computes the same scores and the same gradient. It takes GPTModel's output-layer call
    (`weight`, `runtime_gather_output`) and ignores both; its checkpoint entry is Megatron-Core's default
    for a module without sharded state: a replicated tensor under `output_layer.weight`.
    """

    def __init__(self, hidden_size: int, std: float, seed: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size))
        if not self.weight.is_meta:  # drawn on the CPU from its own stream: the same on every rank and layout
            generator = torch.Generator().manual_seed((seed + 1) * LAYER_SEED_STRIDE - 1)  # no layer's
            with torch.no_grad():
                self.weight.normal_(0.0, std, generator=generator)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        return F.linear(hidden, self.weight), None


def mask_vocab_padding(output_layer: torch.nn.Module, vocab_size: int) -> None:
    """Keep the output layer's padding rows (ids >= `vocab_size`) out of every softmax.

    Megatron-Core pads the vocabulary to a multiple of 128 x TP and leaves the padding rows' logits in
    the loss: a zero row gives logit 0, which takes probability mass from real tokens, and how much
    depends on TP (a 52,000-token vocabulary has 48 padding rows at TP=1 and 176 at TP=2). Filling those
    logits with the dtype's lowest value gives them probability 0 and gradient 0, so the loss is the
    same at every TP and equals the Hugging Face model's (which has no padding rows).
    A no-op hook is not even registered when the vocabulary needs no padding.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    local_rows = output_layer.output_size_per_partition
    if local_rows * tp <= vocab_size:
        return
    rank = parallel_state.get_tensor_model_parallel_rank()

    def hook(module, args, output):
        logits, bias = output
        width = logits.shape[-1]  # this rank's shard, or the whole padded vocabulary when gathered
        start = rank * local_rows if width == local_rows else 0
        # in place, on the padding columns only: a copy of the whole [seq, batch, vocab] tensor was a
        # tenth of a scoring pass over a 51k vocabulary (the matmul that made the logits saved its inputs,
        # not its output, so autograd allows it; the filled entries get gradient 0)
        logits[..., max(vocab_size - start, 0):].fill_(torch.finfo(logits.dtype).min)
        return logits, bias

    output_layer.register_forward_hook(hook)


def _params_to(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give every parameter the configured dtype (buffers such as rotary frequencies stay fp32).

    The local spec's norms are torch.nn.RMSNorm/LayerNorm, created in fp32 whatever params_dtype is
    (Megatron-LM hides this by wrapping models in Float16Module). Left alone, a bf16 model would keep
    fp32 norms that Megatron's mixed-precision optimizer cannot map in its checkpoint, and a bf16
    Hugging Face checkpoint would be stored with fp32 norm weights.
    """
    for param in module.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)


def routed_expert_weights(model: ModelConfig) -> int:
    """Expert weights one token passes through, over all MoE layers: its top-k routed experts' MLPs (no shared
    expert, no router). Forward FLOPs are twice this; a training step's, three times that."""
    if not model.is_moe:
        return 0
    gated = 3 if model.gated else 2
    return (sum(model.moe_flags) * model.moe_router_topk * gated * model.hidden_size
            * (model.moe_ffn_hidden_size or model.ffn_hidden_size))


def attended_keys(model: ModelConfig, seq_length: int) -> int:
    """Keys a query's scores are computed over, summed over the layers: the sequence on a full-attention layer, at most
    the window on a sliding-window layer (GPT-OSS's every other layer sees 128 keys, not 4,096)."""
    if model.sliding_window is None:
        return model.num_layers * seq_length
    windowed = model.sliding_window_layers or [1] * model.num_layers
    return sum(min(seq_length, model.sliding_window) if flag else seq_length for flag in windowed)


def training_flops_per_token(model: ModelConfig, seq_length: int, frozen_weights: bool = False) -> float:
    """Model FLOPs to train on one token: 3 x forward (forward + backward), PaLM-style accounting; with
    `frozen_weights` (LoRA: the base frozen) the weights' gradient GEMMs are not run (Megatron-Core's
    `linear_with_frozen_weight`), so the weights count 2 x forward and the attention scores still 3 x (the
    adapters' own FLOPs, 2 x rank x (in + out) per adapted linear, are left out: under 1% at usual ranks).

    Forward per token: 2 FLOPs per multiply-add of every weight used (for MoE, the top-k routed experts
    plus shared expert and router, not all experts) and 4 x keys x (heads x head_dim) per layer for the
    attention scores and their weighted sum, keys the sequence (counted without the causal half, as PaLM's MFU does)
    or on a sliding-window layer at most the window (`attended_keys`).
    """
    if model.is_hybrid:
        return hybrid.training_flops(model, seq_length, frozen_weights)
    h, layers = model.hidden_size, model.num_layers
    q, kv = model.num_attention_heads * model.head_dim, model.query_groups * model.head_dim
    gated = 3 if model.gated else 2
    attention = h * (q + 2 * kv) + q * h
    keys = attended_keys(model, seq_length) / layers  # per layer, on average: a sliding window's layers see fewer
    scores = 4 * keys * q  # q.k and probabilities.v, 2 FLOPs per multiply-add each
    if model.multi_latent_attention:  # the latents' down and up projections; values heads x v_head_dim wide
        m, v = model, model.num_attention_heads * model.v_head_dim
        up = (m.kv_lora_rank * (m.num_attention_heads * m.qk_head_dim + v)
              + (h * m.q_lora_rank + m.q_lora_rank * q if m.q_lora_rank else h * q))
        attention = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + up + v * h
        scores = 2 * keys * (q + v)
    dense_mlp = gated * h * model.ffn_hidden_size
    if model.is_moe:
        moe_layers = sum(model.moe_flags)
        moe_mlp = gated * h * (model.moe_shared_expert_intermediate_size or 0) + h * model.num_experts
        mlp_total = routed_expert_weights(model) + moe_layers * moe_mlp + (layers - moe_layers) * dense_mlp
    else:
        mlp_total = layers * dense_mlp
    weights = 2 * (layers * attention + mlp_total + h * model.vocab_size)
    return (2.0 if frozen_weights else 3.0) * weights + 3.0 * layers * scores

