"""Step time of a layout: compute from the training log's FLOP count at a calibrated MFU, plus each communication term
the layout adds, shown apart (docs/planning.md has each formula).

- compute: model FLOPs of a global batch (`core.modeling.model.training_flops_per_token`, the count `workers.run_state` logs MFU
  with; with LoRA no weight-gradient GEMMs for the frozen base) over world x datasheet peak x the GPU's calibrated MFU
  (`plan.hardware`). The MFU was measured on one GPU, so it includes no communication: every term below is added on
  top;
- moe_imbalance: with EP, every rank waits for the most loaded one, whose experts take `Workload.moe_imbalance` times
  the mean's tokens: the experts' share of the FLOPs, (imbalance - 1) times again;
- recompute: full recompute runs every layer's forward again (the forward FLOPs less the output layer's); selective
  (core attention) the attention scores' forward, 4 s q FLOPs per token and layer;
- tp: 2 collectives of s b h e bytes per layer in forward and 2 in backward (all-reduces, or all-gather +
  reduce-scatter under sequence parallelism: the same bytes), each moving 2 (t - 1)/t of them, on the critical path;
- cp: each rank's keys and values go around the CP ring (CP - 1 hops) in forward, and keys, values and their
  gradients in backward (3 passes), not overlapped with attention (an upper bound);
- ep: 2 all-to-alls of the routed tokens (T k h e bytes, (EP - 1)/EP leave the rank) per MoE layer in forward, 2 in
  backward;
- pp_bubble: (PP - 1) / (VPP x micro-batches) of a stage's step time; pp_p2p: one activation forward and one gradient
  back per micro-batch and chunk boundary;
- dp: the fp32 gradient buffer (with LoRA, the adapters') all-reduced (2 (d - 1)/d of it), or reduce-scattered and the
  weights all-gathered with the distributed optimizer, after the last micro-batch (the worker does not overlap it), over
  NVLink when the DP group stays inside a node (Megatron-Core orders ranks TP, CP, EP, DP, PP: a DP group spans TP x CP
  x DP ranks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pai_cookbook.core.configs.model_config import ModelConfig
from pai_cookbook.core.modeling.model import routed_expert_weights, training_flops_per_token
from pai_cookbook.plan import states
from pai_cookbook.plan.hardware import Cluster
from pai_cookbook.plan.layouts import Layout, Workload

TERMS = ("compute", "recompute", "moe_imbalance", "tp", "cp", "ep", "pp_bubble", "pp_p2p", "dp")


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by term."""

    compute: float
    recompute: float
    moe_imbalance: float
    tp: float
    cp: float
    ep: float
    pp_bubble: float
    pp_p2p: float
    dp: float
    tokens_per_step: int

    @property
    def total(self) -> float:
        return sum(getattr(self, term) for term in TERMS)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total

    def days(self, tokens: float) -> float:
        """Days to train on `tokens` tokens at this speed."""
        return tokens / self.tokens_per_s / 86400

    def terms(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if k in TERMS} | {"total": self.total}


def recompute_flops_per_token(model: ModelConfig, layout: Layout, seq_length: int) -> float:
    """FLOPs per token the recomputation adds (module doc)."""
    q = model.num_attention_heads * model.head_dim
    if layout.recompute == "full":
        return training_flops_per_token(model, seq_length) / 3 - 2 * model.hidden_size * model.vocab_size
    if layout.recompute == "selective":
        return 4 * model.num_layers * seq_length * q
    return 0.0


def step_time(model: ModelConfig, layout: Layout, workload: Workload, cluster: Cluster) -> StepTime:
    """The step time of `layout` on `cluster`, term by term (module doc)."""
    world, gpu = cluster.world_size, cluster.gpu
    tokens = workload.global_batch_size * workload.seq_length
    rate = world * gpu.peak_flops(workload.dtype) * gpu.mfu_for(model)  # model FLOP/s of the whole cluster
    compute = tokens * training_flops_per_token(model, workload.seq_length, workload.lora is not None) / rate
    recompute = tokens * recompute_flops_per_token(model, layout, workload.seq_length) / rate
    e = states.DTYPE_BYTES[workload.dtype]
    micro = workload.micro_batches(layout, world)
    s, b, h = workload.seq_length // layout.cp, layout.micro_batch_size, model.hidden_size
    layers = model.num_layers // layout.pp  # on one pipeline rank
    activation = s * b * h * e  # one micro-batch's hidden states on one rank
    t = layout.tp
    passes = 6 if layout.recompute == "full" else 4  # the recomputed forward repeats its two collectives
    tp = micro * layers * passes * 2 * (t - 1) / t * activation / cluster.bandwidth(t) if t > 1 else 0.0
    cp = 0.0
    if layout.cp > 1:
        kv = s * b * 2 * model.query_groups * model.head_dim // t * e
        cp = micro * layers * 3 * (layout.cp - 1) * kv / cluster.bandwidth(t * layout.cp)
    ep = imbalance = 0.0
    if model.is_moe and layout.ep > 1:
        moe_layers = sum(states.is_moe_layer(model, n) for n in range(model.num_layers)) // layout.pp
        routed = (s // t if layout.sequence_parallel else s) * b * model.moe_router_topk * h * e
        ep = (micro * moe_layers * 4 * (layout.ep - 1) / layout.ep * routed * workload.moe_imbalance
              / cluster.bandwidth(t * layout.ep))
        # every rank waits for the most loaded one: its experts' share of the FLOPs takes moe_imbalance times as long
        expert_flops = 3.0 * 2 * routed_expert_weights(model)  # per token, forward and backward (as compute counts)
        imbalance = tokens * expert_flops * (workload.moe_imbalance - 1.0) / rate
    vpp = layout.vpp or 1
    stage = compute + recompute + imbalance + tp + cp + ep
    bubble = stage * (layout.pp - 1) / (vpp * micro)
    p2p = micro * vpp * 2 * activation / cluster.bandwidth(world) if layout.pp > 1 else 0.0
    dp = 0.0
    d = layout.dp(world) * layout.cp
    if d > 1:
        params = states.states(model, layout, workload, world, 0).trainable  # LoRA: the adapters alone
        span = layout.tp * layout.cp * layout.dp(world)
        moved = (params * states.GRAD_BYTES + params * e) if layout.distributed_optimizer else 2 * params * 4
        dp = (d - 1) / d * moved / cluster.bandwidth(span)
    return StepTime(compute=compute, recompute=recompute, moe_imbalance=imbalance, tp=tp, cp=cp, ep=ep,
                    pp_bubble=bubble, pp_p2p=p2p, dp=dp, tokens_per_step=tokens)
