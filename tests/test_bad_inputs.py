"""Bad input from docs/bad-inputs.md that used to end in a raw traceback: each is refused, before any worker
starts, with a message that names the file (and line) and the fix. None of these tests launches a worker."""

import json
import re
import struct

import pytest

from pai_cookbook import convert, data, moe
from pai_cookbook.core.checkpoints import checkpoint, families
from pai_cookbook.core.configs.config import ConfigError, RunConfig
from pai_cookbook.core.text import tokenizer
from pai_cookbook.fixtures import tiny_models
from tests.conftest import tiny_run


@pytest.fixture
def tiny_llama(tmp_path):
    return tiny_models.make_tiny_hf_model("llama", tmp_path / "llama")


def test_empty_or_misspelt_config_json(tiny_llama):
    config = json.loads((tiny_llama / "config.json").read_text())
    config["num_hidden_layer"] = config.pop("num_hidden_layers")
    (tiny_llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config.json has the key 'num_hidden_layer'.*did you mean 'num_hidden_layers'"):
        convert.inspect_hf(tiny_llama)
    (tiny_llama / "config.json").write_text("")
    with pytest.raises(ConfigError, match=r"config.json is not valid JSON \(0 bytes"):
        families.from_hf(tiny_llama)


def test_garbage_safetensors_header(tiny_llama):
    shard = sorted(tiny_llama.glob("model-*.safetensors"))[0]
    garbage = b"not json at all"
    shard.write_bytes(struct.pack("<Q", len(garbage)) + garbage + b"\0" * 64)
    with pytest.raises(ConfigError, match=rf"{shard.name} has a damaged safetensors header"):
        convert.inspect_hf(tiny_llama)


def test_a_folder_without_tokenizer_is_refused_unless_asked(tiny_llama, tmp_path):
    for name in tokenizer.FILES:
        (tiny_llama / name).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match=r"has no tokenizer files.*require_tokenizer=False"):
        convert.hf_to_megatron(tiny_llama, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not checkpoint.partial_dir(tmp_path / "out").exists()


def test_output_that_is_a_file(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(FileExistsError, match=r"out is a file, not a folder"):
        checkpoint.check_writable(tmp_path / "out", overwrite=True)


def test_negative_loss_weights():
    with pytest.raises(ConfigError, match=r"moe_aux_loss_coeff -1.0 .* must be >= 0"):
        moe.upcycled_config(families.tiny("llama"), 4, moe_aux_loss_coeff=-1.0)


def test_run_config_files(tmp_path):
    path = tiny_run().save(tmp_path / "run.json")
    path.write_text(path.read_text()[:40])
    with pytest.raises(ConfigError, match=r"run.json is not valid JSON"):
        RunConfig.load(path)
    good = json.loads(tiny_run().to_json())
    good["data"]["seq_length"] = "32"
    path.write_text(json.dumps(good))
    with pytest.raises(ConfigError, match=r"DataConfig.seq_length must be int, got '32' \(str\)"):
        RunConfig.load(path)


def test_text_that_is_not_utf8_names_file_and_line(tmp_path):
    txt = tmp_path / "gbk.txt"
    txt.write_bytes(b"hello\n\n" + "天气".encode("gbk") + b"\n")
    with pytest.raises(data.DataError, match=r"gbk.txt:3: not UTF-8 text"):
        list(data.read_documents(txt))
    jsonl = tmp_path / "gbk.jsonl"
    jsonl.write_bytes(b'{"text": "ok"}\n' + '{"text": "天气"}'.encode("gbk") + b"\n")
    with pytest.raises(data.DataError, match=r"gbk.jsonl:2: not UTF-8 text"):
        list(data.read_documents(jsonl))


def test_a_bad_line_mid_file_leaves_no_partial_dataset(tmp_path):
    tokenizer.tiny().save_pretrained(tmp_path / "tok")
    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"text": "hello world"}\n' * 100 + '{"text": 1\n')  # the 101st line is broken
    with pytest.raises(data.DataError, match=r"in.jsonl:101: not valid JSON"):
        data.prepare([corpus], tmp_path / "ds", tmp_path / "tok", show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "tok"]


# ------------------------------------------------------------------------------------------------------------------
# Issue 39, finding 8: what a probe of bad input found refused with a raw or misleading error (a KeyError, a
# StopIteration, a UnicodeDecodeError without its file, a string iterated as a list). Each is now the cookbook's
# own error naming the input and the fix, before anything is written or launched.
# ------------------------------------------------------------------------------------------------------------------
CHAT = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def tok():
    from pai_cookbook.fixtures import smollm2

    return smollm2.hf_folder()


@pytest.fixture
def files(tmp_path):
    """Bad files as users have them: GBK text, JSON cut short by a kill, a folder where a file belongs."""
    (tmp_path / "gbk.jsonl").write_bytes('{"prompt": "天气"}\n'.encode("gbk"))
    (tmp_path / "cut.json").write_text('{"tokens": 12, "documents"')
    (tmp_path / "folder").mkdir()
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    return tmp_path


def _sft(files, tok, **kwargs):
    from pai_cookbook import sft

    options = {"source": [{"messages": CHAT}] * 4, "out_dir": files / "set", "tokenizer_dir": tok, "seq_length": 64,
               "template": "chatml"} | kwargs
    return sft.prepare(options.pop("source"), options.pop("out_dir"), options.pop("tokenizer_dir"), **options)


def _encode(tok, conversation):
    from pai_cookbook import sft

    return sft.encode(tokenizer.load(tok), conversation, "chatml")


RAW = {
    # sft: files, records, arguments
    "sft.read a GBK file": (lambda f, t: __import__("pai_cookbook.sft").sft.read(f / "gbk.jsonl"),
                            r"gbk.jsonl:1: not UTF-8 text \(byte .* at offset \d+\); convert the file to UTF-8"),
    "sft.read a missing file": (lambda f, t: __import__("pai_cookbook.sft").sft.read(f / "nowhere.jsonl"),
                                r"conversations file .*nowhere.jsonl does not exist"),
    "sft.read a folder": (lambda f, t: __import__("pai_cookbook.sft").sft.read(f / "folder"),
                          r"conversations file .*folder is a folder; give the file inside it"),
    "sft: only system messages": (lambda f, t: _sft(f, t, source=[{"messages": [{"role": "system", "content": "x"}]}]),
                                  r"conversation 1: the conversation has only system messages.*add a \"user\" turn"),
    "sft: a turn without a role": (lambda f, t: _sft(f, t, source=[{"messages": [{"content": "x"}]}]),
                                   r"conversation 1, message 1 has no \"role\".*give each message a role"),
    "sft: source None": (lambda f, t: _sft(f, t, source=None), r"source must be a list of conversations.*got None"),
    "sft: one conversation, not a list": (lambda f, t: _sft(f, t, source={"messages": CHAT}),
                                          r"source must be a list of conversations .*got one dict.*pass \[that dict\]"),
    "sft: seq_length as text": (lambda f, t: _sft(f, t, seq_length="64"), r"seq_length='64' must be an int >= 2"),
    "sft: seq_length 0": (lambda f, t: _sft(f, t, seq_length=0), r"seq_length=0 must be >= 2"),
    "sft: valid_fraction as text": (lambda f, t: _sft(f, t, valid_fraction="0.1"),
                                    r"valid_fraction='0.1' must be a number in \[0, 1\)"),
    "sft: out_dir is a file": (lambda f, t: _sft(f, t, out_dir=f / "a_file"), r"a_file is a file, not a folder"),
    "sft: a misspelt template name": (lambda f, t: _sft(f, t, template="chatlm"),
                                      r"chat template 'chatlm' is not a file, a folder, Jinja text or one of \['chatml'"),
    "sft: a template file that does not exist": (lambda f, t: _sft(f, t, template="mine.jinja"),
                                                 r"chat template 'mine.jinja' is not a file"),
    "sft: tokenizer_dir is a file": (lambda f, t: _sft(f, t, tokenizer_dir=t / "tokenizer.json"),
                                     r"tokenizer.json is a file; give the folder that holds the tokenizer files"),
    "sft: stop_tokens as one string": (lambda f, t: _sft(f, t, stop_tokens="</s>"),
                                       r"stop_tokens must be a list of token strings; got one str.*pass \['</s>'\]"),
    "sft.encode a raw record": (lambda f, t: _encode(t, {"prompt": "2+2?", "response": "4"}),
                                r"expected a conversation \{\"messages\": \[...\]\}.*sft.read"),
    "sft.encode content None": (lambda f, t: _encode(t, {"messages": [{"role": "user", "content": None}], "line": 3}),
                                r"line 3, message 1 needs a string \"content\"; found"),
    "sft.describe a cut sft.json": (lambda f, t: (f / "folder" / "sft.json").write_text('{"seq') and
                                    __import__("pai_cookbook.sft").sft.describe(f / "folder"),
                                    r"sft.json is not valid JSON \(5 bytes.*Prepare the set again"),
    "sft.follows no records": (lambda f, t: __import__("pai_cookbook.sft").sft.follows([], "x"), r"no records to score"),
    "sft.audit samples of other conversations": (
        lambda f, t: _audit_other_lines(t), r"samples of lines \[1\] have no conversation among those given \(lines \[7\]\)"),
    # GRPO/PPO prompts
    "RL: a prompt None": (lambda f, t: _rl([None]), r"prompt 1 is None \(NoneType\); give a string"),
    "RL: a prompt field None": (lambda f, t: _rl([{"prompt": None}]), r"prompt 1: \"prompt\" must be a string, found None"),
    "RL: empty messages": (lambda f, t: _rl([{"messages": []}]), r"prompt 1: \"messages\" must be a non-empty list"),
    "RL: a message without content": (lambda f, t: _rl([{"messages": [{"role": "user"}]}]),
                                      r"prompt 1, message 1 needs a string \"content\""),
    "RL: prompts as one string": (lambda f, t: _rl("What is 2+2?"), r"prompts must be a list of strings .*got one str"),
    # data
    "data.prepare a missing tokenizer": (lambda f, t: data.prepare([f / "chat.jsonl"], f / "ds", f / "no_tok"),
                                         r"tokenizer_dir carries no tokenizer"),
    "data.prepare workers 0": (lambda f, t: data.prepare([f / "chat.jsonl"], f / "ds", t, workers=0),
                               r"workers=0 must be >= 1"),
    "data.prepare a prefix under a file": (lambda f, t: data.prepare([f / "chat.jsonl"], f / "a_file" / "ds", t),
                                           r"a_file is a file, not a folder; choose another output prefix"),
    "data.prepare inputs as one string": (lambda f, t: data.prepare(str(f / "chat.jsonl"), f / "ds", t),
                                          r"inputs must be a list of .jsonl/.txt paths; got one str"),
    "data.prepare no inputs": (lambda f, t: data.prepare([], f / "ds", t), r"no inputs; give at least one"),
    "data.read_prompts a GBK file": (lambda f, t: data.read_prompts(f / "gbk.jsonl"),
                                     r"gbk.jsonl:1: not UTF-8 text"),
    "data.read_prompts a missing file": (lambda f, t: data.read_prompts(f / "none.jsonl"),
                                         r"prompts file .*none.jsonl does not exist"),
    "data.describe a cut sidecar": (lambda f, t: [(f / "ds.bin").write_text(""), (f / "ds.idx").write_text(""),
                                                  (f / "ds.json").write_text("{")] and data.describe(f / "ds"),
                                    r"ds.json is not valid JSON \(1 bytes.*Prepare the dataset again"),
    "DataConfig split 0,0,0": (lambda f, t: __import__("pai_cookbook.core.configs.config").core.configs.config.DataConfig(
                                  split="0,0,0"),
                               r"split '0,0,0' gives every part weight 0"),
    # conversion and checkpoints
    "an index cut short": (lambda f, t: _damaged_index(f, "{\"weight_map\": {"),
                           r"model.safetensors.index.json is not valid JSON.*Download the model's index file again"),
    "an index without a weight_map": (lambda f, t: _damaged_index(f, "{}"), r"has no \"weight_map\""),
    "a checkpoint description cut short": (lambda f, t: (f / "folder" / checkpoint.CONFIG_FILE).write_text("{\"mo")
                                           and checkpoint.read_config(f / "folder"),
                                           r"pai_cookbook.json is not valid JSON.*convert or train it again"),
    "a truncated tokenizer_config.json": (lambda f, t: (f / "folder" / "tokenizer_config.json").write_text("{\"chat")
                                          and __import__("pai_cookbook.sft").sft.read_template(f / "folder"),
                                          r"tokenizer_config.json is not valid JSON.*tokenizer files again"),
    "a run config that is a folder": (lambda f, t: RunConfig.load(f / "folder"),
                                      r"folder is a folder; give the RunConfig JSON file"),
    # generation, rewards, FP8, MoE
    "generate: a prompt None": (lambda f, t: _generate(f, [None]), r"prompt 1 is None \(NoneType\); give a string"),
    "generate: empty messages": (lambda f, t: _generate(f, [{"messages": []}]),
                                 r"prompt 1: \"messages\" must be a non-empty list"),
    "generate: a message without content": (lambda f, t: _generate(f, [{"messages": [{"role": "user"}]}]),
                                            r"prompt 1, message 1 needs a string \"content\""),
    "generate: a record without prompt": (lambda f, t: _generate(f, [{"text": "hi"}]),
                                          r"prompt 1 has neither \"prompt\" nor \"messages\" \(its keys: \['text'\]\)"),
    "generate: prompts as one string": (lambda f, t: _generate(f, "What is 2+2?"),
                                        r"prompts must be a list of strings or prompt records; got one str"),
    "GenerationConfig max_new_tokens as text": (lambda f, t: __import__("pai_cookbook.generate").generate.GenerationConfig(
                                                    max_new_tokens="8"), r"max_new_tokens='8' must be an int >= 1"),
    "reward pairs: prompt None": (lambda f, t: _pairs([{"prompt": None, "chosen": "a", "rejected": "b"}]),
                                  r"pair 1: \"prompt\" must be a string, found None"),
    "reward pairs: empty messages": (lambda f, t: _pairs([{"messages": [], "chosen": "a", "rejected": "b"}]),
                                     r"pair 1: \"messages\" must be a non-empty list"),
    "reward pairs: a message without content": (lambda f, t: _pairs([{"messages": [{"role": "user"}], "chosen": "a",
                                                                      "rejected": "b"}]),
                                                r"pair 1, message 1 needs a string \"content\""),
    "reward pairs: one pair, not a list": (lambda f, t: _pairs({"prompt": "q", "chosen": "a", "rejected": "b"}),
                                           r"pairs must be a list of .*got one dict"),
    "length_baseline of no pairs": (lambda f, t: __import__("pai_cookbook.reward_model").reward_model.length_baseline([]),
                                    r"no pairs: a reward model needs preference pairs"),
    "fp8.mean_curve of ragged curves": (lambda f, t: __import__("pai_cookbook.fp8").fp8.mean_curve([[1, 2], [1]]),
                                        r"the curves have different lengths \[1, 2\]"),
    "fp8.tail_mean of 0 steps": (lambda f, t: __import__("pai_cookbook.fp8").fp8.tail_mean([1.0, 2.0], steps=0),
                                 r"steps=0 must be an int >= 1"),
    "moe_layer_freq 0": (lambda f, t: moe.upcycled_config(families.tiny("llama"), 4, moe_layer_freq=0),
                         r"moe_layer_freq=0 must be an int >= 1"),
    "extend: new_tokens as text": (lambda f, t: __import__("pai_cookbook.extend").extend.extend_tokenizer(
        t, ["天气"], f / "ext", "100"), r"new_tokens='100' must be an int >= 1"),
    "extend: a base folder that does not exist": (lambda f, t: __import__("pai_cookbook.extend").extend.extend_tokenizer(
        f / "nope", ["天气"], f / "ext", 100), r"base tokenizer folder .*nope does not exist"),
    "extend: a tokenizer.json cut short": (lambda f, t: (f / "folder" / "tokenizer.json").write_text("{\"mod") and
                                           __import__("pai_cookbook.extend").extend.extend_tokenizer(
                                               f / "folder", ["天气"], f / "ext", 100),
                                           r"tokenizer.json is not valid JSON.*Save the tokenizer there again"),
    "extend.compression of no texts": (lambda f, t: __import__("pai_cookbook.extend").extend.compression(t, []),
                                       r"no texts to measure"),
    "an extension record cut short": (lambda f, t: (f / "folder" / "pai_cookbook_extension.json").write_text("{") and
                                      __import__("pai_cookbook.extend").extend.read_extension(f / "folder"),
                                      r"is not valid JSON.*Extend the tokenizer again"),
    "moe.load_balance of a dense run": (lambda f, t: moe.load_balance([{"loss": 1.0}], 0),
                                        r"the history has no 'expert_load'"),
}


def _audit_other_lines(tok):
    from pai_cookbook import sft

    hf = tokenizer.load(tok)
    sample = sft.encode(hf, {"messages": CHAT, "line": 1}, "chatml")
    return sft.audit(hf, [sample], [{"messages": CHAT, "line": 7}], "chatml")


def _rl(prompts):
    from pai_cookbook import rlhf

    return rlhf.records_of(prompts)


def _damaged_index(folder, text):
    (folder / "config.json").write_text(json.dumps(families.to_hf(families.tiny("llama")).to_dict()))
    (folder / "model.safetensors.index.json").write_text(text)
    return convert.inspect_hf(folder)


def _generate(folder, prompts):
    from pai_cookbook import generate

    return generate.generate(folder / "no_checkpoint", prompts)


def _pairs(pairs):
    from pai_cookbook import reward_model

    return reward_model.check_pairs(pairs)


@pytest.mark.parametrize("case", RAW, ids=list(RAW))
def test_a_bad_input_is_refused_with_the_input_and_the_fix(case, files, tok, no_launch):
    call, message = RAW[case]
    # ConfigError, SFTError and DataError are ValueErrors; a KeyError, TypeError, StopIteration... fails the test
    with pytest.raises((ValueError, FileNotFoundError)) as caught:
        call(files, tok)
    assert not isinstance(caught.value, (UnicodeDecodeError, json.JSONDecodeError)), caught.value
    assert re.search(message, str(caught.value), re.S), str(caught.value)
    assert not (files / "set").exists() and not (files / "ds.bin").exists() or case.startswith("data.describe")


def test_a_metrics_log_whose_last_line_was_cut_by_a_kill_reads_the_steps_before_it(tmp_path):
    from pai_cookbook import train

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    with pytest.warns(UserWarning, match=r"metrics.jsonl:3: the last record is cut short"):
        assert [r["step"] for r in train.logged_steps(tmp_path)] == [1, 2]
    # resumed after the kill: the new launch appends from a line of its own, and every record reads
    from pai_cookbook.core.launching import worker

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    with worker.open_log(tmp_path / "metrics.jsonl", fresh=False) as log:
        log.write('{"step": 3, "loss": 1.2}\n')
    assert [r["step"] for r in train.logged_steps(tmp_path)] == [1, 2, 3]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lo\n{"step": 2, "loss": 1.5}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:1 is not valid JSON.*Remove that line"):
        train.logged_steps(tmp_path)
