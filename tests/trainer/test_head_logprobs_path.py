"""completion_logprobs through the LM head in chunks (no [n, T', V] logits) against the logits
path: the same log-probs, entropies and parameter gradients, for the joint and the shared-prompt
forward, at a temperature, with tied and untied heads, with LoRA (policy and adapter-disabled
reference), and under bf16 autocast within bf16's own tolerance."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from grouprl.lora import adapter_disabled
from grouprl.micro_batches import MicroBatch
from grouprl.policy import _plain_head, completion_logprobs
from grouprl.tasks.testing import ARCHITECTURES, build_tiny_architecture, with_random_lora
from tests.trainer.test_shared_prompt import ragged_rollout

WHOLE, CHUNKED = 1 << 60, 0  # max_logits_elements: always the logits path / always the head path


def run(model, rollout, share, max_logits_elements, autocast=None, entropy=True):
    model.zero_grad(set_to_none=True)
    mb = MicroBatch.from_rollout(rollout, torch.arange(len(rollout)), 0 if share else None)
    logp, ent = completion_logprobs(model, mb, temperature=0.7, autocast_dtype=autocast, with_entropy=entropy,
                                    max_logits_elements=max_logits_elements)  # [n, T'] each
    m = mb.completion_mask
    weights = torch.linspace(-1, 1, m.numel()).view(m.shape)  # an arbitrary upstream gradient
    (logp * m * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach()[m], None if ent is None else ent[m], grads


def assert_same(a, b, atol, grad_rtol):
    assert torch.allclose(a[0], b[0], atol=atol, rtol=0)
    if a[1] is not None:
        assert torch.allclose(a[1], b[1], atol=atol, rtol=0)
    assert a[2].keys() == b[2].keys() and len(a[2]) > 0
    for name, g in b[2].items():
        assert float((a[2][name] - g).norm()) <= grad_rtol * float(g.norm()) + 1e-12, name


@pytest.fixture(scope="module")
def tied(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()


@pytest.fixture(scope="module")
def untied():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).train()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.2)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("which", ["tied", "untied"])
def test_the_chunked_head_equals_the_logits_path(request, which, share):
    model = request.getfixturevalue(which)
    r = ragged_rollout([3, 9, 5], G=4, seed=1)
    chunked, whole = run(model, r, share, CHUNKED), run(model, r, share, WHOLE)
    assert_same(chunked, whole, atol=1e-5, grad_rtol=1e-5)
    head = "lm_head.weight" if which == "untied" else "model.embed_tokens.weight"
    assert head in chunked[2]  # the head's gradient comes through head_logprobs


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_each_architecture_takes_the_chunked_head_with_the_logits_paths_values(kind):
    """Every architecture the fast decoder takes has a plain head (logits = lm_head(last hidden
    state)): the chunked head is taken, and its log-probs and gradients are the logits path's."""
    model, _ = build_tiny_architecture(kind, vocab_size=120, seed=4)
    model.train()
    assert _plain_head(model) is model.lm_head
    r = ragged_rollout([3, 9, 5], G=2, seed=1)
    assert_same(run(model, r, True, CHUNKED), run(model, r, True, WHOLE), atol=1e-5, grad_rtol=1e-5)


def test_lora_policy_and_its_adapter_disabled_reference(tied):
    lora = with_random_lora(copy.deepcopy(tied)).train()
    r = ragged_rollout([4, 7], G=3, seed=2)
    assert_same(run(lora, r, True, CHUNKED), run(lora, r, True, WHOLE), atol=1e-5, grad_rtol=1e-5)
    with torch.no_grad(), adapter_disabled(lora):
        mb = MicroBatch.from_rollout(r, torch.arange(len(r)))
        ref = [completion_logprobs(lora, mb, temperature=0.7, max_logits_elements=x)[0][mb.completion_mask]
               for x in (CHUNKED, WHOLE)]
        base = completion_logprobs(tied, mb, temperature=0.7)[0][mb.completion_mask]
    assert torch.allclose(ref[0], ref[1], atol=1e-5, rtol=0) and torch.allclose(ref[0], base, atol=1e-5, rtol=0)


def test_bf16_autocast_within_bf16_tolerance(tied):
    r = ragged_rollout([5, 8], G=4, seed=3)
    chunked = run(tied, r, False, CHUNKED, autocast=torch.bfloat16)
    whole = run(tied, r, False, WHOLE, autocast=torch.bfloat16)
    assert_same(chunked, whole, atol=3e-2, grad_rtol=3e-2)


def test_padding_positions_get_zero_and_no_entropy_when_not_asked(tied):
    r = ragged_rollout([3, 6], G=4, seed=4)
    mb = MicroBatch.from_rollout(r, torch.arange(len(r)))
    with torch.no_grad():
        logp, ent = completion_logprobs(tied, mb, temperature=1.0, max_logits_elements=CHUNKED)
    assert ent is None and logp.shape == mb.completion_ids.shape
    assert (logp[~mb.completion_mask] == 0).all() and (logp[mb.completion_mask] < 0).all()


def test_a_training_step_through_the_chunked_head_equals_the_logits_path(make_cfg, monkeypatch):
    """Same seed: one step with every log-prob pass (policy, reference, update) through the head
    in chunks, one through whole logits; the updated weights agree to fp32 rounding."""
    import grouprl.policy as policy
    from grouprl.trainer import Trainer

    weights = []
    for limits in (policy.WHOLE_LOGITS_MAX_ELEMENTS, {}):  # {} and a default of 0: every pass chunked
        monkeypatch.setattr(policy, "WHOLE_LOGITS_MAX_ELEMENTS", limits)
        monkeypatch.setattr(policy, "DEFAULT_WHOLE_LOGITS_MAX_ELEMENTS", 1 << 26 if limits else 0)
        trainer = Trainer(make_cfg(beta=0.04, num_iterations=2, learning_rate=1e-2))
        metrics = trainer.train_step()
        assert metrics["kl"] >= 0 and metrics["entropy"] > 0
        weights.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    start = torch.cat([p.detach().flatten() for p in Trainer(make_cfg()).model.parameters()])
    moved = (weights[0] - start).abs().max()
    assert moved > 1e-4 and (weights[0] - weights[1]).abs().max() <= 1e-3 * moved


@pytest.mark.parametrize("share", [False, True])
def test_the_entropy_gradient_is_the_same_on_every_path(tiny_model_dir, share):
    """entropy_grad (an entropy bonus): Σ a·logp + Σ b·H gives the same parameter gradients through
    whole logits and the chunked head, padded and packed; without entropy_grad the entropy is a
    constant and the gradient is the log-probs' alone."""
    from grouprl import packing

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    assert packing.enable(model)
    r = ragged_rollout([3, 9, 5], G=4, seed=5)

    def grads(limit, packed, entropy_grad=True):
        model.zero_grad(set_to_none=True)
        mb = MicroBatch.from_rollout(r, torch.arange(len(r)), 0 if share else None)
        logp, ent = completion_logprobs(model, mb, temperature=0.7, with_entropy=True, entropy_grad=entropy_grad,
                                        max_logits_elements=limit, packed=packed)  # [n, T'] each
        assert ent.requires_grad == entropy_grad
        m = mb.completion_mask
        a = torch.linspace(-1, 1, m.numel()).view(m.shape)
        (logp * m * a + ent * m * a.flip(0)).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = grads(WHOLE, False)
    for limit, packed in [(CHUNKED, False), (WHOLE, True), (CHUNKED, True)]:
        got = grads(limit, packed)
        assert got.keys() == want.keys()
        for name, g in want.items():
            assert float((got[name] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-12, (limit, packed, name)
    without = grads(CHUNKED, False, entropy_grad=False)
    assert any(float((without[n] - g).norm()) > 1e-3 * float(g.norm()) for n, g in want.items())
