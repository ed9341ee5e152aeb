"""Mixture-of-Experts: router statistics while training, and dense -> MoE upcycling.

`RouterStats` (`core.measures.router_stats`, which the training workers share) watches every Megatron-Core router of
a model and turns each optimizer step into figures a user can act on: per MoE layer, the share of routed
tokens each expert received, the auxiliary and z-losses Megatron-Core computed, and the tokens dropped by a
capacity factor. `workers.training.train` records them in the per-step logs of every MoE run.

`upcycle(dense_ckpt, out, num_experts=8)` builds an MoE checkpoint from a dense one by copying the
dense MLP into every expert (sparse upcycling, Komatsuzaki et al. 2022) with Megatron-Core's own
`upcycle_state_dict`. Because the router's top-k weights are renormalised to sum to one, k identical
experts compute exactly the dense MLP: the upcycled model starts as the same function as the dense
one, and continued pretraining then lets the experts diverge.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import ConfigError, ModelConfig, ParallelConfig
from pai_cookbook.core.launching import cli, nodes
from pai_cookbook.core.launching.jobs import UpcycleJob
from pai_cookbook.core.measures.router_stats import AUX_LOSS_NAMES, RouterStats, moe_layer_flags

__all__ = ["AUX_LOSS_NAMES", "UPCYCLE_TARGETS", "RouterStats", "UpcycleJob", "ep_imbalance", "layout_parity",
           "load_balance", "main",
           "moe_layer_flags", "upcycle", "upcycled_config"]

UPCYCLE_TARGETS = {"llama": "mixtral", "mistral": "mixtral"}
"""Dense family -> the MoE family with the same attention and norms (and a Hugging Face export)."""
_CHANGE_THE_FUNCTION = {"moe_router_pre_softmax", "moe_router_score_function", "moe_router_enable_expert_bias",
                        "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_ffn_hidden_size",
                        "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity"}


def load_balance(history: list[dict[str, Any]], skip: int) -> torch.Tensor:
    """Mean expert shares after warm-up, in units of the fair share: [MoE layers, experts].

    Args:
        history: `train.run(...)["router"]`: per-step router figures (each with `expert_load`).
        skip: warm-up steps left out.
    """
    if any("expert_load" not in h for h in history):
        raise ValueError("the history has no 'expert_load' per step: pass train.run(...)['router'] of an MoE run.")
    loads = torch.tensor([h["expert_load"] for h in history[skip:]], dtype=torch.float64)
    if loads.numel() == 0:
        raise ValueError(f"no steps after a warm-up of {skip} in a history of {len(history)}; lower `skip`.")
    return loads.mean(dim=0) * loads.shape[-1]


def ep_imbalance(history: list[dict[str, Any]], ep: int, skip: int = 0) -> float:
    """The most loaded expert-parallel rank's routed tokens over the mean rank's, from a run's router figures: per step
    and MoE layer, the experts' shares summed over each rank's block of E / EP consecutive experts (Megatron-Core's
    placement), the largest block over the mean; averaged over the steps after `skip`, the largest over the layers.
    What the planner's `Workload.moe_imbalance` takes (1.0: balanced)."""
    if any("expert_load" not in h for h in history):
        raise ValueError("the history has no 'expert_load' per step: pass train.run(...)['router'] of an MoE run.")
    loads = torch.tensor([h["expert_load"] for h in history[skip:]], dtype=torch.float64)
    if loads.numel() == 0:
        raise ValueError(f"no steps after a warm-up of {skip} in a history of {len(history)}; lower `skip`.")
    steps, layers, experts = loads.shape
    if ep < 1 or experts % ep:
        raise ValueError(f"EP={ep} does not divide the {experts} experts; give a divisor of {experts}.")
    blocks = loads.reshape(steps, layers, ep, experts // ep).sum(-1)
    return float((blocks.max(-1).values / blocks.mean(-1)).mean(0).max())


def settled(history: list[dict[str, Any]], window: int = 10, low: float = 0.5, high: float = 2.0) -> dict[str, Any]:
    """When the router settles: the first step from which every expert's share, averaged over `window` steps and in
    units of the fair share, stays within [`low`, `high`] in every MoE layer to the end of the run. What a heat map of
    `expert_load` shows, as figures: single steps swing more than their averages (a step routes one small batch).

    Returns {"step": the 1-based step the first such window starts at (None if the last window is still outside),
    "averaged": (least, most) of the windowed shares from there, "single": (least, most) of single steps from there}."""
    if any("expert_load" not in h for h in history):
        raise ValueError("the history has no 'expert_load' per step: pass train.run(...)['router'] of an MoE run.")
    if len(history) < window:
        raise ValueError(f"{len(history)} steps are fewer than one window of {window}; lower `window`.")
    loads = torch.tensor([h["expert_load"] for h in history], dtype=torch.float64)
    loads = loads * loads.shape[-1]  # units of the fair share: [steps, layers, experts]
    sums = torch.cat([torch.zeros_like(loads[:1]), loads.cumsum(0)])
    averaged = (sums[window:] - sums[:-window]) / window  # [j]: steps j+1 .. j+window
    inside = ((averaged >= low) & (averaged <= high)).flatten(1).all(1).tolist()
    first = len(inside)
    while first > 0 and inside[first - 1]:
        first -= 1
    if first == len(inside):
        return {"step": None, "averaged": None, "single": None}
    return {"step": first + 1, "averaged": (float(averaged[first:].min()), float(averaged[first:].max())),
            "single": (float(loads[first:].min()), float(loads[first:].max()))}


def layout_parity(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """How closely two `train.run` results of one MoE training at two layouts agree.

    Layouts differ by float rounding (~1e-7); top-k routing turns that into a different choice only at
    a near-tie, after which the runs train on slightly different paths. So the loss is compared over
    the steps whose routing (every expert's token count) was identical, and that step count is reported.
    """
    same = next((i for i, (a, b) in enumerate(zip(reference["router"], other["router"]))
                 if a["expert_load"] != b["expert_load"]), len(reference["router"]))
    diffs = [abs(a - b) for a, b in zip(reference["losses"], other["losses"])]
    return {"identical_routing_steps": same, "max_abs_diff_identical_routing": max(diffs[:same], default=0.0),
            "max_abs_diff": max(diffs)}


# ------------------------------------------------------------------------------------------------
# Dense -> MoE upcycling
# ------------------------------------------------------------------------------------------------
def upcycled_config(dense: ModelConfig, num_experts: int, topk: int = 2, **moe_fields: Any) -> ModelConfig:
    """The MoE ModelConfig of `dense` with `num_experts` copies of its MLP, `topk` of them per token.

    Args:
        moe_fields: other ModelConfig MoE fields (aux-loss coefficient, layer frequency, dispatcher).
    Raises:
        ConfigError: the dense model is MoE already, its family has no MoE counterpart, or a field would
            make the upcycled model compute something else than the dense one at step 0.
    """
    if dense.is_moe:
        raise ConfigError(f"the model is MoE already ({dense.num_experts} experts); upcycle a dense checkpoint.")
    if dense.family not in UPCYCLE_TARGETS:
        raise ConfigError(f"family {dense.family!r} has no MoE counterpart to upcycle into; supported: "
                          f"{sorted(UPCYCLE_TARGETS)} -> mixtral.")
    if topk == 1:  # Megatron-Core's own refusal came from the worker, after every check here had passed
        raise ConfigError("topk=1: Megatron-Core routes one expert per token only with the softmax taken before the "
                          "top-k (moe_router_pre_softmax), which weights that expert by its probability, about "
                          "1/num_experts at the start, so the upcycled model would not compute the dense one. Upcycle "
                          "with topk >= 2 (Mixtral's 2: the top-k weights then sum to one).")
    bad = sorted(set(moe_fields) & _CHANGE_THE_FUNCTION)
    if bad:
        raise ConfigError(f"{bad} would make the upcycled model compute something else than the dense one at "
                          f"the start (top-k weights sum to one over full-width copies of the MLP, no shared "
                          f"expert, no token dropped); leave them out (a capacity factor can be set for training).")
    return dataclasses.replace(dense, family=UPCYCLE_TARGETS[dense.family], num_experts=num_experts,
                               moe_router_topk=topk, moe_ffn_hidden_size=dense.ffn_hidden_size,
                               moe_router_pre_softmax=False, moe_router_score_function="softmax", **moe_fields)


@nodes.node0_only
def upcycle(dense_ckpt: str | Path, out: str | Path, *, num_experts: int, topk: int = 2,
            parallel: ParallelConfig | None = None, seed: int = 1234, overwrite: bool = False,
            run_dir: str | Path | None = None, **moe_fields: Any) -> dict[str, Any]:
    """Write an MoE checkpoint at `out` whose experts are copies of `dense_ckpt`'s MLPs.

    Args:
        dense_ckpt: a cookbook checkpoint of a dense model (converted or trained).
        num_experts / topk: experts per MoE layer, and experts per token.
        parallel: layout the upcycling runs at (one process by default; a large model can be split,
            with expert-TP equal to TP so expert shards line up with the dense MLP's shards).
        seed: seeds the router weights (the only new weights).
        moe_fields: further MoE fields of the new ModelConfig (see `upcycled_config`).
    Returns:
        The new ModelConfig (as a dict) and the checkpoint path.
    """
    from pai_cookbook.core.launching import launch

    dense_ckpt = checkpoint.resolve(dense_ckpt)
    dense, _ = checkpoint.read_config(dense_ckpt)
    moe = upcycled_config(dense, num_experts, topk, **moe_fields)
    parallel = parallel or ParallelConfig()
    if parallel.expert_tp != parallel.tensor_model_parallel_size:
        raise ConfigError(f"upcycling copies the dense MLP's TP shards into experts, so expert-TP must equal TP "
                          f"({parallel.tensor_model_parallel_size}), got {parallel.expert_tp}.")
    layout.check(moe, parallel, purpose="load")
    checkpoint.check_writable(out, overwrite)
    job = UpcycleJob(src=str(Path(dense_ckpt).resolve()), out=str(Path(out).resolve()), model=moe, parallel=parallel,
                     seed=seed)
    with checkpoint.worker_writes(out):
        launch.launch(job, nproc_per_node=layout.world_size(parallel),
                      run_dir=run_dir or Path(out).with_name(Path(out).name + ".logs"), echo=False, show_progress=False)
    return {"model": dataclasses.asdict(moe), "checkpoint": str(out)}


def main(argv: list[str] | None = None) -> int:
    """CLI: `python -m pai_cookbook.moe upcycle DENSE_CKPT OUT --experts N [--topk K] [--aux-loss C]`."""
    parser = argparse.ArgumentParser(prog="python -m pai_cookbook.moe", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["upcycle"])
    parser.add_argument("dense_ckpt", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--experts", type=int, required=True, help="routed experts per MoE layer")
    parser.add_argument("--topk", type=int, default=2, help="experts per token")
    parser.add_argument("--aux-loss", type=float, default=0.0, help="load-balancing loss weight for training")
    parser.add_argument("--layer-freq", type=int, default=1, help="every n-th layer becomes MoE")
    parser.add_argument("--overwrite", action="store_true")
    opts = parser.parse_args(argv)
    return cli.finish("pai_cookbook.moe", lambda: upcycle(
        opts.dense_ckpt, opts.out, num_experts=opts.experts, topk=opts.topk, overwrite=opts.overwrite,
        moe_aux_loss_coeff=opts.aux_loss, moe_layer_freq=opts.layer_freq))


if __name__ == "__main__":
    sys.exit(main())
