"""A checkpoint saved by the cookbook on one end of the supported Megatron-Core range loads on the other, at another
layout, with the same logits: 0.16 (Python 3.11) and 0.19 (Python 3.12), each run in its own environment.

This process runs one end; the other end runs in the environment `bash ci/setup_env.sh 0.16` (or the default one)
made, as a subprocess of the same cookbook code. Each end converts the same tiny Hugging Face model (Llama, and
Mixtral for the experts' sharded keys), saves it at its own layout with Megatron-Core's save, and writes its logits;
each then loads the other's checkpoint at a layout it was not saved at, and the logits are compared directly
(`parity.check_layouts`'s `logits_dir`).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pai_cookbook.core.machine import versions

pytestmark = [pytest.mark.releases, pytest.mark.multiproc]
ROOT = Path(__file__).resolve().parent.parent
# The other end's environment, by the release this process runs (ci/setup_env.sh's folders).
OTHER_VENV = {(0, 16): ROOT / ".venv", (0, 19): ROOT / ".venv-mcore016"}
LOGIT_BOUND = 1e-5  # fp32, as every layout parity check (tests/test_convert.py)

# layouts: (this end saves at, the other end saves at, this end loads the other's at, the other loads this one's at)
CASES = {"llama": ({"tensor_model_parallel_size": 1}, {"tensor_model_parallel_size": 2},
                   {"tensor_model_parallel_size": 1}, {"tensor_model_parallel_size": 2}),
         "mixtral": ({"expert_model_parallel_size": 1}, {"expert_model_parallel_size": 2},
                     {"expert_model_parallel_size": 1}, {"tensor_model_parallel_size": 2,
                                                          "expert_model_parallel_size": 2})}

# What each end runs: convert the HF model and save it with Megatron-Core's own save at its layout (`convert.reshard`,
# as a training run at that layout saves), its own logits at that layout, and the other end's checkpoint (when given)
# at another layout. argv: a JSON of {hf, out, save, logits, other_ckpt, load, run_dir}.
END = """
import json, sys
from pai_cookbook import convert, parity
from pai_cookbook.core.configs.config import ParallelConfig
from pai_cookbook.core.machine import versions
a = json.loads(sys.argv[1])
rows = {"version": str(versions.megatron_core_version())}
if a["out"]:
    convert.hf_to_megatron(a["hf"], a["out"] + "-converted", run_dir=a["run_dir"] + "/convert")
    convert.reshard(a["out"] + "-converted", a["out"], ParallelConfig(**a["save"]), run_dir=a["run_dir"] + "/save")
    rows["own"] = parity.check_layouts(a["hf"], a["out"], [ParallelConfig(**a["save"])], run_dir=a["run_dir"] + "/own",
                                       logits_dir=a["logits"] + "/own")[0]
if a["other_ckpt"]:
    rows["other"] = parity.check_layouts(a["hf"], a["other_ckpt"], [ParallelConfig(**a["load"])],
                                         run_dir=a["run_dir"] + "/other", logits_dir=a["logits"] + "/other")[0]
print("@@rows " + json.dumps(rows))
"""


def _other_python() -> Path | None:
    python = OTHER_VENV[versions.minor()] / "bin" / "python"
    return python if python.exists() else None


def _run(python: str | Path, script: str, timeout: int, **args) -> dict:
    """`script` in the Python `python` (one end's environment) with `args` as JSON; returns what it printed after
    "@@rows "."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    done = subprocess.run([str(python), "-W", "ignore", "-c", script, json.dumps(args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("@@rows ")).removeprefix("@@rows "))


def _end(python: str | Path, **args) -> dict:
    """One end's run, in the Python `python`; returns its rows (the figures and the logits files)."""
    return _run(python, END, 900, **args)


def _logits(row: dict) -> torch.Tensor:
    return load_file(row["logits_file"])["logits"]


@pytest.mark.multiproc
@pytest.mark.skipif(_other_python() is None, reason="the other end's environment is not set up: bash ci/setup_env.sh "
                    "0.16 (this end 0.19) or bash ci/setup_env.sh (this end 0.16); CI sets up both")
@pytest.mark.parametrize("family", sorted(CASES))
def test_a_checkpoint_moves_between_megatron_core_releases_both_ways(family, tmp_path):
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model

    this_save, other_save, this_load, other_load = CASES[family]
    hf = make_tiny_hf_model(family, tmp_path / "hf")
    here, there = tmp_path / "here", tmp_path / "there"
    # this end first saves its checkpoint; the other end saves its own and loads this one; then this end loads its
    mine = _end(sys.executable, hf=str(hf), out=str(here / "ckpt"), save=this_save, logits=str(here / "logits"),
                other_ckpt=None, load=None, run_dir=str(here / "runs"))
    theirs = _end(_other_python(), hf=str(hf), out=str(there / "ckpt"), save=other_save, logits=str(there / "logits"),
                  other_ckpt=str(here / "ckpt"), load=other_load, run_dir=str(there / "runs"))
    mine |= _end(sys.executable, hf=str(hf), out=None, save=None, logits=str(here / "logits"),
                 other_ckpt=str(there / "ckpt"), load=this_load, run_dir=str(here / "runs2"))
    assert {mine["version"][:4], theirs["version"][:4]} == {"0.16", "0.19"}, (mine["version"], theirs["version"])
    # each end's own checkpoint equals transformers (the bound every parity check holds)...
    assert mine["own"]["max_abs_diff"] <= LOGIT_BOUND and theirs["own"]["max_abs_diff"] <= LOGIT_BOUND
    # ...and the other end's checkpoint, at another layout, gives the logits the end that saved it computed
    forward = (_logits(theirs["other"]) - _logits(mine["own"])).abs().max().item()
    backward = (_logits(mine["other"]) - _logits(theirs["own"])).abs().max().item()
    print(f"{family}: {mine['version']} -> {theirs['version']}: {forward:.2e}; back: {backward:.2e}")
    assert forward <= LOGIT_BOUND and backward <= LOGIT_BOUND, (forward, backward)


# A training run on one end, resumed on the other (same layout: a resume at another layout is refused by design).
TRAIN = """
import json, sys
from pai_cookbook import train
from pai_cookbook.core.checkpoints import families
from pai_cookbook.core.machine import versions
from pai_cookbook.core.configs.config import CheckpointConfig, DataConfig, OptimizerConfig, RunConfig
a = json.loads(sys.argv[1])
config = RunConfig(model=families.tiny("llama"), train_iters=a["iters"],
                   data=DataConfig(seq_length=16, micro_batch_size=2, global_batch_size=4),
                   optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=1),
                   checkpoint=CheckpointConfig(save_dir=a["save_dir"], save_interval=2, keep_last=2))
r = train.run(config, run_dir=a["run_dir"], show_progress=False, echo=False)
print("@@rows " + json.dumps({"version": str(versions.megatron_core_version()), "losses": r["losses"],
                               "first_step": r["first_step"]}))
"""


def _train(python, save_dir, iters, run_dir) -> dict:
    return _run(python, TRAIN, 600, save_dir=str(save_dir), iters=iters, run_dir=str(run_dir))


@pytest.mark.multiproc
@pytest.mark.skipif(_other_python() is None, reason="the other end's environment is not set up: bash ci/setup_env.sh "
                    "0.16 (this end 0.19) or bash ci/setup_env.sh (this end 0.16); CI sets up both")
def test_a_training_run_resumes_on_the_other_release_both_ways(tmp_path):
    """4 steps on one release (saved at steps 2 and 4); its step-2 checkpoint resumed to 4 on the other release gives
    the same losses: model, optimizer state and learning-rate schedule all carry over. Measured 2026-11-27: equal bit
    for bit both ways; the bound is the fp32 parity bound of every layout check, as the releases may round apart."""
    import shutil

    from pai_cookbook.core.checkpoints import checkpoint

    ends = {"here": sys.executable, "there": _other_python()}
    straight = {end: _train(python, tmp_path / f"{end}-straight", 4, tmp_path / f"runs/{end}-straight")
                for end, python in ends.items()}
    for first, then in (("there", "here"), ("here", "there")):
        resume_dir = tmp_path / f"{first}-then-{then}"
        step2 = checkpoint.iteration_dir(tmp_path / f"{first}-straight", 2)
        shutil.copytree(step2, resume_dir / step2.name)
        resumed = _train(ends[then], resume_dir, 4, tmp_path / f"runs/{first}-then-{then}")
        assert straight[first]["version"] != resumed["version"] and resumed["first_step"] == 2, resumed
        assert resumed["losses"] == pytest.approx(straight[first]["losses"][2:], abs=LOGIT_BOUND), (first, then)
        print(f"{straight[first]['version']} -> {resumed['version']}: steps 3-4 {resumed['losses']} "
              f"(straight on {straight[first]['version']}: {straight[first]['losses'][2:]})")
