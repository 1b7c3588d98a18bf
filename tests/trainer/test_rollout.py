"""The KV-cached engine against a naive no-cache decoder, and its sampling contract."""

import pytest
import torch

from grouprl.rollout import HFEngine, Rollout, SamplingParams, sample_next
from grouprl.tasks.tiny import build_tiny_model


@pytest.fixture(scope="module")
def model_and_tok():
    model, tok = build_tiny_model("tiny", seed=3)
    return model.eval(), tok


def naive_greedy(model, prompt: list[int], max_new: int, eos: int) -> list[int]:
    """Recompute the whole sequence every step, no cache, no padding."""
    ids = list(prompt)
    out = []
    for _ in range(max_new):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        if tok == eos:
            break
        ids.append(tok)
    return out


def test_greedy_matches_naive_decoder_with_ragged_prompts(model_and_tok):
    model, tok = model_and_tok
    prompts = [tok("What is 1+2? ")["input_ids"], tok("Hi")["input_ids"], tok("a much longer prompt, 77")["input_ids"]]
    engine = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id)
    ro = engine.generate(prompts, 1, SamplingParams(max_new_tokens=12, greedy=True))
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = naive_greedy(model, p, 12, tok.eos_token_id)
            got = ro.completion_ids[i][ro.completion_mask[i]].tolist()
            assert got == want
            assert bool(ro.truncated[i]) == (want[-1] != tok.eos_token_id)


def test_eos_rows_stop_and_are_padded(model_and_tok):
    model, tok = model_and_tok
    eos = tok.eos_token_id
    engine = HFEngine(model, (eos,), tok.pad_token_id)
    g = torch.Generator().manual_seed(0)
    ro = engine.generate([tok("x")["input_ids"]] * 2, 8, SamplingParams(max_new_tokens=20, temperature=3.0), g)
    assert ro.completion_ids.shape == (16, 20)
    assert 0 < int(ro.truncated.sum()) < 16  # both kinds of rows occur with this seed
    lengths = ro.lengths
    for i in range(16):
        row = ro.completion_ids[i]
        n = int(lengths[i])
        assert (row[n:] == tok.pad_token_id).all()
        has_eos = bool((row[:n] == eos).any())
        assert has_eos == (not bool(ro.truncated[i]))
        if has_eos:
            assert int(row[n - 1]) == eos and not (row[: n - 1] == eos).any()


def test_ignore_eos_gives_exact_length(model_and_tok):
    model, tok = model_and_tok
    engine = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id)
    ro = engine.generate([tok("ab")["input_ids"], tok("abc")["input_ids"]], 4,
                         SamplingParams(max_new_tokens=9, temperature=2.0, ignore_eos=True),
                         torch.Generator().manual_seed(1))
    assert ro.completion_mask.all() and ro.lengths.tolist() == [9] * 8
    assert not ro.truncated.any()


def test_same_generator_state_same_samples_and_groups_share_prompts(model_and_tok):
    model, tok = model_and_tok
    engine = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id, max_batch_size=4)
    prompts = [tok("one")["input_ids"], tok("three")["input_ids"]]
    p = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=20, top_p=0.9)
    a = engine.generate(prompts, 4, p, torch.Generator().manual_seed(5))
    b = engine.generate(prompts, 4, p, torch.Generator().manual_seed(5))
    assert torch.equal(a.completion_ids, b.completion_ids)
    for g, prompt in enumerate(prompts):
        for r in range(g * 4, g * 4 + 4):
            assert a.prompt_ids[r][a.prompt_mask[r].bool()].tolist() == prompt


def test_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    top1 = {int(sample_next(logits, SamplingParams(1, top_k=1), g)) for _ in range(50)}
    assert top1 == {0}
    # top_p = 0.7: the smallest set reaching 0.7 is {0, 1}
    nucleus = {int(sample_next(logits, SamplingParams(1, top_p=0.7), g)) for _ in range(300)}
    assert nucleus == {0, 1}


def test_cat_repads_prompts_left_and_completions_right():
    a = Rollout(torch.tensor([[7, 8]]), torch.tensor([[1, 1]]), torch.tensor([[1, 2, 3]]),
                torch.tensor([[True, True, False]]), torch.tensor([False]))
    b = Rollout(torch.tensor([[9]]), torch.tensor([[1]]), torch.tensor([[4]]),
                torch.tensor([[True]]), torch.tensor([True]))
    c = Rollout.cat([a, b], pad_token_id=0)
    assert c.prompt_ids.tolist() == [[7, 8], [0, 9]]
    assert c.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert c.completion_ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert c.lengths.tolist() == [2, 1]
