"""The sampler/trainer importance-sampling correction in the trainer. An engine wrapper returns the
built-in engine's rollout plus `sampling_logp` = the trainer's own log-probs + a known perturbation
δ, so every ratio w = exp(old − q) = exp(−δ) is known in advance."""

import math

import pytest
import torch

from grouprl.rollout import GenerationEngine
from grouprl.trainer import Trainer


class SamplerWithLogprobs(GenerationEngine):
    """Wraps the trainer's engine; `sampling_logp = trainer log-probs + perturb(rollout)` on real tokens."""

    def __init__(self, trainer: Trainer, perturb):
        self.engine, self.trainer, self.perturb = trainer.engine, trainer, perturb
        self.logprobs = trainer.updater.logprobs  # bound before any test patches it
        self.last = None

    def generate(self, *args, **kwargs):
        rollout = self.engine.generate(*args, **kwargs)
        logp = self.logprobs(self.trainer.model, rollout, self.trainer.cfg)  # [N, T], 0 on padding
        delta = torch.where(rollout.completion_mask, self.perturb(rollout), 0.0)  # [N, T]
        rollout.sampling_logp = logp + delta
        self.last = (rollout, logp)
        return rollout

    decodes_with_policy = True  # it samples with the trainer's own engine

    def sync_weights(self, model, version):
        self.engine.sync_weights(model, version)

    def close(self):
        self.engine.close()


def one_step(make_cfg, perturb=None, *, forbid_logprobs=False, **overrides):
    """(gradient, metrics, trainer) of one train_step; perturb=None keeps the built-in engine."""
    trainer = Trainer(make_cfg(max_grad_norm=None, num_logged_samples=0, **overrides))
    if perturb is not None:
        trainer.engine = SamplerWithLogprobs(trainer, perturb)
    if forbid_logprobs:
        trainer.updater.logprobs = lambda *a: pytest.fail("mu = 1, beta = 0, no correction: no old log-probs")
    grads = []
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: grads.append(
        torch.cat([p.grad.flatten() for p in trainer.model.parameters()])) or step()
    metrics = trainer.train_step()
    return grads[0], metrics, trainer


def rows_alternate(first: float, second: float):
    """δ on the first token of each completion: −log(first) on even rows, −log(second) on odd rows,
    so the sequence ratio W is `first` on even rows and `second` on odd rows."""
    def perturb(rollout):
        n, t = rollout.completion_ids.shape
        delta = torch.zeros(n, t)
        delta[0::2, 0], delta[1::2, 0] = -math.log(first), -math.log(second)
        return delta
    return perturb


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_sampler_equal_to_trainer_gives_the_uncorrected_update_exactly(make_cfg, mode):
    plain, metrics0, _ = one_step(make_cfg)
    same, metrics, _ = one_step(make_cfg, lambda r: torch.zeros(r.completion_ids.shape),
                                vllm_importance_sampling_mode=mode)
    assert plain.abs().max() > 1e-4
    assert torch.equal(plain, same)
    assert metrics["is/mismatch_k3"] == 0.0 and metrics["is/frac_corrected"] == 0.0
    assert metrics["is/ratio_mean"] == 1.0 and metrics["is/ratio_max"] == 1.0
    assert not any(k.startswith("is/") for k in metrics0)


def test_weights_scale_the_gradient_by_the_sequence_ratios(make_cfg):
    """Rows A (even) and B (odd), gradient g = g_A + g_B without correction. sequence_mask, C = 3,
    W_A = 1, W_B = 4: B is masked, the gradient is g_A. sequence_truncate, W_A = 0.5, W_B = 4 → 3:
    the gradient is 0.5·g_A + 3·g_B."""
    g, _, _ = one_step(make_cfg)
    g_a, masked, _ = one_step(make_cfg, rows_alternate(1.0, 4.0), vllm_importance_sampling_mode="sequence_mask")
    g_ab, truncated, _ = one_step(make_cfg, rows_alternate(0.5, 4.0),
                                  vllm_importance_sampling_mode="sequence_truncate")
    g_b = g - g_a
    assert g_a.abs().max() > 1e-4 and g_b.abs().max() > 1e-4
    scale = float(g.abs().max())
    torch.testing.assert_close(g_ab, 0.5 * g_a + 3.0 * g_b, rtol=0, atol=1e-5 * scale)
    assert masked["is/frac_corrected"] == 0.5 and truncated["is/frac_corrected"] == 0.5
    assert masked["is/ratio_max"] == pytest.approx(4.0, rel=1e-5)
    assert truncated["is/ratio_mean"] == pytest.approx((0.5 + 4.0) / 2, rel=1e-5)


def test_metrics_equal_an_independent_computation(make_cfg):
    """token_truncate, C = 1.5, δ_{i,t} = 0.3·((i + 2t) mod 5 − 2): some w above C, some below 1."""
    def perturb(rollout):
        n, t = rollout.completion_ids.shape
        i, j = torch.arange(n)[:, None], torch.arange(t)[None, :]
        return 0.3 * (((i + 2 * j) % 5) - 2).float()

    _, metrics, trainer = one_step(make_cfg, perturb, vllm_importance_sampling_mode="token_truncate",
                                   vllm_importance_sampling_cap=1.5)
    rollout, old = trainer.engine.last
    m = rollout.completion_mask
    log_w = (old - rollout.sampling_logp).double()[m]  # real tokens
    w = log_w.exp()
    assert metrics["is/mismatch_k3"] == pytest.approx(float((w - log_w - 1).mean()), rel=1e-6)
    assert metrics["is/ratio_mean"] == pytest.approx(float(w.mean()), rel=1e-6)
    assert metrics["is/ratio_max"] == pytest.approx(math.exp(0.6), rel=1e-5)
    assert metrics["is/frac_corrected"] == pytest.approx(float((w > 1.5).double().mean()), abs=1e-12)
    assert 0 < metrics["is/frac_corrected"] < 1


def test_mu_1_makes_exactly_one_extra_forward_pass(make_cfg):
    trainer = Trainer(make_cfg(max_steps=1, num_logged_samples=0))
    trainer.engine = SamplerWithLogprobs(trainer, lambda r: torch.zeros(r.completion_ids.shape))
    calls = []
    original = trainer.updater.logprobs
    trainer.updater.logprobs = lambda model, rollout, cfg: calls.append(model) or original(model, rollout, cfg)
    trainer.train()
    assert calls == [trainer.model]  # pi_old from the trainer, once; no reference (beta = 0)


def test_correction_off_is_the_plain_update_with_no_extra_pass(make_cfg):
    plain, _, _ = one_step(make_cfg)
    off, metrics, _ = one_step(make_cfg, rows_alternate(0.5, 4.0), forbid_logprobs=True,
                               vllm_importance_sampling_correction=False)
    assert torch.equal(plain, off)
    assert not any(k.startswith("is/") for k in metrics)
