"""A multi-node job simulated on this machine: two launcher processes with MASTER_ADDR=127.0.0.1,
WORLD_SIZE=2 and RANK=0/1 (what a scheduler sets), writing to one shared folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pai_cookbook import convert
from pai_cookbook.core.machine.runtime import free_port

PIPELINE = str(Path(__file__).parent / "workers" / "node_pipeline.py")
NODE_TIMEOUT_S = 420


def _node(shared: Path, nproc: int, scheduler: dict[str, str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    return subprocess.Popen([sys.executable, PIPELINE, str(shared), str(nproc)], env=env | scheduler,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=NODE_TIMEOUT_S)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.mark.multiproc
def test_two_nodes_write_each_file_once_and_train_as_one_node_does(tmp_path):
    port = str(free_port())
    scheduler = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2"}
    nodes = [_node(tmp_path / "shared", 1, scheduler | {"RANK": str(rank)}) for rank in (0, 1)]
    (node0, err0), (node1, err1) = _result(nodes[0]), _result(nodes[1])
    reference, _ = _result(_node(tmp_path / "alone", 2, {}))

    # Every host-side step ran on node 0 only: node 1 waited for each and got node 0's result.
    for step in ("make_tiny_hf_model", "hf_to_megatron", "prepare", "preflight", "megatron_to_hf"):
        assert "waiting for node 0 to run pai_cookbook." in err1 and step in err1, (step, err1[-2000:])
        assert "waiting for node 0" not in err0
    assert node0 == node1
    # One training run over both nodes (2 processes), equal to one node with 2 processes.
    assert node0["world_size"] == 2 and len(node0["losses"]) == 4
    assert node0["losses"] == pytest.approx(reference["losses"], abs=1e-6)
    assert node0["tokens"] == reference["tokens"]
    assert convert.compare_hf_checkpoints(tmp_path / "shared" / "export", tmp_path / "alone" / "export")["bitwise_identical"]
    assert not list((tmp_path / "shared").glob("**/*.partial"))


@pytest.mark.multiproc
def test_a_node_whose_peer_never_starts_times_out_with_a_message(tmp_path):
    scheduler = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "RANK": "1",
                 "PAI_COOKBOOK_NODE_TIMEOUT_S": "5"}
    lonely = _node(tmp_path, 1, scheduler)
    _, err = lonely.communicate(timeout=120)
    assert lonely.returncode != 0
    assert "no host rendezvous with node 0" in err and "Is node 0 running the same job?" in err
