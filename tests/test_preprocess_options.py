"""PreprocessOptions: every value a preprocessing run is told is checked when the options are made,
with one line naming the flag, and the run's output names follow from them."""
import dataclasses

import pytest

from megatron_dllm.data.prep.preprocess_options import PreprocessOptions

BASE = dict(inputs=["in.jsonl"], output_prefix="out/c", tokenizer_type="SentencePieceTokenizer",
            tokenizer_model="tok.model")


@pytest.mark.parametrize("change, message", [
    (dict(json_keys=[]), "--json-keys: at least one key is required"),
    (dict(json_keys=["text", "text"]), r"--json-keys: duplicate keys in \['text', 'text'\]"),
    (dict(workers=0), "--workers 0: expected >= 1"),
    (dict(inputs="in.jsonl"), "--input 'in.jsonl': expected a list of files or globs, got one string"),
    (dict(num_shards=2, shard_index=2), "--shard-index 2 / --num-shards 2: expected 0 <= shard index"),
    (dict(num_shards=0), "--shard-index 0 / --num-shards 0: expected 0 <= shard index"),
])
def test_bad_values_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        PreprocessOptions(**{**BASE, **change})


def test_output_names():
    whole = PreprocessOptions(**BASE, json_keys=["text", "title"])
    assert whole.dataset_prefixes == {"text": "out/c_text_document", "title": "out/c_title_document"}
    assert whole.rejections_paths == {"text": "out/c_text_document_rejected.tsv",
                                      "title": "out/c_title_document_rejected.tsv"}
    assert (whole.label, whole.tokenizer_options) == ("", {})
    shard = PreprocessOptions(**BASE, num_shards=4)  # shard 0 unless told
    assert shard.dataset_prefixes == {"text": "out/c_shard00000of00004_text_document"}
    assert shard.marker_path == "out/c_shard00000of00004.done.json" and shard.label == "[shard 0/4] "
    with pytest.raises(dataclasses.FrozenInstanceError):
        shard.workers = 2
