"""The cookbook's CPU speed work: converters of Megatron-Core's local layer spec for a CPU, and nothing else.

Applied behind one decision (`core.machine.build.choose_layers`: `DeviceInfo.cpu_converters`, a CPU's default): the workers
hand this package to `core.modeling.model.build_model` (`workers.models`), which applies `convert_spec` and
`convert_output_layer` (the `core.modeling.layer_spec.Converters` it takes); the workers use `packed_for_decoding` and
`fuse_adam` themselves. Every run's record lists them by name (`core.machine.build.CPU_CONVERTERS`, `build.record`). Nothing
here is imported on a GPU or with `PAI_COOKBOOK_LAYERS=local`, which builds Megatron-Core's local spec as upstream
ships it (with the swaps that serve a GPU too: `core.modeling.attention`). Each converter computes what Megatron-Core
computes, bit for bit unless its entry says otherwise; docs/megatron-core-on-cpu.md has their measurements.
"""

from __future__ import annotations


def convert_spec(spec, linears: bool = True) -> None:
    """Apply the layer converters to a layer or decoder-block spec built by `core.modeling.layer_spec`, in place: the layer
    class made lean (`lean_layers`, its dense MLP adopted as `swiglu_function`), the self-attention
    (`lean_attention`) and, unless `linears` is False (emulated FP8 brings its own), the parallel linears
    (`lean_linears`)."""
    from pai_cookbook.core.modeling.attention import LeftPaddedSelfAttention
    from pai_cookbook.core.modeling.specs import swap_classes
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
    upstream = {lean: base for base, lean in linear.LEAN.items()}
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        # multi-latent attention accepts its down projections by exact class (Linear, ColumnParallelLinear or Transformer
        # Engine's): those two keep upstream's linear
        attention = getattr(layer.submodules.self_attention, "submodules", None)
        for name in ("linear_q_down_proj", "linear_kv_down_proj"):
            if hasattr(attention, name):
                setattr(attention, name, upstream.get(getattr(attention, name), getattr(attention, name)))


def convert_output_layer(output_layer) -> None:
    """A language model's output layer (built by GPTModel, outside the spec) made a lean linear (`lean_linears`)."""
    from pai_cookbook.cpu import linear

    linear.make_lean(output_layer)
