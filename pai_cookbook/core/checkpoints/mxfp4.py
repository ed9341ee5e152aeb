"""MXFP4, the format GPT-OSS's released experts are stored in, read on conversion (and written, for tests' checkpoints).

A tensor [..., out, in] is stored as `name_blocks` [..., out, in / 32, 16] (uint8, two 4-bit values a byte, the low
nibble first) and `name_scales` [..., out, in / 32] (uint8): each block of 32 values along the input axis is 16 bytes
of FP4 codes (E2M1: a sign bit and one of 0, 0.5, 1, 1.5, 2, 3, 4, 6) times 2 ** (scale - 127). Every value is exact
in bf16 and fp32 (at most two mantissa bits), so dequantizing then casting loses nothing. The transformers layout of
the experts is the transpose ([experts, in, out]); `core.checkpoints.hf_checkpoint` accepts either form.
"""

from __future__ import annotations

import torch

BLOCK = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., out, in] values of `blocks` [..., out, in / 32, 16] and `scales` [..., out, in / 32], in `dtype`."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # the low nibble is the earlier value
    values = table[codes].reshape(*blocks.shape[:-1], BLOCK)
    values = torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS)[..., None])
    return values.reshape(*blocks.shape[:-2], -1).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of `weight` [..., out, in] (in a multiple of 32): each block's scale the smallest power of two
    that brings its largest magnitude to 6 or below, each value the nearest FP4 code (ties to the smaller magnitude)."""
    grouped = weight.float().reshape(*weight.shape[:-1], -1, BLOCK)
    largest = grouped.abs().amax(dim=-1).clamp(min=2.0 ** -SCALE_BIAS)
    exponent = torch.ceil(torch.log2(largest / 6.0)).clamp(-SCALE_BIAS, 255 - SCALE_BIAS)
    scaled = grouped / torch.pow(2.0, exponent)[..., None]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1) + 8 * (scaled < 0)
    pairs = codes.reshape(*codes.shape[:-1], BLOCK // 2, 2).to(torch.uint8)
    return pairs[..., 0] | (pairs[..., 1] << 4), (exponent + SCALE_BIAS).to(torch.uint8)
