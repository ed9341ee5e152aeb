"""Work is never lost: a resumed run is the run asked for, and a non-finite step stops the run before it costs a
checkpoint (the last finite one survives and resumes)."""

import contextlib
import dataclasses
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pai_cookbook import train
from pai_cookbook.core.checkpoints import checkpoint, damage
from pai_cookbook.core.configs.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    FP8Config,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
)
from pai_cookbook.core.launching import lock, worker
from pai_cookbook.core.launching.launch import WorkerError
from tests.conftest import tiny_run, train_in_background

QUIET = {"show_progress": False, "echo": False}
DATA = DataConfig(seq_length=16, micro_batch_size=2, global_batch_size=2)


def _run(save_dir, train_iters, lr=3e-4, checkpoint_keep=2, **fields):
    return tiny_run(train_iters=train_iters, data=DATA, optimizer=OptimizerConfig(lr=lr, min_lr=lr / 10),
                    checkpoint=CheckpointConfig(save_dir=str(save_dir), save_interval=1, keep_last=checkpoint_keep),
                    **fields)


@pytest.mark.both_ends
def test_a_resumed_run_trains_its_new_steps_on_the_schedule_asked_for(tmp_path, capsys):
    """A finished 2-step run asked again for 4 steps at 10x the learning rate: steps 3-4 follow the new schedule (the
    checkpoint's, restored by Megatron-Core by default, would hold them at the old floor), and the change is said."""
    train.run(_run(tmp_path / "ckpt", 2), run_dir=tmp_path / "r1", **QUIET)
    capsys.readouterr()
    longer = _run(tmp_path / "ckpt", 4, lr=3e-3)
    resumed = train.run(longer, run_dir=tmp_path / "r2", **QUIET)
    said = capsys.readouterr().out
    assert "resuming" in said and "train_iters 2 -> 4" in said and "optimizer.lr 0.0003 -> 0.003" in said
    fresh = train.run(dataclasses.replace(longer, checkpoint=CheckpointConfig(save_dir=str(tmp_path / "fresh"))),
                      run_dir=tmp_path / "r3", **QUIET)
    assert resumed["first_step"] == 2
    assert resumed["lrs"] == pytest.approx(fresh["lrs"][2:], rel=1e-6)
    assert min(resumed["lrs"]) > 3e-4  # above the old schedule's floor (3e-5) and its peak


def test_a_resume_that_would_be_another_run_is_refused_before_launch(tmp_path):
    """Another model shape, seed or data stream pointed at a save_dir is refused naming both values, not loaded."""
    train.run(_run(tmp_path / "ckpt", 1), run_dir=tmp_path / "r1", **QUIET)
    cases = {r"model.num_layers: saved 2, asked 4": _run(tmp_path / "ckpt", 2, model_overrides={"num_layers": 4}),
             r"seed: saved 1234, asked 7": _run(tmp_path / "ckpt", 2, seed=7),
             r"data.seq_length: saved 16, asked 32": dataclasses.replace(
                 _run(tmp_path / "ckpt", 2), data=DataConfig(seq_length=32, micro_batch_size=2, global_batch_size=2))}
    for message, config in cases.items():
        with pytest.raises(ConfigError, match=rf"cannot resume .*iter_0000001: .*{message}.* new checkpoint.save_dir"):
            train.run(config, run_dir=tmp_path / "r2", **QUIET)
        assert not (tmp_path / "r2").exists()


def test_a_run_driven_to_nan_stops_at_that_step_and_its_last_finite_checkpoint_resumes(tmp_path):
    """Continued with an FP8 setting the config accepts but no value survives (tensorwise scaling with a margin of
    2**-200, 0 in fp32), the run stops at its first non-finite step, naming it and the last finite checkpoint; nothing of that
    step is saved, `keep_last` keeps the finite ones, and the run asked again in full precision resumes from the last
    finite checkpoint and trains to finite losses."""
    save_dir = tmp_path / "ckpt"
    train.run(_run(save_dir, 2), run_dir=tmp_path / "r1", **QUIET)
    no_headroom = PrecisionConfig(fp8=FP8Config(recipe="tensorwise", margin=200))
    with pytest.raises(WorkerError, match=r"step (\d+): the loss is (nan|inf).*last finite checkpoint is") as err:
        train.run(_run(save_dir, 8, precision=no_headroom), run_dir=tmp_path / "r2", **QUIET)
    stopped = int(re.search(r"step (\d+): the loss is", str(err.value)).group(1))
    history = train.history(tmp_path / "r2")
    assert stopped == 3 and history["steps"][-1] == 3 and not math.isfinite(history["losses"][-1])
    kept = checkpoint.finished_iterations(save_dir)
    assert [k.name for k in kept] == ["iter_0000001", "iter_0000002"]  # nothing of step 3, the finite ones kept
    assert f"last finite checkpoint is {kept[-1]}" in str(err.value) and "precision.fp8" in str(err.value)
    resumed = train.run(_run(save_dir, 4), run_dir=tmp_path / "r3", **QUIET)
    assert resumed["started_from"] == str(kept[-1]) and all(math.isfinite(x) for x in resumed["losses"])


def test_weights_an_update_broke_are_never_saved(tmp_path):
    """At a rate past fp32's range (1e39) the first update turns the weights to Inf/NaN although its loss and gradient
    norm were finite: the save after it finds them, stops the run and writes nothing, so every checkpoint left is one
    a run can resume from."""
    with pytest.raises(WorkerError, match=r"after step 1 the weights hold NaN or Inf \(the update itself overflowed\); "
                                          r"the run stops here and saves nothing"):
        train.run(_run(tmp_path / "ckpt", 2, lr=1e39), run_dir=tmp_path / "r", **QUIET)
    assert checkpoint.finished_iterations(tmp_path / "ckpt") == []


def test_a_non_finite_critic_stops_the_run_and_is_named(tmp_path):
    """PPO trains two models: a step whose critic diverged stops the run as the policy's would, and says it was the
    critic (the message a worker raises; tests/test_rlhf.py runs a diverging GRPO)."""
    from pai_cookbook.workers import run_state

    policy = {"loss": 0.5, "grad_norm": 1.0}
    assert run_state.finite(policy) and run_state.finite(policy | {"value_loss": 0.1, "critic_grad_norm": 2.0})
    diverged = policy | {"value_loss": math.nan, "critic_grad_norm": math.inf}
    assert not run_state.finite(diverged) and not run_state.finite({"loss": 0.5, "grad_norm": math.nan})
    with pytest.raises(run_state.NonFiniteError, match=r"step 7: the loss is 0.5 and the gradient norm 1.0, the "
                                                       r"critic's loss nan and gradient norm inf; the run stops here"):
        run_state.stop_non_finite(_run(tmp_path / "ckpt", 8), 7, diverged, "start")


def _holder(folder, tmp_path) -> subprocess.Popen:
    """Another process holding `folder`'s lock (as a running launch does) until it is killed."""
    ready = tmp_path / f"held-{Path(folder).name}"
    code = (f"import time; from pathlib import Path; from pai_cookbook.core.launching import lock\n"
            f"with lock.hold({str(folder)!r}, 'training'):\n"
            f"    Path({str(ready)!r}).touch(); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def test_a_second_writer_of_a_folder_is_refused_before_it_touches_it(tmp_path):
    """Training (a run, a reward model) into a save_dir or a run folder another process writes, and converting into an
    output another process writes, are refused before any check deletes anything (a `.partial` of the first writer
    survives)."""
    from pai_cookbook import convert
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model

    save_dir, run_dir, out = tmp_path / "ckpt", tmp_path / "run", tmp_path / "converted"
    (save_dir / "iter_0000002.partial").mkdir(parents=True)  # the first writer's save in progress
    holders = [_holder(folder, tmp_path) for folder in (save_dir, run_dir, out)]
    try:
        pid = holders[0].pid
        with pytest.raises(lock.FolderInUse, match=rf"ckpt is being written by pid {pid} on .*training.*another folder"):
            train.run(_run(save_dir, 2), run_dir=tmp_path / "other", **QUIET)
        assert (save_dir / "iter_0000002.partial").exists() and not (tmp_path / "other").exists()
        with pytest.raises(lock.FolderInUse, match=rf"run is being written by pid {holders[1].pid}"):
            train.run(_run(tmp_path / "ckpt2", 2), run_dir=run_dir, **QUIET)
        assert not (tmp_path / "ckpt2").exists()
        hf = make_tiny_hf_model("llama", tmp_path / "hf")
        with pytest.raises(lock.FolderInUse, match=rf"converted is being written by pid {holders[2].pid}"):
            convert.hf_to_megatron(hf, out)
        assert not out.exists() and not (tmp_path / "converted.partial").exists()
        # a reward model takes the one training launch, locks and all (it took none before)
        from pai_cookbook import reward_model
        from tests.test_reward_model import PAIRS

        base = tmp_path / "base"
        convert.hf_to_megatron(hf, base)
        with pytest.raises(lock.FolderInUse, match=rf"ckpt is being written by pid {pid}"):
            reward_model.train(base, PAIRS[:8], reward_model.RewardModelConfig(steps=1, global_batch_size=8),
                               save_dir=save_dir, run_dir=tmp_path / "rm_run", **QUIET)
        assert (save_dir / "iter_0000002.partial").exists() and not (tmp_path / "rm_run").exists()
    finally:
        for proc in holders:
            proc.kill()
            proc.wait()
    # the holders are gone (killed: their locks went with them): the folder is free, and whose lock was taken over
    # is said
    convert.hf_to_megatron(hf, out)
    assert checkpoint.read_config(out)[0].num_layers == 2


def _run_processes(run_dir: Path) -> list[psutil.Process]:
    """Processes whose environment names `run_dir` as their run folder (the launcher sets it for torchrun, the
    workers and what they start)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(worker.RUN_DIR_ENV) == str(run_dir.resolve()):
                found.append(proc)
    return found


@pytest.mark.multiproc
def test_sigkill_of_the_launcher_ends_every_worker_and_the_rerun_resumes(tmp_path):
    """A notebook kernel restarted (SIGKILL of the launching process) while 2 processes train: 10 s later nothing of
    the run is alive, so the re-run is no second writer; it resumes from the last checkpoint and finishes."""
    config = tiny_run(parallel=ParallelConfig(tensor_model_parallel_size=2), train_iters=400, data=DATA,
                      checkpoint=CheckpointConfig(save_dir=str(tmp_path / "ckpt"), save_interval=5, keep_last=2))
    victim = train_in_background(config, tmp_path, 2, tmp_path / "r1", poll_s=0.05)
    assert checkpoint.finished_iterations(tmp_path / "ckpt"), "no checkpoint within 300 s"
    assert len(_run_processes(tmp_path / "r1")) >= 3  # torchrun and its two workers
    victim.kill()
    victim.wait()
    time.sleep(10)
    assert _run_processes(tmp_path / "r1") == []
    kept = checkpoint.finished_iterations(tmp_path / "ckpt")
    shorter = dataclasses.replace(config, train_iters=int(kept[-1].name.split("_")[1]) + 5)
    resumed = train.run(shorter, nproc_per_node=2, run_dir=tmp_path / "r2", **QUIET)
    assert resumed["started_from"] == str(kept[-1]) and len(resumed["losses"]) == 5


def test_inputs_that_gave_silent_wrong_results_or_raw_errors_are_refused_naming_the_fix(tmp_path):
    """Found by the probe: a string where a list of texts belongs (learned a character at a time), a JSON text field
    holding a dict (its repr tokenized), answers that are all empty (only stop tokens trained), 0 processes
    (ZeroDivisionError)."""
    import json

    from pai_cookbook import data, extend, sft
    from pai_cookbook.fixtures import smollm2

    with pytest.raises(ConfigError, match=r"texts must be a list of strings \(a single string would be learned one "
                                          r"character at a time.*got one str .*pass \['some string'\]"):
        extend.extend_tokenizer(smollm2.hf_folder(), "some string", tmp_path / "ext", 100)
    assert not (tmp_path / "ext").exists()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": {"content": "nested"}}) + "\n")
    with pytest.raises(data.DataError, match=rf"{corpus}:2: field 'text' holds a dict, not text"):
        list(data.read_documents(corpus))
    empty = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]}] * 2
    with pytest.raises(sft.SFTError, match="every answer of the 2 conversations is empty"):
        sft.prepare(empty, tmp_path / "set", smollm2.hf_folder(), seq_length=64)
    with pytest.raises(ConfigError, match=r"nproc_per_node=0; give the number of processes"):
        train.run(_run(tmp_path / "ckpt", 1), nproc_per_node=0, run_dir=tmp_path / "r", **QUIET)


def test_a_checkpoint_write_that_fills_the_disk_says_so_with_the_folder(tmp_path, monkeypatch):
    """Issue 39, finding 4: torch_dist's writer reports a full disk as "unexpected pos 704 vs 598", with neither the
    cause nor the path."""
    import errno
    import shutil

    folder = tmp_path / "ckpt" / "iter_0000002.partial"
    raw = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert checkpoint.disk_full(raw, folder) is raw  # a disk with room: the error as it was
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100, 100, 0))
    said = checkpoint.disk_full(raw, folder)
    assert isinstance(said, OSError) and said.errno == errno.ENOSPC
    assert f"No space left on device while saving {folder} (0 bytes free" in str(said) and "unexpected pos" in str(said)


def test_a_damaged_latest_checkpoint_is_set_aside_and_the_run_resumes_from_the_last_complete_one(tmp_path, capsys):
    """The latest checkpoint's tensor file cut short (a disk that filled after the save, a copy cut short): a resume
    sets it aside (kept, never loaded) and continues from the one before, exactly; generation refuses it by name."""
    from pai_cookbook import generate

    first = train.run(_run(tmp_path / "ckpt", 3, checkpoint_keep=3), run_dir=tmp_path / "r1", **QUIET)
    latest = checkpoint.finished_iterations(tmp_path / "ckpt")[-1]
    assert latest.name == "iter_0000003"
    victim = sorted(latest.glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:-1000])
    assert "bytes, its tensors need" in damage.damage(latest)
    with pytest.raises(ConfigError, match=rf"iter_0000003 is damaged: {victim.name} is \d+ bytes"):
        generate.resolve_checkpoint(tmp_path / "ckpt")
    capsys.readouterr()
    resumed = train.run(_run(tmp_path / "ckpt", 3, checkpoint_keep=3), run_dir=tmp_path / "r2", **QUIET)
    said = capsys.readouterr().out
    assert "iter_0000003 is damaged" in said and "set aside as iter_0000003.damaged" in said
    assert resumed["first_step"] == 2 and resumed["losses"] == first["losses"][2:]
    assert (tmp_path / "ckpt" / "iter_0000003.damaged" / victim.name).exists()
    assert damage.damage(checkpoint.finished_iterations(tmp_path / "ckpt")[-1]) is None


def test_a_resume_whose_only_checkpoint_is_damaged_starts_over_and_says_so(tmp_path, capsys):
    first = train.run(_run(tmp_path / "ckpt", 1, checkpoint_keep=1), run_dir=tmp_path / "r1", **QUIET)
    only = checkpoint.finished_iterations(tmp_path / "ckpt")[-1]
    (only / ".metadata").write_bytes(b"")
    capsys.readouterr()
    again = train.run(_run(tmp_path / "ckpt", 1, checkpoint_keep=1), run_dir=tmp_path / "r2", **QUIET)
    said = capsys.readouterr().out
    assert "iter_0000001 is damaged (its metadata (.metadata) cannot be read" in said
    assert "no complete checkpoint is left, so the run starts from its beginning" in said
    assert again["first_step"] == 0 and again["losses"] == first["losses"]


def test_ppo_policy_and_critic_resume_from_a_step_both_hold(tmp_path, monkeypatch, capsys):
    """A run stopped between the policy's and the critic's save (or one of them damaged): the step only one holds is
    set aside, so both resume from the same step instead of failing in the workers."""
    from types import SimpleNamespace

    from pai_cookbook import rlhf

    monkeypatch.setattr(damage, "damage", lambda ckpt: None)  # whole checkpoints: only their steps differ
    policy, critic = tmp_path / "ppo", tmp_path / "ppo" / "critic"
    for folder, steps in ((policy, (2, 3)), (critic, (2,))):
        for step in steps:
            checkpoint.iteration_dir(folder, step).mkdir(parents=True)
            (checkpoint.iteration_dir(folder, step) / checkpoint.CONFIG_FILE).write_text("{}")
    job = SimpleNamespace(run=SimpleNamespace(checkpoint=CheckpointConfig(save_dir=str(policy))),
                          critic=SimpleNamespace(checkpoint=CheckpointConfig(save_dir=str(critic))))
    rlhf.pair_critic(job)
    assert [p.name for p in checkpoint.finished_iterations(policy)] == ["iter_0000002"]
    assert (policy / "iter_0000003.unpaired").is_dir()
    assert "step 3 has no partner in the other model's folder; policy and critic resume from step 2" in \
        capsys.readouterr().out
