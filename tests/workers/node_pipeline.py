"""One node's part of a multi-node job, as a scheduler would run it on every node (tests/test_nodes.py).

    python node_pipeline.py SHARED_DIR NPROC_PER_NODE

prepare a tiny model and a dataset -> convert -> train -> export, all in SHARED_DIR (storage every
node mounts); prints one JSON line with what this node got back.
"""

import json
import sys
from pathlib import Path

from pai_cookbook import convert, data, train
from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs.config import CheckpointConfig, DataConfig, RunConfig
from pai_cookbook.core.text.tokenizer import TOKENIZER_CORPUS
from pai_cookbook.fixtures import tiny_models


def main(shared: Path, nproc: int) -> dict:
    hf = tiny_models.make_tiny_hf_model("llama", shared / "hf")
    ckpt = shared / "mcore"
    convert.hf_to_megatron(hf, ckpt)
    model, _ = checkpoint.read_config(ckpt)
    prepared = data.prepare([TOKENIZER_CORPUS], shared / "data" / "corpus", ckpt / checkpoint.HF_ASSETS,
                            show_progress=False)
    config = RunConfig(model=model, train_iters=4, seed=7,
                       data=DataConfig(source="indexed", paths=[str(shared / "data" / "corpus")], split="70,30,0",
                                       seq_length=32, micro_batch_size=2, global_batch_size=8),
                       checkpoint=CheckpointConfig(load_dir=str(ckpt), save_dir=str(shared / "checkpoints")))
    result = train.run(config, nproc_per_node=nproc, run_dir=shared / "run", show_progress=False, echo=False)
    exported = convert.megatron_to_hf(result["checkpoint"], shared / "export")
    return {"hf": str(hf), "tokens": prepared["tokens"], "losses": result["losses"],
            "world_size": result["world_size"], "export_tensors": exported["tensors"]}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]))), flush=True)
