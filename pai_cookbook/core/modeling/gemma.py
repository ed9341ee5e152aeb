"""What Gemma 3's text model computes beyond Megatron-Core's GPT layer, added to a built `GPTModel` from outside
(`core.modeling.model.build_model` calls `apply` where the `ModelConfig` asks for it), on every path:

- (1 + w) RMSNorms (`norm_plus_one`): on the local path every RMSNorm (the layers' input and pre-MLP norms, the query
  and key norms, the final norm) becomes `PlusOneRMSNorm`, which computes as transformers' Gemma3RMSNorm does (in
  fp32, scaled by 1 + w, cast once); Transformer Engine's norms take `layernorm_zero_centered_gamma` instead
  (`core.modeling.model.transformer_config`).
- A norm on the attention's output and one on the MLP's (`post_norms`), before each residual add: child modules
  `self_attention.post_layernorm` and `mlp.post_layernorm`, applied by forward hooks, so whatever forward runs the
  attention or the MLP (upstream's layer, the CPU path's lean one, full recompute) applies them, and a LoRA adapter
  on `linear_proj` or `linear_fc2` adds its output before the norm, as PEFT's does.
- A rotary base for the sliding-window layers (`local_rotary_base`) beside the full layers' (linearly scaled by
  `rotary_linear_factor`): the model's rotary module returns both tables (`LocalGlobalRotary`), and a pre-hook on each
  self-attention hands it the one of its kind, by the same rule that gives the layer its window (Megatron-Core's
  `is_layer_window_attention`).
- Token embeddings times `embedding_multiplier`, rounded to the embedding's dtype first, as transformers does.
"""

from __future__ import annotations

import torch

from pai_cookbook.core.configs.config import ModelConfig


class PlusOneRMSNorm(torch.nn.Module):
    """RMSNorm scaled by (1 + weight), its weight starting at zero, computed in fp32 and cast once at the end:
    transformers' Gemma3RMSNorm, line for line."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Its weight, replicated over tensor-parallel ranks (Megatron-Core's default for a plain module does not name
        the TP group where an `MLP` holds it, and every TP rank would claim the main replica)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        dp_cp = (metadata or {}).get("dp_cp_group") or parallel_state.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets, tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                   dp_cp_group=dp_cp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def asked(model: ModelConfig) -> bool:
    """Whether `model` asks for anything `apply` adds."""
    return (model.norm_plus_one or model.post_norms or model.local_rotary_base is not None
            or model.rotary_linear_factor is not None or model.embedding_multiplier is not None)


def local_global_rotary(model: ModelConfig, rotary):
    """A rotary module returning (the sliding-window layers' table, the full layers' table) in place of `rotary`
    (GPTModel's `RotaryEmbedding`, built with the full layers' base)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class LocalGlobalRotary(RotaryEmbedding):
        def __init__(self):
            super().__init__(kv_channels=model.head_dim, rotary_percent=model.rotary_percent,
                             rotary_base=model.rotary_base, use_cpu_initialization=True)
            self.local = RotaryEmbedding(kv_channels=model.head_dim, rotary_percent=model.rotary_percent,
                                         rotary_base=model.local_rotary_base, use_cpu_initialization=True)
            if model.rotary_linear_factor is not None:
                self.inv_freq = self.inv_freq / model.rotary_linear_factor

        def forward(self, *args, **kwargs):
            return LocalGlobal((self.local(*args, **kwargs), super().forward(*args, **kwargs)))

    module = LocalGlobalRotary()
    module.to(rotary.inv_freq.device)
    return module


class LocalGlobal(tuple):
    """(the sliding-window layers' rotary table, the full layers'): what `local_global_rotary` returns."""


def _pick_rotary(attention):
    from megatron.core.transformer.utils import is_layer_window_attention

    config = attention.config
    local = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, attention.layer_number)

    def hook(module, args, kwargs):
        table = kwargs.get("rotary_pos_emb")
        if isinstance(table, tuple):  # LocalGlobal, or a plain tuple after full recompute unpacked it
            kwargs["rotary_pos_emb"] = table[0] if local else table[1]
        return args, kwargs

    attention.register_forward_pre_hook(hook, with_kwargs=True)


def _post_norm(module: torch.nn.Module, norm: torch.nn.Module) -> None:
    module.post_layernorm = norm

    def hook(_module, _args, output):
        out, bias = output
        if bias is not None:
            raise ValueError("a post-norm after a linear with a bias: Gemma's linears have none")
        return module.post_layernorm(out), bias

    module.register_forward_hook(hook)


def apply(gpt, model: ModelConfig, config, transformer_engine: bool) -> None:
    """Make `gpt` (one chunk, as built) compute what `model`'s Gemma fields ask (module doc)."""
    sequence_parallel = config.sequence_parallel

    def norm(hidden_size: int) -> torch.nn.Module:
        made = PlusOneRMSNorm(hidden_size, model.norm_epsilon) if model.norm_plus_one else \
            torch.nn.RMSNorm(hidden_size, eps=model.norm_epsilon)
        made.weight.sequence_parallel = sequence_parallel
        return made.to(device=next(gpt.parameters()).device)

    if model.norm_plus_one and not transformer_engine:
        for module in list(gpt.modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, torch.nn.RMSNorm):
                    replacement = norm(child.normalized_shape[0])
                    setattr(module, child_name, replacement)
                    # a query/key norm is per head, whatever the sequence split
                    replacement.weight.sequence_parallel = getattr(child.weight, "sequence_parallel", False)
    layers = getattr(getattr(gpt, "decoder", None), "layers", [])
    for layer in layers:
        if model.post_norms:
            _post_norm(layer.self_attention, norm(model.hidden_size))
            _post_norm(layer.mlp, norm(model.hidden_size))
        if model.local_rotary_base is not None:
            _pick_rotary(layer.self_attention)
    if model.local_rotary_base is not None and getattr(gpt, "rotary_pos_emb", None) is not None:
        gpt.rotary_pos_emb = local_global_rotary(model, gpt.rotary_pos_emb)
    elif model.rotary_linear_factor is not None and getattr(gpt, "rotary_pos_emb", None) is not None:
        gpt.rotary_pos_emb.inv_freq = gpt.rotary_pos_emb.inv_freq / model.rotary_linear_factor
    if model.embedding_multiplier is not None and getattr(gpt, "pre_process", False):
        multiplier = torch.tensor(model.embedding_multiplier, dtype=torch.float32)
        gpt.embedding.register_forward_hook(lambda _m, _a, out: out * multiplier.to(out.device, out.dtype))
