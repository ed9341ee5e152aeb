"""lm-evaluation-harness on a Megatron-Core checkpoint: `MegatronLM`, a harness model whose three requests are
`pai_cookbook.evaluate`'s (one launch per request type, at any TP/PP layout), registered as "pai-megatron".

    import lm_eval
    from pai_cookbook.harness import MegatronLM

    lm = MegatronLM(ckpt="outputs/06_sft/sft", tensor_parallel_size=2)
    results = lm_eval.simple_evaluate(model=lm, tasks=["mmlu", "lambada_openai"])  # tasks from the hub need internet

It tokenizes as the harness's Hugging Face model does (`evaluate.encode`: the tokenizer's defaults, the prefix token
BOS else EOS), cuts contexts on the left where they exceed the model's positions as that model does, and reads the
model's positions from the checkpoint, so its log-likelihoods are that model's on the checkpoint's Hugging Face
export (`tests/test_harness.py`). From a shell the harness has no plugin mechanism, so this module registers the model
and runs the harness's own command line:

    python -m pai_cookbook.harness --model pai-megatron --model_args ckpt=CKPT,tensor_parallel_size=2 --tasks mmlu
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  the harness's own models stay registered beside this one
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from pai_cookbook import evaluate
from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import ConfigError, PrecisionConfig

NAME = "pai-megatron"
HARNESS_SUPPLIED = ("device", "max_batch_size")
"""Arguments the harness's command line gives every model: the workers' devices are the launch's, and `batch_size`
is the sequences per forward pass, so these are ignored."""
DEFAULT_MAX_GEN_TOKS = 256
"""The harness's own default for generation tasks that do not set `max_gen_toks`."""


def _flag(value: Any) -> bool:
    """A boolean from Python or from `--model_args` text ("True", "false", "1")."""
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes")


@register_model(NAME)
class MegatronLM(TemplateLM):
    """A Megatron-Core checkpoint as a harness model. Each request type the harness sends is one torchrun launch of
    `workers.evaluate` (or the generation worker); `launches` lists what each took."""

    def __init__(self, ckpt: str | Path | None = None, pretrained: str | Path | None = None, *,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, sequence_parallel: bool = False,
                 batch_size: int | str = 8, dtype: str = "fp32", run_dir: str | Path = "runs/harness",
                 show_progress: bool = True, **unused: Any):
        super().__init__()
        from pai_cookbook.generate import resolve_checkpoint

        path = ckpt or pretrained
        if not path:
            raise ConfigError("MegatronLM needs the checkpoint to evaluate: ckpt=<a cookbook checkpoint or save_dir> "
                              "(--model_args ckpt=... from a shell).")
        unused = {k: v for k, v in unused.items() if k not in HARNESS_SUPPLIED}
        if unused:
            raise ConfigError(f"MegatronLM does not take {sorted(unused)}; it takes ckpt (or pretrained), "
                              f"tensor_parallel_size, pipeline_parallel_size, sequence_parallel, batch_size, dtype, "
                              f"run_dir, show_progress.")
        self.ckpt = resolve_checkpoint(path)
        self.tokenizer = evaluate.tokenizer(self.ckpt)
        self.max_length = evaluate.max_length(self.ckpt)
        model, _ = checkpoint.read_config(self.ckpt)
        # for this model (GPT-OSS's experts at expert-TP 1)
        self.parallel = layout.for_model(model, int(tensor_parallel_size), int(pipeline_parallel_size),
                                         sequence_parallel=_flag(sequence_parallel))
        layout.check(model, self.parallel, purpose="load")
        self.precision = PrecisionConfig(dtype=dtype)
        if str(batch_size).startswith("auto"):
            batch_size = 8  # no probing: a launch per request type, whose batch is the sequences per forward pass
        self.batch_size = int(batch_size)
        self.run_dir, self.show_progress = Path(run_dir), _flag(show_progress)
        self.launches: list[dict[str, Any]] = []
        self._count = itertools.count()

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return evaluate.prefix_id(self.tokenizer)

    @property
    def tokenizer_name(self) -> str:
        return str(self.ckpt / checkpoint.HF_ASSETS)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return evaluate.encode(self.tokenizer, string, add_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt through the checkpoint tokenizer's chat template (`--apply_chat_template`), rendered as the
        harness's Hugging Face model renders it: text, then encoded as any prompt is; a template that refuses a system
        role is given the history without it, as that model does."""
        import jinja2

        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"{self.ckpt}'s tokenizer has no chat template, so --apply_chat_template has nothing to "
                              f"apply; leave it out, or give the checkpoint a tokenizer with one ({checkpoint.HF_ASSETS}/).")

        def render(history: list[dict[str, str]]) -> str:
            return self.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)
        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            return render([message for message in chat_history if message["role"] != "system"])

    def _launch_dir(self, kind: str) -> Path:
        return self.run_dir / f"{next(self._count):03d}_{kind}"

    def _scores(self, pairs: list[tuple[list[int], list[int]]], kind: str, disable_tqdm: bool) -> list[dict]:
        out = evaluate.loglikelihood_tokens(self.ckpt, pairs, parallel=self.parallel, precision=self.precision,
                                            batch=self.batch_size, truncate=True, run_dir=self._launch_dir(kind),
                                            show_progress=self.show_progress and not disable_tqdm)
        self.launches.append({"kind": kind, "requests": len(pairs), **out["seconds"],
                              "sequences_per_s": out["sequences_per_s"], "truncated": out["truncated"]})
        return out["results"]

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple]:
        """(log-probability, is greedy) of each (key, context ids, continuation ids), in order."""
        if not requests:
            return []
        results = self._scores([(list(c), list(x)) for _, c, x in requests], "loglikelihood", disable_tqdm)
        return [(r["logprob"], r["greedy"]) for r in results]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over `evaluate.text_windows` (the harness's windows), all in one launch."""
        windows, owner = evaluate.text_windows(self.tokenizer, [req.args[0] for req in requests], self.max_length)
        totals = [0.0] * len(requests)
        for i, result in zip(owner, self._scores(windows, "rolling", disable_tqdm) if windows else []):
            totals[i] += result["logprob"]
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy answers (`evaluate.generate_until`), each cut before its stop strings and the end-of-text token's
        text, the context cut on the left to leave room for `max_gen_toks`; one launch per `max_gen_toks`."""
        eos = self.tokenizer.decode([self.eot_token_id])
        groups: dict[int, list[int]] = {}
        asks = []
        for i, req in enumerate(requests):
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            if kwargs.get("do_sample") or (kwargs.get("temperature") or 0.0) > 0:
                raise ConfigError(f"request {i} asks for sampling ({kwargs}); MegatronLM generates greedily, as "
                                  f"benchmarks score. Set do_sample=False in the task's generation_kwargs.")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            asks.append((context, until + ([eos] if eos not in until else [])))
            groups.setdefault(int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)), []).append(i)
        answers: list[str] = [""] * len(requests)
        for max_new_tokens, members in groups.items():
            run_dir = self._launch_dir("generate")
            texts = evaluate.generate_until(self.ckpt, [asks[i] for i in members], max_new_tokens=max_new_tokens,
                                            parallel=self.parallel, truncate=True, run_dir=run_dir,
                                            show_progress=self.show_progress and not disable_tqdm)
            self.launches.append({"kind": "generate", "requests": len(members)})
            for i, text in zip(members, texts):
                answers[i] = text
        return answers


class ServedLM(MegatronLM):
    """A model behind a running `serve.Server` as a harness model: the same requests as `MegatronLM`'s, tokenized the
    same way, answered by the server (log-likelihoods from vLLM's prompt log-probabilities, greedy answers from its
    completions), so a quantized model is scored on what it serves."""

    def __init__(self, server: Any, *, show_progress: bool = False):
        TemplateLM.__init__(self)
        if not evaluate.served(server):
            raise ConfigError(f"ServedLM takes a running serve.Server; found {type(server).__name__}.")
        self.server, self.ckpt = server, server.model
        self.tokenizer, self.max_length = server.tokenizer, evaluate.max_length(server)
        self.show_progress = show_progress
        self.launches: list[dict[str, Any]] = []

    @property
    def tokenizer_name(self) -> str:
        return str(self.server.model)

    def _scores(self, pairs: list[tuple[list[int], list[int]]], kind: str, disable_tqdm: bool) -> list[dict]:
        out = evaluate.loglikelihood_tokens(self.server, pairs, truncate=True)
        self.launches.append({"kind": kind, "requests": len(pairs), **out["seconds"],
                              "sequences_per_s": out["sequences_per_s"], "truncated": out["truncated"]})
        return out["results"]

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy answers from the server, cut before their stop strings (the end-of-text token ends them)."""
        answers = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            room = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            ids = evaluate.encode(self.tokenizer, context)[-(self.max_length - room):]
            text = self.tokenizer.decode(self.server.greedy_ids([ids], room)[0], skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0] if stop else text
            answers.append(text)
        return answers


KINDS = ("multiple_choice", "cloze", "perplexity")
MMLU_PROMPT = "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:"
"""The harness's own `mmlu` prompt: the question, the lettered choices, then "Answer:" (the choices scored are the
letters)."""


def local_tasks(folder: str | Path, tasks: dict[str, tuple[str, list[dict[str, Any]]]]) -> Path:
    """Harness tasks that read local files (for machines that reach no dataset hub): each name's items written as
    JSONL beside a task YAML of its kind; returns the folder to pass as `include_path`.

    Kinds: "multiple_choice" (items {"question", "choices" (4), "answer" (0-3)}, the harness's MMLU prompt, accuracy);
    "cloze" (items {"context", "word"}: LAMBADA's form, the word after a space; accuracy: the word is the greedy
    continuation, and perplexity); "perplexity" (items {"text"}: rolling log-likelihood, word and byte perplexity,
    bits per byte).
    """
    import yaml

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, (kind, items) in tasks.items():
        if kind not in KINDS:
            raise ConfigError(f"task {name!r}: kind {kind!r} is not one of {KINDS}.")
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
        config: dict[str, Any] = {"task": name, "dataset_path": "json",
                                  "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
                                  "test_split": "test", "metadata": {"version": 1.0}}
        if kind == "multiple_choice":
            config |= {"output_type": "multiple_choice", "doc_to_text": MMLU_PROMPT,
                       "doc_to_choice": list("ABCD"), "doc_to_target": "answer",
                       "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
        elif kind == "cloze":
            config |= {"output_type": "loglikelihood", "doc_to_text": "{{context}}", "doc_to_target": " {{word}}",
                       "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                                       {"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
        else:
            config |= {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                       "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")]}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    return folder


def run(lm: Any, tasks: list[str], *, include_path: str | Path | None = None, limit: int | None = None,
        num_fewshot: int | None = None, apply_chat_template: bool = False) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` of `lm` on `tasks` (names the harness knows, or defined in `include_path`), the
    per-sample results kept (`log_samples`), no bootstrap of standard errors; `apply_chat_template` renders each prompt
    through the model's chat template (the harness's `--apply_chat_template`).

    Raises:
        ConfigError: a task name the harness does not know, or a task it cannot load (its data on a hub this machine
        does not reach), before the model runs.
    """
    from lm_eval import simple_evaluate

    folder = Path(include_path).resolve() if include_path else None
    stamp = tuple(sorted((f.name, f.stat().st_mtime_ns) for f in folder.rglob("*.yaml"))) if folder else ()
    manager = _task_manager(str(folder) if folder else None, stamp)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"the harness knows no task {unknown}; give one of its tasks (`lm_eval ls tasks`) or define "
                          f"it from local files (harness.local_tasks, then include_path=that folder).")
    before = len(getattr(lm, "launches", []))
    try:
        with _quiet():
            return simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                   num_fewshot=num_fewshot, bootstrap_iters=0, log_samples=True,
                                   apply_chat_template=apply_chat_template)
    except Exception as err:
        if len(getattr(lm, "launches", [])) > before:  # the model ran: not a loading problem
            raise
        raise ConfigError(f"the harness could not load {tasks} ({type(err).__name__}: {str(err)[:300]}); a task whose "
                          f"data is on the Hugging Face hub needs internet. Define it from local files instead "
                          f"(harness.local_tasks).") from err


@functools.lru_cache(maxsize=8)
def _task_manager(include_path: str | None, stamp: tuple):
    """The harness's task index (with `include_path`'s tasks), built once per folder and state of its task files
    (`stamp`: their names and times): it reads every task file the harness ships (thousands), 10-20 s on a 2-core
    machine."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def _silent(bar: Any, *args: Any, **kwargs: Any) -> Any:
    return bar(*args, **(kwargs | {"disable": True}))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """While `run` runs the harness: no text bar per document built, per tokenizing pass or per request batch (the
    harness's own bars; a launch shows the cookbook's), nor `datasets`' per file read."""
    import datasets
    import lm_eval.api.model
    import lm_eval.api.task
    import lm_eval.models.huggingface

    modules = (lm_eval.api.model, lm_eval.api.task, lm_eval.models.huggingface)
    saved = [m.tqdm for m in modules]
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    for module, bar in zip(modules, saved):
        module.tqdm = functools.partial(_silent, bar)
    try:
        yield
    finally:
        for module, bar in zip(modules, saved):
            module.tqdm = bar
        if shown:
            datasets.enable_progress_bars()


USAGE = f"""python -m pai_cookbook.harness: lm-evaluation-harness's command line with the model "{NAME}" registered.

    python -m pai_cookbook.harness --model {NAME} --model_args ckpt=CKPT[,KEY=VALUE...] --tasks TASKS [harness options]

{NAME} takes in --model_args: ckpt (a cookbook checkpoint, or a training save folder: its latest iteration),
tensor_parallel_size, pipeline_parallel_size, sequence_parallel, batch_size (sequences per forward pass), dtype
(fp32, bf16), run_dir (the launches' logs), show_progress. The harness's own options: python -m lm_eval --help."""


def _model_args(argv: list[str]) -> list[str]:
    """`ckpt=` named as the harness names a model (`pretrained=`, which MegatronLM takes too), so its results record the
    checkpoint and --output_path files go to a folder named after it."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--model_args="):
            out[i] = "--model_args=" + _named(arg.split("=", 1)[1])
        elif arg == "--model_args" and i + 1 < len(out):
            out[i + 1] = _named(out[i + 1])
    return out


def _named(model_args: str) -> str:
    parts = model_args.split(",")
    if any(p.startswith("pretrained=") for p in parts):
        return model_args
    return ",".join("pretrained=" + p[len("ckpt="):] if p.startswith("ckpt=") else p for p in parts)


def main(argv: list[str] | None = None) -> int:
    """The harness's command line, with "pai-megatron" registered (`python -m pai_cookbook.harness --help`); bad input
    for the model (a key it does not take, a layout the checkpoint cannot load at) is one line and exit 2."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    sys.argv = [sys.argv[0], *_model_args(argv)]
    try:
        cli_evaluate()
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
