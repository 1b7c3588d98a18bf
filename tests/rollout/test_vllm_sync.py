"""Weight sync into the colocated engine: after an optimizer step and a sync vLLM's log-probs are the
trainer's; without the sync they are not; a version already sent is not sent again; LoRA is
sent merged and leaves the base weights untouched, or as its adapter only, with the merged path's
log-probs; one engine per process; no sleep mode on CPU."""

import pytest
import torch

from tests.rollout._vllm import LOGP_ATOL, make_engine, max_logp_gap
from grouprl.policy import load_policy, load_tokenizer
from grouprl.rollout import SamplingParams
from grouprl.rollout.vllm import VLLMEngine

PROMPTS = ["Say numbers 1: ", "abc", "What is 7+8? "]


def optimizer_step(model: torch.nn.Module, lr: float) -> None:
    """One AdamW step on the log-likelihood of a fixed string, as the trainer's update would."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    ids = torch.arange(4, 40)[None]  # [1, 36]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def assert_follows(engine, model, prompts) -> None:
    gap = max_logp_gap(engine, model, prompts)
    assert gap < LOGP_ATOL, f"vLLM's log-probs are {gap:.2e} away from the trainer's"


@pytest.fixture
def tok(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture
def prompts(tok):
    return [tok(p)["input_ids"] for p in PROMPTS]


def test_after_a_step_and_a_sync_vllm_follows_and_a_skipped_sync_fails(tiny_model_dir, tok, prompts):
    engine, model = make_engine(tiny_model_dir, tok), load_policy(str(tiny_model_dir))
    assert_follows(engine, model, prompts)  # both loaded the same checkpoint
    optimizer_step(model, lr=1e-2)
    with pytest.raises(AssertionError, match="away from the trainer's"):
        assert_follows(engine, model, prompts)  # the sync is skipped: vLLM samples the old policy
    engine.sync_weights(model, version=1)
    assert_follows(engine, model, prompts)


def test_a_version_already_sent_is_not_sent_again(tiny_model_dir, tok, prompts):
    engine, model = make_engine(tiny_model_dir, tok), load_policy(str(tiny_model_dir))
    engine.sync_weights(model, version=0)  # the weights vLLM loaded: nothing to send
    optimizer_step(model, lr=1e-2)
    engine.sync_weights(model, version=1)
    optimizer_step(model, lr=1e-2)
    engine.sync_weights(model, version=1)  # the caller says nothing changed: nothing is sent
    with pytest.raises(AssertionError, match="away from the trainer's"):
        assert_follows(engine, model, prompts)
    engine.sync_weights(model, version=2)
    assert_follows(engine, model, prompts)


def test_lora_is_sent_merged_and_the_base_weights_stay_bitwise(tiny_model_dir, tok, prompts):
    engine = make_engine(tiny_model_dir, tok)
    model = load_policy(str(tiny_model_dir), lora_r=8, lora_alpha=16)
    base = {k: v.clone() for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    assert_follows(engine, model, prompts)  # B = 0 at initialisation: the adapter adds nothing yet
    for _ in range(3):
        optimizer_step(model, lr=5e-2)
    with pytest.raises(AssertionError, match="away from the trainer's"):
        assert_follows(engine, model, prompts)
    engine.sync_weights(model, version=1)
    assert_follows(engine, model, prompts)  # the PEFT forward, adapter on, is what vLLM samples
    after = model.get_base_model().state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # merged out of place


def test_lora_adapter_only_gives_the_merged_paths_logprobs(tiny_model_dir, tok, prompts):
    """vllm_lora_sync: adapter. The engine starts from the base folder with LoRA on and receives
    only adapters: after each step's sync its log-probs are the trainer's PEFT forward's, and on the
    same tokens they equal those of an engine sent the merged weights. The base it holds is never
    touched: without the adapter it still samples the base model."""

    model = load_policy(str(tiny_model_dir), lora_r=8, lora_alpha=16)
    for _ in range(3):
        optimizer_step(model, lr=5e-2)
    engine = VLLMEngine(str(tiny_model_dir), eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                        enforce_eager=True, lora_rank=8)
    with pytest.raises(AssertionError, match="away from the trainer's"):
        assert_follows(engine, model, prompts)  # the base model: no adapter yet
    engine.sync_weights(model, version=1)
    assert_follows(engine, model, prompts)
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    adapter = engine.generate(prompts, 1, greedy)
    optimizer_step(model, lr=5e-2)
    engine.sync_weights(model, version=2)  # a second adapter replaces the first
    assert_follows(engine, model, prompts)
    second = engine.generate(prompts, 1, greedy)
    engine._lora = None  # sample without the adapter: the base weights vLLM started with
    base = load_policy(str(tiny_model_dir))
    assert_follows(engine, base, prompts)
    engine.close()

    merged = make_engine(tiny_model_dir, tok)  # the merged path, from the same model
    merged.sync_weights(model, version=2)
    again = merged.generate(prompts, 1, greedy)
    assert torch.equal(again.completion_ids, second.completion_ids)
    both = second.completion_mask
    assert (again.sampling_logp - second.sampling_logp).abs()[both].max() < LOGP_ATOL
    assert not torch.equal(adapter.sampling_logp, second.sampling_logp)  # the second adapter was used


def test_building_a_second_engine_closes_the_first(tiny_model_dir, tok, prompts):
    first, second = make_engine(tiny_model_dir, tok), make_engine(tiny_model_dir, tok)
    with pytest.raises(RuntimeError, match="this VLLMEngine was closed"):
        first.generate(prompts, 1, SamplingParams(max_new_tokens=2, greedy=True))
    assert second.generate(prompts, 1, SamplingParams(max_new_tokens=2, greedy=True)).completion_ids.shape == (3, 2)


def test_sleep_mode_is_refused_where_vllm_has_none(tiny_model_dir, tok):
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        pytest.skip(f"vLLM has sleep mode on {current_platform.device_type}")
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode: vLLM has no sleep mode on this platform"):
        VLLMEngine(str(tiny_model_dir), eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                   enable_sleep_mode=True)


def test_auto_runs_the_adapter_colocated_only_with_a_gpu(monkeypatch, tmp_path):
    """On CPU vLLM's LoRA kernels cost more per step than the merged copy saves (measured,
    benchmarks/README.md), so `auto` sends merged weights there and the adapter with a GPU."""
    from grouprl.config import TrainConfig
    from grouprl.rollout.factory import colocated_lora_rank

    def rank(**kw):
        return colocated_lora_rank(TrainConfig(output_dir=str(tmp_path), **kw))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (rank(lora_r=16), rank(lora_r=16, vllm_lora_sync="adapter"), rank(lora_r=0)) == (0, 16, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (rank(lora_r=16), rank(lora_r=16, vllm_lora_sync="merged")) == (16, 0)


def test_waking_a_sleeping_engine_on_cuda_first_empties_torchs_cache(monkeypatch):
    """What the update freed stays reserved in torch's caching allocator, which vLLM's own allocator
    cannot see: the cache is emptied before each wake_up, then the engine sleeps again (level 1)."""
    events = []

    class Sleeper:
        def wake_up(self):
            events.append("wake_up")

        def sleep(self, level):
            events.append(f"sleep {level}")

    engine = object.__new__(VLLMEngine)  # the wake/sleep bracket alone: no vLLM engine is built
    engine.llm, engine.sleep_mode = Sleeper(), True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    with engine._awake():
        events.append("generate")
    assert events == ["empty_cache", "wake_up", "generate", "sleep 1"]
