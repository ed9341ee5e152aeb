"""The arithmetic of RLHF as notebooks and tests name it (`rl.gae`, `rl.group_advantages`, `rl.kl`, `rl.AdaptiveKL`, ...):
advantages, clipped losses, KL estimators, the adaptive KL coefficient. It lives in `core.rl_math`, which the RL
worker computes with; its docstring gives the formulas and their sources."""

from pai_cookbook.core.rl_math import (
    KL_ESTIMATORS,
    AdaptiveKL,
    RLError,
    clipped_surrogate,
    clipped_value_error,
    completion_mask,
    explained_variance,
    gae,
    group_advantages,
    kl,
    masked_mean,
    policy_loss,
    value_loss,
    whiten,
)

__all__ = ["AdaptiveKL", "KL_ESTIMATORS", "RLError", "clipped_surrogate", "clipped_value_error", "completion_mask",
           "explained_variance", "gae", "group_advantages", "kl", "masked_mean", "policy_loss", "value_loss", "whiten"]
