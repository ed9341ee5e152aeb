"""The cookbook's CPU speed work: converters of Megatron-Core's local layer spec for a CPU, and nothing else.

Applied behind one decision (`core.runtime.choose_layers`: `DeviceInfo.cpu_converters`, a CPU's default), by
`core.layer_spec` (`convert_spec`), `core.model` (`convert_output_layer`) and the workers (`packed_for_decoding`,
`fuse_adam`), and listed by name in every run's record (`core.runtime.layer_record`). Nothing here is imported on
a GPU or with `PAI_COOKBOOK_LAYERS=local`, which builds Megatron-Core's local spec as upstream ships it (with the
swaps that serve a GPU too: `core.attention`). Each converter computes what Megatron-Core computes, bit for bit
unless its entry says otherwise; docs/megatron-core-on-cpu.md has their measurements.
"""

from __future__ import annotations

CONVERTERS = {
    "lean_layers": "cpu.lean_layer.LeanTransformerLayer: TransformerLayer's eval forward without the scaffolding of "
                   "features that are off, where no gradient is recorded (bitwise)",
    "lean_attention": "cpu.attention.LeanSelfAttention: Attention.forward likewise at TP=1 in eval (bitwise), and in "
                      "training the rotary embedding applied right after the projection without extra copies (bitwise)",
    "lean_linears": "cpu.linear.LeanColumnParallelLinear / LeanRowParallelLinear (the output layer too): one matmul "
                    "where no gradient is recorded at TP=1 (bitwise)",
    "swiglu_function": "cpu.glu.GatedMLP: SwiGLU as one autograd function, one gradient tensor for fc1 (bitwise)",
    "onednn_decode_packing": "cpu.linear.packed_for_decoding: oneDNN's inner product on weights packed once while "
                             "generating (logits within ~1e-6 relative, greedy tokens equal)",
    "fused_cpu_adam": "cpu.adam.fuse_adam: torch's fused AdamW kernel on CPU parameters (last-bit differences)",
    "glibc_keep_freed_memory": "core.launch.KEEP_FREED_MEMORY: glibc keeps freed memory for the next step in "
                               "workers of repeated steps (no change to values)",
}
"""Every converter by name, with what it replaces; `core.runtime.layer_record` lists them in each run's record."""


def convert_spec(spec, linears: bool = True) -> None:
    """Apply the layer converters to a layer or decoder-block spec built by `core.layer_spec`, in place: the layer
    class made lean (`lean_layers`, its dense MLP adopted as `swiglu_function`), the self-attention
    (`lean_attention`) and, unless `linears` is False (emulated FP8 brings its own), the parallel linears
    (`lean_linears`)."""
    from pai_cookbook.core.attention import LeftPaddedSelfAttention
    from pai_cookbook.core.layer_spec import swap_classes
    from pai_cookbook.cpu import linear
    from pai_cookbook.cpu.attention import LeanSelfAttention
    from pai_cookbook.cpu.lean_layer import lean_layer_class

    lean_classes: dict[type, type] = {}
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        base = layer.module
        if getattr(base, "lean_converted", False):  # a block's layers may share one spec
            continue
        layer.module = lean_classes.setdefault(base, lean_layer_class(base))
    swap_classes(spec, {LeftPaddedSelfAttention: LeanSelfAttention} | (linear.LEAN if linears else {}))


def convert_output_layer(output_layer) -> None:
    """A language model's output layer (built by GPTModel, outside the spec) made a lean linear (`lean_linears`)."""
    from pai_cookbook.cpu import linear

    linear.make_lean(output_layer)
