"""The shared-prompt forward (policy.completion_logprobs with u < n distinct prompts) against the
single pass over prompt + completion: the same log-probs and the same gradients, for ragged
prompts and completions in any row order, with LoRA, and under bf16 autocast."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from grouprl.micro_batches import MicroBatch
from grouprl.policy import can_share_prompts, completion_logprobs, load_policy
from grouprl.rollout import Rollout

P, T = 9, 7


def ragged_rollout(prompt_lens: list[int], G: int, seed: int = 0) -> Rollout:
    """len(prompt_lens) prompts (left-padded to P) with G completions each, lengths 1..T, rows shuffled."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    plen = torch.tensor(prompt_lens).repeat_interleave(G)  # [N]
    pmask = (torch.arange(P)[None] >= P - plen[:, None]).long()  # [N, P]
    pids = torch.randint(4, 90, (B, P), generator=g).repeat_interleave(G, 0) * pmask  # [N, P]
    lengths = torch.randint(1, T + 1, (B * G,), generator=g)
    lengths[0] = T
    cmask = torch.arange(T)[None] < lengths[:, None]  # [N, T]
    cids = torch.randint(4, 90, (B * G, T), generator=g) * cmask
    perm = torch.randperm(B * G, generator=g)
    return Rollout(pids[perm], pmask[perm], cids[perm], cmask[perm], lengths[perm] == T)


def logprobs_and_grads(model, rollout, share: bool, autocast=None):
    model.zero_grad(set_to_none=True)
    mb = MicroBatch.from_rollout(rollout, torch.arange(len(rollout)), 0 if share else None)
    logp, _ = completion_logprobs(model, mb, temperature=0.7, autocast_dtype=autocast)  # [n, T']
    assert logp.shape == mb.completion_ids.shape
    loss = (logp * mb.completion_mask).sum() / mb.completion_mask.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return mb, logp.detach().masked_fill(~mb.completion_mask, 0.0), grads


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()


def test_micro_batch_stores_each_prompt_once_and_maps_rows_back():
    r = ragged_rollout([3, 9, 5], G=4)
    mb = MicroBatch.from_rollout(r, torch.arange(12), share_min_tokens=0)
    assert mb.prompt_ids.shape == (3, 9) and mb.prompt_index.shape == (12,)
    assert torch.equal(mb.input_ids[:, :P], r.prompt_ids) and torch.equal(mb.attention_mask[:, :P], r.prompt_mask)
    unshared = MicroBatch.from_rollout(r, torch.arange(12))
    assert unshared.prompt_ids.shape == (12, 9) and torch.equal(unshared.input_ids, mb.input_ids)
    assert r.prompt_groups().unique().numel() == 3
    # 12 rows of width 9 -> 3 prompts of 8 + the last token per row: saves 12*9 - 3*8 = 84 tokens
    assert MicroBatch.from_rollout(r, torch.arange(12), share_min_tokens=84).prompt_ids.shape[0] == 3
    assert MicroBatch.from_rollout(r, torch.arange(12), share_min_tokens=85).prompt_ids.shape[0] == 12


def test_shared_forward_matches_single_pass_values_and_gradients(model):
    r = ragged_rollout([3, 9, 5], G=4)
    mb, joint, g_joint = logprobs_and_grads(model, r, share=False)
    mb_s, shared, g_shared = logprobs_and_grads(model, r, share=True)
    assert mb_s.prompt_ids.shape[0] == 3 and mb.prompt_ids.shape[0] == 12
    assert torch.allclose(shared, joint, atol=1e-5, rtol=0), float((shared - joint).abs().max())
    assert g_joint.keys() == g_shared.keys() and len(g_joint) > 0
    for name, g in g_joint.items():
        assert g.norm() > 0, name
        assert rel(g_shared[name], g) < 1e-5, (name, rel(g_shared[name], g))


def test_other_architectures_share_too():
    """Not only Llama/Qwen2: GPT-2 (absolute positions, its own cache layout) gives the same values."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=90, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)).train()
    r = ragged_rollout([3, 9, 5], G=4)
    _, joint, g_joint = logprobs_and_grads(gpt2, r, share=False)
    mb, shared, g_shared = logprobs_and_grads(gpt2, r, share=True)
    assert mb.prompt_ids.shape[0] == 3
    assert torch.allclose(shared, joint, atol=1e-5, rtol=0)
    assert all(rel(g_shared[n], g) < 1e-5 for n, g in g_joint.items() if g.norm() > 0)


def test_frozen_reference_gives_bitwise_the_same_logprobs(model):
    """KL = 0 exactly at step 1 needs the reference (no grad) and the policy on identical kernels."""
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    r = ragged_rollout([4, 6], G=3, seed=1)
    mb = MicroBatch.from_rollout(r, torch.arange(len(r)), share_min_tokens=0)
    policy_logp, _ = completion_logprobs(model, mb, temperature=1.0)
    with torch.no_grad():
        ref_logp, _ = completion_logprobs(ref, mb, temperature=1.0)
    assert torch.equal(policy_logp.detach(), ref_logp)


def test_one_token_prompt_takes_the_single_pass(model):
    r = ragged_rollout([1, 6], G=3, seed=2)
    _, joint, _ = logprobs_and_grads(model, r, share=False)
    _, shared, _ = logprobs_and_grads(model, r, share=True)
    assert torch.equal(shared, joint)


def test_lora_shared_forward_matches_with_and_without_adapter(tiny_model_dir):
    lora = load_policy(str(tiny_model_dir), lora_r=4)
    with torch.no_grad():  # a non-zero adapter, so "disabled" and "enabled" differ
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    r = ragged_rollout([3, 7], G=4, seed=3)
    _, joint, g_joint = logprobs_and_grads(lora, r, share=False)
    _, shared, g_shared = logprobs_and_grads(lora, r, share=True)
    assert torch.allclose(shared, joint, atol=1e-5, rtol=0)
    assert all(rel(g_shared[n], g) < 1e-5 for n, g in g_joint.items()) and g_joint.keys() == g_shared.keys()
    with torch.no_grad(), lora.disable_adapter():
        mbs = [MicroBatch.from_rollout(r, torch.arange(len(r)), s) for s in (None, 0)]
        base = [completion_logprobs(lora, mb, temperature=0.7)[0].masked_fill(~mb.completion_mask, 0.0)
                for mb in mbs]
    assert torch.allclose(base[0], base[1], atol=1e-5, rtol=0)
    assert not torch.allclose(base[1], shared, atol=1e-3)  # the adapter really was off


def test_bf16_autocast_shared_forward_stays_close(model):
    r = ragged_rollout([3, 9, 5], G=4)
    _, joint, _ = logprobs_and_grads(model, r, share=False, autocast=torch.bfloat16)
    _, shared, _ = logprobs_and_grads(model, r, share=True, autocast=torch.bfloat16)
    _, exact, _ = logprobs_and_grads(model, r, share=False)
    # bf16 rounding: both paths measured within 0.006 of fp32 here; their equality is tested in fp32
    assert (shared - exact).abs().max() < 0.02 and (joint - exact).abs().max() < 0.02
    assert (shared - joint).abs().max() < 0.02


def test_gradient_checkpointing_turns_sharing_off(tiny_model_dir):
    assert can_share_prompts(load_policy(str(tiny_model_dir)))
    assert not can_share_prompts(load_policy(str(tiny_model_dir), gradient_checkpointing=True))


def test_a_shared_micro_batch_under_checkpointing_runs_joint(model):
    """The plan shares a group's prompt when the model does not checkpoint at the start; under
    `gradient_checkpointing: auto` a pass over the token budget then turns checkpointing on
    (update.py), which turns the prompt pass's KV cache off. Its completions attended to no prompt:
    log-probs off by up to 0.33 nats. The pass runs joint instead: the same values and gradients."""
    from grouprl.policy import activation_checkpointing

    r = ragged_rollout([3, 9, 5], G=4, seed=1)
    _, want, want_grads = logprobs_and_grads(model, r, share=False)
    with activation_checkpointing(model):
        mb, got, grads = logprobs_and_grads(model, r, share=True)
    assert len(mb.prompt_ids) == 3 < len(mb.completion_ids)  # planned shared
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    for name, g in want_grads.items():
        assert rel(grads[name], g) < 1e-5, name


def test_trainer_micro_batches_keep_groups_together(make_cfg):
    from grouprl.trainer import Trainer

    trainer = Trainer(make_cfg(num_generations=4, prompts_per_step=4, micro_batch_size=4))
    r = ragged_rollout([3, 9, 5, 2], G=4, seed=4)
    groups = r.prompt_groups()
    plan = trainer.updater.planner.plan(r, trainer.cfg)
    assert sorted(torch.cat([rows for rows, _ in plan]).tolist()) == list(range(16))
    for rows, weight in plan:
        assert weight == 1.0 and groups[rows].unique().numel() == 1
        assert torch.equal(r.lengths[rows], r.lengths[rows].sort().values)  # length-sorted inside
    trainer.updater.planner.share_min_tokens = None
    assert any(groups[rows].unique().numel() > 1 for rows, _ in trainer.updater.planner.plan(r, trainer.cfg))


def test_trainer_update_is_the_same_with_and_without_sharing(tiny_model_dir, digits_data, tmp_path):
    """One optimizer step on a fixed batch (ragged prompts, four loss aggregations, three reward
    scalings, two importance-sampling modes): the gradients and the loss do not depend on
    share_prompt_forward."""
    from tests.distributed._worker import config, update_grads

    on, off = (update_grads(config(str(tiny_model_dir), str(digits_data), str(tmp_path / f"run{s}"),
                                   share_prompt_forward=s)) for s in (True, False))
    assert on.keys() == off.keys() and len(on) == 14
    for case, (grads, stats) in off.items():
        grads_on, stats_on = on[case]
        loss, loss_on = stats["loss"], stats_on["loss"]
        assert abs(loss_on - loss) <= 1e-5 * max(1.0, abs(loss)), case
        for name, g in grads.items():
            assert g.norm() > 0 and rel(grads_on[name], g) < 1e-5, (case, name, rel(grads_on[name], g))
