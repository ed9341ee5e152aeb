"""Does the Megatron-Core model compute what the Hugging Face model computes? Measured, not printed.

`check(hf_dir, ckpt, parallel)` loads the converted checkpoint at a TP/PP/EP layout in torchrun workers
(with Megatron-Core's own `dist_checkpointing.load`), runs a fixed batch of real text through it, and
compares fp32 logits with `AutoModelForCausalLM` on the same batch: cosine similarity, max and mean
absolute difference, argmax agreement, and each side's next-token loss on the batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pai_cookbook import checkpoint, runtime, worker
from pai_cookbook.config import DataConfig, ParallelConfig, RunConfig
from pai_cookbook.tiny_models import TOKENIZER_CORPUS

DEFAULT_BATCH, DEFAULT_SEQ = 2, 32


def token_batch(tokenizer_dir: str | Path, batch: int = DEFAULT_BATCH, seq: int = DEFAULT_SEQ) -> torch.Tensor:
    """`batch` windows of `seq` tokens of the cookbook's corpus, tokenized by the model's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer(TOKENIZER_CORPUS.read_text(), add_special_tokens=False).input_ids
    if len(ids) < batch * seq:
        raise ValueError(f"the corpus gives {len(ids)} tokens, fewer than batch x seq = {batch * seq}")
    return torch.tensor(ids[:batch * seq]).view(batch, seq)




def megatron_logits(chunks: list[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [batch, seq, padded vocab] on global rank 0 (None elsewhere), any layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    device = next(chunks[0].parameters()).device
    tokens = tokens.to(device)
    positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)

    def forward_step(data_iterator, model):
        output = model(next(data_iterator), positions, attention_mask=None)

        def collect(output_tensor, non_loss_data=False):
            return gather_from_tensor_model_parallel_region(output_tensor).float().cpu()
        return output, collect

    with torch.no_grad():
        collected = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter([tokens]) for _ in chunks] if len(chunks) > 1
            else iter([tokens]), model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=1,
            seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True,
            collect_non_loss_data=True)
    mine = collected[0] if (collected and ps.get_tensor_model_parallel_rank() == 0
                            and ps.get_data_parallel_rank() == 0) else None
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)  # the last stage's logits reach rank 0
    found = next(x for x in gathered if x is not None)
    return found if torch.distributed.get_rank() == 0 else None


def _next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                   tokens[:, 1:].reshape(-1)))


def compare_logits(hf: torch.Tensor, mcore: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
    """Parity figures of two [batch, seq, vocab] fp32 logit tensors over the same tokens."""
    a, b = hf.double().flatten(), mcore.double().flatten()
    diff = (hf - mcore).abs()
    return {
        "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "argmax_agreement": float((hf.argmax(-1) == mcore.argmax(-1)).double().mean()),
        "hf_loss": _next_token_loss(hf, tokens),
        "megatron_loss": _next_token_loss(mcore, tokens),
        # the first sample alone: the seed project's "single-sample forward loss"
        "hf_sample_loss": _next_token_loss(hf[:1], tokens[:1]),
        "megatron_sample_loss": _next_token_loss(mcore[:1], tokens[:1]),
    }


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits.float()


def check(hf_dir: str | Path, ckpt: str | Path, parallel: ParallelConfig | None = None, *,
          run_dir: str | Path = "runs/parity", batch: int = DEFAULT_BATCH, seq: int = DEFAULT_SEQ) -> dict[str, Any]:
    """Parity of the checkpoint `ckpt` loaded at layout `parallel` against the HF model in `hf_dir`.

    Runs the smallest number of processes that holds the layout (`convert.layout_world_size`).
    """
    from pai_cookbook import launch
    from pai_cookbook.convert import layout_world_size

    parallel = parallel or ParallelConfig()
    model, _ = checkpoint.read_config(ckpt)
    ep = parallel.expert_model_parallel_size
    world = layout_world_size(parallel)
    config = RunConfig(model=model, parallel=parallel,
                       data=DataConfig(seq_length=seq, micro_batch_size=batch,
                                       global_batch_size=batch * world // parallel.model_parallel_size))
    result = launch.launch("pai_cookbook.parity", config, nproc_per_node=world, args=[str(hf_dir), str(ckpt)],
                           run_dir=run_dir, echo=False, show_progress=False)
    result.pop("events")
    return result | {"tp": parallel.tensor_model_parallel_size, "pp": parallel.pipeline_model_parallel_size,
                     "ep": ep, "processes": world}


@worker.entry
def main(config_path: str, hf_dir: str, ckpt: str) -> dict[str, Any] | None:
    from pai_cookbook.model import build_model

    config = RunConfig.load(config_path)
    device = runtime.init_distributed(config.parallel, config.seed)
    try:
        chunks = build_model(config.model, config.parallel, config.precision, device, config.seed)
        checkpoint.load(chunks, ckpt)
        for chunk in chunks:
            chunk.eval()
        tokens = token_batch(Path(ckpt) / checkpoint.HF_ASSETS, config.data.micro_batch_size, config.data.seq_length)
        logits = megatron_logits(chunks, tokens)
        if logits is None:
            return None
        return compare_logits(hf_logits(hf_dir, tokens), logits[..., :config.model.vocab_size], tokens)
    finally:
        runtime.destroy_distributed()


if __name__ == "__main__":
    main()
