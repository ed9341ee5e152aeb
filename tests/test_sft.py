"""SFT data (pai_cookbook/sft/): answer-only loss masks found two ways and cross-checked, bad records named
with their line, truncation counted, first-fit-decreasing packing."""

import json

import pytest
import torch

from pai_cookbook import sft
from pai_cookbook.core.configs.config import CheckpointConfig, DataConfig, OptimizerConfig, ParallelConfig
from pai_cookbook.core.text import tokenizer
from pai_cookbook.fixtures import smollm2
from tests.conftest import random_sft_samples, tiny_run

CONVERSATION = {"line": 1, "messages": [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."}]}


@pytest.fixture(scope="module")
def smol():
    return tokenizer.load(smollm2.hf_folder())


def test_only_assistant_turns_and_their_end_tokens_carry_the_loss(smol):
    own = sft.encode(smol, CONVERSATION)  # SmolLM2's own template: boundary scan only
    marked = sft.encode(smol, CONVERSATION, sft.CHATML)  # the same text, with {% generation %} markers
    assert own.ids == marked.ids and own.loss_mask == marked.loss_mask
    assert own.template_agrees is None and marked.template_agrees is True
    trained = [i for i, m in zip(own.ids, own.loss_mask) if m]
    assert smol.decode(trained) == "Paris.<|im_end|>Rome.<|im_end|>"  # no prompt token, both end tokens
    assert trained.count(smol.convert_tokens_to_ids("<|im_end|>")) == 2
    assert own.ids.count(smol.bos_token_id) == len(CONVERSATION["messages"])  # one <|im_start|> per turn, no extra
    assert sum(own.loss_mask) == len(trained) and own.loss_mask[-1] is False  # the trailing newline is not trained


def test_bad_records_are_named_with_their_line(tmp_path):
    path = tmp_path / "sft.jsonl"
    cases = {'{"messages": [{"role": "user", "content": "hi"}]': "is not JSON",
             '{"messages": [{"role": "human", "content": "hi"}]}': "unknown role 'human'",
             '{"messages": [{"role": "user", "content": "hi"}]}': "no assistant turn",
             '{"question": "hi"}': r"expected \{\"messages\"",
             '{"messages": []}': "non-empty list",
             '{"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}':
                 "starts with an assistant turn"}
    for text, message in cases.items():
        path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + text + "\n")
        with pytest.raises(sft.SFTError, match=message) as err:
            sft.read(path)
        assert f"{path}:2" in str(err.value)
    path.write_text(json.dumps({"system": "s", "prompt": "a", "response": "b"}) + "\n")
    assert [t["role"] for t in sft.read(path)[0]["messages"]] == ["system", "user", "assistant"]


def test_templates_that_cannot_place_or_stop_a_turn_are_refused_naming_the_line(smol, tmp_path):
    upper = sft.CHATML.replace("message['content'] + '<|im_end|>' }}{% endgeneration %}",
                               "message['content'] | upper + '<|im_end|>' }}{% endgeneration %}")
    with pytest.raises(sft.SFTError, match="line 1: the chat template rewrites the assistant message 2"):
        sft.encode(smol, CONVERSATION, upper)
    no_end = sft.CHATML.replace("'<|im_end|>' }}{% endgeneration %}", "'' }}{% endgeneration %}")
    with pytest.raises(sft.SFTError, match=r"line 1: .* never learns to stop\. Name the token .* stop_tokens="):
        sft.encode(smol, CONVERSATION, no_end)
    # markers around the newline after the end token too: transformers' mask and the cookbook's disagree
    wide = sft.CHATML.replace("{% endgeneration %}{{ '\\n' }}", "{{ '\\n' }}{% endgeneration %}")
    assert wide != sft.CHATML and sft.encode(smol, CONVERSATION, wide).template_agrees is False
    with pytest.raises(sft.SFTError, match="mark different tokens"):
        sft.prepare([CONVERSATION, CONVERSATION], tmp_path / "set", smollm2.hf_folder(), seq_length=64, template=wide)
    assert not (tmp_path / "set").exists()
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(CONVERSATION) + "\n")
    with pytest.raises(sft.SFTError, match=f"{path}:1: the chat template rewrites"):
        sft.prepare(path, tmp_path / "set", smollm2.hf_folder(), seq_length=64, template=upper, valid_fraction=0.0)


BOUNDARIES = [{"line": 1, "messages": [{"role": "user", "content": "Greet me."},
                                       {"role": "assistant", "content": "\nHello."}]},
              {"line": 2, "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Agree."},
                                       {"role": "assistant", "content": " Sure."}, {"role": "user", "content": "Go."},
                                       {"role": "assistant", "content": "Done.  \n"}]},
              {"line": 3, "messages": [{"role": "user", "content": "JSON?"},
                                       {"role": "assistant", "content": '{"a": [1, 2]}\n'}]}]


def _trained(tokenizer, sample) -> str:
    return tokenizer.decode([i for i, m in zip(sample.ids, sample.loss_mask) if m])


def test_answers_whose_edges_merge_with_the_template_are_prepared_with_exact_masks(smol, tmp_path):
    """Finding 1 of the real-template review: an answer starting with a newline (merged with the header's), a
    space, or ending in whitespace was refused by a text audit although its mask was right."""
    summary = sft.prepare(BOUNDARIES, tmp_path / "set", smollm2.hf_folder(), seq_length=64, template="chatml",
                          valid_fraction=0.0)
    assert summary["audit"]["mismatched_samples"] == 0 and summary["audit"]["assistant_turns"] == 4
    assert summary["audit"]["stop_tokens_trained"] == 4
    first = sft.encode(smol, BOUNDARIES[0], "chatml")
    # the answer's own newline is trained (SmolLM2 keeps it a token apart from the header's: Qwen2's merges them,
    # and then the merged token is trained, as the model must produce it; tests/test_sft_real_templates.py)
    assert _trained(smol, first) == "\nHello.<|im_end|>"
    assert _trained(smol, sft.encode(smol, BOUNDARIES[1], "chatml")) == " Sure.<|im_end|>Done.  \n<|im_end|>"


# Two real templates' formats (Mistral-7B-Instruct-v0.2's [INST] turns, DeepSeek-LLM-Chat's "User:"/"Assistant:"),
# written here to test the cookbook's rules on SmolLM2's tokenizer; tests/test_sft_real_templates.py runs the
# templates that models ship.
INST = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] "
        "+ ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
        "{% endfor %}")
USER_ASSISTANT = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + "
                  "message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + "
                  "message['content'] + eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
                  "{{ 'Assistant:' }}{% endif %}")


@pytest.mark.parametrize("template", [INST, USER_ASSISTANT], ids=["inst", "user-assistant"])
def test_multi_turn_inst_and_user_assistant_formats_are_prepared(smol, template, tmp_path):
    """Finding 2: every multi-turn [INST] conversation and every DeepSeek-LLM-Chat conversation was refused."""
    talk = {"line": 1, "messages": CONVERSATION["messages"][1:]}
    summary = sft.prepare([talk, talk | {"line": 2}], tmp_path / "set", smollm2.hf_folder(), seq_length=64,
                          template=template, valid_fraction=0.0)
    assert summary["audit"]["mismatched_samples"] == 0 and summary["audit"]["stop_tokens_trained"] == 4
    trained = _trained(smol, sft.encode(smol, talk, template))
    # DeepSeek's generation prompt is "Assistant:", so the space before the answer is the model's to write
    answers = " Paris.<|im_end|> Rome.<|im_end|>" if template is USER_ASSISTANT else "Paris.<|im_end|>Rome.<|im_end|>"
    assert trained == answers


def test_turn_end_tokens_come_from_the_models_generation_config(tmp_path):
    """Finding 3: a model whose eos is not its turn end (Llama 3's <|end_of_text|> and <|eot_id|>, Gemma's <eos> and
    <end_of_turn>) was refused as one that "never learns to stop", though generation_config.json lists the turn end."""
    folder = tmp_path / "tokenizer"
    tokenizer.copy(smollm2.hf_folder(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "<|endoftext|>"}))
    hf = tokenizer.load(folder)
    turn_end, eos = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")
    two = [CONVERSATION, CONVERSATION | {"line": 2}]
    with pytest.raises(sft.SFTError, match=r"stop tokens \['<\|endoftext\|>'\] follows .* stop_tokens="):
        sft.prepare(two, tmp_path / "set", folder, seq_length=64, template="chatml")
    summary = sft.prepare(two, tmp_path / "set", folder, seq_length=64, template="chatml", stop_tokens=["<|im_end|>"])
    assert summary["stop_tokens"] == ["<|im_end|>"] and summary["audit"]["stop_tokens_trained"] == 4
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [turn_end, eos]}))
    summary = sft.prepare(two, tmp_path / "set", folder, seq_length=64, template="chatml")
    assert summary["stop_tokens"] == ["<|im_end|>", "<|endoftext|>"] and summary["audit"]["mismatched_samples"] == 0
    with pytest.raises(sft.SFTError, match="'<im_end>', which is not a token"):
        sft.prepare([CONVERSATION], tmp_path / "set", folder, seq_length=64, stop_tokens=["<im_end>"])


def test_special_token_text_typed_in_a_message_is_refused_with_its_line(smol, tmp_path):
    """Finding 4: an answer typing "<|im_end|>" was tokenized as the stop token and trained mid-answer."""
    typed = {"line": 7, "messages": [{"role": "user", "content": "How does ChatML end a turn?"},
                                     {"role": "assistant", "content": "With <|im_end|> after the answer."}]}
    with pytest.raises(sft.SFTError, match=r"line 7: message 1 types '<\|im_end\|>', the text of the special token"):
        sft.prepare([CONVERSATION, typed], tmp_path / "set", smollm2.hf_folder(), seq_length=64, template="chatml")
    assert not (tmp_path / "set").exists()


NO_SYSTEM = ("{% for message in messages %}{% if message['role'] == 'system' %}{{ raise_exception('System role not "
             "supported') }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + "
             "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_template_without_a_system_role_names_the_line_and_system_fold(smol, tmp_path):
    """Finding 5: Gemma-2's "System role not supported" reached the user raw, without the line."""
    with pytest.raises(sft.SFTError, match=r"line 1: the chat template refuses .* System role not supported.* "
                                           r"system='fold'"):
        sft.prepare([CONVERSATION, CONVERSATION | {"line": 2}], tmp_path / "set", smollm2.hf_folder(), seq_length=64,
                    template=NO_SYSTEM)
    summary = sft.prepare([CONVERSATION, CONVERSATION | {"line": 2}], tmp_path / "set", smollm2.hf_folder(),
                          seq_length=64, template=NO_SYSTEM, system="fold", valid_fraction=0.0)
    assert summary["system"] == "fold" and summary["audit"]["mismatched_samples"] == 0
    folded = sft.encode(smol, CONVERSATION, NO_SYSTEM, system="fold")
    assert "Answer in one word.\n\nCapital of France?" in smol.decode(folded.ids)
    # the template trained with is the set's, for training to write into its checkpoints
    assert (tmp_path / "set" / sft.TEMPLATE_FILE).read_text() == NO_SYSTEM


def test_long_conversations_are_dropped_or_truncated_and_counted(smol):
    long = {"line": 2, "messages": CONVERSATION["messages"][:2] + [{"role": "assistant", "content": "word " * 80}]}
    samples, counts = sft.encode_all(smol, [CONVERSATION, long], seq_length=48)
    assert len(samples) == 1 and counts.dropped_too_long == 1 and counts.cross_checked == 0
    samples, counts = sft.encode_all(smol, [CONVERSATION, long], seq_length=48, truncation="truncate")
    assert len(samples) == 2 and counts.truncated == 1 and len(samples[1].ids) == 49
    # truncated before its answer starts: no loss token left, so it never reaches training
    samples, counts = sft.encode_all(smol, [long], seq_length=12, truncation="truncate", template="chatml")
    assert samples == [] and counts.dropped_no_loss == 1 and counts.cross_checked == 1 and counts.disagreements == []
    # truncated, then dropped: counted once, as dropped, so the counts add up to the conversations
    assert counts.truncated == 0 and counts.conversations == len(samples) + counts.dropped_too_long + counts.dropped_no_loss


def test_thd_lays_rows_end_to_end_with_each_conversations_offsets():
    samples = [sft.Sample(ids=list(range(1, n + 1)), loss_mask=[True] * n) for n in (5, 3, 7, 2)]
    batch = sft.batch(samples, [[0, 1], [2, 3]], 8, pad_id=0)  # row 0: 4 + 2 positions + 2 padding; row 1: 6 + 1 + 1
    flat = sft.thd(batch | {"loss_count": torch.tensor(4)})
    assert flat["cu_seqlens"].tolist() == [0, 4, 6, 8, 14, 15, 16] and flat["max_seqlen"] == 6
    assert flat["tokens"].shape == (1, 16) and torch.equal(flat["labels"].view(2, 8), batch["labels"])
    assert "document" not in flat and int(flat["loss_count"]) == 4


def test_first_fit_decreasing_fills_bins_without_splitting_items():
    lengths = [7, 3, 9, 2, 5, 5, 1, 8, 4]
    bins = sft.pack(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 5 == -(-sum(lengths) // 10)  # 44 tokens: no fewer bins exist
    assert sft.efficiency(lengths, 10, packed=True) == 44 / 50 > sft.efficiency(lengths, 10, packed=False)
    with pytest.raises(sft.SFTError, match="longer than the pack capacity 8"):
        sft.pack(lengths, 8)


def test_a_packed_row_computes_each_conversation_as_it_is_alone(run_scenario):
    """Eight conversations of 4-29 positions in 64-position rows: the block-diagonal causal mask gives each
    the logits it has alone in a padded row (fp32; RoPE positions are not reset, which changes nothing but
    rounding: scores depend only on distances). Without the mask, later conversations see earlier ones."""
    figures = run_scenario(tiny_run(data=DataConfig(seq_length=64, micro_batch_size=1, global_batch_size=1)),
                           scenario="packed_logits")
    assert figures["rows"] < figures["conversations"]  # packing shared rows
    assert figures["max_abs_diff"] <= 1e-5, figures
    assert figures["max_abs_diff_without_boundaries"] > 1e-2, figures  # the comparison can fail


@pytest.fixture(scope="module")
def packed_set(tmp_path_factory):
    """`random_sft_samples`: 20 packed into 64-position rows for training, 4 held out."""
    samples = random_sft_samples()
    folder = tmp_path_factory.mktemp("sft") / "set"
    summary = sft.write(folder, {"train": samples[:20], "valid": samples[20:]}, 64, pad_id=0, vocab_size=256)
    assert summary["train"]["rows"] < 20 and summary["train"]["efficiency"] > summary["train"]["padded_efficiency"]
    return folder


@pytest.fixture(scope="module")
def padded_set(tmp_path_factory):
    """The same 20 training conversations, one per row."""
    folder = tmp_path_factory.mktemp("sft") / "padded"
    sft.write(folder, {"train": random_sft_samples()[:20]}, 64, pad_id=0, packed=False, vocab_size=256)
    return folder


def _sft_run(folder, micro_batch_size=8, global_batch_size=8, **fields):
    overrides = fields.pop("model_overrides", None)
    data = DataConfig(source="sft", paths=[str(folder)], seq_length=64, micro_batch_size=micro_batch_size,
                      global_batch_size=global_batch_size, loss_average=fields.pop("loss_average", "token"))
    return tiny_run(model_overrides=overrides, data=data, **fields)


@pytest.mark.multiproc
def test_one_global_batch_has_the_same_loss_and_gradients_at_every_split_packed_or_padded(packed_set, padded_set,
                                                                                          run_scenario):
    """The per-token loss: micro-batches 1x8, 4x2, 8x1 and DP=2 (4 and 1 per rank) give one global batch the
    same loss and the same gradient of every parameter (fp32, relative to the largest gradient), per token and
    per sample. All 20 conversations in one global batch give the same loss and gradients packed (block
    mask) and padded (one per row). The same rows averaged per micro-batch would not (`loss_by_split`)."""
    rows = sft.describe(packed_set)["train"]["rows"]
    one = run_scenario.layouts([_sft_run(packed_set, m) for m in (8, 2, 1)]
                               + [_sft_run(packed_set, m, loss_average="sample") for m in (8, 1)]
                               + [_sft_run(packed_set, rows, rows), _sft_run(padded_set, 5, 20)], 1, "grads")
    two = run_scenario.layouts([_sft_run(packed_set, m) for m in (4, 1)], 2, "grads")

    def same(run, reference):
        scale = max(abs(g) for g in reference["grads"])
        assert run["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert max(abs(a - b) for a, b in zip(run["grads"], reference["grads"])) <= 1e-5 * scale

    reference, *splits = one[:3]
    for run in splits + two:
        same(run, reference)
    per_sample, per_sample_8x1 = one[3:5]
    same(per_sample_8x1, per_sample)
    packed_all, padded_all = one[5:]
    same(padded_all, packed_all)
    # the two averages weigh tokens differently (a random model's token losses are all near ln 256, so the
    # losses barely differ; the gradients do)
    scale = max(abs(g) for g in reference["grads"])
    assert max(abs(a - b) for a, b in zip(per_sample["grads"], reference["grads"])) > 0.1 * scale


def test_the_mean_of_micro_batch_means_changes_with_the_split():
    losses = torch.rand(8, 16, generator=torch.Generator().manual_seed(0)) * 4
    mask = (torch.arange(16) < torch.tensor([16, 2, 9, 16, 4, 12, 1, 7])[:, None]).float()  # loss tokens per row
    by_split = sft.loss_by_split(losses, mask, [8, 4, 1])
    assert len({round(v["per_token"], 12) for v in by_split.values()}) == 1
    assert by_split[8]["mean_of_means"] == pytest.approx(by_split[8]["per_token"])
    assert abs(by_split[1]["mean_of_means"] - by_split[8]["per_token"]) > 1e-2
    weights, count = sft.loss_weights(mask, None, "sample")
    assert int(count) == 8 and torch.allclose(weights.sum(1), torch.ones(8))


def test_validation_batches_are_the_held_out_rows_in_order_with_the_runs_weights(packed_set):
    """What notebook 06 scores with transformers to reproduce the run's validation loss: `eval_iters` global
    batches, each whole, the held-out rows in order (wrapping round), the same weights as the worker's."""
    valid = sft.load(packed_set, "valid")
    n = valid["tokens"].shape[0]
    config = _sft_run(packed_set, 1, 2, eval_iters=n, eval_interval=1, loss_average="sample")
    batches = sft.validation_batches(config)
    assert len(batches) == n and all(b["tokens"].shape[0] == 2 for b in batches)
    order = torch.cat([b["tokens"] for b in batches])
    expected = torch.cat([valid["tokens"], valid["tokens"]])  # 2n rows read in order: the set twice over
    assert torch.equal(order, expected)
    worker_view = [mb for step in range(n) for mb in sft.global_batch(valid, step, 2, 1, 0, 1, config.seed, "sample",
                                                                        shuffle=False)]
    assert sum(float(b["loss_count"]) for b in batches) == sum(float(mb["loss_count"]) for mb in worker_view)


@pytest.mark.both_ends
@pytest.mark.multiproc
def test_packed_training_at_tp2_and_pp2_matches_one_process_for_20_steps(packed_set, run_scenario):
    """Packed rows, block-diagonal attention: TP=2 and PP=2 train as one process does (losses and validation
    losses within 1e-4). At PP=2 the second stage's layers need the conversation boundaries too; without
    them a packed row's logits move by more than 1e-2 (test_a_packed_row_computes_each_conversation_as_it_is_alone)."""
    def config(parallel):
        return _sft_run(packed_set, 2, parallel=parallel, train_iters=20, eval_interval=10, eval_iters=1,
                        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2))

    reference = run_scenario(config(ParallelConfig()), 1)
    assert reference["losses"][-1] < reference["losses"][0] - 0.5  # it learns
    layouts = [ParallelConfig(tensor_model_parallel_size=2), ParallelConfig(pipeline_model_parallel_size=2)]
    for parallel, other in zip(layouts, run_scenario.layouts([config(p) for p in layouts], 2)):
        assert other["losses"] == pytest.approx(reference["losses"], abs=1e-4), parallel
        assert [v for _, v in other["valid_losses"]] == pytest.approx([v for _, v in reference["valid_losses"]], abs=1e-4)


def test_per_token_losses_of_packed_rows_match_transformers_padding_free(packed_set, run_scenario, tmp_path):
    """The same weights in Megatron-Core (packed rows, block-diagonal mask, positions running on across
    conversations) and in transformers (each row's conversations end to end, positions restarting at each,
    use_cache=False): every loss position within 1e-4 in fp32 (measured 9.5e-7)."""
    from pai_cookbook import convert, hf_baseline
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("llama", tmp_path / "hf")
    convert.hf_to_megatron(hf, tmp_path / "mcore", run_dir=tmp_path / "convert")
    config = _sft_run(packed_set, checkpoint=CheckpointConfig(load_dir=str(tmp_path / "mcore")))
    result = run_scenario(config, scenario="token_losses")
    megatron = torch.tensor(result["losses"])
    rows = {k: v[result["rows"]] for k, v in sft.load(packed_set, "train").items()}
    (reference,) = hf_baseline.hf_packed_token_losses(hf, [rows])
    real = rows["document"] >= 0
    assert (rows["document"].amax(1) >= 1).all()  # two or more conversations in every row
    assert (megatron[real] - reference[real]).abs().max() <= 1e-4, float((megatron[real] - reference[real]).abs().max())


def test_a_set_that_does_not_fit_the_run_is_refused_before_launch(packed_set, tmp_path):
    from pai_cookbook import train

    cases = {"packed into rows of 64 positions, the run's seq_length is 32":
             tiny_run(data=DataConfig(source="sft", paths=[str(packed_set)], seq_length=32)),
             "fewer than one global batch": _sft_run(packed_set, 8, 64),
             "not a prepared SFT set": _sft_run(tmp_path)}
    for message, config in cases.items():
        with pytest.raises(sft.SFTError, match=message):
            train.run(config, run_dir=tmp_path / "run")
        assert not (tmp_path / "run").exists()
    with pytest.warns(UserWarning, match=r"1 of 2 conversations dropped .* lines \[2\]"):
        summary = sft.prepare([CONVERSATION, CONVERSATION | {"line": 2, "messages": CONVERSATION["messages"] * 9}],
                              tmp_path / "set", smollm2.hf_folder(), seq_length=64, valid_fraction=0.0)
    assert summary["counts"]["dropped_lines"] == [2] and summary["train"]["conversations"] == 1
    # a folder holding anything but a prepared set is never replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(sft.SFTError, match="not a prepared SFT set"):
        sft.prepare([CONVERSATION], tmp_path / "mine", smollm2.hf_folder(), seq_length=64, valid_fraction=0.0)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep" and not (tmp_path / "mine.partial").exists()


def test_checkpoints_carry_the_template_the_set_was_prepared_with(tmp_path):
    """Finding 5: `prepare(template=X)` trained with X while the checkpoint kept the tokenizer's own template."""
    from pai_cookbook import convert, train
    from pai_cookbook.core.checkpoints import checkpoint
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model

    tokenizer.byte_level(sft.CHATML).save_pretrained(tmp_path / "tokenizer")
    hf = make_tiny_hf_model("llama", tmp_path / "hf", tokenizer_dir=tmp_path / "tokenizer")
    convert.hf_to_megatron(hf, tmp_path / "mcore", run_dir=tmp_path / "convert")
    talks = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{n} + 1?"},
                           {"role": "assistant", "content": f"{n + 1}."}]} for n in range(4)]
    sft.prepare(talks, tmp_path / "set", tmp_path / "mcore" / checkpoint.HF_ASSETS, seq_length=64, template=NO_SYSTEM,
                system="fold", valid_fraction=0.0)
    config = _sft_run(tmp_path / "set", 1, 1, train_iters=1, eval_interval=0, model_overrides={"vocab_size": 259},
                      checkpoint=CheckpointConfig(load_dir=str(tmp_path / "mcore"), save_dir=str(tmp_path / "save"),
                                                  save_interval=1))
    train.run(config, run_dir=tmp_path / "run")
    saved = checkpoint.iteration_dir(tmp_path / "save", 1)
    assert (saved / checkpoint.HF_ASSETS / sft.TEMPLATE_FILE).read_text() == NO_SYSTEM
    assert checkpoint.load_tokenizer(saved).chat_template == NO_SYSTEM
    assert checkpoint.load_tokenizer(tmp_path / "mcore").chat_template == sft.CHATML  # the base keeps its own
