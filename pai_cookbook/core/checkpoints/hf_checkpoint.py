"""A Hugging Face model folder read without its weights: config.json and the safetensors headers, checked against
each other (`inspect_hf`), before any conversion starts and again in the conversion worker.

The folder's tensors are named with the shard that holds each, its shape and its safetensors dtype (`HFCheckpoint`);
a truncated shard, a damaged header, a missing or unexpected tensor and a shape that config.json does not imply are
refused here, naming the file and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import families, hf_shapes, mxfp4
from pai_cookbook.core.configs.model_config import ConfigError, ModelConfig
from pai_cookbook.core.launching import inputs

IGNORED_HF_TENSORS = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved; recomputed on load
FP32_HF_TENSORS = ("e_score_correction_bias",)  # fp32 in a checkpoint of any dtype (transformers keeps them so)
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass
class HFCheckpoint:
    folder: Path
    model: ModelConfig
    tensors: dict[str, tuple[str, tuple[int, ...], str]]
    """name -> (shard file, shape, safetensors dtype)."""
    stored: dict[str, str] = dataclasses.field(default_factory=dict)
    """name -> the name the shard stores it under, where that differs (a multimodal model's language model)."""
    left_out: int = 0
    """Tensors of the folder the conversion leaves in the source (a multimodal model's vision tower and projector)."""

    @property
    def dtype(self) -> torch.dtype:
        names = {dtype for name, (_, _, dtype) in self.tensors.items()
                 if not (name.endswith(FP32_HF_TENSORS) and dtype == "F32") and not name.endswith(mxfp4.SUFFIXES)}
        if len(names) != 1 or next(iter(names)) not in _DTYPES:
            raise ConfigError(f"{self.folder}: tensors must share one dtype of {sorted(_DTYPES)}, found {sorted(names)}.")
        return _DTYPES[names.pop()]

    @property
    def largest_shard_bytes(self) -> int:
        return max((self.folder / f).stat().st_size for f in {f for f, _, _ in self.tensors.values()})


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file, after checking the file holds all the data it declares."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConfigError(f"{path} is truncated ({size} bytes): not even a safetensors header.")
        (header_len,) = struct.unpack("<Q", raw)
        if 8 + header_len > size:
            raise ConfigError(f"{path} is truncated: header of {header_len} bytes, file of {size}.")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path} has a damaged safetensors header ({err}); the file is corrupt. Download it "
                              f"again.") from None
        if not isinstance(header, dict) or not all(isinstance(v, dict) and "data_offsets" in v
                                                   for k, v in header.items() if k != "__metadata__"):
            raise ConfigError(f"{path} has a safetensors header without tensor entries; the file is corrupt. "
                              f"Download it again.")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise ConfigError(f"{path} is truncated: its tensors need {8 + header_len + end} bytes, the file has "
                          f"{size}. Download it again.")
    return header


def _mtp_tensors(tensors: dict[str, Any], num_layers: int) -> set[str]:
    """Multi-token-prediction tensors: the layers after the model's last (`model.layers.<n >= num_layers>.*`),
    DeepSeek-V3's and GLM-4.5's modules (eh_proj, enorm, hnorm, a decoder layer, shared_head), and Qwen3-Next's, stored
    apart under `mtp.`."""
    return {k for k in tensors if k.startswith("mtp.") or (k.startswith("model.layers.") and k.split(".")[2].isdigit()
                                                           and int(k.split(".")[2]) >= num_layers)}


def _language_model(tensors: dict[str, tuple[str, tuple[int, ...], str]], model: ModelConfig
                    ) -> tuple[dict[str, tuple[str, tuple[int, ...], str]], dict[str, str], int]:
    """A multimodal model's language model (`families.MULTIMODAL`, whose family `model` is): its tensors under the names
    of the text model (`model.` in place of the language model's prefix, `lm_head.` in place of
    `language_model.lm_head.`), the names they are stored under, and how many vision tensors are left out. Any other
    model's tensors unchanged."""
    if model.family not in families.MULTIMODAL.values():
        return tensors, {}, 0
    prefixes = [(p, "model.") for p in families.LANGUAGE_MODEL_PREFIXES] + [("language_model.lm_head.", "lm_head.")]
    renamed, stored, left_out = {}, {}, 0
    for key, meta in tensors.items():
        if key.startswith(families.VISION_PREFIXES):
            left_out += 1
            continue
        prefix = next(((p, to) for p, to in prefixes if key.startswith(p)), None)
        name = key if prefix is None else prefix[1] + key[len(prefix[0]):]
        renamed[name] = meta
        if name != key:
            stored[name] = key
    return renamed, stored, left_out


def _mxfp4_tensors(tensors: dict[str, tuple[str, tuple[int, ...], str]], expected: dict[str, tuple[int, ...]],
                   folder: Path) -> set[str]:
    """The expected tensors stored in MXFP4 (`core.checkpoints.mxfp4`: `name_blocks` and `name_scales` in place of
    `name`, GPT-OSS's released experts), their shapes checked: transformers' [experts, in, out] is stored as
    [experts, out, in / 32, 16] and [experts, out, in / 32]."""
    quantized = set()
    for name, shape in expected.items():
        if name in tensors or name + "_blocks" not in tensors:
            continue
        experts, size_in, size_out = shape
        want = {name + "_blocks": (experts, size_out, size_in // mxfp4.BLOCK, mxfp4.BLOCK // 2),
                name + "_scales": (experts, size_out, size_in // mxfp4.BLOCK)}
        for key, key_shape in want.items():
            found = tensors.get(key)
            if found is None or found[1] != key_shape or found[2] != "U8":
                raise ConfigError(f"{folder}: {name} is stored in MXFP4, which needs {key} of shape {list(key_shape)} "
                                  f"in U8; found {None if found is None else (list(found[1]), found[2])}. The "
                                  f"checkpoint is damaged or does not belong to this config.json.")
        quantized.add(name)
    return quantized


def inspect_hf(folder: str | Path, model: ModelConfig | None = None, *, drop_mtp: bool = False) -> HFCheckpoint:
    """Read config and safetensors headers (no weights) and check them against each other.

    `model`: the folder's config as an earlier inspection read it (the conversion worker gets it with its job, and
    so does not import transformers to read config.json again: ~1.5 s of its start).

    `drop_mtp`: leave out the multi-token-prediction layers some checkpoints carry after the last layer (refused by
    name otherwise).

    Raises:
        ConfigError: unsupported architecture, truncated shard, missing/unexpected tensor, shape mismatch,
            multi-token-prediction layers without `drop_mtp`.
        FileNotFoundError: no config.json, no safetensors, or a shard the index lists is absent.
    """
    folder = Path(folder)
    model = model or families.from_hf(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = inputs.read_json(index, fix="Download the model's index file again.").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index} has no \"weight_map\" of tensor names to shard files; it is damaged or not a "
                              f"safetensors index. Download it again.")
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in folder.glob("*.bin")) or "nothing"
        raise FileNotFoundError(f"{folder} has no model.safetensors(.index.json) (found {found}). The cookbook "
                                f"reads safetensors only (pickle .bin files can run code); re-save the model "
                                f"with save_pretrained(folder, safe_serialization=True).")
    tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for name in files:
        path = folder / name
        if not path.exists():
            raise FileNotFoundError(f"shard {name} listed in {index.name} is missing from {folder}.")
        for key, meta in read_safetensors_header(path).items():
            if key != "__metadata__":
                tensors[key] = (name, tuple(meta["shape"]), meta["dtype"])
    tensors, stored, left_out = _language_model(tensors, model)
    expected = hf_shapes.expected_hf_shapes(model)
    quantized = _mxfp4_tensors(tensors, expected, folder)
    missing = sorted(set(expected) - set(tensors) - set(quantized))
    if missing:
        raise ConfigError(f"{folder}: {len(missing)} tensor(s) that config.json implies are missing, e.g. "
                          f"{missing[:3]}; the weights do not belong to this config.")
    mtp = _mtp_tensors(tensors, model.num_layers)
    if mtp and not drop_mtp:
        layers = sorted({int(k.split(".")[2]) for k in mtp if not k.startswith("mtp.")})
        parts = ", ".join(sorted({k.split(".", 3)[3].split(".")[0] if layers else k.split(".")[1] for k in mtp}))
        where = (f"{len(layers)} multi-token-prediction layer(s) after the model's {model.num_layers} "
                 f"(model.layers.{layers[0]}.*: {parts})" if layers else f"its multi-token-prediction module (mtp.*: "
                                                                         f"{parts})")
        raise ConfigError(f"{folder}: {len(mtp)} tensors of {where}. The cookbook "
                          f"converts the model without them or not at all (transformers does not load them either): "
                          f"pass drop_mtp=True to convert the model alone; the source keeps them.")
    mxfp4_stored = {name + suffix for name in quantized for suffix in mxfp4.SUFFIXES}
    unexpected = sorted(k for k in set(tensors) - set(expected) - mtp - mxfp4_stored
                        if not k.endswith(IGNORED_HF_TENSORS))
    if unexpected:
        raise ConfigError(f"{folder}: tensor(s) the cookbook's {model.family} mapping does not know, e.g. "
                          f"{unexpected[:3]}; the checkpoint has a feature the converter does not cover.")
    for key, shape in expected.items():
        if key not in quantized and tensors[key][1] != shape:
            raise ConfigError(f"{folder}: tensor {key} has shape {list(tensors[key][1])}, but config.json "
                              f"implies {list(shape)}; config and weights disagree.")
    checked = HFCheckpoint(folder, model, {k: tensors[k] for k in expected if k not in quantized}
                           | {k: tensors[k] for k in mxfp4_stored}, stored=stored, left_out=left_out)
    _ = checked.dtype  # one dtype for all tensors, or a ConfigError now rather than in the worker
    return checked
