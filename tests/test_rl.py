"""RLHF arithmetic (pai_cookbook/rl.py) against values computed by hand."""

import math

import pytest
import torch

from pai_cookbook.core.rl import rl_math as rl


def test_gae_on_three_steps():
    # gamma 0.9, lambda 0.8, V = 0 after the last token:
    # delta_2 = 2 + 0 - 0.3 = 1.7                 A_2 = 1.7
    # delta_1 = 0 + 0.9 x 0.3 - 0.4 = -0.13       A_1 = -0.13 + 0.72 x 1.7 = 1.094
    # delta_0 = 1 + 0.9 x 0.4 - 0.5 = 0.86        A_0 = 0.86 + 0.72 x 1.094 = 1.64768
    # a prompt token before and a padding token after change nothing
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.4, 0.3, 9.0]])
    mask = rl.completion_mask([1], [4], 5)
    advantages, returns = rl.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert advantages.tolist()[0] == pytest.approx([0.0, 1.64768, 1.094, 1.7, 0.0])
    assert returns.tolist()[0] == pytest.approx([0.0, 2.14768, 1.494, 2.0, 0.0])


def test_clipped_policy_loss_and_clip_fraction():
    # clip 0.2; ratios 1.5, 0.5, 1.5, 0.5 with advantages +1, +1, -1, -1:
    # min(1.5, 1.2) = 1.2 (clipped), min(0.5, 0.8) = 0.5, min(-1.5, -1.2) = -1.5, min(-0.5, -0.8) = -0.8 (clipped)
    # loss = -(1.2 + 0.5 - 1.5 - 0.8) / 4 = 0.15; clip fraction 2 / 4; the fifth token is masked out
    ratio = torch.tensor([[1.5, 0.5, 1.5, 0.5, 100.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, 5.0]])
    loss, clipped = rl.policy_loss(ratio.log(), torch.zeros_like(ratio), advantages, rl.completion_mask([0], [4], 5))
    assert float(loss) == pytest.approx(0.15) and float(clipped) == pytest.approx(0.5)


def test_clipped_value_loss():
    # old 1.0, new 1.5, return 2.0, clip 0.2: clipped value 1.2; max((1.5 - 2)^2, (1.2 - 2)^2) = 0.64 -> 0.32
    # old 1.0, new 1.1, return 0.0: both unclipped-equal: 0.5 x 1.21 = 0.605; mean (0.32 + 0.605) / 2
    loss = rl.value_loss(torch.tensor([[1.5, 1.1]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 0.0]]),
                         torch.ones(1, 2))
    assert float(loss) == pytest.approx((0.32 + 0.605) / 2)


def test_k1_and_k3_kl_estimators():
    # p(token) = 0.5 under the policy, 0.25 under the reference: k1 = ln 2, k3 = 0.5 + ln 2 - 1
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert float(rl.kl(logp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(rl.kl(logp, ref, "k3")) == pytest.approx(0.5 + math.log(2) - 1)
    assert float(rl.kl(ref, logp, "k1")) < 0 < float(rl.kl(ref, logp, "k3"))  # k3 is never negative
    with pytest.raises(rl.RLError, match="use one of"):
        rl.kl(logp, ref, "k2")


def test_group_advantages_and_what_is_refused():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    advantages = rl.group_advantages(rewards, [7, 7, 7, 3, 3])
    assert advantages[:3].tolist() == [0.0, 0.0, 0.0]  # identical rewards: nothing to learn
    std = math.sqrt(0.5)  # unbiased std of [0, 1]
    assert advantages[3:].tolist() == pytest.approx([-0.5 / std, 0.5 / std], rel=1e-5)
    with pytest.raises(rl.RLError, match=r"groups \[3, 5\] hold one completion each"):
        rl.group_advantages(rewards, [7, 7, 7, 3, 5])
    with pytest.raises(rl.RLError, match="5 rewards but 4 group ids"):
        rl.group_advantages(rewards, [7, 7, 7, 3])


def test_adaptive_kl_moves_the_coefficient_towards_the_target():
    controller = rl.AdaptiveKL(coef=0.1, target=6.0, horizon=100)
    assert controller.update(12.0, 10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))  # error clipped at +0.2
    # 4.5 / 6 - 1 = -0.25, clipped at -0.2
    assert controller.update(4.5, 10) == pytest.approx(0.1 * 1.02 * (1 - 0.2 * 10 / 100))
    assert controller.update(6.0, 10) == pytest.approx(0.1 * 1.02 * 0.98)  # on target: unchanged


def test_masks_keep_prompt_and_padding_out_of_every_mean():
    mask = rl.completion_mask([2, 1], [4, 3], 5)
    assert mask.tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]]
    values = torch.tensor([[1e6, 1e6, 1.0, 3.0, 1e6], [1e6, 2.0, 2.0, 1e6, 1e6]])
    assert float(rl.masked_mean(values, mask)) == pytest.approx(2.0)


def test_clipped_value_error_per_token_and_where_the_clip_counts():
    # the two tokens of test_clipped_value_loss: the first moved 0.5 from 1.0, past the clip 0.2; its clipped
    # value 1.2 is farther from the return 2.0 than 1.5 is, so the clipped error 0.5 x 0.64 counts; the second
    # moved 0.1, inside the clip: both errors are 0.5 x 1.21 and the clip does not count
    error, clipped = rl.clipped_value_error(torch.tensor([[1.5, 1.1]]), torch.tensor([[1.0, 1.0]]),
                                            torch.tensor([[2.0, 0.0]]))
    assert error.tolist()[0] == pytest.approx([0.32, 0.605]) and clipped.tolist() == [[True, False]]


def test_explained_variance_and_whitening():
    mask = rl.completion_mask([1, 0], [3, 2], 4)  # tokens (0, 1), (0, 2), (1, 0), (1, 1); 1e6 is outside
    returns = torch.tensor([[1e6, 1.0, 3.0, 1e6], [2.0, 4.0, 1e6, 1e6]])
    # Var(R) over [1, 3, 2, 4] = 1.25; a critic off by [1, -1, 0, 0] (residual mean 0): Var 0.5 -> 1 - 0.5 / 1.25
    values = returns - torch.tensor([[0.0, 1.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert float(rl.explained_variance(values, returns, mask)) == pytest.approx(0.6)
    assert float(rl.explained_variance(returns, returns, mask)) == pytest.approx(1.0)  # predicts every return
    # a critic that predicts the mean return everywhere explains nothing
    assert float(rl.explained_variance(torch.full_like(returns, 2.5), returns, mask)) == pytest.approx(0.0)
    # whitening: mean 2.5, unbiased variance 5 / 3 over the four masked tokens; 0 outside the mask
    white = rl.whiten(returns, mask)
    scale = math.sqrt(5 / 3)
    assert white[mask > 0].tolist() == pytest.approx([-1.5 / scale, 0.5 / scale, -0.5 / scale, 1.5 / scale], rel=1e-5)
    assert white[mask == 0].tolist() == [0.0] * 4
    # a rank's share whitened with the whole batch's moments (what the PPO worker passes) is that slice
    assert torch.equal(rl.whiten(returns[:1], mask[:1], (2.5, 5 / 3)), white[:1])


def test_sampled_token_log_probabilities_keep_float64s_digits_on_a_trained_models_row():
    """The RL worker's engine log-probabilities against float64 on a row shaped like a trained model's (one
    logit near 9, the unused part of a 49,152-token vocabulary near -7.6, as notebook 08's policy has)."""
    from pai_cookbook.workers.engine import entropy, token_logprobs

    logits = -7.6 + 0.24 * torch.randn(2, 49152, generator=torch.Generator().manual_seed(0))
    logits[:, 33], logits[:, 40] = 9.4, 6.6
    tokens, rows = torch.tensor([33, 40]), torch.arange(2)
    exact = torch.log_softmax(logits.double(), -1)
    # Megatron-Core's return_log_probs is torch.log_softmax, whose fp32 CPU kernel loses every exp(-17) term
    # against the running sum: 2.0e-4 here. The case must show that, or it guards nothing.
    lost = float((torch.log_softmax(logits, -1)[rows, tokens].double() - exact[rows, tokens]).abs().max())
    if lost < 1e-4:
        pytest.skip(f"this torch's float32 log_softmax keeps the digits here ({lost:.1e}); nothing to guard")
    assert float((token_logprobs(logits, tokens).double() - exact[rows, tokens]).abs().max()) < 1e-6
    assert torch.allclose(entropy(logits).double(), -(exact.exp() * exact).sum(-1), atol=1e-5)
