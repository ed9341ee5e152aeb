"""An indexed dataset (`DataConfig(source="indexed")`) as training reads it: its sidecar summary (`describe`), checked
against the files it describes (`fingerprint`), Megatron-Core's GPT datasets over it (`build_datasets`) and a step's
micro-batches (`global_batch`). The data recipe (`pai_cookbook.data`) writes such datasets and checks them before launch;
the training workers read them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pai_cookbook.core.launching import inputs

SIDECAR_SUFFIX = ".json"


class DataError(ValueError):
    """Input data that cannot be prepared or trained on; the message says where and how to fix it."""


def fingerprint(prefix: str | Path) -> dict[str, Any]:
    """What ties a sidecar to its pair: the .bin's size and a hash of the .idx's size, first and last MiB (the index
    holds every document's length and offset, ~20 bytes each: its ends differ between two preparations)."""
    index = Path(f"{prefix}.idx")
    digest = hashlib.sha256(str(index.stat().st_size).encode())
    with index.open("rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, index.stat().st_size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return {"bin_bytes": os.path.getsize(f"{prefix}.bin"), "idx_sha256": digest.hexdigest()}


def describe(prefix: str | Path) -> dict[str, Any]:
    """The sidecar summary of a prepared dataset; a clear error when the dataset is missing, empty, or its files are
    not the ones its sidecar describes (a preparation killed while publishing)."""
    prefix = Path(prefix)
    for suffix in (".bin", ".idx", SIDECAR_SUFFIX):
        if not Path(f"{prefix}{suffix}").exists():
            raise DataError(f"dataset {prefix} has no {prefix.name}{suffix}; prepare it with data.prepare(...) (a "
                            f"preparation interrupted while publishing its files leaves the dataset without one).")
    summary = inputs.read_json(f"{prefix}{SIDECAR_SUFFIX}", fix="Prepare the dataset again with data.prepare(...).",
                               error=DataError)
    recorded = {key: summary[key] for key in ("bin_bytes", "idx_sha256") if key in summary}
    if recorded and recorded != fingerprint(prefix):
        raise DataError(f"dataset {prefix}: {prefix.name}.bin/.idx are not the files its sidecar {prefix.name}"
                        f"{SIDECAR_SUFFIX} describes (a preparation was interrupted while publishing them). Prepare it "
                        f"again with data.prepare(...).")
    if summary["tokens"] == 0:
        raise DataError(f"dataset {prefix} holds no tokens; prepare it from non-empty inputs.")
    return summary


def _blend(config: Any) -> tuple[list[str], list[float] | None]:
    return [str(p) for p in config.paths], (list(config.weights) if config.weights else None)


def index_cache_dir(paths: Sequence[str | Path]) -> Path:
    """Where Megatron-Core caches the sample index for these datasets, keyed by their content.

    Megatron-Core's own cache key is the dataset config (paths, split, lengths, seed), not the data:
    a corpus prepared again under the same prefix would silently reuse the old sample index (seen
    here as 452-token "samples" of a 64-token run). Hashing the .idx files makes a new corpus a new key.
    """
    import hashlib

    digest = hashlib.sha256()
    for prefix in paths:
        digest.update(Path(f"{prefix}.idx").read_bytes())
        digest.update(str(Path(f"{prefix}.bin").stat().st_size).encode())
    return Path(paths[0]).parent / ".index_cache" / digest.hexdigest()[:16]


def build_datasets(run: Any, eval_batches: int) -> tuple[Any, Any]:
    """Megatron-Core GPT train and validation datasets for a RunConfig whose data.source is 'indexed'.

    Sizes are in samples: train_iters x global batch for training and eval_batches x global batch
    for validation; Megatron-Core's builder repeats the data in epochs as needed and mixes the blend.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    data = run.data
    tokenizer_dir = describe(data.paths[0])["tokenizer"]
    config = GPTDatasetConfig(
        random_seed=run.seed, sequence_length=data.seq_length, blend=_blend(data), split=data.split,
        tokenizer=MegatronTokenizer.from_pretrained(tokenizer_dir, metadata_path={"library": "huggingface"}),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,  # the attention is causal; no mask tensor needed
        path_to_cache=str(index_cache_dir(data.paths)), mmap_bin_files=True,
    )
    samples = [run.train_iters * data.global_batch_size, max(eval_batches, 1) * data.global_batch_size, 0]
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, samples, lambda: True, config).build()
    return train, valid


def global_batch(dataset: Any, step: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int) -> list[dict[str, Any]]:
    """This DP rank's micro-batches of global batch `step`: samples [step x GBS, (step + 1) x GBS).

    The same samples at every layout (so layouts compare), and a resumed run continues exactly where
    it stopped: the data position is the step number.
    """
    import torch

    per_rank = global_batch_size // dp_size
    first = step * global_batch_size + dp_rank * per_rank
    samples = [dataset[first + i] for i in range(per_rank)]
    stacked = {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
               for key in ("tokens", "labels", "loss_mask")}
    return [{key: value[i:i + micro_batch_size] for key, value in stacked.items()}
            for i in range(0, per_rank, micro_batch_size)]
