"""A disk that fills while the cookbook writes: every writer (conversion both ways, a training checkpoint, an SFT set)
says the disk is full and names the folder, and leaves nothing a later run loads. On a real full disk: a tmpfs of a
few kilobytes mounted for the test, where each writer meets the error the OS and its library really give (torch_dist's
"unexpected pos", safetensors' SafetensorError, torch's CheckpointException, which is not an Exception). Mounting needs
root; elsewhere these tests are skipped with the reason."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

from pai_cookbook import convert
from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs.config import CheckpointConfig
from tests.conftest import tiny_run

FULL = r"(?s)No space left on device while saving \S*{where} \([\d,]+ bytes free there; .*\)\. Free space or save elsewhere; "


@pytest.fixture
def small_disk(tmp_path):
    """A mounted tmpfs of `size` (a callable: size -> folder), unmounted after the test."""
    mounts = []

    def make(size: str):
        folder = tmp_path / f"disk{len(mounts)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the full-disk tests need root")
        mounts.append(folder)
        return folder

    yield make
    for folder in mounts:
        subprocess.run(["umount", str(folder)], capture_output=True)


def test_both_conversions_say_the_disk_is_full_and_publish_nothing(converted, small_disk):
    hf, ckpt, _ = converted["llama"]
    disk = small_disk("64k")
    for _ in range(2):  # the second meets what the first left (its lock file), as a user's re-run would
        with pytest.raises(OSError, match=FULL.format(where="mcore.partial") + "nothing of mcore is left half-written"):
            convert.hf_to_megatron(hf, disk / "mcore")
        with pytest.raises(OSError, match=FULL.format(where="hf.partial") + "nothing of hf is left half-written"):
            convert.megatron_to_hf(ckpt, disk / "hf")
        assert sorted(p.name for p in disk.iterdir() if not p.name.startswith(".")) == []


def test_a_training_checkpoint_on_a_full_disk_is_said_so_and_never_loadable(small_disk, tmp_path):
    disk = small_disk("64k")
    config = dataclasses.replace(tiny_run(), checkpoint=CheckpointConfig(save_dir=str(disk / "run"), save_interval=2))
    from pai_cookbook import train

    with pytest.raises(OSError, match=FULL.format(where="run") + "a re-run resumes from the last finished"):
        train.run(config, run_dir=tmp_path / "logs", show_progress=False, echo=False)
    assert checkpoint.finished_iterations(disk / "run") == []  # the half-written save is a .partial folder


def test_an_sft_set_on_a_full_disk_is_said_so_and_nothing_is_kept(small_disk):
    from pai_cookbook import sft
    from pai_cookbook.fixtures import smollm2
    from tests.test_bad_inputs import CHAT

    disk = small_disk("8k")
    with pytest.raises(OSError, match=FULL.format(where="set.partial") + "nothing was kept; give another out_dir"):
        sft.prepare([{"messages": CHAT}] * 64, disk / "set", smollm2.hf_folder(), seq_length=64, template="chatml")
    assert sorted(p.name for p in disk.iterdir() if not p.name.startswith(".")) == []


def test_every_checkpoint_writer_says_the_disk_is_full_and_leaves_nothing(converted, small_disk):
    """Resharding and upcycling (their workers save through `checkpoint.save`) and extending a tokenizer: on a full disk
    the disk is named as full with what a re-run does, not as a crash "a re-run resumes from", and no `.partial` is left
    on it (each ended as a WorkerError advising a resume, `.partial` left behind; extending raised a bare OSError)."""
    from pai_cookbook import corpora, extend, moe
    from pai_cookbook.core.configs.config import ParallelConfig
    from pai_cookbook.fixtures import smollm2

    _, ckpt, _ = converted["llama"]
    disk = small_disk("64k")
    writers = {"resharded": lambda out: convert.reshard(ckpt, out, ParallelConfig(), run_dir=disk.parent / "r1"),
               "upcycled": lambda out: moe.upcycle(ckpt, out, num_experts=2, run_dir=disk.parent / "r2"),
               "extended": lambda out: extend.extend_tokenizer(smollm2.hf_folder(), corpora.chinese(limit=400), out, 50)}
    for name, write in writers.items():
        then = "was kept" if name == "extended" else "is left half-written"
        with pytest.raises(OSError, match=FULL.format(where=f"{name}(.partial)?") + f"nothing of {name} {then}"):
            write(disk / name)
        assert sorted(p.name for p in disk.iterdir() if not p.name.startswith(".")) == [], name
