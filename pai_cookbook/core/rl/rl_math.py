"""The arithmetic of RLHF: advantages, clipped losses, KL estimators, the adaptive KL coefficient.

    advantages, returns = rl.gae(rewards, values, mask, gamma=1.0, lam=0.95)          # PPO, per token
    advantages = rl.group_advantages(rewards, groups)                                   # GRPO, per completion
    loss, clipped = rl.policy_loss(logprobs, old_logprobs, advantages, mask, clip=0.2)
    loss = rl.value_loss(values, old_values, returns, mask, clip=0.2)
    kl = rl.kl(logprobs, ref_logprobs, "k3")
    advantages = rl.whiten(advantages, mask)                                          # PPO, per batch
    fit = rl.explained_variance(values, returns, mask)                                # the critic's

Tensors are [batch, tokens] over a completion's tokens; `mask` is 1 on the tokens the policy generated and
0 on prompt and padding tokens, which no loss, advantage or KL may see. Every mean is over the masked
tokens of the whole batch (`masked_mean`), the per-token normalisation of the training worker. The
formulas are those of PPO (Schulman et al. 2017; GAE: Schulman et al. 2016), the RLHF set-up of Ziegler et
al. 2019 (KL penalty, adaptive coefficient) and GRPO (Shao et al. 2024); tests/test_rl.py checks each
against values computed by hand.

The RL worker computes with these; tests name them `rl` (`from pai_cookbook.core.rl import rl_math as rl`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

KL_ESTIMATORS = ("k1", "k3")


class RLError(ValueError):
    """Bad RL input, named before any worker starts."""


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is 1 (prompt and padding positions do not count)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's masked tokens: delta_t = r_t + gamma V_{t+1} - V_t,
    A_t = delta_t + gamma lam A_{t+1}, with V = 0 after a completion's last token. Returns (advantages,
    returns = advantages + values), 0 outside the mask.

    A masked-out position between two completion tokens (there is none in a completion) is not skipped:
    the mask must be one contiguous span per row, which is what `completion_mask` builds.
    """
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value = values[:, t] * mask[:, t]
        next_advantage = advantages[:, t]
    return advantages, (advantages + values) * mask


def group_advantages(rewards: torch.Tensor, groups: Sequence[int] | torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each completion's reward minus its group's mean, over the group's standard deviation (unbiased,
    as TRL computes it) + eps. A group whose rewards are all equal gives zero advantage: nothing to learn.

    Raises:
        RLError: a group with a single completion (its advantage would be 0 whatever its reward: a wrong
            group id silently removes the baseline), or groups that do not match the rewards.
    """
    groups = torch.as_tensor(groups, device=rewards.device)
    if groups.shape != rewards.shape:
        raise RLError(f"{rewards.numel()} rewards but {groups.numel()} group ids; give one group id per completion.")
    ids, sizes = groups.unique(return_counts=True)
    if (sizes < 2).any():
        raise RLError(f"groups {ids[sizes < 2].tolist()} hold one completion each; GRPO compares the completions of "
                      f"one prompt, so sample at least 2 per prompt and give them the same group id.")
    out = torch.zeros_like(rewards)
    for group in ids:
        members = groups == group
        out[members] = (rewards[members] - rewards[members].mean()) / (rewards[members].std() + eps)
    return out


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate: -min(ratio A, clip(ratio, 1 - clip, 1 + clip) A), ratio = exp(logp - logp_old),
    averaged over the masked tokens. Returns (loss, clip fraction: the share of tokens where the clipped term
    is the smaller one and so stops the gradient, as TRL's PPO counts it; OpenAI's baselines count
    |ratio - 1| > clip instead, which includes tokens whose unclipped term is still the minimum)."""
    losses, clipped = clipped_surrogate(logprobs, old_logprobs, advantages, clip)
    return masked_mean(losses, mask), masked_mean(clipped.to(logprobs.dtype), mask)


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      clip: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """`policy_loss` per token, before any mean: (-min(ratio A, clip(ratio) A), where the clipped term won).
    `advantages` broadcast: [batch, tokens] for PPO, [batch, 1] for GRPO's one advantage per completion."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped, clipped = ratio * advantages, torch.clamp(ratio, 1 - clip, 1 + clip) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.2) -> torch.Tensor:
    """PPO's clipped value loss: 0.5 max((V - R)^2, (V_clipped - R)^2), V_clipped = V_old + clip(V - V_old,
    -clip, clip), averaged over the masked tokens."""
    return masked_mean(clipped_value_error(values, old_values, returns, clip)[0], mask)


def clipped_value_error(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                        clip: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """`value_loss` per token, before any mean: (0.5 max((V - R)^2, (V_clipped - R)^2), where the clipped
    error was the larger one: the value moved more than `clip` from the rollout's and away from the return)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped_error, clipped_error = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped_error, clipped_error), clipped_error > unclipped_error


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over the masked tokens: 1 when the critic predicts every return, 0 when it
    predicts no better than their mean, negative when worse (the PPO diagnostic of baselines and TRL)."""
    residual = returns - values
    variance = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    return 1 - masked_mean((residual - masked_mean(residual, mask)) ** 2, mask) / variance.clamp(min=1e-12)


def whiten(values: torch.Tensor, mask: torch.Tensor, moments: tuple[float, float] | None = None,
           eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked tokens (variance with Bessel's correction, as TRL's `masked_whiten`); 0
    outside the mask. PPO whitens its advantages per batch so the policy's step size does not follow the
    reward's scale. `moments`: (mean, variance) of the whole batch when `values` is one rank's share of it."""
    mask = mask.to(values.dtype)
    if moments is None:
        count = mask.sum()
        mean = masked_mean(values, mask)
        moments = (mean, ((values - mean) ** 2 * mask).sum() / (count - 1).clamp(min=1))
    mean, variance = moments
    return (values - mean) * (variance + eps) ** -0.5 * mask


def kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probabilities:
    k1 = logp - logp_ref (unbiased, can be negative), k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1
    (unbiased, never negative; Schulman's "Approximating KL divergence")."""
    if estimator not in KL_ESTIMATORS:
        raise RLError(f"KL estimator {estimator!r}; use one of {KL_ESTIMATORS}.")
    log_ratio = ref_logprobs - logprobs
    return -log_ratio if estimator == "k1" else torch.exp(log_ratio) - log_ratio - 1


@dataclass
class AdaptiveKL:
    """Ziegler et al.'s controller: after each batch the KL coefficient moves towards keeping the mean KL at
    `target`: coef *= 1 + clip(KL / target - 1, -0.2, 0.2) x steps / horizon."""

    coef: float = 0.1
    target: float = 6.0
    horizon: int = 10_000

    def update(self, mean_kl: float, steps: int) -> float:
        error = min(max(mean_kl / self.target - 1, -0.2), 0.2)
        self.coef *= 1 + error * steps / self.horizon
        return self.coef


def completion_mask(prompt_lengths: Sequence[int], lengths: Sequence[int], width: int) -> torch.Tensor:
    """[rows, width] mask of each row's completion tokens: positions [prompt_length, length) of the row
    (prompt before, padding after are 0)."""
    index = torch.arange(width)
    return ((index >= torch.tensor(prompt_lengths)[:, None]) & (index < torch.tensor(lengths)[:, None])).float()
