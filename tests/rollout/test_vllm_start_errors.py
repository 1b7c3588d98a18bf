"""VLLMEngine refusing to start, with the setting to change: a mixture-of-experts model on CPU (vLLM's
CPU kernel keeps the experts it prepared at load, out of a weight sync's reach) and a KV cache too
small for the model's context on CPU (where VLLM_CPU_KVCACHE_SPACE sizes it). Each start shuts down
the process's previous engine, so these live apart from the tests that share one."""

import pytest

import tests.rollout._vllm  # noqa: F401  (skips the module without vLLM)
from grouprl.tasks import DEFAULT_POLICY_DIR


def test_a_mixture_of_experts_model_is_refused_on_cpu_before_vllm_starts(tmp_path):
    """vLLM's CPU kernel for MoE layers keeps the experts it prepared at load: a sync would not reach them."""
    from transformers import Qwen3MoeConfig

    from grouprl.rollout.vllm import VLLMEngine

    Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                   num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"CPU kernel for mixture-of-experts layers .*\(use_vllm: false\)"):
        VLLMEngine(str(tmp_path), eos_token_ids=(0,), pad_token_id=1)


def test_a_kv_cache_too_small_on_cpu_names_the_settings_that_size_it(tmp_path):
    """vLLM's own advice (gpu_memory_utilization) does nothing on CPU, where grouprl sizes the cache by
    VLLM_CPU_KVCACHE_SPACE: a model whose context needs more says so."""
    import json
    import shutil

    from grouprl.rollout.vllm import VLLMEngine

    shutil.copytree(DEFAULT_POLICY_DIR, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1 << 23}))
    with pytest.raises(ValueError, match=r"KV cache .* On CPU the KV cache is VLLM_CPU_KVCACHE_SPACE GiB \(\d+ here\), "
                                         r"not vllm_gpu_memory_utilization"):
        VLLMEngine(str(tmp_path / "m"), eos_token_ids=(0,), pad_token_id=1)
