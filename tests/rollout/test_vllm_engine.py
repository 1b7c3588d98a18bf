"""VLLMEngine on vLLM's CPU build, against the trainer's forward pass and the Rollout contract.
The shipped policy (trained on addition) gives peaked distributions, so greedy decoding has no
near-ties that kernel rounding could flip."""

import pytest
import torch

from tests.rollout._vllm import LOGP_ATOL, make_engine, trainer_logp
from grouprl.policy import load_policy, load_tokenizer
from grouprl.rollout import HFEngine, SamplingParams
from grouprl.tasks import DEFAULT_POLICY_DIR


@pytest.fixture(scope="module")
def setup():
    tok = load_tokenizer(str(DEFAULT_POLICY_DIR))
    model = load_policy(str(DEFAULT_POLICY_DIR)).eval()
    prompts = [tok(f"What is {a}+{b}? Answer: ")["input_ids"] for a, b in [(12, 34), (7, 88), (5, 5)]]
    prompts.append(tok("Hi")["input_ids"])  # ragged: left padding
    return make_engine(DEFAULT_POLICY_DIR, tok), model, tok, prompts


def test_rollout_contract_eos_truncation_and_padding(setup):
    engine, _, tok, prompts = setup
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ro = engine.generate(prompts, 8, SamplingParams(max_new_tokens=5, temperature=2.0),
                         torch.Generator().manual_seed(0))
    N, T = 4 * 8, 5
    assert ro.completion_ids.shape == ro.completion_mask.shape == ro.sampling_logp.shape == (N, T)
    assert ro.sampling_logp.dtype == torch.float32 and ro.completion_mask.dtype == torch.bool
    assert ro.prompt_ids.shape == ro.prompt_mask.shape == (N, max(map(len, prompts)))
    assert 0 < int(ro.truncated.sum()) < N  # rows that hit EOS and rows that ran out both occur
    for i in range(N):
        prompt = prompts[i // 8]
        assert ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist() == prompt
        assert ro.prompt_mask[i, -1] == 1  # left padding: every prompt ends at the last column
        n = int(ro.lengths[i])
        assert ro.completion_mask[i].tolist() == [True] * n + [False] * (T - n)
        assert (ro.completion_ids[i, n:] == pad).all() and (ro.sampling_logp[i, n:] == 0).all()
        assert (ro.sampling_logp[i, :n] < 0).all()
        real = ro.completion_ids[i, :n]
        assert bool(ro.truncated[i]) == (int(real[-1]) != eos)
        assert not (real[:-1] == eos).any()  # EOS only ever ends a completion


def test_ignore_eos_gives_exact_length(setup):
    engine, _, tok, prompts = setup
    ro = engine.generate(prompts, 2, SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True),
                         torch.Generator().manual_seed(1))
    assert ro.completion_mask.all() and ro.lengths.tolist() == [12] * 8
    assert not ro.truncated.any()
    assert (ro.completion_ids == tok.eos_token_id).any()  # the policy does emit EOS, and went on past it


def test_greedy_matches_the_built_in_engine_and_the_trainer_logprobs(setup):
    engine, model, tok, prompts = setup
    params = SamplingParams(max_new_tokens=16, greedy=True)
    ro = engine.generate(prompts, 1, params)
    hf = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id).generate(prompts, 1, params)
    assert torch.equal(ro.completion_ids, hf.completion_ids) and torch.equal(ro.truncated, hf.truncated)
    logp = trainer_logp(model, ro)  # [N, T']
    T = logp.shape[1]
    torch.testing.assert_close(ro.sampling_logp[:, :T][ro.completion_mask[:, :T]],
                               logp[ro.completion_mask[:, :T]], atol=LOGP_ATOL, rtol=0)


def test_same_generator_state_same_samples(setup):
    engine, *_, prompts = setup
    p = SamplingParams(max_new_tokens=10, temperature=1.5)
    a = engine.generate(prompts, 4, p, torch.Generator().manual_seed(5))
    b = engine.generate(prompts, 4, p, torch.Generator().manual_seed(5))
    c = engine.generate(prompts, 4, p, torch.Generator().manual_seed(6))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampling_logp, b.sampling_logp)
    assert not torch.equal(a.completion_ids, c.completion_ids)


def reference_processed_logp(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                             top_k: int, top_p: float) -> torch.Tensor:
    """Naive per row: logits [n, V] / temperature, keep the top-k, then the smallest top set with
    probability >= top_p (renormalised after top-k), log-softmax over what is kept; [n]."""
    out = []
    for row, tok in zip(logits.double() / temperature, tokens):
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[row.topk(top_k).indices] = True
        row = row.masked_fill(~keep, float("-inf"))
        probs, order = row.softmax(-1).sort(descending=True)
        before = probs.cumsum(0) - probs  # mass of the tokens ranked above
        keep = torch.zeros_like(keep)
        keep[order[before < top_p]] = True
        out.append(row.masked_fill(~keep, float("-inf")).log_softmax(-1)[tok])
    return torch.stack(out).float()


def test_sampling_logp_is_the_processed_distribution_with_top_k_and_top_p(setup):
    """Every sampled token's log-prob is that of the temperature-scaled, top-k then top-p
    truncated and renormalised distribution computed from the trainer's logits (TRL #6789)."""
    engine, model, _, prompts = setup
    temperature, top_k, top_p = 1.3, 6, 0.8
    ro = engine.generate(prompts, 4, SamplingParams(max_new_tokens=8, temperature=temperature, top_k=top_k,
                                                    top_p=top_p), torch.Generator().manual_seed(2))
    ids = torch.cat([ro.prompt_ids, ro.completion_ids], 1)  # [N, P+T]
    attn = torch.cat([ro.prompt_mask, ro.completion_mask.long()], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn,
                       position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits  # [N, P+T, V]
    P, T = ro.prompt_ids.shape[1], ro.completion_ids.shape[1]
    step_logits = logits[:, P - 1:P - 1 + T][ro.completion_mask]  # [tokens, V]
    want = reference_processed_logp(step_logits, ro.completion_ids[ro.completion_mask], temperature, top_k, top_p)
    assert want.isfinite().all()  # every sampled token lies in the kept set
    full = (step_logits / temperature).log_softmax(-1).gather(1, ro.completion_ids[ro.completion_mask][:, None])
    assert (want - full.squeeze(1)).max() > 0.05  # truncation matters here: renormalising is visible
    torch.testing.assert_close(ro.sampling_logp[ro.completion_mask], want, atol=LOGP_ATOL, rtol=0)


def test_top_k_2_the_two_candidates_probabilities_sum_to_one(setup):
    engine, *_, prompts = setup
    ro = engine.generate(prompts[-1:], 32, SamplingParams(max_new_tokens=1, temperature=2.0, top_k=2),
                         torch.Generator().manual_seed(3))
    first = dict(zip(ro.completion_ids[:, 0].tolist(), ro.sampling_logp[:, 0].tolist()))  # token -> logp
    assert len(first) == 2  # both candidates were drawn
    assert abs(sum(torch.tensor(list(first.values())).exp().tolist()) - 1.0) < 1e-5


def test_a_prompt_and_completion_past_max_model_len_is_an_error_naming_both_fixes(setup):
    """vLLM would cut such a completion short (returned as complete, even under ignore_eos) or refuse it
    mid-batch: the call says which setting to change instead."""
    engine, _, tok, prompts = setup
    T = engine.max_model_len - max(map(len, prompts)) + 1
    with pytest.raises(ValueError, match=rf"a prompt of {max(map(len, prompts))} tokens \+ {T} new tokens "
                                         rf"\(max_completion_length, less what earlier turns took\) is longer than "
                                         rf"vLLM's max_model_len {engine.max_model_len}: set "
                                         rf"vllm_max_model_length to at least {engine.max_model_len + 1}"):
        engine.generate(prompts, 1, SamplingParams(max_new_tokens=T, greedy=True))


def test_each_row_is_checked_against_its_own_room(setup):
    """A multi-turn continuation: the longest context has little room left, the shortest much. Each fits
    max_model_len with its own room, though the longest context + the largest room does not; each row
    gets at most its own room."""
    engine, _, tok, prompts = setup
    long, short = prompts[0], prompts[-1]
    rooms = (engine.max_model_len - len(long), engine.max_model_len - len(short))
    params = SamplingParams(max_new_tokens=max(rooms), greedy=True, ignore_eos=True, row_max_new_tokens=rooms)
    ro = engine.generate([long, short], 1, params)
    assert ro.lengths.tolist() == list(rooms)
    with pytest.raises(ValueError, match=rf"a prompt of {len(long)} tokens \+ {rooms[0] + 1} new tokens"):
        engine.generate([long, short], 1, SamplingParams(max_new_tokens=max(rooms), greedy=True,
                                                         row_max_new_tokens=(rooms[0] + 1, rooms[1])))

