"""Vocabulary extension on released vocabularies (pai_cookbook/fixtures/real_tokenizers.py: llama.cpp's vocabulary GGUFs and
Mistral's SentencePiece models, fetched once with pip and cached): every old id and every old text's ids kept,
Chinese compressed. `pytest -s` prints the table (the merge against the add_tokens baseline).

Timing (2 shared CPU cores): the bases are built once and cached; each extension learns 2,000 (byte-level BPE) or
5,000 (SentencePiece) tokens from 10,000 Chinese sentences.
"""

from __future__ import annotations

import time

import pytest

from pai_cookbook.fixtures import real_tokenizers

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    start = time.perf_counter()
    found = real_tokenizers.matrix(tmp_path_factory.mktemp("extend-matrix"))
    print("\n" + real_tokenizers.table(found) + f"\nmatrix: {time.perf_counter() - start:.0f}s")
    return found


def test_every_family_extends_keeping_old_ids_and_old_text(rows):
    merges = [row for row in rows if row["method"] == "merge"]
    assert [row["tokenizer"] for row in merges] == [case.id for case in real_tokenizers.CASES]
    for row in merges:
        assert row["added"] >= real_tokenizers.NEW_TOKENS[row["family"]] * 0.7, row
        assert (row["old_ids_moved"], row["specials_moved"], row["reference_changed"], row["llama_cpp_changed"],
                row["roundtrip_new_failures"], row["english_changed"]) == (0, 0, 0, 0, 0, 0), row
        assert row["zh_tokens_per_char_after"] < row["zh_tokens_per_char_before"] * 0.8, row
        if row["family"] == "SentencePiece":
            assert row["sentencepiece_changed"] == 0, row
            # SentencePiece and the Hugging Face tokenizer disagree only where the base already did
            assert row["sentencepiece_hf_disagree"] <= row["sentencepiece_hf_disagree_base"], row
        if row["reference_strings"]:
            assert row["base_agrees_llama_cpp"] >= row["reference_strings"] * 0.6, row


def test_add_tokens_baseline_is_measured_for_every_tokenizer(rows):
    baseline = {row["tokenizer"]: row for row in rows if row["method"] == "add_tokens"}
    assert set(baseline) == {case.id for case in real_tokenizers.CASES}
    for row in baseline.values():
        assert row["added"] > 0 and row["zh_tokens_per_char_after"] <= row["zh_tokens_per_char_before"]
        # every learned string holds a Chinese character here, so add_tokens changes no English and no round trip
        assert row["english_changed"] == 0 and row["roundtrip_new_failures"] == 0, row
