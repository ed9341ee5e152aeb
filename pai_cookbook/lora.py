"""LoRA's adapters after training: merged into their base as a full checkpoint (`merge`), or exported as a Hugging
Face PEFT adapter (`export_peft`). Training with adapters is `train.run` with `RunConfig(lora=LoRAConfig(...))`
(`core.configs.lora`, `core.modeling.lora`); its checkpoints hold the adapters alone and name their base."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pai_cookbook.convert import _write
from pai_cookbook.core.checkpoints import checkpoint, checkpoint_config, families
from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import ParallelConfig
from pai_cookbook.core.configs.lora import TARGETS, LoRAConfig
from pai_cookbook.core.configs.model_config import ConfigError
from pai_cookbook.core.launching import nodes
from pai_cookbook.core.launching.jobs import ConvertJob

__all__ = ["TARGETS", "LoRAConfig", "adapter_folder", "export_peft", "merge"]


def adapter_folder(path: str | Path) -> tuple[Path, Path]:
    """(the adapter checkpoint, its base) for an adapter checkpoint or a LoRA run's save_dir (its latest), the base
    checked to be the one the adapters were trained on.

    Raises:
        ConfigError: no adapters there, or a base that is missing or another checkpoint than it was."""
    folder = checkpoint.resolve(path)
    base = checkpoint.read_state(folder).get("lora_base")
    if base is None:
        raise ConfigError(f"{folder} holds no LoRA adapters (a full checkpoint): train with "
                          f"RunConfig(lora=LoRAConfig(...)), or use the checkpoint as it is.")
    base_dir = Path(base["path"])
    if not (base_dir / checkpoint.CONFIG_FILE).exists() or checkpoint_config.identity(base_dir) != base["identity"]:
        raise ConfigError(f"{folder}'s adapters were trained on {base_dir} (identity {base['identity']}), which is "
                          f"{'missing' if not base_dir.exists() else 'another checkpoint now'}: put that base back "
                          f"where it was.")
    return folder, base_dir


def moe_dense_mlp_adapters(folder: Path, base: Path) -> dict[str, Any] | None:
    """The dense layers (0-based) whose MLP an MoE model's adapters adapt, with the family and targets; None where
    there are none (a dense model, MoE layers only, or no MLP target: an MoE layer's experts take no adapter)."""
    run = checkpoint.saved_run(folder) or {}
    targets = [t for t in (run.get("lora") or {}).get("targets", []) if t in ("linear_fc1", "linear_fc2")]
    model, _ = checkpoint.read_config(base)
    layers = [i for i, moe in enumerate(model.moe_flags) if not moe] if model.is_moe else []
    if not targets or not layers:
        return None
    return {"family": model.family, "targets": targets, "layers": layers}


@nodes.node0_only
def merge(adapters: str | Path, out: str | Path, parallel: ParallelConfig | None = None, *, overwrite: bool = False,
          run_dir: str | Path | None = None) -> dict[str, Any]:
    """The base with the adapters folded into its weights (W + alpha / r B A), saved as a full checkpoint at
    `parallel` (default one process): what generation, conversion to Hugging Face and further training load."""
    from pai_cookbook.core.launching import launch

    folder, base = adapter_folder(adapters)
    parallel = parallel or ParallelConfig()
    model, _ = checkpoint.read_config(base)
    layout.check(model, parallel, purpose="load")
    checkpoint.check_writable(out, overwrite)
    job = ConvertJob(direction="lora_merge", src=str(folder.resolve()), dst=str(Path(out).resolve()), parallel=parallel)
    with checkpoint.worker_writes(out):
        result = launch.launch(job, nproc_per_node=job.processes(), echo=False, show_progress=False,
                               run_dir=run_dir or Path(out).with_name(Path(out).name + ".logs"))
    return {k: v for k, v in result.items() if k != "events"}


def export_peft(adapters: str | Path, out: str | Path, *, base_model: str | Path | None = None, overwrite: bool = False,
                run_dir: str | Path | None = None) -> dict[str, Any]:
    """The adapters as a Hugging Face PEFT adapter folder (adapter_model.safetensors, adapter_config.json) that
    `peft.AutoPeftModelForCausalLM.from_pretrained(out)` loads, or `peft.PeftModel.from_pretrained(<the base as a
    transformers model>, out)`; the folder appears only when complete.

    Args:
        base_model: the Hugging Face model the adapter applies to (a folder or a hub name), written as
            `base_model_name_or_path`; default the folder the base was converted from, where it still holds a
            config.json.
    Raises:
        ConfigError: no base_model given and none found: a base trained by the cookbook, or its source gone. Export it
            (`convert.megatron_to_hf(base, folder)`) and pass that folder. Adapters on the dense MLPs of an MoE
            model (`moe_dense_mlp_adapters`): refused, naming the layers and the ways through.
    """
    folder, base = adapter_folder(adapters)
    dense = moe_dense_mlp_adapters(folder, base)
    if dense:
        raise ConfigError(
            f"{folder} adapts the MLP ({', '.join(dense['targets'])}) of the dense layers {dense['layers']} of an MoE "
            f"model ({dense['family']}): a PEFT adapter names its modules by their last names (gate_proj, up_proj, "
            f"down_proj), which in an MoE model name the routed experts too, and PEFT on transformers 5 reads them as "
            f"the experts' fused weights, so those layers would load unadapted (the exported model would not be the "
            f"one trained). Merge instead (lora.merge, then convert.megatron_to_hf: a full model that computes what "
            f"was trained), or train with targets=['linear_qkv', 'linear_proj'] to export an adapter.")
    source = checkpoint_config.description(base).get("source")
    if base_model is None and source and (Path(source) / "config.json").exists():
        source_type = json.loads((Path(source) / "config.json").read_text()).get("model_type")
        if source_type in families.MULTIMODAL:
            raise ConfigError(f"the adapters' base came from {source}, a multimodal {source_type} whose language model "
                              f"alone was converted: an adapter on it would name modules that model does not have (its "
                              f"language model's sit under another prefix, beside a vision tower's of the same names). "
                              f"Export the base (convert.megatron_to_hf({str(base)!r}, folder): the text model) and pass "
                              f"base_model=folder.")
        base_model = source
    if base_model is None:
        raise ConfigError(f"the adapters' base {base} names no Hugging Face folder it came from that still exists "
                          f"(source: {source}), so the adapter could not say what it applies to; export the base "
                          f"(convert.megatron_to_hf({str(base)!r}, folder)) and pass base_model=folder, or a hub name.")
    job = ConvertJob(direction="lora_peft", src=str(folder.resolve()), dst="")

    def name_the_base(partial: Path) -> None:
        path = partial / "adapter_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"base_model_name_or_path": str(base_model)},
                                   indent=2))
    return _write(job, Path(out), overwrite, run_dir, None, finish=name_the_base)
