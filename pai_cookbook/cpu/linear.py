"""Megatron-Core's parallel linears with a short forward where nothing is recorded for backward.

Megatron-Core's `ColumnParallelLinear` / `RowParallelLinear` run every forward through an autograd
`Function` (`LinearWithGradAccumulationAndAsyncCommunication`, for gradient-accumulation fusion and overlapped
gradient all-reduces), and through two more (`copy_to_` / `reduce_from_tensor_model_parallel_region`) even at
TP=1, where they return their input; each looks its tensor-parallel group up again and warns through Python's
`warnings` that it was not given one. None of it does anything when no gradient is recorded (generation,
RL rollouts, evaluation) on a layer that exchanges nothing (TP=1, no sequence parallelism, no expert
communication): then these classes compute what Megatron-Core's forward computes, with the same ops (`matmul`
with the transposed weight, then the bias), so the outputs are bitwise the same. Anything else (gradients on,
TP > 1, sequence parallelism, experts spread over ranks) is Megatron-Core's own forward, unchanged.

On a decode step Megatron-Core's wrappers around the GEMM cost more than the GEMM of a short row;
docs/megatron-core-on-cpu.md has the step before and after.

`pai_cookbook.cpu.convert_spec` puts them wherever the local spec uses Megatron-Core's linears on the CPU path (not
with emulated FP8, whose linears are `core.modeling.fp8`'s); `cpu.convert_output_layer` makes a language model's output layer
one too (`make_lean`).

**oneDNN's prepacked weights while decoding** (`packed_for_decoding`). PyTorch's CPU matmul is MKL's `sgemm`; for the
few rows a decode step has (one per sequence) that is far slower than oneDNN's inner product on a weight reordered
once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, what
TorchInductor's CPU freezing pass uses; docs/megatron-core-on-cpu.md has the decode step before and after). Inside the
context every short linear of the model with an fp32 CPU weight uses its packed copy; the copies are made on entry
from the weights as they are then and dropped on exit, so a model trained between two generation calls (the RL worker)
is packed afresh each time. The sums are oneDNN's, not MKL's: logits agree to rounding, not bit for bit (greedy tokens
equal to transformers' in tests/test_generate.py). Where oneDNN is not in this torch build, the context does nothing.

Training keeps MKL's matmul (Megatron-Core's own Function): oneDNN's forward and input-gradient GEMMs were a little
faster a step, but changed which way notebook 08's deliberately unstable PPO run went (docs/cpu-history.md).
`PAI_COOKBOOK_ONEDNN=0` in the environment of the process that imports this module (a worker inherits the
launcher's) turns the packing off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import get_pg_size


def _onednn_available() -> bool:
    """True where this torch build has oneDNN and the two ops `packed_for_decoding` calls, and the environment does
    not turn them off (`PAI_COOKBOOK_ONEDNN=0`: MKL's matmul while decoding too, as Megatron-Core computes)."""
    return (os.environ.get(ONEDNN_ENV, "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


ONEDNN_ENV = "PAI_COOKBOOK_ONEDNN"
ONEDNN = _onednn_available()


def _exchanges_nothing(layer) -> bool:
    """True where Megatron-Core's forward would communicate nothing: one tensor-parallel rank, no sequence
    parallelism, no expert communication."""
    return get_pg_size(layer.tp_group) == 1 and not layer.sequence_parallel and not layer.explicit_expert_comm


def _matmul(layer, input_: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Megatron-Core's forward at TP=1 without autograd: matmul with the transposed weight, the bias added
    unless the layer hands it back (`skip_bias_add`, for a fused bias-dropout-add). Inside `packed_for_decoding`,
    oneDNN's inner product on the packed weight, the bias in the same call."""
    bias = layer.bias if layer.bias is not None and not layer.skip_bias_add else None
    if layer.packed is not None:
        output = torch.ops.mkldnn._linear_pointwise(input_, layer.packed, bias, "none", [], "")
    else:
        output = torch.matmul(input_, weight.t())
        if bias is not None:
            output = output + bias
    return output, layer.bias if layer.skip_bias_add else None


class LeanColumnParallelLinear(ColumnParallelLinear):
    """`ColumnParallelLinear` whose forward is one matmul where no gradient is recorded and TP=1 (module doc)."""

    packed: torch.Tensor | None = None  # oneDNN's copy of the weight inside `packed_for_decoding`
    packed_source: torch.Tensor | None = None  # the weight it was packed from (a tied output layer's embedding)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lean = _exchanges_nothing(self)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        # A weight handed in (the output layer's tied embedding) takes the short path only where it is the one
        # packed; any other goes through Megatron-Core's forward, which checks its shape.
        if (not self.lean or torch.is_grad_enabled() or
                (weight is not None and (self.packed is None or weight is not self.packed_source))):
            return super().forward(input_, weight, runtime_gather_output)
        return _matmul(self, input_, self.weight if weight is None else weight)


class LeanRowParallelLinear(RowParallelLinear):
    """`RowParallelLinear` whose forward is one matmul where no gradient is recorded and TP=1 (module doc)."""

    packed: torch.Tensor | None = None
    packed_source: torch.Tensor | None = None  # always None: a row-parallel linear is never handed a weight

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lean = _exchanges_nothing(self)

    def forward(self, input_):
        if not self.lean or torch.is_grad_enabled():
            return super().forward(input_)
        return _matmul(self, input_, self.weight)


LEAN = {ColumnParallelLinear: LeanColumnParallelLinear, RowParallelLinear: LeanRowParallelLinear}


def make_lean(layer: torch.nn.Module) -> None:
    """Give a linear Megatron-Core built outside the layer spec (GPTModel's output layer) the short forward."""
    lean = LEAN.get(type(layer))
    if lean is not None:
        layer.__class__ = lean
        layer.lean = _exchanges_nothing(layer)


@contextlib.contextmanager
def packed_for_decoding(model: torch.nn.Module, rows: int) -> Iterator[int]:
    """Pack every short linear's fp32 CPU weight for oneDNN while the block runs (module doc); `rows` is the
    decode step's row count, oneDNN's hint for the layout. Yields how many weights were packed (0 on CUDA, with
    other dtypes, or without oneDNN). The weights must not change inside the block (the copies would not follow);
    the copies are dropped on exit, an exception's included, and a context around this one gets its own back."""
    layers = []
    try:
        if ONEDNN:
            tied = {}  # a tied output layer owns no weight: its GPTModel hands it the embedding's
            for gpt in model.modules():
                if getattr(gpt, "share_embeddings_and_output_weights", False) and getattr(gpt, "post_process", False):
                    tied[id(gpt.output_layer)] = gpt.shared_embedding_or_output_weight()
            for module in model.modules():
                if not isinstance(module, (LeanColumnParallelLinear, LeanRowParallelLinear)) or not module.lean:
                    continue
                weight = module.weight if module.weight is not None else tied.get(id(module))
                if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
                    continue
                layers.append((module, module.packed, module.packed_source))
                module.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
                if module.weight is None:  # a plain attribute: nn.Module would register a Parameter as its own
                    object.__setattr__(module, "packed_source", weight)
        yield len(layers)
    finally:  # also where packing itself failed part way (out of memory): no layer keeps a copy
        for module, packed, source in layers:
            module.packed = packed
            object.__setattr__(module, "packed_source", source)
