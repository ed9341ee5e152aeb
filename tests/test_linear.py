"""`cpu.linear`: Megatron-Core's parallel linears with a short forward where no gradient is recorded (TP=1)."""

import pytest
import torch

from pai_cookbook.core.checkpoints import families
from pai_cookbook.core.configs.config import ParallelConfig, PrecisionConfig
from pai_cookbook.core.machine import runtime


def test_lean_linears_compute_megatron_cores_forward_bit_for_bit_and_train_through_it():
    """A tiny Qwen2 with every bias on (the QKV bias added in the linear, the projections' biases handed back for
    the fused bias-dropout-add): logits under no_grad with the short forward equal Megatron-Core's own bit for bit,
    and only the output layer (not in the layer spec) still goes through Megatron-Core's autograd Function then.
    With gradients on, Megatron-Core's forward runs and every weight gets a gradient."""
    from megatron.core.tensor_parallel import layers

    from pai_cookbook.cpu.linear import LeanColumnParallelLinear, LeanRowParallelLinear
    from pai_cookbook.workers.models import build_model

    model = families.tiny("qwen2", add_bias_linear=True)
    calls = []
    megatrons = layers.linear_with_grad_accumulation_and_async_allreduce

    def counted(*args, **kwargs):
        calls.append(1)
        return megatrons(*args, **kwargs)

    counted.warned = megatrons.warned  # the function reads its own attribute through the module's name

    with runtime.world_of_one() as device:
        (gpt,) = build_model(model, ParallelConfig(), PrecisionConfig(dtype="fp32"), device, seed=3)
        lean = [m for m in gpt.decoder.modules() if isinstance(m, (LeanColumnParallelLinear, LeanRowParallelLinear))]
        assert len(lean) == 4 * model.num_layers and all(m.lean for m in lean)
        assert isinstance(gpt.output_layer, (LeanColumnParallelLinear, LeanRowParallelLinear))  # handed the embedding
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


def _static_decode(gpt, model, tokens: torch.Tensor, steps: int, left_padding: list[int] | None = None
                   ) -> list[torch.Tensor]:
    """Logits of a prefill over `tokens` and `steps` greedy one-token steps through Megatron-Core's static KV cache,
    the rows left-padded by `left_padding` tokens (masked, positions from each row's first real token) if given."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from pai_cookbook.core.modeling.attention import LEFT_PADDING
    from pai_cookbook.workers.engine import inference_mode

    rows, width = tokens.shape
    context = StaticInferenceContext(rows, width + steps)
    setattr(context, LEFT_PADDING, None if left_padding is None else torch.tensor(left_padding))
    logits, positions = [], torch.arange(width).expand(rows, width)
    with torch.no_grad(), inference_mode():  # as the engine runs it (0.18 on: only the last token's logits then)
        for _ in range(steps + 1):
            out = gpt(tokens, positions, None, inference_context=context, runtime_gather_output=True)
            logits.append(out)
            context.sequence_len_offset += tokens.shape[1]
            tokens = out[:, -1:, :model.vocab_size].argmax(-1)
            positions = torch.full((rows, 1), context.sequence_len_offset)
    return logits


def _short_and_megatron_forward(family: str, **overrides) -> None:
    from pai_cookbook.workers.models import build_model

    model = families.tiny(family, **overrides)
    with runtime.world_of_one() as device:
        (gpt,) = build_model(model, ParallelConfig(), PrecisionConfig(dtype="fp32"), device, seed=5)
        gpt.eval()
        with torch.no_grad():  # Megatron-Core initialises biases to zero, which would hide a bias left out
            for name, param in gpt.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(2))
        layers = list(gpt.decoder.layers)
        short = layers + [layer.self_attention for layer in layers]
        assert all(type(m).__name__.startswith("Lean") for m in layers) and all(m.lean for m in short), family
        tokens = torch.randint(0, model.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(9).expand(3, 9)
        long_calls = []
        megatron_attention = layers[0]._forward_attention
        layers[0]._forward_attention = lambda *a, **k: long_calls.append(1) or megatron_attention(*a, **k)
        lean = _static_decode(gpt, model, tokens, steps=6)
        lean_padded = _static_decode(gpt, model, tokens, steps=6, left_padding=[0, 3, 5])
        with torch.no_grad():
            lean_eval = gpt(tokens, positions, None)
        assert not long_calls
        for m in short:
            m.lean = False
        megatron = _static_decode(gpt, model, tokens, steps=6)
        megatron_padded = _static_decode(gpt, model, tokens, steps=6, left_padding=[0, 3, 5])
        with torch.no_grad():
            megatron_eval = gpt(tokens, positions, None)
        assert len(long_calls) == 15  # Megatron-Core's own forward ran: two prefills, 2 x 6 steps, the evaluation
        for m in short:
            m.lean = True
        for a, b in zip(lean + lean_padded, megatron + megatron_padded, strict=True):
            assert torch.equal(a, b), family
        # the unpadded row computes what it did alone (to rounding: the kernel takes a mask instead of is_causal); a
        # padded row reads other tokens (its first ones are padding)
        assert torch.allclose(lean[0][0], lean_padded[0][0], atol=1e-5, rtol=0)
        assert not torch.allclose(lean[0][1], lean_padded[0][1], atol=1e-5, rtol=0)
        assert torch.equal(lean_eval, megatron_eval), family
        assert lean[0].shape[1] == 1 and not torch.equal(lean[1], lean[2])  # last-token logits; steps differ
        gpt.train()
        gpt(tokens, positions, None, labels=tokens).float().mean().backward()
        assert len(long_calls) == 16
        assert all(p.grad is not None for m in layers for p in m.self_attention.parameters()), family


@pytest.mark.both_ends
def test_lean_layers_decode_as_megatron_core_does_bit_for_bit():
    """`cpu.lean_layer`: a prefill and six KV-cached decode steps, the rows unpadded and left-padded, give the same
    logits bit for bit with the short layer and attention forward as with Megatron-Core's, for a dense model with
    every bias on (non-zero), an MoE model with QK norms and one with a shared expert and a QKV bias; so does a forward
    without a cache (evaluation). With gradients on, Megatron-Core's forward runs (the short one records nothing for
    the optimizer)."""
    _short_and_megatron_forward("qwen2", add_bias_linear=True)
    _short_and_megatron_forward("qwen3_moe")
    _short_and_megatron_forward("qwen2_moe")


def _packed_and_mkl_decode(family: str) -> None:
    from pai_cookbook.cpu import linear
    from pai_cookbook.workers.models import build_model

    model = families.tiny(family)
    with runtime.world_of_one() as device:
        (gpt,) = build_model(model, ParallelConfig(), PrecisionConfig(dtype="fp32"), device, seed=7)
        gpt.eval()
        short = [m for m in gpt.modules() if isinstance(m, (linear.LeanColumnParallelLinear, linear.LeanRowParallelLinear))]
        assert gpt.output_layer in short and all(m.lean for m in short), family
        if model.num_experts is None:
            assert len(short) == 4 * model.num_layers + 1, family
        tokens = torch.randint(0, model.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
        mkl = _static_decode(gpt, model, tokens, steps=6, left_padding=[0, 3, 5])
        with linear.packed_for_decoding(gpt, rows=3) as packed:
            assert packed == len(short) and all(m.packed is not None for m in short), family
            onednn = _static_decode(gpt, model, tokens, steps=6, left_padding=[0, 3, 5])
        assert all(m.packed is None for m in short)
        # oneDNN sums in its own order: the same logits to fp32 rounding, the same greedy tokens (each step feeds the
        # previous step's argmax, so a different token would change every later row by far more than this)
        for a, b in zip(mkl, onednn, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert not all(map(torch.equal, mkl, onednn))  # oneDNN ran: its last bits differ (every step, measured)
        # weights changed between two contexts (the RL worker trains between them) are packed afresh
        with torch.no_grad():
            gpt.embedding.word_embeddings.weight.mul_(1.5)
            gpt.decoder.layers[0].self_attention.linear_proj.weight.mul_(-1.0)
        changed = _static_decode(gpt, model, tokens, steps=0)
        try:
            with linear.packed_for_decoding(gpt, rows=3):
                torch.testing.assert_close(_static_decode(gpt, model, tokens, steps=0)[0], changed[0], rtol=1e-5,
                                           atol=1e-5)
                with linear.packed_for_decoding(gpt, rows=1):  # an inner context gives the outer its copies back
                    pass
                assert all(m.packed is not None for m in short)
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        assert all(m.packed is None for m in short)  # dropped on the way out of an exception too
        assert not torch.allclose(changed[0], mkl[0], rtol=1e-3, atol=1e-3)


def test_weights_packed_for_onednn_decode_as_megatron_cores_matmul_does_to_rounding():
    """`cpu.linear.packed_for_decoding`: every short linear, the output layer included (tied to the embedding for
    Qwen2, its own weight for Llama; an MoE model's experts), runs oneDNN's inner product on a packed copy inside the
    context; a prefill and six cached steps of left-padded rows give MKL's logits to fp32 rounding and the same greedy
    tokens; weights changed between two contexts are packed afresh; nested contexts give the outer one its copies
    back; the copies are dropped on exit, an exception's included."""
    _packed_and_mkl_decode("qwen2")
    _packed_and_mkl_decode("llama")
    _packed_and_mkl_decode("qwen3_moe")
