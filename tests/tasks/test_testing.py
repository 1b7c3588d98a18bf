"""Character tokenizer and tiny Qwen2 builders."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl.tasks.testing import (
    CHARACTERS,
    TINY_SIZES,
    build_char_tokenizer,
    build_qwen2,
    build_tiny_model,
    save_tiny_model,
)

TEXT = 'What is 58+67? Answer: 125\n\\boxed{42}  "ok" ~ <think>x</think>'


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_one_token_per_character_and_round_trip():
    tok = build_char_tokenizer()
    ids = tok(TEXT)["input_ids"]
    assert len(ids) == len(TEXT)  # no BOS/EOS added, no merges
    assert tok.decode(ids) == TEXT
    every = tok(CHARACTERS)["input_ids"]
    assert sorted(every) == list(range(4, 4 + len(CHARACTERS)))  # each character has its own id
    assert len(tok) == 4 + len(CHARACTERS) == 100


def test_special_tokens():
    tok = build_char_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok("<eos>")["input_ids"] == [tok.eos_token_id]
    assert tok.decode([5, 6, tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == tok.decode([5, 6])


def test_reload_from_disk_encodes_identically(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    save_tiny_model(tmp_path)
    tok, again = build_char_tokenizer(), AutoTokenizer.from_pretrained(tmp_path)
    assert again(TEXT)["input_ids"] == tok(TEXT)["input_ids"]
    assert again.decode(again(TEXT)["input_ids"]) == TEXT
    assert (again.pad_token_id, again.eos_token_id, len(again)) == (0, 1, 100)
    batch = again(["1+2=", "10+20="], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0]  # left padding, ready for generation


def test_saved_model_reloads_with_the_same_outputs(tmp_path):
    save_tiny_model(tmp_path, seed=3)
    model, tok = build_tiny_model("tiny", seed=3)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    torch.testing.assert_close(again(ids).logits, model(ids).logits)
    assert again.config.tie_word_embeddings
    assert again.config.eos_token_id == tok.eos_token_id and again.config.pad_token_id == tok.pad_token_id


@pytest.mark.parametrize(
    "size, expected",
    [("tiny", 0.54e6), ("10m", 9.5e6), ("50m", 52.5e6)],
)
def test_named_sizes_param_counts(size, expected):
    hidden, layers, heads, mlp = TINY_SIZES[size]
    # count from the shapes, without building the 50 M model's weights twice:
    # per layer q,k,v,o (+ q,k,v biases) and the gated MLP, two norms; tied embedding; final norm
    per_layer = 4 * hidden * hidden + 3 * hidden + 3 * hidden * mlp + 2 * hidden
    formula = layers * per_layer + 100 * hidden + hidden
    assert formula == pytest.approx(expected, rel=0.03)
    if size == "tiny":
        model, _ = build_tiny_model(size)
        assert n_params(model) == formula


def test_same_seed_same_weights_different_seed_different():
    tok = build_char_tokenizer()
    kw = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    a, b, c = build_qwen2(tok, **kw, seed=1), build_qwen2(tok, **kw, seed=1), build_qwen2(tok, **kw, seed=2)
    torch.testing.assert_close(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.config.vocab_size == len(tok)
    assert a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()  # tied


def test_bad_sizes_fail_clearly():
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="divisible"):
        build_qwen2(tok, hidden_size=30, num_layers=1, num_heads=4, intermediate_size=64)
    with pytest.raises(ValueError, match="named tiny size"):
        build_tiny_model("huge")


def test_the_old_import_path_still_works_and_says_where_it_moved():
    import importlib
    import sys

    import grouprl.tasks.testing as testing

    sys.modules.pop("grouprl.tasks.tiny", None)
    with pytest.warns(DeprecationWarning, match="grouprl.tasks.testing"):
        tiny = importlib.import_module("grouprl.tasks.tiny")
    assert tiny.save_tiny_model is testing.save_tiny_model and tiny.build_tiny_model is testing.build_tiny_model
