"""Tokenizers, in one place: load, copy into a checkpoint, fingerprint, chat templates, the tiny one.

Every tokenizer the cookbook uses is a Hugging Face tokenizer folder (tokenizer.json and/or
tokenizer.model, tokenizer_config.json with its chat template); it is loaded without remote code.
A checkpoint carries its tokenizer in `hf_assets/` (`copy`), a prepared dataset records the
`fingerprint` of the one it was tokenized with, so training refuses a dataset made with another.

The tiny tokenizer of the CPU runs is a file of this repository (data/tiny_tokenizer.json), not
trained on each use: `tokenizers`' BPE trainer breaks ties between equally frequent pairs in hash-map
order, so three trainings on the same corpus gave three different tokenizers (measured), and
notebook runs that start from a tiny model did not repeat. `make_tokenizer` retrains one (it wrote
that file: `make_tokenizer(256).backend_tokenizer.save("data/tiny_tokenizer.json")`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parents[3] / "data"
TOKENIZER_CORPUS = DATA_DIR / "tiny_corpus.txt"
"""The cookbook's own small English + Chinese text: what the tiny tokenizer was trained on."""
TINY_TOKENIZER = DATA_DIR / "tiny_tokenizer.json"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]

VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")
"""Files that define the vocabulary (what a fingerprint covers)."""
FILES = VOCABULARY_FILES + ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""Every tokenizer file a checkpoint carries."""


def fingerprint(folder: str | Path) -> str | None:
    """SHA-256 over a tokenizer folder's vocabulary files; None when it has none of them."""
    digest, found = hashlib.sha256(), False
    for name in VOCABULARY_FILES:
        path = Path(folder) / name
        if path.exists():
            digest.update(name.encode() + path.read_bytes())
            found = True
    return digest.hexdigest() if found else None


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).exists() for name in VOCABULARY_FILES)


def load(folder: str | Path, what: str = ""):
    """The Hugging Face tokenizer in `folder` (no remote code); `what` names the folder in errors.

    Raises:
        FileNotFoundError: the folder has no vocabulary file.
    """
    from transformers import AutoTokenizer

    if Path(folder).is_file():
        raise FileNotFoundError(f"{what or folder} is a file; give the folder that holds the tokenizer files "
                                f"({Path(folder).parent}, if this is one of them).")
    if not has_tokenizer(folder):
        raise FileNotFoundError(
            f"{what or folder} carries no tokenizer: expected one of {list(VOCABULARY_FILES)} (and "
            f"tokenizer_config.json) in {folder}/. Copy the model's Hugging Face tokenizer files there, e.g. "
            f"tokenizer.copy(Path('<hf model folder>'), Path('{folder}')).")
    return AutoTokenizer.from_pretrained(folder)


def copy(src: str | Path, dst: str | Path, names: tuple[str, ...] = FILES) -> list[str]:
    """Copy the files of `names` (the tokenizer's, by default) that exist in `src` into `dst`; returns
    their names. `checkpoint.copy_assets` copies the model config along with them through it."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = [name for name in names if (src / name).exists()]
    for name in copied:
        shutil.copy2(src / name, dst / name)
    return copied


def eos_ids(folder: str | Path, tokenizer) -> list[int]:
    """End-of-sequence ids of a Hugging Face folder (a checkpoint's `hf_assets/`): its generation config's
    (Llama 3 lists two), else the tokenizer's."""
    path = Path(folder) / "generation_config.json"
    found = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    if found is None:
        found = tokenizer.eos_token_id
    return [found] if isinstance(found, int) else list(found or [])


def encode(tokenizer, record: dict[str, Any], chat_template: str) -> list[int]:
    """Token ids of one prompt record ("prompt" text or chat "messages"), through the chat template
    when `chat_template` ("auto", "always", "never") and the record ask for it.

    The template's text is tokenized without adding special tokens again (templates write BOS
    themselves); a plain prompt is tokenized exactly as `tokenizer(prompt)` does, as Hugging Face does.
    """
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if chat_template == "always" and not has_template:
        raise ValueError("chat_template='always' but the checkpoint's tokenizer has no chat template; use 'auto'.")
    use = chat_template == "always" or (chat_template == "auto" and has_template) or "messages" in record
    if not use:
        return tokenizer(record["prompt"]).input_ids
    if not has_template:
        raise ValueError(f"line {record.get('line')}: a \"messages\" prompt needs a tokenizer with a chat template; "
                         f"give a \"prompt\" string instead, or use a checkpoint whose tokenizer has one (after SFT).")
    messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


class MegatronView:
    """The tokenizer interface Megatron-Core's text generation controller calls, over a Hugging Face one."""

    def __init__(self, hf_tokenizer, eos: list[int]):
        self.hf = hf_tokenizer
        self.eos_ids = eos
        self.eod = eos[0] if eos else -1  # the controller pads with it; -1: never terminates
        self.bos = hf_tokenizer.bos_token_id
        self.vocab_size = len(hf_tokenizer)

    def tokenize(self, text: str) -> list[int]:
        return self.hf(text).input_ids

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


def _fast(backend):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make_tokenizer(vocab_size: int, corpus: Path = TOKENIZER_CORPUS):
    """Train a byte-pair tokenizer of at most `vocab_size` tokens on `corpus` (not reproducible: see above)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    # limit_alphabet keeps room for merges in a 256-token vocabulary; rarer characters become <unk>.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  limit_alphabet=vocab_size // 2, show_progress=False)
    backend.train([str(corpus)], trainer)
    return _fast(backend)


def tiny():
    """The tiny 256-token tokenizer of the CPU runs: the same one on every run and machine."""
    from tokenizers import Tokenizer

    return _fast(Tokenizer.from_file(str(TINY_TOKENIZER)))


CHAT_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""SmolLM2's (and Qwen's) ChatML special tokens, with their roles: unknown/padding-free end of text, BOS, EOS."""


def byte_level(chat_template: str | None = None):
    """A byte-level tokenizer with no merges: ChatML's three special tokens, then one token per byte (259).

    For tasks whose text is a few characters (notebook 08's digit sorting): every string encodes, the
    same way on every machine (built in code, nothing trained), and a tiny model's output layer is
    259 rows instead of a real tokenizer's tens of thousands (49,152 rows x 64 = 99% of a 2-layer,
    64-wide Llama's weights and compute). Specials as SmolLM2-Instruct's: BOS <|im_start|>, EOS and
    padding <|im_end|>, unknown <|endoftext|>.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(CHAT_SPECIAL_TOKENS + alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(CHAT_SPECIAL_TOKENS)
    unknown, start, end = CHAT_SPECIAL_TOKENS
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=unknown, bos_token=start, eos_token=end,
                                   pad_token=end)
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast
