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
    """Parity of the checkpoint `ckpt` loaded at layout `parallel` against the HF model in `hf_dir`."""
    return check_layouts(hf_dir, ckpt, [parallel or ParallelConfig()], run_dir=run_dir, batch=batch, seq=seq)[0]


def check_layouts(hf_dir: str | Path, ckpt: str | Path, layouts: list[ParallelConfig], *,
                  run_dir: str | Path = "runs/parity", batch: int = DEFAULT_BATCH,
                  seq: int = DEFAULT_SEQ) -> list[dict[str, Any]]:
    """Parity at several layouts in one torchrun launch: Megatron-Core's parallel state is rebuilt per
    layout inside one process group, and the Hugging Face logits are computed once.

    Runs the smallest world that holds every layout (the lcm of `convert.layout_world_size`); every
    layout is validated against the model and that world before anything starts.
    """
    import json
    import math

    from pai_cookbook import launch
    from pai_cookbook.convert import layout_world_size

    model, _ = checkpoint.read_config(ckpt)
    world = math.lcm(*(layout_world_size(p) for p in layouts))
    device = runtime.detect_device()
    configs = [_config(model, p, world, batch, seq) for p in layouts]
    for config in configs:
        config.validate(world, device)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "layouts.json").write_text(json.dumps([json.loads(c.to_json()) for c in configs]))
    result = launch.launch("pai_cookbook.parity", nproc_per_node=world,
                           args=[str(run_dir / "layouts.json"), str(hf_dir), str(ckpt)],
                           run_dir=run_dir, echo=False, show_progress=False)
    return [row | {"tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size,
                   "ep": p.expert_model_parallel_size, "processes": world}
            for row, p in zip(result["rows"], layouts)]


def _config(model, parallel: ParallelConfig, world: int, batch: int, seq: int) -> RunConfig:
    dp = world // parallel.model_parallel_size
    return RunConfig(model=model, parallel=parallel,
                     data=DataConfig(seq_length=seq, micro_batch_size=batch, global_batch_size=batch * dp))


@worker.entry
def main(layouts_path: str, hf_dir: str, ckpt: str) -> dict[str, Any] | None:
    import json

    from pai_cookbook.model import build_model

    configs = [RunConfig.from_json(json.dumps(c)) for c in json.loads(Path(layouts_path).read_text())]
    tokens = token_batch(Path(ckpt) / checkpoint.HF_ASSETS, configs[0].data.micro_batch_size,
                         configs[0].data.seq_length)
    reference = hf_logits(hf_dir, tokens) if worker.rank() == 0 else None
    rows = []
    try:
        for config, device in zip(configs, runtime.each_layout((c.parallel, c.seed) for c in configs)):
            chunks = build_model(config.model, config.parallel, config.precision, device, config.seed)
            checkpoint.load(chunks, ckpt)
            for chunk in chunks:
                chunk.eval()
            logits = megatron_logits(chunks, tokens)
            if reference is not None:
                rows.append(compare_logits(reference, logits[..., :config.model.vocab_size], tokens))
        return {"rows": rows} if worker.rank() == 0 else None
    finally:
        runtime.destroy_distributed()


if __name__ == "__main__":
    main()
