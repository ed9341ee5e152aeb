"""The knobs of RLHF's runs, checked when built: a reward model's (`RewardModelConfig`), GRPO's (`GRPOConfig`),
PPO's (`PPOConfig`) and preference tuning's (`DPOConfig`). The recipes (`reward_model`, `rlhf`, `dpo`) export them;
the jobs that carry them to the workers are `core.launching.jobs.RewardModelJob`, `RLJob` and `DPOJob`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pai_cookbook.core.configs.model_config import ConfigError
from pai_cookbook.core.rl.rl_math import KL_ESTIMATORS


def check_pair_run(config) -> None:
    """The knobs every pairwise run has (`RewardModelConfig`, `DPOConfig`): whole steps and batches, a global batch of
    whole micro-batches, a positive rate, no negative warmup or interval."""
    name = type(config).__name__
    for knob in ("steps", "global_batch_size", "micro_batch_size"):
        if getattr(config, knob) < 1:
            raise ConfigError(f"{name}.{knob}={getattr(config, knob)} must be at least 1.")
    if config.global_batch_size % config.micro_batch_size:
        raise ConfigError(f"{name}.global_batch_size={config.global_batch_size} must be a multiple of "
                          f"micro_batch_size={config.micro_batch_size}.")
    if not config.lr > 0 or config.warmup_steps < 0 or config.eval_interval < 0:
        raise ConfigError(f"{name}: lr={config.lr} must be > 0, warmup_steps={config.warmup_steps} and "
                          f"eval_interval={config.eval_interval} >= 0.")


@dataclass(kw_only=True)
class RewardModelConfig:
    """The knobs of a reward-model run; batch sizes count pairs (each is two sequences)."""

    steps: int = 100
    lr: float = 1e-4
    """Peak learning rate, after `warmup_steps`, decayed by cosine to lr / 10."""
    warmup_steps: int = 0
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    global_batch_size: int = 16
    """Pairs per optimizer step (over all data-parallel ranks)."""
    micro_batch_size: int = 4
    """Pairs per forward/backward: 2 x this sequences."""
    eval_interval: int = 0
    """Held-out accuracy every this many steps (and after the last); 0: after the last only."""
    seed: int = 1234
    """Pair order (reshuffled every pass over the set) and the head's initial weights."""
    chat_template: str = "auto"
    """Prompts through the tokenizer's chat template: "auto" (when it has one), "always", "never"."""

    def __post_init__(self) -> None:
        check_pair_run(self)


DPO_LOSSES = ("sigmoid", "ipo", "simpo")


@dataclass(kw_only=True)
class DPOConfig:
    """The knobs of a preference-tuning run (`dpo.train`); batch sizes count pairs (each is two sequences).

    The losses, with Δ the policy's log-probability of the chosen answer minus the rejected one's, each less the
    reference's (summed over the answer's tokens):
    - "sigmoid": DPO (Rafailov et al. 2023), -log σ(β Δ); with `label_smoothing` ε the conservative form
      -(1 - ε) log σ(β Δ) - ε log σ(-β Δ) (Mitchell 2023: ε is the share of pairs assumed flipped).
    - "ipo": IPO (Azar et al. 2023), (Δ' - 1 / (2β))², Δ' with each answer's log-ratio averaged over its tokens
      (as TRL computes it, confirmed with IPO's authors).
    - "simpo": SimPO (Meng et al. 2024), -log σ(β (ℓ_chosen - ℓ_rejected) - γ) with ℓ an answer's mean token
      log-probability under the policy: length-normalised and without a reference.
    """

    loss: str = "sigmoid"
    beta: float = 0.1
    """DPO's and IPO's KL weight (IPO's τ); SimPO's reward scale (its paper uses 2-10)."""
    label_smoothing: float = 0.0
    """The "sigmoid" and "simpo" losses' ε in [0, 0.5): the share of pairs whose label is assumed wrong."""
    simpo_gamma: float = 0.5
    """SimPO's target margin γ (in units of β-scaled mean log-probability)."""
    sft_weight: float = 0.0
    """α of a supervised term beside the preference loss: α times the chosen answer's mean token negative
    log-likelihood, per pair (RPO, Pang et al. 2024). It holds the chosen answers up where the preference loss alone
    pushes both down (notebook 12's section 4); 0 leaves it out."""
    steps: int = 100
    lr: float = 1e-6
    """Peak learning rate, after `warmup_steps`; then constant (`lr_decay_style`) or cosine to lr / 10."""
    lr_decay_style: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    """Adam's second-moment decay: the cookbook's training default (Megatron-LM's); TRL and torch default to 0.999."""
    adam_eps: float = 1e-8
    global_batch_size: int = 16
    """Pairs per optimizer step (over all data-parallel ranks)."""
    micro_batch_size: int = 4
    """Pairs per forward/backward: 2 x this sequences."""
    eval_interval: int = 0
    """Held-out figures every this many steps (and before the first and after the last); 0: those two only."""
    seed: int = 1234
    """Pair order (reshuffled every pass over the set)."""

    def __post_init__(self) -> None:
        check_pair_run(self)
        if self.loss not in DPO_LOSSES:
            raise ConfigError(f"DPOConfig.loss={self.loss!r}; use one of {DPO_LOSSES}.")
        if not self.beta > 0:
            raise ConfigError(f"DPOConfig.beta={self.beta} must be > 0 (0.1 is DPO's usual, 2-10 SimPO's).")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"DPOConfig.label_smoothing={self.label_smoothing} must lie in [0, 0.5): it is the "
                              f"share of labels assumed wrong, and at 0.5 nothing is learned.")
        if self.label_smoothing and self.loss == "ipo":
            raise ConfigError("DPOConfig.label_smoothing applies to the 'sigmoid' and 'simpo' losses; IPO's squared "
                              "loss has none. Set it to 0.")
        if self.lr_decay_style not in ("constant", "cosine"):
            raise ConfigError(f"DPOConfig.lr_decay_style={self.lr_decay_style!r}; use 'constant' or 'cosine'.")
        if not self.sft_weight >= 0:
            raise ConfigError(f"DPOConfig.sft_weight={self.sft_weight} must be >= 0 (1.0 is RPO's; 0 leaves it out).")

    @property
    def uses_reference(self) -> bool:
        return self.loss != "simpo"


@dataclass(kw_only=True)
class GRPOConfig:
    """The knobs of a GRPO run. Defaults: DeepSeekMath's clip and KL coefficient, one update per batch."""

    steps: int = 20
    """Rollout-and-update steps."""
    prompts_per_step: int = 4
    """Prompts sampled per step (drawn in order from the prompt set, reshuffled every pass)."""
    group_size: int = 8
    """Completions per prompt; GRPO's baseline is their mean reward (at least 2)."""
    max_new_tokens: int = 16
    """Completion length limit, end-of-turn token included."""
    epochs: int = 1
    """Optimizer steps on each batch of rollouts (the first sees ratio 1; later ones are clipped)."""
    clip: float = 0.2
    """PPO's ratio clip: ratios outside [1 - clip, 1 + clip] stop the gradient where they would gain."""
    kl_coef: float = 0.04
    """Weight of the per-token KL(policy || reference) in the loss; 0 switches the reference off."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    lr: float = 1e-5
    """Adam's learning rate, constant after the warmup."""
    warmup_steps: int = 0
    """Optimizer steps (`epochs` per RL step) of linear warmup from 0 to lr: Adam's first steps move every weight
    by about lr whatever the gradient's size, which a small policy may not survive at a learning rate it learns
    well at later."""
    clip_grad: float = 1.0
    micro_batch_size: int = 8
    """Completions per forward/backward; a step's batch (prompts x group) is split into these."""
    seed: int = 1234
    """Sampling and prompt order; the same seed gives the same run at every layout."""
    shuffle_rewards: bool = False
    """The control: each step's rewards are permuted across its completions before the advantages, which
    keeps their distribution and removes their meaning. A run that learns anyway learned from noise."""
    rollouts: str | None = None
    """A rollouts.jsonl of an earlier run to replay instead of sampling (layout parity, debugging)."""
    save_interval: int | None = None
    """Checkpoint every this many steps (and at the last); 0: the last only; None: every quarter of the run
    (`saves_every`), so a run that dies (a killed kernel, a lost node) loses at most a quarter of its steps. (A
    reward that fails mid-run saves the finished steps whatever this is.)"""
    chat_template: str = "auto"
    """Prompts through the tokenizer's chat template: "auto" (when it has one), "always", "never"."""
    eval_interval: int = 0
    """With `eval_prompts`: sample and score them before the first step, every this many steps and after the
    last (0: before the first and after the last only)."""
    eval_samples: int = 2
    """Completions per held-out prompt at each evaluation (temperature 1, one fixed seed for every evaluation)."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        for knob in ("steps", "prompts_per_step", "max_new_tokens", "epochs", "micro_batch_size", "eval_samples"):
            if getattr(self, knob) < 1:
                raise ConfigError(f"{name}.{knob}={getattr(self, knob)} must be at least 1.")
        self._check_group_size()
        if not 0.0 < self.clip < 1.0:
            raise ConfigError(f"{name}.clip={self.clip} must lie in (0, 1); 0.2 is usual.")
        if self.kl_coef < 0:
            raise ConfigError(f"{name}.kl_coef={self.kl_coef} must be >= 0 (0 switches the KL penalty off).")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"{name}.kl_estimator={self.kl_estimator!r}; use one of {KL_ESTIMATORS}.")
        for knob in ("warmup_steps", "eval_interval", "save_interval"):
            if (getattr(self, knob) or 0) < 0:
                raise ConfigError(f"{name}.{knob}={getattr(self, knob)} must be >= 0.")
        if not self.lr > 0:
            raise ConfigError(f"{name}.lr={self.lr} must be > 0.")

    @property
    def saves_every(self) -> int:
        """Steps between checkpoints: `save_interval`, or a quarter of the run when it is None."""
        return -(-self.steps // 4) if self.save_interval is None else self.save_interval

    def _check_group_size(self) -> None:
        if self.group_size < 2:
            raise ConfigError(f"GRPOConfig.group_size={self.group_size}: GRPO compares the completions of one prompt "
                              f"with each other, so it needs at least 2 (8-64 is usual).")

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.group_size


@dataclass(kw_only=True)
class PPOConfig(GRPOConfig):
    """The knobs of a PPO run (InstructGPT's recipe, Ziegler et al. 2019): a critic (a scalar-head GPT, by
    default the reward model's weights) predicts each token's return; GAE turns the per-token rewards into
    advantages; the KL to the reference is a per-token penalty in the reward, its coefficient fixed or steered
    by `rl.AdaptiveKL` towards `kl_target`. The fields it shares with GRPOConfig mean the same."""

    group_size: int = 1
    """Completions per prompt (the critic is PPO's baseline, so 1 is usual)."""
    kl_coef: float = 0.05
    """The KL penalty's (starting) coefficient in the reward: r_t = -kl_coef KL_t, plus the score at the end."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    kl_target: float | None = None
    """Per-completion KL (summed over its tokens) the adaptive controller steers to; None: a fixed kl_coef."""
    kl_horizon: int = 10_000
    """The controller's horizon in completions: how slowly the coefficient moves (Ziegler et al.: 10,000)."""
    critic_lr: float | None = None
    """The critic's learning rate (default: lr)."""
    value_clip: float = 0.2
    """How far a value may move from the rollout's before its clipped error counts (in reward units)."""
    gamma: float = 1.0
    lam: float = 0.95
    """GAE's discount and lambda (per token; 1 and 0.95 as in InstructGPT-style RLHF)."""
    whiten_advantages: bool = True
    """Normalise the advantages over each step's completion tokens (zero mean, unit variance)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kl_target is not None and not self.kl_target > 0:
            raise ConfigError(f"PPOConfig.kl_target={self.kl_target} must be > 0 (or None for a fixed coefficient).")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ConfigError("PPOConfig.kl_coef=0 with a kl_target: the adaptive controller scales the coefficient, "
                              "so it can never leave 0. Start it above 0 (0.05 is usual).")
        if self.kl_horizon < 1 or not self.value_clip > 0 or not 0 < self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"PPOConfig: kl_horizon={self.kl_horizon} must be >= 1, value_clip={self.value_clip} > 0, "
                              f"gamma={self.gamma} in (0, 1], lam={self.lam} in [0, 1].")
        if self.critic_lr is not None and not self.critic_lr > 0:
            raise ConfigError(f"PPOConfig.critic_lr={self.critic_lr} must be > 0.")

    def _check_group_size(self) -> None:
        if self.group_size < 1:
            raise ConfigError(f"PPOConfig.group_size={self.group_size} must be at least 1.")
