"""Reinforcement learning from rewards on Megatron-Core: GRPO and PPO, with rollouts from Megatron-Core's own engine.

`prepare` (every check before launch), `run` (grpo, ppo, reading a run back); the knobs (`GRPOConfig`, `PPOConfig`),
the job (`RLJob`) and the reward calls, which the RL worker shares, are `core.configs.rlhf_config`, `core.launching.jobs` and
`core.rl.reward_functions`.

    config = rlhf.GRPOConfig(steps=40, prompts_per_step=4, group_size=8, max_new_tokens=12, lr=1e-5)
    result = rlhf.grpo("sft/iter_0000100", prompts, "pai_cookbook.rewards:exact_answer", config,
                       save_dir="grpo", run_dir="runs/grpo")
    result = rlhf.ppo("sft/iter_0000100", prompts, "rm/iter_0000300", rlhf.PPOConfig(kl_target=3.0),
                      eval_prompts=held_out, true_reward="pai_cookbook.rewards:positional_match")
    curves = rlhf.history("runs/grpo")          # reward, kl, clip fraction, lengths... per step
    held = rlhf.evals("runs/ppo")               # the held-out reward (and true reward) at each evaluation

One step: Megatron-Core's static inference engine (notebook 07's, KV cache) samples `group_size`
completions of each of `prompts_per_step` prompts on the policy's own weights: the engine runs the very
modules the optimizer updates, in the same process, so there is no copy to synchronise, and every step
checks it (the engine's log-probabilities of the sampled tokens against the trainer's forward of the same
tokens; a stale copy would differ after the first update). The reward (a function, or a reward model's
score) scores each completion. GRPO's advantage is the reward against its group's (`rl.group_advantages`),
with a KL penalty to the frozen reference in the loss; PPO's come from a critic (a scalar-head GPT trained
beside the policy) by GAE over per-token rewards that carry the KL penalty (`rl.gae`, `rl.AdaptiveKL`).
The policy then takes `epochs` clipped policy-gradient steps (`rl.clipped_surrogate`), averaged per token
over the whole batch, as the training worker averages SFT's loss; PPO's critic a clipped value step after each.

Sampling is at temperature 1 with neither top-k nor top-p: the completions are drawn from the policy
itself, so the importance ratios and the engine-vs-trainer check compare like with like. Reward functions
are `reward(completion: str, record: dict) -> float` named as "module:function" (they run in the workers;
`pai_cookbook.rewards` has the built-in ones); each is tried on every prompt before launch (an empty completion,
the prompt's own text, the record's answer), and one that fails on a sampled completion stops the run after it saves
the steps finished. A reward model is a checkpoint `reward_model.train` wrote, with the policy's tokenizer.
"""

from pai_cookbook.core.configs.rlhf_config import GRPOConfig, PPOConfig
from pai_cookbook.core.launching.jobs import RLJob
from pai_cookbook.core.rl.reward_functions import Reward, resolve_reward, score
from pai_cookbook.rlhf.prepare import CRITIC, check_reference, prepare, records_of
from pai_cookbook.rlhf.run import evals, grpo, history, pair_critic, ppo, read_rollouts, sampled_reward

__all__ = ["CRITIC", "GRPOConfig", "PPOConfig", "RLJob", "Reward", "check_reference", "evals", "grpo", "history",
           "pair_critic", "ppo", "prepare", "read_rollouts", "records_of", "resolve_reward", "sampled_reward", "score"]
