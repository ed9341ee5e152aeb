"""SFT data (pai_cookbook/sft.py): answer-only loss masks found two ways and cross-checked, bad records named
with their line, truncation counted, first-fit-decreasing packing."""

import json

import pytest

from pai_cookbook import sft, smollm2
from pai_cookbook.core import tokenizer
from pai_cookbook.core.config import DataConfig
from tests.conftest import tiny_run

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
             '{"messages": []}': "non-empty list"}
    for text, message in cases.items():
        path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + text + "\n")
        with pytest.raises(sft.SFTError, match=message) as err:
            sft.read(path)
        assert f"{path}:2" in str(err.value)
    path.write_text(json.dumps({"system": "s", "prompt": "a", "response": "b"}) + "\n")
    assert [t["role"] for t in sft.read(path)[0]["messages"]] == ["system", "user", "assistant"]


def test_templates_that_cannot_mark_or_stop_are_refused(smol):
    counting = "{{ messages | length }}" + sft.CHATML  # the text of a turn depends on the turns after it
    with pytest.raises(sft.SFTError, match="prefixes of its turns"):
        sft.encode(smol, CONVERSATION, counting)
    no_end = sft.CHATML.replace("'<|im_end|>' }}{% endgeneration %}", "'' }}{% endgeneration %}")
    with pytest.raises(sft.SFTError, match="never learns to stop"):
        sft.encode(smol, CONVERSATION, no_end)


def test_long_conversations_are_dropped_or_truncated_and_counted(smol):
    long = {"line": 2, "messages": CONVERSATION["messages"][:2] + [{"role": "assistant", "content": "word " * 80}]}
    samples, counts = sft.encode_all(smol, [CONVERSATION, long], seq_length=48)
    assert len(samples) == 1 and counts.dropped_too_long == 1 and counts.cross_checked == 0
    samples, counts = sft.encode_all(smol, [CONVERSATION, long], seq_length=48, truncation="truncate")
    assert len(samples) == 2 and counts.truncated == 1 and len(samples[1].ids) == 49
    # truncated before its answer starts: no loss token left, so it never reaches training
    samples, counts = sft.encode_all(smol, [long], seq_length=12, truncation="truncate", template="chatml")
    assert samples == [] and counts.dropped_no_loss == 1 and counts.cross_checked == 1 and counts.disagreements == []


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
