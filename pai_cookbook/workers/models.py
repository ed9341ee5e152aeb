"""The model a worker builds: `core.modeling.model.build_model` with the CPU converters where the one decision of what runs
here puts them (`DeviceInfo.cpu_converters`, `core.machine.build.choose_layers`).

The engine never imports the CPU package; the workers hand it in, so a GPU (or `PAI_COOKBOOK_LAYERS=local`) never
loads it.
"""

from __future__ import annotations

import torch

from pai_cookbook.core.configs.config import MemoryConfig, ModelConfig, ParallelConfig, PrecisionConfig
from pai_cookbook.core.machine.runtime import DeviceInfo
from pai_cookbook.core.modeling import model as core_model
from pai_cookbook.core.modeling.layer_spec import Converters


def converters(device: DeviceInfo) -> Converters | None:
    """`pai_cookbook.cpu` on the CPU path, None on every other."""
    if not device.cpu_converters:
        return None
    from pai_cookbook import cpu

    return cpu


def build_model(model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig, device: DeviceInfo,
                seed: int, memory: MemoryConfig | None = None, head: str = "lm",
                initialize: bool = True) -> list[torch.nn.Module]:
    """`core.modeling.model.build_model` with the same arguments, and `converters(device)`."""
    return core_model.build_model(model, parallel, precision, device, seed, memory, head, initialize,
                                  converters=converters(device))
