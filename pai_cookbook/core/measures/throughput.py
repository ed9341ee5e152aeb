"""How fast a run goes against what the hardware can do: the datasheet's dense peak of known GPUs, model FLOPs
utilisation, and a measured matmul peak (for machines the datasheet table lacks, and the CPU)."""

from __future__ import annotations

import time

import torch

DATASHEET_DENSE_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA's datasheet figures without sparsity, TFLOP/s per GPU. Keys are matched against
    # `torch.cuda.get_device_name()` (e.g. "NVIDIA H100 80GB HBM3"), the more specific first.
    "H100 PCIe": {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100 NVL": {"fp8": 1671.0, "bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100": {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "fp32": 67.0},  # SXM
    "H800 PCIe": {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H800": {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "fp32": 67.0},  # SXM
    "H200 NVL": {"fp8": 1671.0, "bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H200": {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "fp32": 67.0},  # SXM
    "H20": {"fp8": 296.0, "bf16": 148.0, "fp16": 148.0, "fp32": 44.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},  # after A100/A800, whose names contain "A10"
    "L20": {"fp8": 239.0, "bf16": 119.5, "fp16": 119.5, "fp32": 59.8},
    "V100": {"fp16": 125.0, "fp32": 15.7},  # SXM2; no bf16
    "T4": {"fp16": 65.0, "fp32": 8.1},  # no bf16
    "L40S": {"fp8": 733.0, "bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "B200": {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0},
}
"""Dense peak TFLOP/s by GPU and the precision of a run's GEMMs (fp8 where Transformer Engine runs them in FP8)."""


def datasheet_peak_flops(device_name: str, precision: str) -> float | None:
    """The datasheet's dense peak FLOP/s of one GPU named `device_name` (as torch names it) for `precision`
    ("fp8", "bf16", "fp16", "fp32"), or None for a GPU (or a CPU) the table does not know: MFU as the field reports
    it divides model FLOP/s by this figure."""
    name = device_name.upper()
    for gpu, peaks in DATASHEET_DENSE_TFLOPS.items():
        if gpu.upper() in name:
            tflops = peaks.get(precision)
            return None if tflops is None else tflops * 1e12
    return None


def model_flops_utilization(tokens_per_s: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Model FLOP/s (`tokens_per_s` x `flops_per_token`) over `peak_flops` (None where that peak is unknown)."""
    return None if not peak_flops else tokens_per_s * flops_per_token / peak_flops


PEAK_MATMUL_SIZE = 8192
"""Largest square matmul the measured peak uses: big enough to saturate a GPU (an H100 reaches about twice at 8192
what it reaches at 2048: docs/installing.md). On a CPU the doubling stops far earlier, on time."""
PEAK_MIN_SIZE = 256
PEAK_MEASURE_S = 0.5


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32,
                        seconds: float = PEAK_MEASURE_S) -> float:
    """Dense matmul FLOP/s this process reaches (its device and threads): the best rate of square matmuls whose size
    doubles from 256 until one takes a tenth of `seconds` (or reaches `PEAK_MATMUL_SIZE`), each size timed for a
    quarter of `seconds`.

    Reported beside MFU under its own name (`mfu_of_measured_peak`): the fraction of the best this hardware's own
    matmuls reach, the only peak a CPU has (there is no datasheet figure for it). The best size, not the largest: a
    CPU's rate can fall once the matrices outgrow its caches (docs/megatron-core-on-cpu.md), a GPU's rises up to the
    largest. The doubling stops on time because on a CPU without bf16 kernels one large bf16 matmul takes about a
    minute, which a fixed size spent before every bf16 run.
    """
    def timed(a, b) -> float:
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    best, size = 0.0, PEAK_MIN_SIZE
    while True:
        a = torch.randn(size, size, dtype=dtype, device=device)
        b = torch.randn_like(a)
        timed(a, b)  # warm-up
        one = timed(a, b)
        runs, start = 0, time.perf_counter()
        while runs == 0 or time.perf_counter() - start < seconds / 4:
            timed(a, b)
            runs += 1
        best = max(best, runs * 2 * size ** 3 / (time.perf_counter() - start))
        if size >= PEAK_MATMUL_SIZE or one > seconds / 10:
            return best
        size *= 2
