"""Generation from Megatron-Core checkpoints: exact greedy parity with `transformers` for every family
at TP1 and TP2, seeded sampling equal across runs and layouts, one-token steps with the KV cache, end
conditions, and every bad input refused before a worker starts.

Two launches in all: one runs every family at TP1 and TP2 (parallel state rebuilt per job), one repeats
the sampling run and checks end-of-sequence / stop strings. The Hugging Face side is the model exported
from the checkpoint with the converter (the session's `converted` fixture, shared with test_convert).
"""

import dataclasses
import json
import shutil

import pytest

from pai_cookbook import generate, hf_baseline
from pai_cookbook.core.checkpoints import checkpoint, families
from pai_cookbook.core.configs.config import ConfigError, ParallelConfig
from pai_cookbook.core.launching import launch
from pai_cookbook.generate import GenerationConfig
from tests.conftest import layout_for, on_both_ends

NEW_TOKENS = 32
# Prompts of different lengths in one batch (left-padded to the longest, the padding masked), two batches,
# so TP1's two data-parallel replicas each take one.
PROMPTS = ["The Python language reference describes", "def f(x): return", "In the beginning",
           "Chinese paragraphs and the interpreter"]
GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.0, batch_size=2)
# Random tiny models would otherwise stop at a random end-of-sequence draw: ignore_eos keeps every
# completion at 32 tokens on both sides. The penalised run also checks the repetition penalty against
# transformers' RepetitionPenaltyLogitsProcessor.
PENALISED = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.2, batch_size=2)
SAMPLING = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True, top_k=0, top_p=0.9, temperature=0.8,
                            seed=7, batch_size=2)
TP1, TP2 = ParallelConfig(), ParallelConfig(tensor_model_parallel_size=2)
PP2 = ParallelConfig(pipeline_model_parallel_size=2)
RECORDS = [{"prompt": p, "line": i + 1} for i, p in enumerate(PROMPTS)]
LAUNCH_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def checkpoints(converted):
    """family -> (HF model exported from the checkpoint, converted Megatron-Core checkpoint)."""
    return {family: (back, ckpt) for family, (_, ckpt, back) in converted.items()}


@pytest.fixture(scope="module")
def first_launch(checkpoints, tmp_path_factory):
    """Every family greedy at TP1 and TP2; llama also penalised, uncached, sampled at TP1/TP2, and at PP2."""
    jobs = []
    for family, (_, ckpt) in checkpoints.items():
        jobs += [generate.prepare(ckpt, RECORDS, GREEDY, TP1, f"{family} tp1"),
                 generate.prepare(ckpt, RECORDS, GREEDY, layout_for(family, tp=2), f"{family} tp2")]
    llama = checkpoints["llama"][1]
    jobs += [generate.prepare(llama, RECORDS, PENALISED, TP2, "penalised tp2"),
             generate.prepare(llama, RECORDS, dataclasses.replace(GREEDY, kv_cache=False), TP1,
                              "uncached tp1"),
             generate.prepare(llama, RECORDS, SAMPLING, TP1, "sampling tp1"),
             generate.prepare(llama, RECORDS, SAMPLING, TP2, "sampling tp2"),
             generate.prepare(llama, RECORDS, GREEDY, PP2, "llama pp2"),
             generate.prepare(llama, RECORDS, SAMPLING, PP2, "sampling pp2")]
    results = generate.run_jobs(jobs, run_dir=tmp_path_factory.mktemp("run1"), show_progress=False,
                                timeout_s=LAUNCH_TIMEOUT_S)
    return {job.label: (job, result) for job, result in zip(jobs, results)}


@pytest.mark.multiproc
@pytest.mark.parametrize("family", [on_both_ends(f) for f in families.supported()])
def test_greedy_equals_transformers_at_tp1_and_tp2(family, checkpoints, first_launch):
    hf, _ = checkpoints[family]
    job, _ = first_launch[f"{family} tp1"]
    reference = hf_baseline.hf_generate(hf, job.prompt_ids, GREEDY)["tokens"]
    assert all(len(t) == NEW_TOKENS for t in reference)
    for tp in (1, 2):
        result = first_launch[f"{family} tp{tp}"][1]
        assert result["tokens"] == reference, (tp, result["tokens"], reference)
        assert result["ranks_agree"] and result["finish"] == ["length"] * len(PROMPTS)


@pytest.mark.multiproc
def test_every_result_records_the_engine_and_path_that_ran(first_launch):
    from pai_cookbook.core.machine import versions

    expected = {"megatron_core": str(versions.megatron_core_version()), "engine": "StaticInferenceEngine",
                "path": "static batching (legacy=True)", "padding": "left", "kv_cache": True}
    assert first_launch["llama tp2"][1]["engine"] == expected
    assert first_launch["uncached tp1"][1]["engine"] == expected | {"kv_cache": False}


@pytest.mark.multiproc
def test_the_kv_cache_allocated_is_the_one_predicted(checkpoints, first_launch):
    """`generate.kv_cache_bytes` (what notebook 07 prints for a model and a batch) is what Megatron-Core's static
    engine allocates on the most loaded rank, to the byte: every family (multi-latent attention included) at TP1 and
    TP2, and a pipeline stage at PP2."""
    import torch

    from pai_cookbook.core.checkpoints import checkpoint

    labels = [f"{family} {tp}" for family in checkpoints for tp in ("tp1", "tp2")] + ["llama pp2"]
    for label in labels:
        job, result = first_launch[label]
        model, dtype = checkpoint.read_config(job.ckpt)
        width = torch.empty(0, dtype=dtype).element_size()
        predicted = generate.kv_cache_bytes(model, job.config.batch_size, job.max_sequence, width,
                                            job.parallel.tensor_model_parallel_size,
                                            job.parallel.pipeline_model_parallel_size)
        assert result["kv_cache_bytes"] == predicted > 0, (label, result["kv_cache_bytes"], predicted)


@pytest.mark.multiproc
def test_pipeline_parallel_generation_equals_one_process(checkpoints, first_launch):
    # The last stage's logits are broadcast to every stage, which samples with the same generator.
    assert first_launch["llama pp2"][1]["tokens"] == first_launch["llama tp1"][1]["tokens"]
    assert first_launch["sampling pp2"][1]["tokens"] == first_launch["sampling tp1"][1]["tokens"]
    assert first_launch["llama pp2"][1]["ranks_agree"]


@pytest.mark.multiproc
def test_pipeline_parallel_generation_needs_the_inference_compat_patch(checkpoints, tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the compatibility layer is a no-op on CUDA")
    monkeypatch.setenv("PAI_COOKBOOK_COMPAT_SKIP", "inference_pipeline_tensors")
    job = generate.prepare(checkpoints["llama"][1], RECORDS[:1], dataclasses.replace(GREEDY, max_new_tokens=2), PP2)
    with pytest.raises(launch.WorkerError) as err:
        generate.run_jobs([job], run_dir=tmp_path, show_progress=False, timeout_s=LAUNCH_TIMEOUT_S)
    assert "assert tensor.is_cuda" in err.value.log_tail


@pytest.mark.multiproc
def test_repetition_penalty_equals_transformers(checkpoints, first_launch):
    job, result = first_launch["penalised tp2"]
    assert result["tokens"] == hf_baseline.hf_generate(checkpoints["llama"][0], job.prompt_ids, PENALISED)["tokens"]
    assert result["tokens"] != first_launch["llama tp2"][1]["tokens"]  # the penalty changed something


@pytest.mark.multiproc
def test_kv_cache_runs_one_token_steps(first_launch):
    # One prefill over the batch's prompts, left-padded to the longest, then forward steps of one token each,
    # one per new token (32 for every row: every row samples from the first step on). Without the cache every
    # step re-reads the whole prefix, so the lengths grow by one per step.
    job, cached = first_launch["llama tp1"]
    _, uncached = first_launch["uncached tp1"]
    assert len(cached["forward_lengths"]) == len(PROMPTS) // GREEDY.batch_size
    for batch, lengths in enumerate(cached["forward_lengths"]):
        rows = job.prompt_ids[batch * GREEDY.batch_size:(batch + 1) * GREEDY.batch_size]
        shortest, longest = min(map(len, rows)), max(map(len, rows))
        assert shortest < longest  # the batch needs its padding
        assert lengths == [longest] + [1] * (NEW_TOKENS - 1)
        assert uncached["forward_lengths"][batch] == list(range(longest, longest + NEW_TOKENS))
    assert uncached["tokens"] == cached["tokens"]


@pytest.fixture(scope="module")
def second_launch(checkpoints, first_launch, tmp_path_factory):
    """Sampling again (a new launch); an extra end-of-sequence id and a stop string seen in the greedy output."""
    llama = checkpoints["llama"][1]
    greedy = first_launch["llama tp2"][1]["tokens"][0]
    tokenizer = checkpoint.load_tokenizer(llama)
    text = tokenizer.decode(greedy, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    eos_config = dataclasses.replace(GREEDY, ignore_eos=False, eos_token_ids=(greedy[5],))
    stop_config = dataclasses.replace(GREEDY, stop=(stop,))
    jobs = [generate.prepare(llama, RECORDS, SAMPLING, TP2, "sampling"),
            generate.prepare(llama, RECORDS[:1], eos_config, TP2, "eos"),
            generate.prepare(llama, RECORDS[:1], stop_config, TP2, "stop")]
    results = generate.run_jobs(jobs, run_dir=tmp_path_factory.mktemp("run2"), show_progress=False,
                                timeout_s=LAUNCH_TIMEOUT_S)
    return {job.label: (job, result) for job, result in zip(jobs, results)}, greedy, text, stop


@pytest.mark.multiproc
def test_seeded_sampling_is_reproducible_and_layout_independent(first_launch, second_launch):
    tp1 = first_launch["sampling tp1"][1]
    tp2 = first_launch["sampling tp2"][1]
    again = second_launch[0]["sampling"][1]
    assert tp1["tokens"] == tp2["tokens"] == again["tokens"]
    assert tp2["ranks_agree"] and again["ranks_agree"]  # both TP ranks drew the same tokens
    assert tp1["tokens"] != first_launch["llama tp1"][1]["tokens"]  # it sampled, not argmax


@pytest.mark.multiproc
def test_end_of_sequence_and_stop_strings_end_a_completion(second_launch):
    results, greedy, text, stop = second_launch
    eos = results["eos"][1]
    # The first end token (the added id, or the tokenizer's own) ends it and is not returned.
    ends = {greedy[5], checkpoint.load_tokenizer(results["eos"][0].ckpt).eos_token_id}
    first = next(i for i, token in enumerate(greedy) if token in ends)
    assert eos["tokens"] == [greedy[:first]] and eos["finish"] == ["eos"]
    job, result = results["stop"]
    assert result["finish"] == ["stop"] and len(result["tokens"][0]) < NEW_TOKENS
    (record,) = generate.completion_records(job.ckpt, RECORDS[:1], job, result)
    assert record["completion"] == text[:text.find(stop)] and record["finish_reason"] == "stop"
    assert result["tokens"][0] == greedy[:len(result["tokens"][0])]


# -------------------------------------------------------------------------------------------------
# Refused before any worker starts (launch is replaced by a function that fails the test)
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    ({"top_k": 40, "top_p": 0.9}, r"set top_k=0 to sample with top_p, or top_p=0\.0"),
    ({"temperature": 0.0}, r"temperature=0\.0 must be > 0"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty=0\.0 must be > 0"),
    ({"top_p": 1.5}, r"top_p=1\.5 must be in \[0, 1\]"),
    ({"max_new_tokens": 0}, r"max_new_tokens=0 must be >= 1"),
    ({"chat_template": "maybe"}, r"chat_template='maybe'"),
    ({"stop": ("",)}, r"empty string"),
])
def test_bad_generation_config_names_the_fix(fields, message):
    with pytest.raises(ConfigError, match=message):
        GenerationConfig(**fields)


def test_empty_and_malformed_prompt_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no prompts"):
        generate.read_prompts(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not valid JSON"):
        generate.read_prompts(bad)
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 has neither \"prompt\" nor \"messages\""):
        generate.read_prompts(bad)
    text = tmp_path / "p.txt"
    text.write_text("one\n\ntwo\n")
    assert [r["prompt"] for r in generate.read_prompts(text)] == ["one", "two"]


def test_bad_requests_are_refused_before_launch(checkpoints, tmp_path, no_launch):
    _, ckpt = checkpoints["llama"]
    with pytest.raises(ValueError, match=r"line 2: prompt of \d+ tokens \+ max_new_tokens=32 exceeds the context of 40"):
        generate.generate(ckpt, ["a", "the Python language reference " * 4],
                          GenerationConfig(max_new_tokens=32, max_sequence_length=40))
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(ckpt, bare)
    shutil.rmtree(bare / checkpoint.HF_ASSETS)
    with pytest.raises(FileNotFoundError, match=r"carries no tokenizer.*hf_assets"):
        generate.generate(bare, ["hello"])
    with pytest.raises(ConfigError, match=r"PP=3 must divide the 2 layers"):
        generate.generate(ckpt, ["hello"], parallel=ParallelConfig(pipeline_model_parallel_size=3))
    with pytest.raises(ConfigError, match=r"TP=4 must divide"):
        generate.generate(ckpt, ["hello"], parallel=ParallelConfig(tensor_model_parallel_size=4))
    with pytest.raises(FileNotFoundError, match="not a checkpoint written by the cookbook"):
        generate.generate(tmp_path, ["hello"])
    with pytest.raises(ConfigError, match=r"nproc_per_node=0 must be >= 1"):  # was taken as "not given"
        generate.generate(ckpt, ["hello"], nproc_per_node=0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b", "top_k": 1\n')
    code = generate.main([str(ckpt), "--input", str(prompts), "--output", str(tmp_path / "o.jsonl")])
    assert code == 2 and not (tmp_path / "o.jsonl").exists()
    code = generate.main([str(ckpt), "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"),
                          "--top-k", "5", "--top-p", "0.5"])
    assert code == 2


def test_training_save_dir_resolves_to_latest_iteration(checkpoints, tmp_path):
    _, ckpt = checkpoints["llama"]
    for step in (2, 10):
        shutil.copytree(ckpt, checkpoint.iteration_dir(tmp_path, step))
    checkpoint.iteration_dir(tmp_path, 20).with_suffix(".partial").mkdir()  # unfinished: never chosen
    assert generate.resolve_checkpoint(tmp_path) == checkpoint.iteration_dir(tmp_path, 10)


def test_chat_template_formats_prompts_and_messages(checkpoints):
    tokenizer = checkpoint.load_tokenizer(checkpoints["llama"][1])
    plain = generate.encode(tokenizer, {"prompt": "hi"}, "auto")
    assert plain == tokenizer("hi").input_ids
    with pytest.raises(ValueError, match="has no chat template"):
        generate.encode(tokenizer, {"prompt": "hi"}, "always")
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    expected = tokenizer("<s>user: hi\nassistant:", add_special_tokens=False).input_ids
    assert generate.encode(tokenizer, {"prompt": "hi"}, "auto") == expected
    assert generate.encode(tokenizer, {"messages": [{"role": "user", "content": "hi"}]}, "auto") == expected
    assert generate.encode(tokenizer, {"prompt": "hi"}, "never") == plain
    assert json.dumps(expected)  # plain ints, ready for the workers' JSON


def test_an_unwritable_output_is_refused_before_generating(tmp_path, checkpoints, capsys):
    ckpt = checkpoints["llama"][1]
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\n")
    for output, why in ((tmp_path, "is a directory"), (prompts / "o.jsonl", "is a file, not a folder")):
        code = generate.main([str(ckpt), "--input", str(prompts), "--output", str(output), "--run-dir",
                              str(tmp_path / "run")])
        assert code == 2 and why in capsys.readouterr().err
        assert not (tmp_path / "run" / "logs").exists()  # no worker started
    with pytest.raises(ValueError, match="is a directory"):
        generate.generate_file(ckpt, prompts, tmp_path)


def test_a_new_batch_never_reuses_the_previous_batchs_mask():
    # Two batches whose steps share offsets and lengths (same width, same step) but not their padding: the
    # per-step cache of the attention must build the second batch's mask from its own padding.
    from types import SimpleNamespace

    import torch

    from pai_cookbook.core.modeling import attention

    context = SimpleNamespace(batch_size_offset=0, sequence_len_offset=5)
    masks = []
    for padding in (torch.tensor([0, 3]), torch.tensor([2, 0])):
        setattr(context, attention.LEFT_PADDING, padding)
        masks.append(attention._per_step(context, "mask", 2, 1, lambda p=padding: attention.left_padded_mask(p, 5, 1)))
    assert torch.equal(masks[1], attention.left_padded_mask(torch.tensor([2, 0]), 5, 1))
    assert not torch.equal(masks[0], masks[1])


def test_a_full_disk_at_the_end_keeps_the_completions_and_leaves_no_half_output(tmp_path, checkpoints, monkeypatch):
    """Issue 39, finding 4: every completion was generated, then the write failed on a full disk: the completions
    were lost and a 0-byte file was left. Now the output is whole or absent, and the error carries the completions."""
    import errno
    from pathlib import Path

    ckpt = checkpoints["llama"][1]
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    output = tmp_path / "out.jsonl"
    write_text = Path.write_text

    def full_disk(path, *args, **kwargs):
        if path.name.endswith(".partial"):
            write_text(path, "{\"half\"")  # a write cut short
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    config = generate.GenerationConfig(max_new_tokens=4)
    with pytest.raises(generate.NotSaved, match=rf"could not write {output}: No space left on device\. The 2 "
                                                r"completions are not lost") as err:
        generate.generate_file(ckpt, prompts, output, config, run_dir=tmp_path / "run", show_progress=False)
    assert [r["prompt"] for r in err.value.result["records"]] == ["one", "two"]
    assert not output.exists() and not (tmp_path / "out.jsonl.partial").exists()
