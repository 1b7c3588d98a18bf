"""reward_model: a tiny random sequence-classification model built here, scored batched and unbatched."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast

from grouprl.rewards import resolve_reward_func

WORDS = "what is 12 + 30 ? answer 42 41 the user assistant : hello".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm")
    vocab = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=16, n_layer=2, n_head=2, num_labels=1,
                        pad_token_id=1)
    GPT2ForSequenceClassification(config).eval().save_pretrained(path)
    return str(path)


def test_batched_scores_equal_unbatched(model_dir):
    batched = resolve_reward_func("reward_model", model=model_dir, batch_size=3)
    single = resolve_reward_func("reward_model", model=model_dir, batch_size=1)
    prompts = ["what is 12 + 30 ? answer", "hello", "what is 12 + 30 ? answer", "hello the user"]
    completions = ["42", "41 41 41 the", "41", [{"role": "assistant", "content": "hello hello"}]]
    a = batched(prompts, completions)
    b = single(prompts, completions)
    assert len(a) == 4 and all(type(x) is float for x in a)
    assert a == pytest.approx(b, abs=1e-5)
    assert len(set(round(x, 6) for x in a)) > 1  # a random model still tells the texts apart
    assert batched.__name__ == "reward_model"


def test_chat_template_is_applied(model_dir):
    scorer = resolve_reward_func("reward_model", model=model_dir)
    scorer.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    scorer.templated = True
    text = scorer.text([{"role": "user", "content": "hello"}], "42")
    assert text.split() == ["user", ":", "hello", "assistant", ":", "42"]
    assert len(scorer(["hello"], ["42"])) == 1
