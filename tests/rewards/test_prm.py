"""process_reward_model on tiny PRMs built here: each step's reward is the PRM's probability read
at the step's separator token, for a token-classification head, for Qwen2.5-Math-PRM's two-layer
head and for a causal LM's good/bad tokens, and the steps' ends are the completion's character
offsets. A checkpoint whose weights do not fit the kind is an error, never random scores."""

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification, Qwen2Model

from grouprl.rewards import CharOffset, resolve_reward_func
from grouprl.tasks.testing import build_char_tokenizer

PROMPT, COMPLETION = "2+3+4=", "5\n9\n"  # two steps, each ending in its newline


def _config(tokenizer, **kw) -> Qwen2Config:
    return Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       pad_token_id=tokenizer.pad_token_id, **kw)


def _newline_positions(tokenizer, text: str) -> list[int]:
    enc = tokenizer(text, return_offsets_mapping=True)
    return [k for k, (s, e) in enumerate(enc["offset_mapping"]) if text[s:e] == "\n"]


@pytest.fixture(scope="module")
def token_classification_prm(tmp_path_factory):
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model = Qwen2ForTokenClassification(_config(tokenizer, num_labels=2)).eval()
    path = tmp_path_factory.mktemp("prm") / "tc"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def test_token_classification_prm_reads_the_good_label_at_each_separator(token_classification_prm):
    path, model, tokenizer = token_classification_prm
    prm = resolve_reward_func("process_reward_model", model=str(path), use_chat_template=False)
    got = prm([PROMPT, PROMPT], [COMPLETION, "7\n"])

    text = PROMPT + COMPLETION
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        probs = model(**ids).logits[0].softmax(-1)[:, 1]  # [L] P(good) at every token
    want = [probs[k].item() for k in _newline_positions(tokenizer, text)]
    assert [e for e, _ in got[0]] == [CharOffset(2), CharOffset(4)]
    assert [r for _, r in got[0]] == pytest.approx(want, abs=1e-6)
    assert len(got[1]) == 1 and got[1][0][0] == CharOffset(2)
    assert got[1][0][1] != pytest.approx(want[0], abs=1e-6)  # another prefix ("7"), another score


def test_causal_lm_prm_compares_the_good_and_bad_tokens(tmp_path):
    torch.manual_seed(1)
    tokenizer = build_char_tokenizer()
    model = Qwen2ForCausalLM(_config(tokenizer)).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prm = resolve_reward_func("process_reward_model", model=str(tmp_path), good_token="+", bad_token="-",
                              reward="signed", use_chat_template=False)
    got = prm([PROMPT], [COMPLETION])[0]

    text = PROMPT + COMPLETION
    good, bad = tokenizer.convert_tokens_to_ids("+"), tokenizer.convert_tokens_to_ids("-")
    with torch.no_grad():
        logits = model(**tokenizer(text, return_tensors="pt")).logits[0]  # [L, V]
    p_good = logits[:, [good, bad]].softmax(-1)[:, 0]  # [L]
    want = [2 * p_good[k].item() - 1 for k in _newline_positions(tokenizer, text)]
    assert [r for _, r in got] == pytest.approx(want, abs=1e-6)


def test_a_prm_whose_architecture_is_neither_kind_asks_for_kind(tmp_path):
    tokenizer = build_char_tokenizer()
    config = _config(tokenizer)
    config.architectures = ["Qwen2Model"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="set kind: token_classification, mlp_head or causal_lm"):
        resolve_reward_func("process_reward_model", model=str(tmp_path))


@pytest.fixture(scope="module")
def qwen_prm_layout(tmp_path_factory):
    """Qwen2.5-Math-PRM's checkpoint layout, offline: architectures ["Qwen2ForProcessRewardModel"], the
    backbone's weights under `model.` and score = Sequential(Linear(h, h), ReLU, Linear(h, 2)) as
    score.0 / score.2 (its modeling code is on the Hub, not in transformers)."""
    torch.manual_seed(2)
    tokenizer = build_char_tokenizer()
    config = _config(tokenizer)
    config.architectures = ["Qwen2ForProcessRewardModel"]
    backbone = Qwen2Model(config).eval()
    head = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).eval()
    path = tmp_path_factory.mktemp("prm") / "qwen-prm"
    path.mkdir()
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    weights = {f"model.{k}": v for k, v in backbone.state_dict().items()}
    weights.update({f"score.{k}": v for k, v in head.state_dict().items()})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path, backbone, head, tokenizer


def test_qwen_prm_layout_is_read_with_its_two_layer_head(qwen_prm_layout):
    path, backbone, head, tokenizer = qwen_prm_layout
    prm = resolve_reward_func("process_reward_model", model=str(path), use_chat_template=False)
    assert prm.kind == "mlp_head"
    got = prm([PROMPT], [COMPLETION])[0]

    text = PROMPT + COMPLETION
    with torch.no_grad():
        probs = head(backbone(**tokenizer(text, return_tensors="pt")).last_hidden_state)[0].softmax(-1)[:, 1]  # [L]
    want = [probs[k].item() for k in _newline_positions(tokenizer, text)]
    assert [e for e, _ in got] == [CharOffset(2), CharOffset(4)]
    assert [r for _, r in got] == pytest.approx(want, abs=1e-6)


def test_weights_that_do_not_fit_the_kind_are_an_error_not_a_random_head(qwen_prm_layout, token_classification_prm):
    """Qwen2.5-Math-PRM as a token-classification model would get a fresh Linear(h, 2) head; a linear
    head read as mlp_head would miss score.0 / score.2."""
    with pytest.raises(ValueError, match=r"do not fit kind='token_classification'.*missing \['score.bias', "
                                         r"'score.weight'\].*unexpected \['score.0.bias'.*mlp_head"):
        resolve_reward_func("process_reward_model", model=str(qwen_prm_layout[0]), kind="token_classification")
    with pytest.raises(ValueError, match=r"do not fit kind='mlp_head'.*randomly initialised"):
        resolve_reward_func("process_reward_model", model=str(token_classification_prm[0]), kind="mlp_head")


def test_a_mark_on_a_character_split_over_byte_tokens_is_read_at_its_last_piece():
    """Byte-level BPE splits an emoji over tokens that share its offsets: the model has read the character,
    and so the step, whole only at the last piece. The first piece was read (before the step's end)."""
    import itertools

    from grouprl.rewards.prm import _last_covering

    offsets = [(0, 1), (1, 2), (2, 3), (2, 3), (2, 3), (3, 4)]  # "ab", a 4-byte character as three pieces, "c"
    ends = list(itertools.accumulate((e for _, e in offsets), max))
    assert [_last_covering(offsets, ends, m) for m in range(4)] == [0, 1, 4, 5]

