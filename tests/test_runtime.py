"""Device and launch-environment detection."""

import logging
import os
import socket
import subprocess
import sys

import pytest
import torch

from pai_cookbook.core.machine import runtime, versions


def test_single_machine_gets_a_free_local_port():
    env = runtime.detect_launch_env({})
    assert not env.multi_node and env.nnodes == 1 and env.master_addr == "127.0.0.1" and env.master_port > 0


def test_a_chosen_port_is_below_the_ephemeral_range():
    # where no outgoing connection can take it between the launcher choosing it and the rendezvous binding it
    low = runtime._ephemeral_low()
    if low is None:
        pytest.skip("no ephemeral port range to read (not Linux)")
    ports = {runtime.free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports) and len(ports) > 1


def test_a_one_process_world_binds_no_port():
    # The launcher's port taken by another program before the worker binds it (seen in CI as EADDRINUSE):
    # a world of one process joins its group without it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(taken.getsockname()[1]), "RANK": "0",
                            "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
        code = ("import torch; from pai_cookbook.core.machine import runtime; runtime.init_distributed(None, 0); "
                "print('world', torch.distributed.get_world_size())")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["world", "1"]


def test_scheduler_variables_make_a_multi_node_job():
    env = runtime.detect_launch_env({"MASTER_ADDR": "dlc-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "4",
                                     "RANK": "3"})
    assert env.multi_node and (env.nnodes, env.node_rank, env.master_port) == (4, 3, 23456)
    assert env.world_size(8) == 32


def test_inside_a_torchrun_worker_the_variables_are_process_level():
    env = runtime.detect_launch_env({"MASTER_ADDR": "h", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"})
    assert not env.multi_node


@pytest.mark.parametrize("environ, message", [
    ({"MASTER_ADDR": "h"}, r"\['WORLD_SIZE', 'RANK'\] are not"),
    ({"MASTER_ADDR": "h", "WORLD_SIZE": "2", "RANK": "2"}, r"RANK 2 is outside \[0, WORLD_SIZE=2\)"),
    ({"MASTER_ADDR": "h", "WORLD_SIZE": "two", "RANK": "0"}, r"must be integers"),
])
def test_partial_scheduler_variables_are_explained(environ, message):
    with pytest.raises(ValueError, match=message):
        runtime.detect_launch_env(environ)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU path")
def test_cpu_device_uses_gloo_and_local_layers():
    device = runtime.detect_device()
    assert device.backend == "gloo" and not device.is_cuda and not device.supports_fp8
    report = runtime.environment_report()
    from pai_cookbook.core.machine import versions

    assert report["runs_here"]["cpu compatibility layer"]
    assert report["versions"]["megatron-core"] == str(versions.megatron_core_version())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_device_uses_nccl():
    device = runtime.detect_device()
    assert device.backend == "nccl" and device.count >= 1


NOTICES = ("load_common is deprecated", "MCore's async save is deprecated")
CHECKPOINT_LOGGERS = ("megatron.core.dist_checkpointing.strategies.common", "megatron.core.dist_checkpointing.strategies.torch")


@pytest.mark.skipif(not runtime.can_host_world_of_one(), reason="needs a process without CUDA (runtime.world_of_one)")
def test_the_cookbooks_checkpoints_save_and_load_without_megatron_cores_notices(tmp_path, caplog, monkeypatch):
    # A checkpoint as the cookbook writes it (with the common.pt 0.16 reads, core.checkpoints.checkpoint_format) saved
    # and loaded: Megatron-Core 0.19 logs two deprecations on the way that the user cannot act on; pai_cookbook's log
    # filter keeps them out of cells and worker logs. Without the filter the same calls log them (on 0.19), so this
    # sees the lines it hides.
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    from pai_cookbook.core.checkpoints import checkpoint_format

    def round_trip(folder):
        monkeypatch.setattr(torch_strategy, "_logged_mcore_async_deprecation", False, raising=False)  # once a process
        folder.mkdir()
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, str(folder))
        checkpoint_format.common_state_where_older_releases_read_it(folder)
        loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, str(folder))
        assert torch.equal(loaded["w"], torch.arange(4.0))

    with runtime.world_of_one(), caplog.at_level("WARNING"):
        round_trip(tmp_path / "filtered")
        assert not [r for r in caplog.records if r.getMessage().startswith(NOTICES)], caplog.text
        if versions.common_state_in_shards():  # 0.19 on: the releases that print them
            for name in CHECKPOINT_LOGGERS:
                monkeypatch.setattr(logging.getLogger(name), "filters", [])
            round_trip(tmp_path / "unfiltered")
            said = {notice for notice in NOTICES for r in caplog.records if r.getMessage().startswith(notice)}
            assert said == set(NOTICES), caplog.text


def test_torchs_one_process_load_warning_is_filtered_and_its_save_twin_is_not():
    # Megatron-Core 0.19's load calls torch's loader with no_dist=True inside an initialized group: torch's warning
    # that it assumes one process says nothing there (pai_cookbook/__init__ filters it; its text has commas, which
    # PYTHONWARNINGS cannot carry). A save without a process group would be a real fault: its warning stays. In a
    # fresh process, as a worker imports the package (pytest discards filters added while it collects).
    code = ("import warnings, pai_cookbook\n"
            "for side in ('load', 'save'):\n"
            "    warnings.warn(f'torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
            "{side} in a single process.', UserWarning)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "intent is to save" in out.stderr and "intent is to load" not in out.stderr, out.stderr
