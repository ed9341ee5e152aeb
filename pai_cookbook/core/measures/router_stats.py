"""The router's figures of each training step of an MoE model (`RouterStats`): per MoE layer, the share of routed
tokens each expert received, the auxiliary and z-losses Megatron-Core computed, and the tokens a capacity factor
dropped. The training workers record them in every MoE run's per-step logs; `pai_cookbook.moe` reads them back
(`load_balance`, `layout_parity`).
"""

from __future__ import annotations

from typing import Any

import torch

from pai_cookbook.core.configs.config import ModelConfig, RunConfig

AUX_LOSS_NAMES = {"load_balancing_loss": "aux_loss", "seq_load_balancing_loss": "seq_aux_loss",
                  "global_load_balancing_loss": "global_aux_loss", "z_loss": "z_loss"}
"""Megatron-Core's aux-loss tracker names -> the names in the cookbook's per-step logs."""


def moe_layer_flags(model: ModelConfig) -> list[bool]:
    """Which layers are MoE, by `moe_layer_freq` (an interval, or one 0/1 flag per layer): `ModelConfig.moe_flags`."""
    return model.moe_flags


class RouterStats:
    """Per-step router figures of this rank's model chunks, reduced over all ranks by `step()`.

    A forward hook on each `TopKRouter` counts the (token, expert) assignments it made in training
    forwards (evaluation is not counted). Tokens are counted where they are routed: without sequence
    parallelism every TP rank routes the same tokens, so the world-wide sum is divided by TP.
    """

    def __init__(self, chunks: list[torch.nn.Module], config: RunConfig):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import TopKRouter

        model, parallel = config.model, config.parallel
        self.num_experts = model.num_experts
        self.moe_layers = [i for i, moe in enumerate(moe_layer_flags(model)) if moe]
        # Counted on the model's device: a hook that copied to the host would sync the GPU per layer.
        device = next(chunks[0].parameters()).device
        self.counts = torch.zeros(model.num_layers, model.num_experts, dtype=torch.float64, device=device)
        self.dropped = torch.zeros(model.num_layers, dtype=torch.float64, device=device)
        self.duplicates = 1 if parallel.sequence_parallel else parallel.tensor_model_parallel_size
        dp = ps.get_data_parallel_world_size()
        self.num_microbatches = config.data.global_batch_size // (config.data.micro_batch_size * dp)
        self.handles = [module.register_forward_hook(self._record) for chunk in chunks
                        for module in chunk.modules() if isinstance(module, TopKRouter)]

    def _record(self, router: torch.nn.Module, inputs: Any, outputs: tuple[torch.Tensor, torch.Tensor]) -> None:
        if not router.training:
            return
        probs, routing_map = outputs
        # Padding to capacity adds zero-probability fillers to the map: they are not routed tokens.
        kept = routing_map & (probs > 0)
        layer = router.layer_number - 1
        self.counts[layer] += kept.sum(0)
        self.dropped[layer] += routing_map.shape[0] * router.topk - kept.sum()

    def step(self) -> dict[str, Any]:
        """This step's figures (collective: every rank calls it); resets the counters.

        Returns:
            `expert_load`: per MoE layer, each expert's share of the routed tokens (sums to 1; the fair
            share is 1 / num_experts); `min_load` / `max_load`: the smallest and largest share over all
            layers, in units of the fair share (1.0 = perfectly balanced); `dropped_tokens`; and, for each
            aux loss Megatron-Core computed, its per-layer values and their mean (e.g. `aux_loss`).
        """
        from megatron.core.transformer.moe import moe_utils

        flat = torch.cat([self.counts.flatten(), self.dropped])
        torch.distributed.all_reduce(flat)
        flat = flat.cpu() / self.duplicates
        counts = flat[:self.counts.numel()].view_as(self.counts)[self.moe_layers]
        share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
        figures: dict[str, Any] = {
            "expert_load": share.tolist(),
            "min_load": float(share.min() * self.num_experts),
            "max_load": float(share.max() * self.num_experts),
            "dropped_tokens": float(flat[self.counts.numel():].sum()),
        }
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        moe_utils.reduce_aux_losses_tracker_across_ranks()
        for name, entry in tracker.items():
            # summed over micro-batches by Megatron-Core; the per-step value is their mean
            values = (entry["values"].float().cpu() / self.num_microbatches)[self.moe_layers]
            key = AUX_LOSS_NAMES.get(name, name)
            figures[f"{key}_per_layer"] = values.tolist()
            figures[key] = float(values.mean())
        moe_utils.clear_aux_losses_tracker()
        self.counts.zero_()
        self.dropped.zero_()
        return figures

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
