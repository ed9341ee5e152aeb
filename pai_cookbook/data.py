"""Data preparation: raw text or JSONL -> Megatron-Core indexed dataset (.bin/.idx).

    summary = data.prepare(["corpus.jsonl"], "data/corpus", tokenizer_dir="ckpt/hf_assets")

Documents are tokenized in a process pool (each worker loads the tokenizer once), an end-of-document
token is appended to each, and Megatron-Core's `IndexedDatasetBuilder` writes the files that its
`GPTDataset` reads for training. A sidecar `<prefix>.json` records the tokenizer and its vocabulary
size, so training refuses a dataset tokenized with another vocabulary before any worker starts.

Input formats: `.jsonl` (one JSON object per line, text in `text_field`) and `.txt` (documents
separated by blank lines).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from pai_cookbook.core.launching import inputs as core_inputs
from pai_cookbook.core.launching import nodes
from pai_cookbook.core.text import tokenizer
from pai_cookbook.core.text.indexed_data import (
    SIDECAR_SUFFIX,
    DataError,
    build_datasets,
    describe,
    fingerprint,
    global_batch,
    index_cache_dir,
)

__all__ = ["DOCS_PER_TASK", "SIDECAR_SUFFIX", "DataError", "build_datasets", "check_for_training", "describe", "fingerprint",
           "global_batch", "index_cache_dir", "prepare", "read_documents", "read_prompts", "split_documents",
           "write_default_corpus"]

DOCS_PER_TASK = 64
"""Documents per task sent to a tokenizer worker: large enough to amortise the inter-process hop."""

_tokenizer = None  # one per pool worker


def read_documents(path: str | Path, text_field: str = "text") -> Iterator[str]:
    """Yield the documents of a .jsonl or .txt file, with the line number in any error."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"input {path} does not exist.")
    if path.suffix not in (".jsonl", ".txt"):
        raise DataError(f"input {path} has suffix {path.suffix!r}; the cookbook reads .jsonl and .txt.")
    try:
        yield from _documents(path, text_field)
    except UnicodeDecodeError as err:
        with path.open("rb") as f:
            line = f.read(err.start).count(b"\n") + 1 if path.suffix == ".txt" else None
        where = f"{path}:{line}" if line else str(path)
        raise DataError(core_inputs.not_utf8(where, err.object, err.start)) from None


def _documents(path: Path, text_field: str) -> Iterator[str]:
    if path.suffix == ".jsonl":
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(core_inputs.not_utf8(f"{path}:{number}", raw, err.start)) from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{number}: not valid JSON ({err.msg}); each line must be one object.") from None
                if not isinstance(record, dict) or text_field not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(f"{path}:{number}: no field {text_field!r} (found {keys}); set text_field.")
                if record[text_field] and not isinstance(record[text_field], str):
                    raise DataError(f"{path}:{number}: field {text_field!r} holds a {type(record[text_field]).__name__}, "
                                    f"not text (its repr would be tokenized); point text_field at a string field.")
                if record[text_field]:
                    yield record[text_field]
    elif path.suffix == ".txt":
        paragraph: list[str] = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                paragraph.append(line)
            elif paragraph:
                yield "\n".join(paragraph)
                paragraph = []
        if paragraph:
            yield "\n".join(paragraph)


@nodes.node0_only
def write_default_corpus(path: str | Path) -> Path:
    """Write the cookbook's default training corpus as JSONL and return its path.

    English: the 79 topics of the Python language reference that CPython ships as `pydoc_data.topics`
    (about 0.46 MB of prose and grammar; every machine with Python has it, no download). Chinese: the
    paragraphs the cookbook wrote in data/tiny_corpus.txt. One document per topic or paragraph, in a
    fixed shuffled order: Megatron-Core's split takes contiguous document ranges, so an unshuffled file
    would put one language only into the validation split.
    """
    import random
    from pydoc_data.topics import topics

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [{"text": topics[name], "source": f"pydoc_data.topics/{name}"} for name in sorted(topics)]
    records += [{"text": doc, "source": "cookbook"} for doc in read_documents(tokenizer.TOKENIZER_CORPUS) if not doc.isascii()]
    random.Random(0).shuffle(records)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def _init_worker(tokenizer_dir: str) -> None:
    global _tokenizer
    from transformers import AutoTokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the pool is the parallelism
    _tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)


def _tokenize(documents: list[str]) -> list[list[int]]:
    return _tokenizer(documents, add_special_tokens=False).input_ids


def _batches(documents: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@nodes.node0_only
def prepare(inputs: Sequence[str | Path], output_prefix: str | Path, tokenizer_dir: str | Path, *,
            text_field: str = "text", workers: int = 2, append_eod: bool = True,
            show_progress: bool = True) -> dict[str, Any]:
    """Tokenize `inputs` into `<output_prefix>.bin/.idx` (+ `.json` sidecar).

    Args:
        inputs: .jsonl / .txt files, read in order.
        output_prefix: path without suffix, e.g. "data/corpus".
        tokenizer_dir: a Hugging Face tokenizer folder (a converted checkpoint's `hf_assets/` works).
        workers: tokenizer processes.
        append_eod: end each document with the tokenizer's EOS token (the GPT dataset's document separator).
    Returns:
        Summary: documents, tokens, seconds, tokens_per_s, files written.
    Raises:
        DataError: missing, empty or malformed input (with the line number).
    """
    inputs = core_inputs.listed(inputs, "inputs", ".jsonl/.txt paths", error=DataError)
    if not inputs:
        raise DataError("no inputs; give at least one .jsonl or .txt file.")
    core_inputs.integer(workers, "workers", error=DataError)
    prefix = Path(output_prefix)
    blocked = next((p for p in [prefix.parent, *prefix.parent.parents] if p.exists()), None)
    if blocked is not None and not blocked.is_dir():
        raise DataError(f"output_prefix {prefix}: {blocked} is a file, not a folder; choose another output prefix.")
    hf_tokenizer = tokenizer.load(tokenizer_dir, "tokenizer_dir")
    eod = hf_tokenizer.eos_token_id
    if append_eod and eod is None:
        raise DataError(f"tokenizer in {tokenizer_dir} has no eos_token; set one or pass append_eod=False.")
    for path in inputs:  # fail on a missing or malformed file before writing anything
        if not any(True for _ in read_documents(path, text_field)):
            raise DataError(f"input {path} has no documents (empty file or empty {text_field!r} fields).")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(prefix.name + ".partial")
    partial_files = [Path(f"{tmp}.bin"), Path(f"{tmp}.idx")]
    start = time.perf_counter()
    try:
        documents, tokens = _write_dataset(inputs, tmp, hf_tokenizer, tokenizer_dir, text_field, workers,
                                           eod if append_eod else None, show_progress)
    except BaseException as err:
        for path in partial_files:  # a failed write leaves nothing behind (nor a full disk)
            path.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno is not None and not isinstance(err, FileNotFoundError):
            raise OSError(err.errno, f"{err.strerror or err} while writing {tmp}.bin/.idx (dataset {prefix}); "
                                     f"nothing was kept") from err
        raise
    seconds = time.perf_counter() - start
    summary = {"documents": documents, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
               "vocab_size": len(hf_tokenizer), "eod": eod, "tokenizer": str(Path(tokenizer_dir).resolve()),
               "tokenizer_sha256": tokenizer.fingerprint(tokenizer_dir),
               "inputs": [str(p) for p in inputs]}
    summary |= fingerprint(tmp)
    # Published sidecar last, and the old one removed first: a preparation killed between these renames leaves files
    # that `describe` refuses (no sidecar, or one whose fingerprint is of other files), never a mismatched pair.
    sidecar = Path(f"{prefix}{SIDECAR_SUFFIX}")
    sidecar.unlink(missing_ok=True)
    for suffix in (".bin", ".idx"):
        os.replace(f"{tmp}{suffix}", f"{prefix}{suffix}")
    Path(f"{tmp}{SIDECAR_SUFFIX}").write_text(json.dumps(summary, indent=2))
    os.replace(f"{tmp}{SIDECAR_SUFFIX}", sidecar)
    return summary | {"files": [f"{prefix}.bin", f"{prefix}.idx"]}


def _write_dataset(inputs: Sequence[str | Path], tmp: Path, hf_tokenizer: Any, tokenizer_dir: str | Path,
                   text_field: str, workers: int, eod: int | None, show_progress: bool) -> tuple[int, int]:
    """Tokenize every input into `<tmp>.bin/.idx`; returns (documents, tokens)."""
    from pai_cookbook.core.launching import progress
    from pai_cookbook.core.machine import megatron_import

    megatron_import.import_megatron_core()  # in the caller's process: without TorchInductor on CPU, as workers import it
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=DType.optimal_dtype(len(hf_tokenizer)))
    documents = tokens = 0
    bar = progress.bar(desc="tokenizing", unit="doc", disable=not show_progress)
    # fork (Linux): workers need not re-import the caller's __main__, so a script without an
    # `if __name__ == "__main__":` guard works too; they only tokenize (no torch, no threads shared).
    context = get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer_dir),)) as pool:
        for path in inputs:
            for ids_batch in pool.imap(_tokenize, _batches(read_documents(path, text_field), DOCS_PER_TASK)):
                for ids in ids_batch:
                    if eod is not None:
                        ids = ids + [eod]
                    builder.add_document(np.asarray(ids), [len(ids)])
                    tokens += len(ids)
                documents += len(ids_batch)
                bar.update(len(ids_batch))
    bar.close()
    builder.finalize(f"{tmp}.idx")
    return documents, tokens


def split_documents(documents: int, split: str) -> list[int]:
    """Documents per train/valid/test split, computed as Megatron-Core's builder does (rounded bounds)."""
    weights = [float(x) for x in split.split(",")]
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / sum(weights) * documents)))
    bounds[-1] = documents
    return [b - a for a, b in zip(bounds, bounds[1:])]


def check_for_training(run: Any) -> None:
    """Before launch: every dataset exists, is non-empty, has documents in every split the run reads,
    and was tokenized with a vocabulary that fits (the model's own tokenizer when training starts from
    a checkpoint that carries one).

    Raises:
        DataError: naming the dataset and the fix.
    """
    from pai_cookbook.core.checkpoints import checkpoint

    load_dir = run.checkpoint.load_dir
    expected = tokenizer.fingerprint(Path(load_dir) / checkpoint.HF_ASSETS) if load_dir else None
    for prefix in run.data.paths:
        summary = describe(prefix)
        if expected and summary.get("tokenizer_sha256") not in (None, expected):
            raise DataError(f"dataset {prefix} was tokenized with {summary['tokenizer']}, not with the tokenizer of "
                            f"{load_dir} (their vocabulary files differ). Prepare it again with "
                            f"tokenizer_dir={Path(load_dir) / checkpoint.HF_ASSETS}.")
        if summary["vocab_size"] > run.model.vocab_size:
            raise DataError(f"dataset {prefix} was tokenized with a {summary['vocab_size']}-token vocabulary "
                            f"({summary['tokenizer']}), larger than the model's {run.model.vocab_size}: it was "
                            f"prepared for another model. Prepare it again with this model's tokenizer.")
        train_docs, valid_docs, _ = split_documents(summary["documents"], run.data.split)
        # An empty split makes Megatron-Core's GPTDataset count epochs forever: refuse it here.
        empty = [name for name, docs, used in (("train", train_docs, True), ("validation", valid_docs, True))
                 if used and docs == 0]
        if empty:
            raise DataError(f"dataset {prefix} has {summary['documents']} documents; split {run.data.split!r} leaves "
                            f"the {' and '.join(empty)} split empty. Use more documents or a split that gives each "
                            f"at least one (e.g. '80,20,0').")


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Records of a prompt file: `.jsonl` objects with "prompt" (text) or "messages" (chat), other keys kept;
    any other file: one prompt per non-empty line.

    Raises:
        ValueError: the file is empty, or a line is not a JSON object with a string "prompt" or a
            "messages" list (the message names the line number).
    """
    path = Path(path)
    lines = core_inputs.read_text(path, what="prompts file", error=DataError).splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            records.append({"prompt": line, "line": number})
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno}); each line must be "
                             f'one object such as {{"prompt": "..."}}.') from err
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number}: expected an object with a string \"prompt\" or a \"messages\" list "
                            f"of {{\"role\", \"content\"}}; found {line[:80]!r}.")
        records.append(core_inputs.prompt_record(record, f"{path}:{number}", error=DataError) | {"line": number})
    if not records:
        raise ValueError(f"{path} holds no prompts (empty or blank lines only); write one prompt per line "
                         f'(.txt) or one {{"prompt": "..."}} object per line (.jsonl).')
    return records
