"""Text generation from a Megatron-Core checkpoint (the Hugging Face baseline is `hf_baseline`).

    config = GenerationConfig(max_new_tokens=64, top_k=0, top_p=0.9, temperature=0.8)
    rows = generate.generate("ckpt/iter_0000200", ["The capital of France is"], config)["records"]
    generate.generate_file("ckpt", "prompts.jsonl", "completions.jsonl", config,
                           parallel=ParallelConfig(tensor_model_parallel_size=2))

CLI: `python -m pai_cookbook.generate CKPT --input prompts.jsonl --output out.jsonl --tp 2 --top-p 0.9`.

The checkpoint path is all it needs: a cookbook checkpoint (converted, or written by training) carries
its model config (`pai_cookbook.json`) and tokenizer (`hf_assets/`); a training `save_dir` resolves
to its latest finished `iter_*`. The seed script's other knobs are derived, not asked for: vocabulary
padding and extra vocabulary come from the checkpoint's config, the padding length from the batch.
Everything checkable (sampling values, empty or malformed input, a prompt that does not fit the
context, a missing tokenizer) is checked here, before any worker starts; generation itself runs in
`pai_cookbook.workers.generate` under torchrun with Megatron-Core's static inference engine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pai_cookbook.core.checkpoints import checkpoint, damage
from pai_cookbook.core.checkpoints.checkpoint import load_tokenizer
from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import ConfigError, ParallelConfig
from pai_cookbook.core.configs.generation import CHAT_TEMPLATE_MODES, DTYPES, GenerationConfig, kv_cache_bytes
from pai_cookbook.core.launching import cli, inputs
from pai_cookbook.core.launching.jobs import GenerationBatch, GenerationJob
from pai_cookbook.core.machine import runtime
from pai_cookbook.core.text.tokenizer import encode, eos_ids
from pai_cookbook.data import read_prompts

__all__ = ["CHAT_TEMPLATE_MODES", "DTYPES", "GenerationBatch", "GenerationConfig", "GenerationJob", "NotSaved",
           "check_fits", "check_output_file", "completion_records", "completions_markdown", "context_limit", "generate",
           "generate_file", "kv_cache_bytes", "main", "prepare", "resolve_checkpoint", "run_jobs"]


# --------------------------------------------------------------------------------------------------
# Inputs: checkpoint, tokenizer, prompt files -- all checked before a worker starts
# --------------------------------------------------------------------------------------------------
def resolve_checkpoint(path: str | Path, language_model: bool = True) -> Path:
    """A cookbook checkpoint folder, or a training save_dir's latest finished iteration; with
    `language_model`, refused when it is a reward model (it has no logits to generate or train from)."""
    path = checkpoint.resolve(path)
    problem = damage.damage(path) if (path / ".metadata").exists() else None
    if problem:
        raise ConfigError(f"{path} is damaged: {problem}. Give an earlier checkpoint; a training run resumed into "
                          f"its save_dir sets the damaged one aside and continues from the last complete one.")
    if language_model and checkpoint.head(path) != "lm":  # head() raises with what is missing
        raise ConfigError(f"{path} is a reward model (a scalar head instead of logits over the vocabulary): it "
                          f"scores completions and cannot generate or be trained as a policy. Give a language "
                          f"model's checkpoint (the reward model's base, for instance).")
    return path


def context_limit(model, config: GenerationConfig) -> int:
    """Tokens (prompt + completion) one sequence may hold: the model's limit and the configured
    max_sequence_length (a sliding window is applied inside attention, not here)."""
    limits = [model.max_position_embeddings, config.max_sequence_length]
    return min(x for x in limits if x)


def check_fits(prompt_ids: Sequence[Sequence[int]], records: Sequence[dict], limit: int, config: GenerationConfig) -> int:
    """Refuse a prompt that leaves no room for max_new_tokens; returns the KV-cache length needed."""
    for ids, record in zip(prompt_ids, records):
        if not ids:
            raise ValueError(f"line {record.get('line')}: the prompt encodes to no tokens; remove it or give text.")
        if len(ids) + config.max_new_tokens > limit:
            raise ValueError(f"line {record.get('line')}: prompt of {len(ids)} tokens + max_new_tokens="
                             f"{config.max_new_tokens} exceeds the context of {limit} tokens; shorten the prompt "
                             f"or lower max_new_tokens (to at most {limit - len(ids)}).")
    return max(len(ids) for ids in prompt_ids) + config.max_new_tokens


# --------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------
def prepare(ckpt: str | Path, records: Sequence[dict[str, Any]], config: GenerationConfig,
            parallel: ParallelConfig | None = None, label: str = "") -> GenerationJob:
    """Check everything about one generation request and tokenize its prompts (no worker starts)."""
    ckpt = resolve_checkpoint(ckpt)
    model, _ = checkpoint.read_config(ckpt)
    parallel = parallel or ParallelConfig()
    layout.check(model, parallel, purpose="infer")
    hf_tokenizer = load_tokenizer(ckpt)
    prompt_ids = [encode(hf_tokenizer, r, config.chat_template) for r in records]
    longest = check_fits(prompt_ids, records, context_limit(model, config), config)
    eos = eos_ids(ckpt / checkpoint.HF_ASSETS, hf_tokenizer) + list(config.eos_token_ids)
    return GenerationJob(ckpt=str(Path(ckpt).resolve()), prompt_ids=prompt_ids, config=config, parallel=parallel,
                         label=label, eos_ids=eos, max_sequence=longest)


def run_jobs(jobs: Sequence[GenerationJob], *, run_dir: str | Path = "runs/generate",
             nproc_per_node: int | None = None, show_progress: bool = True,
             timeout_s: float | None = None) -> list[dict[str, Any]]:
    """Run several generation jobs in one torchrun launch (parallel state rebuilt per job).

    Args:
        jobs: from `prepare`; their layouts must fit the world size.
        nproc_per_node: processes; default the smallest world holding every layout (lcm of TP x PP x EP
            worlds). More processes than a layout needs become data-parallel replicas sharing the batches.
    Returns:
        One dict per job: "tokens" (generated ids per prompt), "finish" ("eos", "stop" or "length"),
        "tokens_per_s", "seconds", "forward_seconds" (of them, in the model's forward steps), "packing_seconds"
        (before them: the weights packed for oneDNN on a CPU, cpu.linear.packed_for_decoding), "ranks_agree",
        "kv_cache_bytes" (the KV cache the static engine allocated, on the rank that held the most: `kv_cache_bytes`
        predicts it),
        "forward_lengths" (tokens per forward step, per batch), "layers" (what computed it:
        `core.machine.build.record`), "engine" (which inference engine and path ran, and Megatron-Core's release:
        `workers.engine.engine_record`).
    """
    from pai_cookbook.core.launching import launch

    world = math.lcm(*(layout.world_size(j.parallel) for j in jobs)) if nproc_per_node is None else \
        inputs.integer(nproc_per_node, "nproc_per_node")
    for job in jobs:
        model, _ = checkpoint.read_config(job.ckpt)
        layout.check(model, job.parallel, world, purpose="infer")
    result = launch.launch(GenerationBatch(jobs=list(jobs)), nproc_per_node=world, run_dir=run_dir, echo=False,
                           show_progress=show_progress, timeout_s=timeout_s)
    return [job | {"layers": result["layers"]} for job in result["jobs"]]


def check_output_file(path: Path) -> None:
    """Refuse an output file that cannot be written, before the work that fills it.

    Raises:
        ValueError: the path is a directory, its folder is a file, or either is read-only.
    """
    if path.is_dir():
        raise ValueError(f"--output {path} is a directory; give a file path such as {path / 'completions.jsonl'}.")
    folder = checkpoint.nearest_existing(path.parent)  # it must let us create the rest
    if not folder.is_dir():
        raise ValueError(f"--output {path}: {folder} is a file, not a folder; choose another output path.")
    target = path if path.exists() else folder
    if not os.access(target, os.W_OK):
        raise ValueError(f"--output {path}: {target} is not writable by this user; choose a writable path.")
    path.parent.mkdir(parents=True, exist_ok=True)


def completion_records(ckpt: str | Path, records: Sequence[dict], job: GenerationJob, out: dict) -> list[dict]:
    """Output records: the input's fields, the completion text (cut at a stop string) and token counts."""
    tokenizer = load_tokenizer(ckpt)
    rows = []
    for record, prompt, tokens, finish in zip(records, job.prompt_ids, out["tokens"], out["finish"]):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if finish == "stop":
            text = text[:min(text.find(s) for s in job.config.stop if s in text)]
        rows.append({k: v for k, v in record.items() if k != "line"} |
                    {"completion": text, "prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                     "finish_reason": finish, "completion_ids": tokens})
    return rows


def completions_markdown(records: Sequence[dict], reference: Sequence[str] | None = None) -> str:
    """A Markdown table of prompts and completions, with a reference column (e.g. Hugging Face's) if given."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    columns = ["prompt", "completion", "tokens", "finish"] + (["Hugging Face"] if reference else [])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for i, r in enumerate(records):
        prompt = inputs.prompt_text(r)  # a chat: its last turn
        row = [cell(prompt), cell(r["completion"]), str(r["completion_tokens"]),
               r["finish_reason"]] + ([cell(reference[i])] if reference else [])
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def generate(ckpt: str | Path, prompts: Sequence[str | dict[str, Any]], config: GenerationConfig | None = None, *,
             parallel: ParallelConfig | None = None, nproc_per_node: int | None = None,
             run_dir: str | Path = "runs/generate", show_progress: bool = True) -> dict[str, Any]:
    """Complete `prompts` with the Megatron-Core checkpoint `ckpt` (under torchrun, at layout `parallel`).

    Args:
        ckpt: a cookbook checkpoint, or a training save_dir (its latest iteration).
        prompts: strings, or records with "prompt" or "messages" (other keys are kept in the output).
        config: decoding settings; default greedy.
    Returns:
        {"records": one dict per prompt (prompt fields, completion, prompt_tokens, completion_tokens,
        finish_reason), "tokens_per_s", "seconds", "generated_tokens", "layout", "ranks_agree", "kv_cache_bytes",
        "max_sequence" (the longest prompt plus max_new_tokens: what the cache holds per sequence), "layers" and "engine"
        (what computed them: `run_jobs`)}.
    Raises:
        ConfigError / ValueError / FileNotFoundError: before any worker starts (see `prepare`).
    """
    config = config or GenerationConfig()
    records = [{"line": i} | inputs.prompt_record(p, f"prompt {i}")
               for i, p in enumerate(inputs.listed(prompts, "prompts", "strings or prompt records"), start=1)]
    if not records:
        raise ConfigError("no prompts given; pass at least one prompt string.")
    job = prepare(ckpt, records, config, parallel)
    (out,) = run_jobs([job], run_dir=run_dir, nproc_per_node=nproc_per_node, show_progress=show_progress)
    return {"records": completion_records(job.ckpt, records, job, out)} | {
        k: out[k] for k in ("tokens_per_s", "seconds", "generated_tokens", "layout", "ranks_agree", "kv_cache_bytes",
                            "layers", "engine")} | {"max_sequence": job.max_sequence}


class NotSaved(OSError):
    """Completions generated but not written (`generate_file`): `.result` holds them."""

    def __init__(self, errno: int | None, message: str, result: dict[str, Any]):
        super().__init__(errno, message)
        self.result = result


def generate_file(ckpt: str | Path, input_path: str | Path, output_path: str | Path,
                  config: GenerationConfig | None = None, **kwargs: Any) -> dict[str, Any]:
    """JSONL (or one prompt per line) in, JSONL out: `generate` on every record of `input_path`.

    The output path is checked before anything is generated: a run's completions are never lost to an
    output that turns out to be a directory or read-only. They are written to `<output>.partial` and renamed,
    so the output is whole or absent; a write that fails (a full disk) raises `NotSaved`, which names the path
    and the cause and carries the completions (`.result`), so they are never lost.
    """
    output_path = Path(output_path)
    check_output_file(output_path)
    result = generate(ckpt, read_prompts(input_path), config, **kwargs)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in result["records"])
    partial = output_path.with_name(output_path.name + ".partial")
    try:
        partial.write_text(lines, encoding="utf-8")
        os.replace(partial, output_path)
    except OSError as err:
        partial.unlink(missing_ok=True)
        raise NotSaved(err.errno, f"could not write {output_path}: {err.strerror or err}. The "
                                  f"{len(result['records'])} completions are not lost: this error's .result holds "
                                  f"them (`except generate.NotSaved as e: e.result['records']`); free space or give "
                                  f"another output, then write them", result) from err
    return result


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """CLI: exit 0 on success, 2 on bad input (nothing started), 1 on a worker failure."""
    p = argparse.ArgumentParser(prog="python -m pai_cookbook.generate", description=__doc__.splitlines()[0])
    p.add_argument("ckpt", help="cookbook checkpoint folder, or a training save_dir (latest iteration)")
    p.add_argument("--input", required=True, help=".jsonl with prompt/messages per line, or one prompt per line")
    p.add_argument("--output", required=True, help="JSONL: input fields + completion, token counts, finish_reason")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (must divide the layers)")
    p.add_argument("--nproc-per-node", type=int, help="processes (default TP x PP; more become data-parallel)")
    p.add_argument("--run-dir", default="runs/generate")
    defaults = GenerationConfig()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        elif isinstance(value, tuple):  # stop strings, extra EOS ids: repeat the flag
            p.add_argument(flag, action="append", default=[], type=str if name == "stop" else int)
        else:
            kind = {"max_sequence_length": int, "dtype": str}.get(name, type(value))
            p.add_argument(flag, type=kind, default=value)
    opts = vars(p.parse_args(argv))

    def work() -> dict[str, Any]:
        config = GenerationConfig(**{k: opts[k] for k in asdict(defaults)})
        parallel = ParallelConfig(tensor_model_parallel_size=opts["tp"], pipeline_model_parallel_size=opts["pp"])
        return generate_file(opts["ckpt"], opts["input"], opts["output"], config, parallel=parallel,
                             nproc_per_node=opts["nproc_per_node"], run_dir=opts["run_dir"], show_progress=True)

    def report(result: dict[str, Any]) -> None:
        print(f"{len(result['records'])} completions -> {opts['output']}; {result['generated_tokens']} tokens at "
              f"{result['tokens_per_s']:.1f} tokens/s ({runtime.detect_device().name})")
    try:
        return cli.finish("pai_cookbook.generate", work, report)
    except NotSaved as err:  # the last place the completions can go is this process's standard output
        print(f"pai_cookbook.generate: {err.strerror}; they follow on standard output, one JSON record a line",
              file=sys.stderr)
        for record in err.result["records"]:
            print(json.dumps(record, ensure_ascii=False))
        return 1


if __name__ == "__main__":
    sys.exit(main())
