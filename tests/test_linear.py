"""`core.linear`: Megatron-Core's parallel linears with a short forward where no gradient is recorded (TP=1)."""

import torch

from pai_cookbook.core import families, runtime
from pai_cookbook.core.config import ParallelConfig, PrecisionConfig


def test_lean_linears_compute_megatron_cores_forward_bit_for_bit_and_train_through_it():
    """A tiny Qwen2 with every bias on (the QKV bias added in the linear, the projections' biases handed back for
    the fused bias-dropout-add): logits under no_grad with the short forward equal Megatron-Core's own bit for bit,
    and only the output layer (not in the layer spec) still goes through Megatron-Core's autograd Function then.
    With gradients on, Megatron-Core's forward runs and every weight gets a gradient."""
    from megatron.core.tensor_parallel import layers

    from pai_cookbook.core.linear import LeanColumnParallelLinear, LeanRowParallelLinear
    from pai_cookbook.core.model import build_model

    model = families.tiny("qwen2", add_bias_linear=True)
    calls = []
    megatrons = layers.linear_with_grad_accumulation_and_async_allreduce

    def counted(*args, **kwargs):
        calls.append(1)
        return megatrons(*args, **kwargs)

    counted.warned = megatrons.warned  # the function reads its own attribute through the module's name

    with runtime.world_of_one() as device:
        (gpt,) = build_model(model, ParallelConfig(), PrecisionConfig(dtype="fp32"), device, seed=3)
        lean = [m for m in gpt.modules() if isinstance(m, (LeanColumnParallelLinear, LeanRowParallelLinear))]
        assert len(lean) == 4 * model.num_layers and all(m.lean for m in lean)
        with torch.no_grad():  # Megatron-Core initialises biases to zero, which would hide a bias left out
            for m in lean:
                m.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
        assert sum(not m.skip_bias_add for m in lean) == model.num_layers  # the QKV bias, added in the linear
        tokens = torch.randint(0, model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(12).expand(2, 12)
        layers.linear_with_grad_accumulation_and_async_allreduce = counted
        try:
            with torch.no_grad():
                short = gpt(tokens, positions, None)
                short_calls = len(calls)
                for m in lean:
                    m.lean = False
                megatron = gpt(tokens, positions, None)
                megatron_calls = len(calls) - short_calls
                for m in lean:
                    m.lean = True
            loss = gpt(tokens, positions, None, labels=tokens).float().mean()
            trained_calls = len(calls) - short_calls - megatron_calls
        finally:
            layers.linear_with_grad_accumulation_and_async_allreduce = megatrons
        loss.backward()
    assert torch.equal(short, megatron)
    assert (short_calls, megatron_calls, trained_calls) == (1, 4 * model.num_layers + 1, 4 * model.num_layers + 1)
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for m in lean for p in m.parameters())
