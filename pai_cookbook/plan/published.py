"""NVIDIA's published H100 pre-training layouts, each with its source: what the planner must say fits (tests/test_plan_gpu.py)
and what notebook 09 shows beside its own plan. They run on 80 GB H100s, so each bounds the overhead the plan assumes:
what the rest of the model predicts leaves at most that much for the CUDA context, NCCL and fragmentation."""

from __future__ import annotations

from dataclasses import dataclass

from pai_cookbook.plan.layouts import Layout, Workload


@dataclass(frozen=True)
class Published:
    name: str
    shape: str
    """A name of `plan.shapes.SHAPES`."""
    world: int
    layout: Layout
    workload: Workload
    source: str


LAYOUTS = (
    Published("NeMo llama3_8b", "Llama-3-8B", 8, Layout(cp=2, distributed_optimizer=True),
              Workload(seq_length=8192, global_batch_size=512),
              "NVIDIA/NeMo nemo/collections/llm/recipes/llama3_8b.py: TP1 PP1 CP2 on 1 node x 8, seq 8192, micro-batch 1, "
              "global 512, distributed Adam, gradients reduced in fp32"),
    Published("NeMo llama3_70b", "Llama-3-70B", 32,
              Layout(tp=4, pp=4, vpp=5, cp=2, sequence_parallel=True, distributed_optimizer=True),
              Workload(seq_length=8192, global_batch_size=512),
              "NVIDIA/NeMo nemo/collections/llm/recipes/llama3_70b.py: TP4 PP4 VPP5 CP2 SP on 4 nodes x 8, seq 8192, "
              "micro-batch 1, global 512, distributed Adam, gradients reduced in fp32"),
    Published("Megatron-LM Mixtral 8x7B", "Mixtral-8x7B", 32, Layout(pp=4, ep=8, distributed_optimizer=True),
              Workload(seq_length=4096, global_batch_size=256),
              "NVIDIA/Megatron-LM examples/mixtral/README.md: 'for training, the recommended model parallel config is "
              "TP1EP8PP4' (the sequence, batch and node count are the plan's: the README gives the layout alone)"),
)
