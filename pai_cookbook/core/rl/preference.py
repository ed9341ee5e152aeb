"""The arithmetic of preference tuning without a reward model: DPO's, IPO's and SimPO's losses and rewards per pair.

    losses, chosen_reward, rejected_reward = preference.losses(config, policy, reference, tokens)

`policy` and `reference` are (chosen, rejected) log-probabilities of each pair's answers, summed over the answer's
tokens; `tokens` the answers' token counts. The formulas are those of the papers `DPOConfig` names, written as TRL
1.16 computes them (DPOTrainer's "sigmoid" and "ipo", CPOTrainer's "simpo"); tests/test_dpo.py checks them by hand
and the worker's training against TRL's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Pair = tuple[torch.Tensor, torch.Tensor]
"""(chosen, rejected), one value per pair each."""


def losses(config, policy: Pair, reference: Pair, tokens: Pair) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each pair's loss under `config` (a `DPOConfig`), plus `sft_weight` times the chosen answer's mean token negative
    log-likelihood, and the implicit rewards of its chosen and rejected answers: β times the log-ratio to the
    reference (DPO, IPO) or β times the mean token log-probability (SimPO)."""
    beta, smoothing = config.beta, config.label_smoothing
    if config.loss == "simpo":
        chosen, rejected = (p / n.clamp(min=1) for p, n in zip(policy, tokens))
        logits = beta * (chosen - rejected) - config.simpo_gamma
        loss = -(1 - smoothing) * F.logsigmoid(logits) - smoothing * F.logsigmoid(-logits)
        return loss - config.sft_weight * chosen, beta * chosen, beta * rejected
    chosen, rejected = (p - r for p, r in zip(policy, reference))
    supervised = -config.sft_weight * policy[0] / tokens[0].clamp(min=1) if config.sft_weight else 0.0
    if config.loss == "ipo":
        delta = chosen / tokens[0].clamp(min=1) - rejected / tokens[1].clamp(min=1)
        loss = (delta - 1 / (2 * beta)) ** 2
    else:
        logits = beta * (chosen - rejected)
        loss = -(1 - smoothing) * F.logsigmoid(logits) - smoothing * F.logsigmoid(-logits)
    return loss + supervised, beta * chosen, beta * rejected
