"""Is the model better on a benchmark? What a Megatron-Core checkpoint scores, at any layout, one launch per call:

    scores = evaluate.loglikelihood(ckpt, [("The capital of France is", " Paris")])  # [{"logprob", "greedy"}]
    ppl = evaluate.perplexity(ckpt, texts)             # per token, per byte, per word (the harness's windows)
    answers = evaluate.generate_until(ckpt, [("2 + 2 =", ["\\n"])], max_new_tokens=16)

These are the three requests of lm-evaluation-harness (`pai_cookbook.harness` runs any harness task on them). A
context and its continuation are tokenized as the harness tokenizes them (`encode_pair`: the context's trailing
spaces move to the continuation; the continuation's ids are those of the whole text after the context's), and the
continuation is scored after its whole context (the context cut on the left where the two exceed the model's
positions, as the harness's Hugging Face model cuts it, and only when asked: `truncate=True`). Perplexity follows the
harness's rolling windows (`rolling_windows`): every token of a text is predicted once, from as much of the text
before it as the model's positions hold, the first from the end-of-text token.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import ConfigError, ParallelConfig, PrecisionConfig
from pai_cookbook.core.configs.generation import GenerationConfig
from pai_cookbook.core.launching import inputs, nodes
from pai_cookbook.core.launching.jobs import EvalJob, GenerationJob
from pai_cookbook.core.text import tokenizer as tokenizers

__all__ = ["encode", "encode_pair", "generate_until", "loglikelihood", "loglikelihood_tokens", "max_length", "perplexity",
           "rolling_windows", "served", "text_windows", "tokenizer"]


def served(ckpt: Any) -> bool:
    """Whether `ckpt` is a running `serve.Server`: every function here then scores on the server (what it runs:
    quantized weights through vLLM's kernels) instead of launching Megatron-Core."""
    from pai_cookbook.serve import Server

    return isinstance(ckpt, Server)


def tokenizer(ckpt: str | Path):
    """The tokenizer a checkpoint carries (`hf_assets/`), refused by name where it has none."""
    from pai_cookbook.generate import resolve_checkpoint

    if served(ckpt):
        return ckpt.tokenizer

    folder = resolve_checkpoint(ckpt) / checkpoint.HF_ASSETS
    if not any((folder / name).exists() for name in tokenizers.VOCABULARY_FILES):
        raise ConfigError(f"{Path(ckpt)} carries no tokenizer ({folder} holds none of {list(tokenizers.VOCABULARY_FILES)}"
                          f"): evaluation reads text. Convert the model with `convert.hf_to_megatron` from a Hugging "
                          f"Face folder that has its tokenizer, or copy the tokenizer files into {folder}.")
    return tokenizers.load(folder)


def max_length(ckpt: str | Path) -> int:
    """Positions the model attends over: what a scored sequence (context + continuation, less its last token) may
    hold. A sliding window does not shorten it: each layer applies its window inside attention, as transformers
    does. A server's is one less than its `max_model_len`: it is fed the scored sequence whole."""
    if served(ckpt):
        return ckpt.max_model_len - 1
    model, _ = checkpoint.read_config(checkpoint.resolve(ckpt))
    return model.max_position_embeddings


def prefix_id(hf) -> int:
    """The token an empty context stands for, and the first token of a text is predicted from (the harness's
    Hugging Face model's: beginning of text, else end of text)."""
    return hf.bos_token_id if hf.bos_token_id is not None else hf.eos_token_id


def encode(hf, text: str, add_special_tokens: bool | None = None) -> list[int]:
    """`text`'s ids as the harness's Hugging Face model encodes it: the tokenizer's own default (a Llama tokenizer
    adds its BOS, SmolLM2's adds nothing) unless `add_special_tokens` says, or the text already starts with the
    prefix token's text."""
    if add_special_tokens is None and text.startswith(hf.decode(prefix_id(hf))):
        add_special_tokens = False
    return hf.encode(text, **({} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}))


def encode_pair(hf, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-evaluation-harness makes them: trailing whitespace of the context moves
    to the continuation, and the continuation's ids are the whole text's after the context's, so a merge across the
    boundary is the whole text's; an empty context is the prefix token (or the continuation's first token, where
    that is the prefix token)."""
    if not context:
        ids = encode(hf, continuation, add_special_tokens=False)
        return ([prefix_id(hf)], ids) if not ids or ids[0] != prefix_id(hf) else (ids[:1], ids[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, context_ids = encode(hf, context + continuation), encode(hf, context)
    return whole[:len(context_ids)], whole[len(context_ids):]


@nodes.node0_only
def loglikelihood_tokens(ckpt: str | Path, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                         parallel: ParallelConfig | None = None, precision: PrecisionConfig | None = None,
                         batch: int = 8, truncate: bool = False, run_dir: str | Path = "runs/evaluate",
                         show_progress: bool = True) -> dict[str, Any]:
    """The log-probability of each continuation (ids) after its context (ids), and whether it is the greedy one.

    Args:
        truncate: where context + continuation exceed `max_length` + 1 tokens, cut the context on the left (the
            harness's Hugging Face model does); False refuses such a pair.
    Returns:
        {"results": per pair {"logprob", "greedy", "token_logprobs"}, "seconds": {"load", "score"},
        "sequences_per_s" (requests answered per second of scoring), "fed": the sequences the model ran (requests that
        differ only in their last token share one: a multiple-choice question's answers), "truncated": how many
        contexts were cut, "layers"}.
    Raises:
        ConfigError: before launch: an empty continuation, a continuation longer than the model's positions, a
        pair that does not fit (without `truncate`), a layout the model cannot take.
    """
    from pai_cookbook.core.launching import launch
    from pai_cookbook.generate import resolve_checkpoint

    on_server = served(ckpt)  # the same checks, then the server scores what a launch would
    if not on_server:
        ckpt = resolve_checkpoint(ckpt)
        model, _ = checkpoint.read_config(ckpt)
        parallel = parallel or ParallelConfig()
        layout.check(model, parallel, purpose="load")  # a plain forward: sequence parallelism too
    limit = max_length(ckpt)
    sequences, scored, cut = [], [], 0
    for i, (context, continuation) in enumerate(inputs.listed(pairs, "pairs", "(context ids, continuation ids)")):
        context, continuation = list(context), list(continuation)
        if not continuation:
            raise ConfigError(f"pair {i}: the continuation has no tokens; there is nothing to score.")
        if len(continuation) > limit:
            raise ConfigError(f"pair {i}: a continuation of {len(continuation)} tokens is longer than the model's "
                              f"{limit} positions; it cannot be scored in one pass. Shorten it.")
        if not context:
            raise ConfigError(f"pair {i}: no context; give the prefix token (`evaluate.encode_pair` does) so that "
                              f"the first token is predicted from something.")
        whole = context + continuation
        if len(whole) > limit + 1:
            if not truncate:
                raise ConfigError(f"pair {i}: context + continuation are {len(whole)} tokens, beyond the model's "
                                  f"{limit} positions + 1; shorten the context, or cut it on the left as the "
                                  f"harness does with truncate=True.")
            whole, cut = whole[-(limit + 1):], cut + 1
        sequences.append(whole)
        scored.append(len(continuation))
    if not sequences:
        raise ConfigError("no pairs given; pass at least one (context ids, continuation ids).")
    if on_server:
        return ckpt.score_sequences(sequences, scored) | {"truncated": cut}
    job = EvalJob(ckpt=str(Path(ckpt).resolve()), sequences=sequences, scored=scored, parallel=parallel,
                  precision=precision or PrecisionConfig(), batch=inputs.integer(batch, "batch"))
    result = launch.launch(job, nproc_per_node=job.processes(), run_dir=run_dir, echo=False,
                           show_progress=show_progress)
    return {k: result[k] for k in ("results", "seconds", "sequences_per_s", "positions", "fed", "layers")} | {
        "truncated": cut}


def loglikelihood(ckpt: str | Path, requests: Sequence[tuple[str, str]], **options: Any) -> dict[str, Any]:
    """`loglikelihood_tokens` of (context, continuation) texts, tokenized by `encode_pair` with the checkpoint's
    tokenizer; `options` are `loglikelihood_tokens`'s."""
    ckpt = ckpt if served(ckpt) else checkpoint.resolve(ckpt)  # once: tokenizer() and loglikelihood_tokens() check it
    hf = tokenizer(ckpt)
    pairs = [encode_pair(hf, *_text_pair(r, i)) for i, r in enumerate(inputs.listed(requests, "requests",
                                                                                    "(context, continuation) texts"))]
    return loglikelihood_tokens(ckpt, pairs, **options)


def _text_pair(request: Any, i: int) -> tuple[str, str]:
    if not (isinstance(request, (tuple, list)) and len(request) == 2 and all(isinstance(x, str) for x in request)):
        raise ConfigError(f"request {i}: expected a (context, continuation) pair of strings, found {request!r:.80}.")
    return request[0], request[1]


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, found {type(value).__name__} {value!r:.60}.")
    return value


def rolling_windows(ids: Sequence[int], prefix: int, limit: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) windows that predict every token of `ids` once: the first `limit` tokens from the
    prefix token, then each next block of up to `limit` tokens from the `limit` tokens before its last (the harness's
    `get_rolling_token_windows` with a one-token context, made disjoint)."""
    ids = list(ids)
    first = min(limit, len(ids))
    windows = [([prefix] + ids[:first - 1], ids[:first])] if ids else []
    done = first
    while done < len(ids):
        size = min(len(ids) - done, limit)
        end = done + size
        windows.append((ids[max(end - limit - 1, 0):end - 1], ids[end - size:end]))
        done = end
    return [(context[:len(context) - (len(target) - 1)], target) for context, target in windows]


def text_windows(hf, texts: Sequence[str], limit: int) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """Every text's `rolling_windows` (its ids by `encode`), end to end, and the index of the text each belongs to (a
    text that encodes to no tokens has none)."""
    windows, owner = [], []
    for i, text in enumerate(texts):
        for window in rolling_windows(encode(hf, text), prefix_id(hf), limit):
            windows.append(window)
            owner.append(i)
    return windows, owner


def perplexity(ckpt: str | Path, texts: Sequence[str], **options: Any) -> dict[str, Any]:
    """Perplexity of `texts`, each scored whole through `rolling_windows`, normalised three ways: per token
    (`token_perplexity`, exp of the mean negative log-likelihood), per byte of UTF-8 (`bits_per_byte`), and per word
    (`word_perplexity`, words split on whitespace), the harness's three. `options` are `loglikelihood_tokens`'s.

    Returns:
        those three, "logprob" (the sum), "tokens", "bytes", "words", "per_text" logprobs, "windows" (the sequences
        scored), and the launch's figures.
    """
    ckpt = ckpt if served(ckpt) else checkpoint.resolve(ckpt)  # once: tokenizer() and loglikelihood_tokens() check it
    texts = [_string(t, f"text {i}") for i, t in enumerate(inputs.listed(texts, "texts", "strings"))]
    windows, owner = text_windows(tokenizer(ckpt), texts, max_length(ckpt))
    empty = sorted(set(range(len(texts))) - set(owner))
    if empty:
        raise ConfigError(f"text {empty[0]} encodes to no tokens; remove it.")
    out = loglikelihood_tokens(ckpt, windows, **options)
    per_text = [0.0] * len(texts)
    for i, result in zip(owner, out["results"]):
        per_text[i] += result["logprob"]
    total = sum(per_text)
    tokens = sum(len(target) for _, target in windows)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    words = sum(len(re.split(r"\s+", t)) for t in texts)
    return {"token_perplexity": math.exp(-total / tokens), "bits_per_byte": -total / nbytes / math.log(2),
            "word_perplexity": math.exp(-total / words), "logprob": total, "tokens": tokens, "bytes": nbytes,
            "words": words, "per_text": per_text, "windows": len(windows)} | {
                k: out[k] for k in ("seconds", "sequences_per_s", "layers")}


def generate_until(ckpt: str | Path, requests: Sequence[tuple[str, Sequence[str]]], *, max_new_tokens: int = 256,
                   parallel: ParallelConfig | None = None, truncate: bool = False,
                   run_dir: str | Path = "runs/evaluate_generate", show_progress: bool = True) -> list[str]:
    """Greedy completions of each context (encoded by `encode`; no chat template, no repetition penalty), cut before
    the first of its stop strings: the harness's `generate_until` with its defaults.

    Args:
        truncate: keep a context's last `max_length` - `max_new_tokens` tokens where it is longer (the harness's
            Hugging Face model does); False refuses it."""
    from pai_cookbook import generate

    ckpt = generate.resolve_checkpoint(ckpt)
    hf = tokenizer(ckpt)
    model, _ = checkpoint.read_config(ckpt)
    parallel = parallel or ParallelConfig()
    layout.check(model, parallel, purpose="infer")
    checked = [(_string(c, f"request {i}'s context"), [_string(s, f"request {i}'s stop string") for s in until])
               for i, (c, until) in enumerate(inputs.listed(requests, "requests", "(context, stop strings)"))]
    limit = max_length(ckpt)
    room = limit - max_new_tokens
    if room < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} leaves no room for a context in the model's "
                          f"{limit} positions; lower it.")
    ids = [encode(hf, context) or [prefix_id(hf)] for context, _ in checked]
    if truncate:
        ids = [i[-room:] for i in ids]
    # A row stops at its own strings only: rows are grouped by their stop strings, a job each, one launch for all
    # (one job for the union let a row end at another request's stop)
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, (_, until) in enumerate(checked):
        groups.setdefault(tuple(sorted({s for s in until if s})), []).append(i)
    eos = tokenizers.eos_ids(Path(ckpt) / checkpoint.HF_ASSETS, hf)
    jobs = []
    for stops, members in groups.items():
        config = GenerationConfig(max_new_tokens=max_new_tokens, repetition_penalty=1.0, stop=stops,
                                  chat_template="never")
        longest = generate.check_fits([ids[i] for i in members], [{"line": i} for i in members], limit, config)
        jobs.append(GenerationJob(ckpt=str(Path(ckpt).resolve()), prompt_ids=[ids[i] for i in members], config=config,
                                  parallel=parallel, eos_ids=eos, max_sequence=longest))
    generated: list[list[int]] = [[] for _ in checked]
    for members, out in zip(groups.values(), generate.run_jobs(jobs, run_dir=run_dir, show_progress=show_progress)):
        for i, tokens in zip(members, out["tokens"]):
            generated[i] = tokens
    answers = []
    for tokens, (_, until) in zip(generated, checked):
        text = hf.decode(tokens, skip_special_tokens=True)
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        answers.append(text)
    return answers
