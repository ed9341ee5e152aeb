"""Supervised fine-tuning data: conversations -> token ids with an answer-only loss mask, then packed.

    summary = sft.prepare("data/sft/arithmetic.jsonl", "runs/sft_data", tokenizer_dir, seq_length=512)
    config = RunConfig(..., data=DataConfig(source="sft", paths=["runs/sft_data"], seq_length=512))

or step by step:

    conversations = sft.read("data/sft/arithmetic.jsonl")    # "messages", or "prompt"/"response" records
    samples, counts = sft.encode_all(tokenizer, conversations, seq_length=512)
    rows = sft.pack([len(s.ids) - 1 for s in samples], 512)  # first-fit decreasing, no sample split
    batch = sft.batch(samples, rows, 512, pad_id)             # tokens, labels, loss_mask, document ids

`records` (read, encode), `rows` (pack, batch), `prepared` (prepare, the set on disk), `audit` (the masks checked a
second way; what the model learnt); what training reads from a prepared set (`load`, `global_batch`, `validation_batches`,
`thd`, `attention_mask`) is `core.text.sft_data`, which the training workers share. What SFT tools get wrong is
refused or counted: prompt tokens in the loss, the stop token left out or typed inside an answer, a second BOS,
samples without a loss token (`chat_template` names the line and the way through).
"""

from pai_cookbook.core.text.sft_data import SFTError, attention_mask, global_batch, load, loss_weights, thd, validation_batches
from pai_cookbook.sft.audit import audit, follows, mask_html
from pai_cookbook.sft.prepared import SPLITS, SUMMARY, TEMPLATE_FILE, check_for_training, describe, prepare, write
from pai_cookbook.sft.records import (
    CHATML,
    DEFAULT_SET,
    DEFAULT_TEST_SET,
    ROLES,
    TEMPLATES,
    TRUNCATION,
    Counts,
    Sample,
    checked_messages,
    encode,
    encode_all,
    read,
    read_template,
    template_text,
)
from pai_cookbook.sft.rows import batch, efficiency, loss_by_split, pack

__all__ = ["CHATML", "DEFAULT_SET", "DEFAULT_TEST_SET", "ROLES", "SPLITS", "SUMMARY", "TEMPLATES", "TEMPLATE_FILE",
    "TRUNCATION", "Counts", "SFTError", "Sample", "attention_mask", "audit", "batch", "check_for_training",
    "checked_messages", "describe", "efficiency", "encode", "encode_all", "follows", "global_batch", "load",
    "loss_by_split", "loss_weights", "mask_html", "pack", "prepare", "read", "read_template", "template_text",
    "thd", "validation_batches", "write"]
