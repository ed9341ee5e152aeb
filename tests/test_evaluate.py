"""Evaluation on Megatron-Core (pai_cookbook/evaluate.py, workers/evaluate.py): log-likelihoods equal transformers' at
every layout, tokenized as lm-evaluation-harness tokenizes, perplexity over the harness's windows, greedy answers
cut at their stop strings, and bad requests refused before any worker starts."""

from __future__ import annotations

import pytest
import torch

from pai_cookbook import evaluate
from pai_cookbook.core.configs.config import ConfigError, ParallelConfig

QUIET = {"show_progress": False}
REQUESTS = [("The capital of France is", " Paris"), ("2 + 2 =", " 4"), ("", "Hello world"),
            ("One two  ", "three"), ("A longer context, with punctuation; and more words before the end:", " done.")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(Hugging Face folder, its Megatron-Core checkpoint): a tiny random Llama with SmolLM2's real tokenizer, 64
    positions (so that long requests meet the limit)."""
    from pai_cookbook import convert
    from pai_cookbook.fixtures import smollm2
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("evaluate")
    hf = make_tiny_hf_model("llama", root / "hf", tokenizer_dir=smollm2.hf_folder(), max_position_embeddings=64)
    convert.hf_to_megatron(hf, root / "mcore", run_dir=root / "convert")
    return hf, root / "mcore"


def _transformers(hf, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    out = []
    for context, continuation in pairs:
        ids = torch.tensor([context + continuation])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids[:, :-1]).logits.float(), -1)[0, -len(continuation):]
        target = torch.tensor(continuation)
        out.append((float(logprobs.gather(-1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all())))
    return out


@pytest.mark.multiproc
def test_loglikelihoods_equal_transformers_at_every_layout(tiny, tmp_path):
    """Each continuation's log-probability and greedy flag at TP=1, TP=2 with sequence parallelism, and PP=2, against
    transformers on the same ids: within 1e-4 in fp32, the flags identical. One request continues with the model's
    own greedy tokens, so a flag is True somewhere (a random model's are otherwise all False); five more share their
    fed tokens with it or with each other, as a multiple-choice question's do, and fewer sequences are fed."""
    import transformers

    hf, ckpt = tiny
    tokenizer = evaluate.tokenizer(ckpt)
    pairs = [evaluate.encode_pair(tokenizer, *r) for r in REQUESTS]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    context = pairs[0][0]
    with torch.no_grad():
        own = model.generate(torch.tensor([context]), max_new_tokens=3, do_sample=False)[0, len(context):].tolist()
    pairs.append((context, own))
    # A multiple-choice question's requests: one context, continuations that differ in their last token only (one
    # token each, the model's own first among them; and the own three tokens' first two with another last), which the
    # worker feeds once and reads at one position (workers.evaluate.shared_inputs)
    pairs += [(context, [token]) for token in (own[0], 17, 1234, 3)] + [(context, own[:2] + [own[2] + 1])]
    reference = _transformers(hf, pairs)
    assert reference[len(REQUESTS)][1] and reference[len(REQUESTS) + 1][1] and not all(flag for _, flag in reference)
    layouts = [ParallelConfig(), ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
               ParallelConfig(pipeline_model_parallel_size=2)]
    for i, parallel in enumerate(layouts):
        out = evaluate.loglikelihood_tokens(ckpt, pairs, parallel=parallel, batch=3, run_dir=tmp_path / f"r{i}",
                                            **QUIET)
        got = [(r["logprob"], r["greedy"]) for r in out["results"]]
        # the first request and the four one-token answers share a pass, the own three tokens and their variant one
        assert out["fed"] == len(pairs) - 5, out["fed"]
        assert [g for _, g in got] == [g for _, g in reference], parallel
        assert max(abs(a - b) for (a, _), (b, _) in zip(got, reference)) <= 1e-4, (parallel, got, reference)


def test_rolling_windows_predict_every_token_once_from_at_most_the_limit():
    """Every token is a target exactly once, in order; each window feeds at most `limit` positions; the first token
    is predicted from the prefix, every other from the tokens just before it."""
    for length in (1, 5, 8, 9, 23, 64):
        ids = list(range(100, 100 + length))
        stream = [7] + ids  # the token that predicts ids[k] is stream[k]
        windows = evaluate.rolling_windows(ids, prefix=7, limit=8)
        assert [t for _, target in windows for t in target] == ids
        for context, target in windows:
            fed, k = (context + target)[:-1], ids.index(target[0])
            assert len(fed) <= 8 and fed == stream[k - len(context) + 1:k + len(target)]
        assert len(windows) == -(-length // 8)


@pytest.mark.multiproc
def test_perplexity_is_transformers_log_likelihood_of_every_token(tiny, tmp_path):
    """A text within the model's positions: its log-likelihood is transformers' of every token after the prefix token.
    A text three windows long: every token scored once (the token count is the text's), each window within the
    positions. The three normalisations are that one sum over tokens, bytes and words."""
    import math

    import transformers

    hf, ckpt = tiny
    tokenizer = evaluate.tokenizer(ckpt)
    short, long = "A short text to score.", " ".join(["Every token of a long text is predicted exactly once."] * 12)
    out = evaluate.perplexity(ckpt, [short, long], parallel=ParallelConfig(tensor_model_parallel_size=2),
                              run_dir=tmp_path / "p", **QUIET)
    ids = [evaluate.prefix_id(tokenizer)] + evaluate.encode(tokenizer, short)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits.float(), -1)[0]
    reference = float(logprobs.gather(-1, torch.tensor(ids[1:])[:, None]).sum())
    assert abs(out["per_text"][0] - reference) <= 1e-4
    long_ids = evaluate.encode(tokenizer, long)
    assert len(long_ids) > 2 * 64 and out["tokens"] == len(ids) - 1 + len(long_ids) and out["windows"] == 1 + 3
    assert out["bits_per_byte"] == pytest.approx(-out["logprob"] / len((short + long).encode()) / math.log(2))
    assert out["token_perplexity"] == pytest.approx(math.exp(-out["logprob"] / out["tokens"]))


@pytest.mark.multiproc
def test_a_sliding_window_is_applied_inside_attention_as_transformers_does(tmp_path):
    """A Mistral whose window (8) is shorter than its positions (64): the model's length is its positions, as
    HFLM's is, and a 50-token text's log-likelihood is transformers' (each layer's queries see the last 8
    positions) within 1e-4 at TP=2, scored in one pass (the window was once taken for the model's length, and the
    text cut into 8-token pieces)."""
    import transformers

    from pai_cookbook import convert
    from pai_cookbook.fixtures import smollm2
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("mistral", tmp_path / "hf", tokenizer_dir=smollm2.hf_folder(), max_position_embeddings=64,
                            sliding_window=8)
    ckpt = tmp_path / "mcore"
    convert.hf_to_megatron(hf, ckpt, run_dir=tmp_path / "convert")
    assert evaluate.max_length(ckpt) == 64
    tokenizer = evaluate.tokenizer(ckpt)
    text = ("A sliding window lets each layer of the model see only the last few positions before a token, so a "
            "text several times longer than the window tests whether the window is applied where the model applies "
            "it, and nowhere else.")
    ids = [evaluate.prefix_id(tokenizer)] + evaluate.encode(tokenizer, text)
    assert 8 * 4 < len(ids) <= 64
    out = evaluate.perplexity(ckpt, [text], parallel=ParallelConfig(tensor_model_parallel_size=2),
                              run_dir=tmp_path / "p", **QUIET)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits.float(), -1)[0]
    reference = float(logprobs.gather(-1, torch.tensor(ids[1:])[:, None]).sum())
    assert out["windows"] == 1 and abs(out["per_text"][0] - reference) <= 1e-4, (out["per_text"], reference)


def test_a_pair_is_tokenized_as_the_whole_text_is(tiny):
    """The context's trailing spaces move to the continuation, and the continuation's ids are the whole text's after
    the context's: context + continuation ids are the whole text's ids exactly."""
    tokenizer = evaluate.tokenizer(tiny[1])
    context, continuation = evaluate.encode_pair(tokenizer, "One two  ", "three")
    assert context + continuation == evaluate.encode(tokenizer, "One two  three")
    assert tokenizer.decode(continuation) == "  three"
    assert evaluate.encode_pair(tokenizer, "", "Hi")[0] == [evaluate.prefix_id(tokenizer)]


@pytest.mark.multiproc
def test_greedy_answers_stop_where_transformers_stops(tiny, tmp_path):
    """generate_until: greedy, without repetition penalty, cut before the first of its own stop strings: transformers'
    greedy continuation of the same ids, decoded and cut the same way, whatever another request's stops are."""
    import transformers

    hf, ckpt = tiny
    tokenizer = evaluate.tokenizer(ckpt)
    contexts = ["Question: what is two plus two?\nAnswer:", "Once upon a time"]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    expected = []
    for context in contexts:
        ids = tokenizer(context, add_special_tokens=False).input_ids
        with torch.no_grad():
            new = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):]
        expected.append(tokenizer.decode(new, skip_special_tokens=True))
    stop = expected[0][3:6]  # a stop string the first answer meets
    # each row stops at its own strings: the same context again with a stop its answer never meets runs to the end
    # (one job for the union of the stops ended it at the other request's)
    other = "\n\n" if "\n\n" not in expected[0] else "@@@"
    answers = evaluate.generate_until(ckpt, [(contexts[0], [stop]), (contexts[1], []), (contexts[0], [other])],
                                      max_new_tokens=12, run_dir=tmp_path / "g", **QUIET)
    assert answers == [expected[0].split(stop)[0], expected[1], expected[0]]


def test_requests_that_cannot_be_scored_are_refused_before_launch(tiny, tmp_path, no_launch):
    """A continuation longer than the model's positions, a pair beyond them without truncate=True, an empty
    continuation, a checkpoint without a tokenizer, a request that is not a pair of strings: each named, with the
    fix."""
    import shutil

    from pai_cookbook.core.checkpoints import checkpoint

    _, ckpt = tiny
    with pytest.raises(ConfigError, match="longer than the model's 64 positions"):
        evaluate.loglikelihood_tokens(ckpt, [([1], list(range(5, 70)))])
    with pytest.raises(ConfigError, match="truncate=True"):
        evaluate.loglikelihood_tokens(ckpt, [(list(range(5, 61)), list(range(5, 15)))])  # 66 > 64 + 1
    with pytest.raises(ConfigError, match="nothing to score"):
        evaluate.loglikelihood_tokens(ckpt, [([1, 2], [])])
    with pytest.raises(ConfigError, match=r"request 0: expected a \(context, continuation\) pair"):
        evaluate.loglikelihood(ckpt, ["just a string"])
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare)
    for name in evaluate.tokenizers.VOCABULARY_FILES:
        (bare / checkpoint.HF_ASSETS / name).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="carries no tokenizer"):
        evaluate.perplexity(bare, ["some text"])
