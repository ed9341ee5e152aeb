"""Shared helpers: tiny configs and real torchrun runs of tests/workers/scenarios.py."""

import pytest

from pai_cookbook.core.checkpoints import families
from pai_cookbook.core.configs.config import DataConfig, RunConfig
from pai_cookbook.core.launching import launch
from tests.workers.scenarios import Scenario


def tiny_run(family: str = "llama", *, model_overrides: dict | None = None, **fields) -> RunConfig:
    """A RunConfig small enough for a 2-core CPU: 2 layers, width 64, 8 x 32 tokens per step."""
    fields.setdefault("data", DataConfig(seq_length=32, micro_batch_size=2, global_batch_size=8))
    fields.setdefault("train_iters", 2)
    return RunConfig(model=families.tiny(family, **(model_overrides or {})), **fields)


def random_sft_samples() -> list:
    """24 random conversations of 5-60 ids (length-skewed), the first ~40% of each a prompt outside the loss,
    in the tiny model's 256-token vocabulary (tests/test_sft.py packs them; tests/test_lora.py trains on them)."""
    import torch

    from pai_cookbook.sft import Sample

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 61, (24,), generator=generator).tolist()
    return [Sample(ids=torch.randint(3, 256, (n,), generator=generator).tolist(),
                   loss_mask=[i >= 0.4 * n for i in range(n)], line=k + 1) for k, n in enumerate(lengths)]


def runnable_families() -> list[str]:
    """The families the installed Megatron-Core runs (multi-latent attention from 0.17 on, hybrids from 0.19 on:
    `layout.check`)."""
    from pai_cookbook.core.machine import versions

    return [f for f in families.supported() if (versions.minor() >= (0, 17) or not families.tiny(f).multi_latent_attention)
            and (versions.minor() >= (0, 19) or not families.tiny(f).is_hybrid)]


def layout_for(family: str, tp: int = 1, pp: int = 1, ep: int = 1, **fields):
    """ParallelConfig(TP, PP, EP) for `family`'s tiny model (`layout.for_model`: GPT-OSS's experts at expert-TP 1)."""
    from pai_cookbook.core.configs import layout

    return layout.for_model(families.tiny(family), tp, pp, ep, **fields)


def on_both_ends(family: str):
    """A test parameter for `family`, in both tiers (marker both_ends) where every supported release runs it."""
    model = families.tiny(family)
    return pytest.param(family, marks=[] if model.multi_latent_attention or model.is_hybrid else [pytest.mark.both_ends])


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """family -> (tiny HF folder, Megatron-Core checkpoint, HF export of it), made once per session for
    the conversion and generation tests."""
    from pai_cookbook import convert
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("convert")
    out = {}
    for family in runnable_families():
        hf = make_tiny_hf_model(family, root / family)
        ckpt, back = root / f"{family}-mcore", root / f"{family}-hf"
        convert.hf_to_megatron(hf, ckpt)
        convert.megatron_to_hf(ckpt, back)
        out[family] = (hf, ckpt, back)
    return out


@pytest.fixture
def run_scenario(tmp_path):
    """Run a scenario under torchrun; returns rank 0's result or raises launch.WorkerError."""
    counter = iter(range(1000))

    def run(config: RunConfig, nproc: int = 1, scenario: str = "train", skip: str = "") -> dict:
        return launch.launch(Scenario(config=config, scenario=scenario), nproc_per_node=nproc,
                             run_dir=tmp_path / f"run{next(counter)}",
                             env={"PAI_COOKBOOK_COMPAT_SKIP": skip}, echo=False, show_progress=False)

    def run_layouts(configs: list[RunConfig], nproc: int, scenario: str = "layouts") -> list[dict]:
        """Train each config in one launch of `nproc` processes (parallel state rebuilt per config)."""
        job = Scenario(config=configs[0], scenario=scenario, layouts=configs)
        return launch.launch(job, nproc_per_node=nproc, run_dir=tmp_path / f"run{next(counter)}", echo=False,
                             show_progress=False)["runs"]

    run.layouts = run_layouts
    return run


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything starts a worker: for inputs that must be refused before launch."""
    def fail(*args, **kwargs):
        raise AssertionError("a worker was launched for an input that should have been refused")
    monkeypatch.setattr(launch, "launch", fail)


def train_in_background(config: RunConfig, folder, nproc: int, run_dir, poll_s: float = 0.01):
    """`train.run(config)` in another Python process (a notebook kernel, say), returned once its save_dir holds a
    finished checkpoint (or after 300 s)."""
    import subprocess
    import sys
    import time

    from pai_cookbook.core.checkpoints import checkpoint

    config.save(folder / "config.json")
    code = (f"from pai_cookbook import train; from pai_cookbook.core.configs.config import RunConfig; "
            f"train.run(RunConfig.load({str(folder / 'config.json')!r}), nproc_per_node={nproc}, "
            f"run_dir={str(run_dir)!r}, show_progress=False, echo=False)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not checkpoint.finished_iterations(config.checkpoint.save_dir) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return proc



@pytest.fixture(scope="session")
def serving_env():
    """The serving environment's Python (vLLM, llm-compressor). Under ci/test.sh it is set up beside the tests
    (`serve.SETUP_STATUS_ENV`): waited for, and a failed setup fails the test; elsewhere a missing one skips, naming
    the command."""
    import os

    from pai_cookbook import serve
    from pai_cookbook.core.configs.config import ConfigError

    try:
        return serve.serving_python()
    except ConfigError as e:
        if os.environ.get(serve.SETUP_STATUS_ENV):
            pytest.fail(str(e))
        pytest.skip(str(e))
