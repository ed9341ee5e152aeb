"""Serve a Hugging Face folder (an export, or a quantized copy) through vLLM's OpenAI-compatible server, and query it:

    with serve.Server("outputs/13_deploy/int8") as server:        # a free port, its log in a file, stopped on exit
        reply = server.client().chat.completions.create(model=server.name, messages=[...])
        ids = server.greedy_ids([[504, 3575, 282]], max_tokens=16)
        scores = evaluate.perplexity(server, texts)            # notebook 11's measures, on what the server runs
        rows = serve.throughput(server, prompts, concurrency=(1, 4, 16))

vLLM lives in its own environment, as on a serving image (`bash ci/setup_env.sh serve`: `.venv-serve`, vLLM's CPU
build on Python 3.11; `PAI_COOKBOOK_SERVE_PYTHON` names another one's Python). The server is a child in its own
process group, under a keeper (`workers/supervise.py`) that ends the whole group: it ends with the `with` block, on an
error or interrupt inside it, at the interpreter's exit, when the process that started it dies (the kernel asks for
SIGTERM, as it does for every launch's workers), and when it dies itself (what it started goes with it).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pai_cookbook.core.configs.config import ConfigError
from pai_cookbook.core.launching import inputs, processes

__all__ = ["SERVE_PYTHON_ENV", "Server", "ServerError", "check_hf_model", "free_port", "serving_python", "throughput"]

SERVE_PYTHON_ENV = "PAI_COOKBOOK_SERVE_PYTHON"
"""The Python of an environment with vLLM; default: the repository's `.venv-serve`."""
SERVE_VENV = ".venv-serve"
SETUP_STATUS_ENV = "PAI_COOKBOOK_SERVE_SETUP"
"""Where a setup of the serving environment running beside this process (ci/run_all.sh's, ci/test.sh's) writes its
exit status, its log beside it as `.log`: `serving_python` waits for it."""
SETUP_WAIT_S = 1800
LOG_TAIL_LINES = 30
NOISE = ("Route:", "it/s]", "GET /health")
"""Log lines left out of a failure's tail: the server's route list, progress bars and health polls."""


class ServerError(RuntimeError):
    """The server did not start, stopped, or answered with an error; the message carries its log's tail."""


def serving_python() -> Path:
    """The serving environment's Python, refused by name where there is none. Where `PAI_COOKBOOK_SERVE_SETUP` names
    the status file of a setup running beside (the main job starts it with the first notebook), it is waited for, and
    a failed setup is refused with its log's tail."""
    status = os.environ.get(SETUP_STATUS_ENV)
    if status:
        status, deadline = Path(status), time.monotonic() + SETUP_WAIT_S
        while not status.exists():
            if time.monotonic() > deadline:
                raise ServerError(f"the serving environment's setup did not finish in {SETUP_WAIT_S} s ({status})")
            time.sleep(2)
        code, log = status.read_text().strip(), status.with_suffix(".log")
        if code != "0":
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else "(no log)"
            raise ConfigError(f"`bash ci/setup_env.sh serve` failed (exit {code}); its log {log} ends:\n{tail}")
    named = os.environ.get(SERVE_PYTHON_ENV)
    path = Path(named) if named else Path(__file__).resolve().parent.parent / SERVE_VENV / "bin" / "python"
    if not path.exists():
        raise ConfigError(f"no serving environment: {path} does not exist. Create it with `bash ci/setup_env.sh serve` "
                          f"(vLLM and llm-compressor in their own environment, as on a serving image), or set "
                          f"{SERVE_PYTHON_ENV} to the Python of an environment that has vLLM.")
    return path


def check_hf_model(folder: str | Path) -> Path:
    """A Hugging Face model folder: config.json with a model type, and safetensors weights."""
    folder = Path(folder)
    config = folder / "config.json"
    if not config.exists():
        hint = (" It is a Megatron-Core checkpoint: export it with `convert.megatron_to_hf` first."
                if (folder / "pai_cookbook.json").exists() else "")
        raise ConfigError(f"{folder} is not a Hugging Face model folder (no config.json).{hint}")
    if "model_type" not in json.loads(config.read_text()):
        raise ConfigError(f"{config} has no model_type: it is not a transformers model's config.")
    if not list(folder.glob("*.safetensors")):
        raise ConfigError(f"{folder} has no *.safetensors weights; the server loads safetensors only (save the model "
                          f"with `save_pretrained(..., safe_serialization=True)`).")
    return folder


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_port(host: str, port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"port {port} on {host} is in use ({e.strerror}); pass another port, or port=None for a "
                              f"free one.") from None


_LIVE: set[Server] = set()
atexit.register(lambda: [server.stop() for server in list(_LIVE)])


class Server:
    """vLLM's OpenAI-compatible server for one model folder.

    Args:
        model: a Hugging Face folder (`check_hf_model`).
        dtype: what the unquantized layers and activations run in ("bfloat16", what a GPU serves; "float32" where ids
            must equal an fp32 reference). vLLM's CPU INT4 kernel takes bf16 only.
        eager: skip torch.compile at start (26 s against 122 s for SmolLM2 on 2 cores, docs/deployment.md).
        kv_cache_gib: the KV cache vLLM reserves on the CPU, whole GiB (its `VLLM_CPU_KVCACHE_SPACE`); a GPU's is a fraction
            of its memory (`--gpu-memory-utilization` in `extra_args`).
        log: the server's log file; default `<model>.serve.log` beside the folder.
    """

    def __init__(self, model: str | Path, *, name: str = "model", dtype: str = "bfloat16", port: int | None = None,
                 host: str = "127.0.0.1", max_model_len: int | None = None, eager: bool = True,
                 kv_cache_gib: int = 1, log: str | Path | None = None, startup_timeout_s: float = 900,
                 extra_args: Sequence[str] = (), python: str | Path | None = None):
        self.model = check_hf_model(model).resolve()
        self.name, self.dtype, self.host = name, dtype, host
        if dtype not in ("bfloat16", "float16", "float32", "auto"):
            raise ConfigError(f"dtype={dtype!r}: the server runs bfloat16, float16, float32 or auto.")
        if _weight_bits(self.model) == 4 and dtype == "float32" and not _has_gpu():
            raise ConfigError(f"{self.model} holds 4-bit weights, and vLLM's CPU kernel for them runs in bfloat16 or "
                              f"float16 only; serve it with dtype='bfloat16'.")
        if port is not None:
            _check_port(host, inputs.integer(port, "port"))
        self.port = port
        self.max_model_len = max_model_len or _positions(self.model)
        self.eager, self.kv_cache_gib = eager, inputs.integer(kv_cache_gib, "kv_cache_gib")
        self.log = Path(log) if log else self.model.with_name(self.model.name + ".serve.log")
        self.startup_timeout_s, self.extra_args = startup_timeout_s, list(extra_args)
        self.python = Path(python) if python else None
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._tokenizer = None

    # ---------------------------------------------------------------------------------------------- lifetime
    def argv(self) -> list[str]:
        # the API server's module, not the `vllm serve` script: the script asks for the distribution "vllm", which
        # the CPU build is not named (it is "vllm-cpu"); the arguments are the same
        argv = [str(self.python or serving_python()), "-W", "ignore::DeprecationWarning", "-m",
                "vllm.entrypoints.openai.api_server", "--model", str(self.model), "--host", self.host,
                "--port", str(self.port), "--dtype", self.dtype, "--served-model-name", self.name,
                "--max-model-len", str(self.max_model_len), "--seed", "0"]
        return argv + (["--enforce-eager"] if self.eager else []) + self.extra_args

    def start(self) -> Server:
        if self.running:
            return self
        self.port = self.port or free_port(self.host)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "PYTHONUNBUFFERED": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
        env.pop("PYTHONPATH", None)  # the serving environment's own packages, not the notebook's
        started = time.monotonic()
        keeper = [sys.executable, str(Path(__file__).resolve().parent / "workers" / "supervise.py")]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(keeper + self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.log.parent, start_new_session=True,
                                         preexec_fn=processes.death_signal())
        _LIVE.add(self)
        try:
            while not self._healthy():
                if self.proc.poll() is not None:
                    raise ServerError(f"the server for {self.model.name} exited with code {self.proc.returncode} "
                                      f"before it was ready; log {self.log}\n{self.log_tail()}")
                if time.monotonic() - started > self.startup_timeout_s:
                    raise ServerError(f"the server for {self.model.name} was not ready after startup_timeout_s="
                                      f"{self.startup_timeout_s:g}; it was stopped. Log {self.log}\n{self.log_tail()}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def stop(self) -> None:
        """Terminate the server and everything it started (its engine and workers); idempotent."""
        if self.proc is not None:
            processes.terminate(self.proc)  # the keeper ends the server's group (workers/supervise.py)
        _LIVE.discard(self)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self in _LIVE

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if not self.log.exists():
            return "(no log)"
        kept = [x for x in self.log.read_text(errors="replace").splitlines() if not any(n in x for n in NOISE)]
        return "\n".join(kept[-lines:])

    def _require_running(self) -> None:
        if not self.running:
            raise ServerError(f"the server for {self.model.name} is not running (stopped, or never started): start "
                              f"it with `with serve.Server(...) as server:` and query it inside the block.")

    # ---------------------------------------------------------------------------------------------- queries
    def client(self):
        """An `openai.OpenAI` client for this server (the API key is not checked)."""
        import openai

        self._require_running()
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=600)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model)
        return self._tokenizer

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        self._require_running()
        request = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"the server answered {e.code}: {e.read().decode(errors='replace')[:500]}\n"
                              f"{self.log_tail(10)}") from None
        except (urllib.error.URLError, ConnectionError) as e:
            raise ServerError(f"the server at {self.url} did not answer ({e}); log {self.log}\n"
                              f"{self.log_tail(10)}") from None

    def greedy_ids(self, prompts: Sequence[Sequence[int]], max_tokens: int, *, concurrency: int = 8) -> list[list[int]]:
        """Greedy continuations of prompt ids (no chat template), to the end-of-text token or `max_tokens`."""
        def one(ids):
            body = {"model": self.name, "prompt": [int(i) for i in ids], "max_tokens": max_tokens, "temperature": 0.0,
                    "return_token_ids": True}
            return self._post(body)["choices"][0]["token_ids"]
        return _concurrently(one, [list(p) for p in prompts], concurrency)

    def score_sequences(self, sequences: Sequence[Sequence[int]], scored: Sequence[int], *,
                        concurrency: int = 8) -> dict[str, Any]:
        """The log-probability of each sequence's last `scored` tokens from vLLM's prompt log-probabilities, and
        whether every one of them ranks first (greedy): what `evaluate.loglikelihood_tokens` gets from a server,
        after its checks (a sequence holds at most `max_model_len` tokens)."""
        def one(item):
            whole, n = item
            body = {"model": self.name, "prompt": [int(t) for t in whole], "max_tokens": 1, "temperature": 0.0,
                    "prompt_logprobs": 1}
            positions = self._post(body)["choices"][0]["prompt_logprobs"][-n:]
            picked = [p[str(t)] for p, t in zip(positions, whole[-n:])]
            logprobs = [x["logprob"] for x in picked]
            return {"logprob": sum(logprobs), "greedy": all(x["rank"] == 1 for x in picked), "token_logprobs": logprobs}
        started = time.monotonic()
        results = _concurrently(one, list(zip(sequences, scored)), concurrency)
        seconds = time.monotonic() - started
        return {"results": results, "seconds": {"load": self.startup_s or 0.0, "score": seconds},
                "sequences_per_s": len(results) / max(seconds, 1e-9), "positions": self.max_model_len,
                "fed": len(results), "layers": None}


def _concurrently(fn, items: list, workers: int) -> list:
    """`fn` of each item, `workers` requests in flight at once, in the items' order."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(fn, items))


def _positions(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config.get("max_position_embeddings") or 2048)


def _weight_bits(model: Path) -> int | None:
    """The fewest bits any weights of a compressed-tensors folder hold (None where it is not quantized)."""
    config = json.loads((model / "config.json").read_text()).get("quantization_config") or {}
    bits = [g.get("weights", {}).get("num_bits") for g in config.get("config_groups", {}).values()]
    return min((b for b in bits if b), default=None)


def _has_gpu() -> bool:
    from pai_cookbook.core.machine import runtime

    return runtime.detect_device(dict(os.environ)).is_cuda


def throughput(server: Server, prompts: Sequence[str], *, concurrency: Sequence[int] = (1, 4, 16),
               max_tokens: int = 64, rounds: int = 2) -> list[dict[str, Any]]:
    """Tokens per second and time to first token with `c` chat requests at once, for each `c`: every request a
    streamed chat completion of exactly `max_tokens` tokens (the end-of-text token ignored), prompts taken in turn.
    `rounds` waves of `c` requests each (the figures are the waves' totals and means); one warm-up request first.
    Returns per `c`: requests, tokens, seconds, tokens_per_s, ttft_s (mean and max)."""
    client = server.client()

    def one(prompt: str) -> tuple[float, int]:
        sent = time.monotonic()
        first, tokens = None, 0
        stream = client.chat.completions.create(
            model=server.name, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0.0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - sent
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return (first if first is not None else time.monotonic() - sent), tokens

    one(prompts[0])
    rows = []
    for c in concurrency:
        out, seconds = [], 0.0
        for wave in range(rounds):
            asked = [prompts[(wave * c + i) % len(prompts)] for i in range(c)]
            started = time.monotonic()
            out += _concurrently(one, asked, c)
            seconds += time.monotonic() - started
        tokens = sum(t for _, t in out)
        rows.append({"concurrency": c, "requests": len(out), "tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds, "ttft_s": sum(f for f, _ in out) / len(out),
                     "ttft_max_s": max(f for f, _ in out)})
    return rows


if __name__ == "__main__":  # pragma: no cover - a manual check: python -m pai_cookbook.serve FOLDER
    with Server(sys.argv[1]) as _server:
        print(f"{_server.url} ready after {_server.startup_s:.0f} s; log {_server.log}")
