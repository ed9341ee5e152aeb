"""The clusters a plan is made for: a small table of GPUs (memory, datasheet peak, links, calibrated MFU) and `Cluster`.

MFU is calibrated per GPU type and GEMM size on the cookbook's own measured runs, never fitted per layout:
- H100 80GB HBM3 (2026-11-26, main at c735405, docs/planning.md), two widths: the Llama-3.2-1B shape (16 x 2048, 32/8
  heads, ffn 8192, vocab 128,256, tied), bf16, seq 2048, micro-batch 4, one GPU, 44,300 tokens/s x 8.22e9 model
  FLOPs/token = 364 TFLOP/s = 0.368 of the datasheet's 989; a ~0.5B Llama (24 x 1024, ffn 2816, 16/4 heads, vocab
  256), the same run settings, 80,600 tokens/s x 2.23e9 = 180 TFLOP/s = 0.182. Between them the MFU is interpolated
  in log2 of the hidden size; beyond them the nearest measured one holds (wider GEMMs usually reach more: the plan is
  conservative there).
- Other GPUs: no cookbook run yet; they borrow the H100's fractions of the datasheet peak (`mfu_source` says so).

Link bandwidths are datasheet figures per GPU and direction; `LINK_EFFICIENCY` of them is what a ring collective is
assumed to reach (an assumption, not a measurement of this project).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pai_cookbook.core.configs.model_config import ConfigError, require
from pai_cookbook.core.measures import throughput

GIB = 2**30
LINK_EFFICIENCY = 0.7
"""Fraction of a link's datasheet bandwidth a ring all-reduce / reduce-scatter is assumed to reach."""
H100_MEASURED_TFLOPS = 364.0
"""Model TFLOP/s of the cookbook's Llama-3.2-1B-shape bf16 run on one H100 80GB HBM3 (2026-11-26)."""
H100_MFU = H100_MEASURED_TFLOPS / throughput.DATASHEET_DENSE_TFLOPS["H100"]["bf16"]
H100_MFU_BY_WIDTH = ((1024, 179.6 / throughput.DATASHEET_DENSE_TFLOPS["H100"]["bf16"]), (2048, H100_MFU))
"""(hidden size, MFU) of the H100's measured runs (module doc)."""


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One GPU type: what a plan needs to know of it."""

    name: str
    datasheet_name: str
    """Key into `core.measures.throughput.DATASHEET_DENSE_TFLOPS` (as torch names the device)."""
    memory_gib: float
    """Memory a process can allocate (the marketing GB less what the driver keeps)."""
    nvlink_gbps: float
    """Intra-node GPU-to-GPU bandwidth per GPU and direction, GB/s (NVLink; PCIe where there is none)."""
    network_gbps: float
    """Inter-node bandwidth per GPU and direction, GB/s (one 400 Gb/s NIC per GPU = 50)."""
    mfu: float = H100_MFU
    mfu_source: str = "borrowed from the H100's measured fractions of its datasheet peak (0.368 at width 2048)"
    bf16: bool = True
    """Tensor cores that compute in bf16 (Ampere, sm80, and later)."""
    transformer_engine: bool = True
    """Transformer Engine's fused attention and FlashAttention-2 run on it (sm80 and later)."""
    limits: str = ""
    """What it cannot do, said plainly."""

    def mfu_for(self, model) -> float:
        """The MFU `model` is planned at on this GPU: the H100's measured points by hidden size (module doc), scaled
        to this GPU's own fraction where it has one, interpolated in log2 of the width, the nearest point outside."""
        points = [(width, mfu * self.mfu / H100_MFU) for width, mfu in H100_MFU_BY_WIDTH]
        width = model.hidden_size
        if width <= points[0][0]:
            return points[0][1]
        for (w0, m0), (w1, m1) in zip(points, points[1:]):
            if width <= w1:
                share = (math.log2(width) - math.log2(w0)) / (math.log2(w1) - math.log2(w0))
                return m0 + share * (m1 - m0)
        return points[-1][1]

    def peak_flops(self, dtype: str) -> float:
        """Datasheet dense FLOP/s for GEMMs in `dtype` ("bf16", "fp32", ...)."""
        peak = throughput.datasheet_peak_flops(self.datasheet_name, dtype)
        require(peak is not None, f"no datasheet peak for {self.name} in {dtype}; the table knows "
                                  f"{sorted(throughput.DATASHEET_DENSE_TFLOPS)}.")
        return peak


GPUS: dict[str, GPU] = {gpu.name: gpu for gpu in (
    GPU(name="H100-80GB", datasheet_name="NVIDIA H100 80GB HBM3", memory_gib=79.1, nvlink_gbps=450, network_gbps=50,
        mfu=H100_MFU, mfu_source="measured at widths 1024 and 2048: 0.182 and 0.368 (2026-11-26)"),
    GPU(name="H800-80GB", datasheet_name="NVIDIA H800", memory_gib=79.1, nvlink_gbps=200, network_gbps=50),
    GPU(name="H200-141GB", datasheet_name="NVIDIA H200", memory_gib=139.8, nvlink_gbps=450, network_gbps=50),
    GPU(name="H20-96GB", datasheet_name="NVIDIA H20", memory_gib=95.0, nvlink_gbps=450, network_gbps=50),
    GPU(name="A100-80GB", datasheet_name="NVIDIA A100-SXM4-80GB", memory_gib=79.1, nvlink_gbps=300, network_gbps=25),
    GPU(name="A100-40GB", datasheet_name="NVIDIA A100-SXM4-40GB", memory_gib=39.4, nvlink_gbps=300, network_gbps=25),
    GPU(name="L40S-48GB", datasheet_name="NVIDIA L40S", memory_gib=44.4, nvlink_gbps=32, network_gbps=25),
    GPU(name="B200-180GB", datasheet_name="NVIDIA B200", memory_gib=178.0, nvlink_gbps=900, network_gbps=50),
    # What PAI-DSW rents beside the H-class: PCIe cards without NVLink (PCIe 4.0 x16: 32 GB/s per direction, 3.0: 16),
    # and two generations before bf16.
    GPU(name="A10-24GB", datasheet_name="NVIDIA A10", memory_gib=22.0, nvlink_gbps=32, network_gbps=12.5,
        limits="no NVLink: tensor and pipeline parallel traffic crosses PCIe"),
    GPU(name="L20-48GB", datasheet_name="NVIDIA L20", memory_gib=44.4, nvlink_gbps=32, network_gbps=12.5,
        limits="no NVLink: tensor and pipeline parallel traffic crosses PCIe"),
    GPU(name="V100-32GB", datasheet_name="Tesla V100-SXM2-32GB", memory_gib=31.5, nvlink_gbps=150, network_gbps=12.5,
        bf16=False, transformer_engine=False,
        limits="no bf16 (fp32 here; fp16 with loss scaling is not a cookbook precision); no FlashAttention-2 or "
               "Transformer Engine fused attention (sm70): the local spec, PyTorch's memory-efficient attention"),
    GPU(name="T4-16GB", datasheet_name="Tesla T4", memory_gib=14.5, nvlink_gbps=16, network_gbps=12.5, bf16=False,
        transformer_engine=False,
        limits="no bf16 (fp32 here; fp16 with loss scaling is not a cookbook precision); no FlashAttention-2 or "
               "Transformer Engine fused attention (sm75): the local spec, PyTorch's memory-efficient attention; "
               "PCIe 3.0, no NVLink"),
)}


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Nodes of identical GPUs."""

    gpu: GPU
    gpus_per_node: int = 8
    nodes: int = 1

    def __post_init__(self) -> None:
        require(self.gpus_per_node >= 1 and self.nodes >= 1,
                f"a cluster needs >= 1 GPU per node and >= 1 node, got {self.gpus_per_node} x {self.nodes}.")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def bandwidth(self, group_span: int) -> float:
        """Bytes/s a collective over `group_span` consecutive ranks reaches: NVLink within a node, the network
        beyond it (LINK_EFFICIENCY of the datasheet figure)."""
        gbps = self.gpu.nvlink_gbps if group_span <= self.gpus_per_node else self.gpu.network_gbps
        return gbps * 1e9 * LINK_EFFICIENCY


def gpu(name: str) -> GPU:
    """The GPU of the table named `name` (case-insensitive)."""
    for key, value in GPUS.items():
        if key.lower() == name.lower():
            return value
    raise ConfigError(f"unknown GPU {name!r}; the table has {sorted(GPUS)}.")
