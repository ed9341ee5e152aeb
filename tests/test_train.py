"""The training worker: layout parity from one seed, atomic checkpoints, refusal to overwrite."""

import pytest

from pai_cookbook import checkpoint, train
from pai_cookbook.config import CheckpointConfig, DataConfig, ParallelConfig
from tests.conftest import tiny_run


@pytest.mark.multiproc
def test_pipeline_parallel_matches_single_process_from_the_same_seed(run_scenario):
    # Layers seed their init by global layer number, so PP=2 builds the PP=1 model exactly.
    four_layers = {"num_layers": 4}
    reference = run_scenario(tiny_run(model_overrides=four_layers))["losses"]
    pp2 = run_scenario(tiny_run(model_overrides=four_layers,
                                parallel=ParallelConfig(pipeline_model_parallel_size=2)), 2)["losses"]
    assert pp2 == pytest.approx(reference, abs=1e-5)


@pytest.mark.multiproc
def test_data_parallel_matches_single_process(run_scenario):
    reference = run_scenario(tiny_run())["losses"]
    dp2 = run_scenario(tiny_run(), 2)["losses"]  # DP=2: each rank takes half of the same global batch
    assert dp2 == pytest.approx(reference, abs=1e-5)


def test_checkpoint_is_saved_atomically_and_never_overwritten_silently(tmp_path):
    save_dir = tmp_path / "ckpt"
    config = tiny_run(checkpoint=CheckpointConfig(save_dir=str(save_dir)), train_iters=1,
                      data=DataConfig(seq_length=16, micro_batch_size=2, global_batch_size=2))
    result = train.run(config, run_dir=tmp_path / "run", show_progress=False, echo=False)
    assert result["checkpoint"] == str(save_dir)
    model, _ = checkpoint.read_config(save_dir)  # self-describing
    assert model == config.model
    assert not checkpoint.partial_dir(save_dir).exists()
    with pytest.raises(FileExistsError, match=r"already holds files.*checkpoint.overwrite=True"):
        train.run(config, run_dir=tmp_path / "run2")
    assert not (tmp_path / "run2").exists(), "refused before any worker started"


def test_synthetic_batches_split_one_global_batch_over_dp_ranks():
    config = tiny_run(data=DataConfig(seq_length=8, micro_batch_size=1, global_batch_size=4))
    whole = train.synthetic_batches(config, step=3, dp_rank=0, dp_size=1)
    halves = [mb for rank in range(2) for mb in train.synthetic_batches(config, step=3, dp_rank=rank, dp_size=2)]
    assert all((a["tokens"] == b["tokens"]).all() for a, b in zip(whole, halves))
    tokens, labels = whole[0]["tokens"][0], whole[0]["labels"][0]
    assert (labels[:-1] == tokens[1:]).all()
    stride = (tokens[1] - tokens[0]) % config.model.vocab_size
    assert ((tokens[1:] - tokens[:-1]) % config.model.vocab_size == stride).all()  # a progression
