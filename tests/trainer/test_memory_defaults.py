"""Per-device memory defaults (grouprl/memory.py): the token budget `auto` means."""

import pytest
import torch

from grouprl import memory
from grouprl.config import ConfigError, TrainConfig


class Shape:  # what activation_bytes_per_token reads of a model config
    hidden_size, num_hidden_layers, intermediate_size = 2048, 24, 8192


def test_activation_bytes_per_token_of_the_smollm2_1_7b_shape():
    """d = 2048, L = 24, I = 8192. A layer's working set: 16·2048 + 12·8192 = 131,072 bytes.
    Checkpointing: 4·24·2048 = 196,608 saved + one layer = 327,680. Without: 24 × (8,192 + 131,072)
    = 3,342,336, ten times more."""
    assert memory.activation_bytes_per_token(Shape, checkpointing=True) == 327_680
    assert memory.activation_bytes_per_token(Shape, checkpointing=False) == 3_342_336


@pytest.mark.parametrize("free_gib, state_gib, per_token, want", [
    (120, 20, 327_680, 65536),   # a quarter of 100 GiB is 81,920 tokens: capped at 65,536
    (30, 20, 327_680, 8192),     # 2.5 GiB / 320 KiB = 8,192 tokens: a power of two already
    (30, 18, 327_680, 8192),     # 3 GiB / 320 KiB = 9,830: down to 8,192
    (21, 20, 327_680, 4096),     # 0.25 GiB: 819 tokens, raised to the floor (one sequence runs alone anyway)
    (10, 20, 327_680, 4096),     # less free than the state needs: the floor, not a negative budget
])
def test_the_cuda_budget_is_a_quarter_of_what_the_state_leaves(free_gib, state_gib, per_token, want):
    assert memory.cuda_budget(free_gib * 2**30, state_gib * 2**30, per_token) == want


def test_auto_on_cpu_is_the_measured_4096_and_numbers_pass_through():
    model = torch.nn.Linear(2, 2)
    cpu = torch.device("cpu")
    assert memory.token_budget("auto", model, cpu, checkpointing=False) == memory.CPU_BUDGET == 4096
    assert memory.token_budget(1234, model, cpu, checkpointing=False) == 1234
    assert memory.token_budget(None, model, cpu, checkpointing=False) is None


def test_auto_on_cuda_counts_the_trainable_parameters_state(monkeypatch):
    """A model with 2^20 trainable parameters (12 MiB of gradients and AdamW moments to come) and
    1 MiB frozen; 1 GiB + 12 MiB free: a quarter of 1 GiB over the config's per-token bytes."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(512, 512, bias=False))
    model[1].weight.requires_grad_(False)
    model.config = Shape
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30 + 12 * 2**20, 2**34))
    got = memory.token_budget("auto", model, torch.device("cuda"), checkpointing=True)
    assert got == memory.cuda_budget(2**30 + 12 * 2**20, 12 * 2**20, 327_680) == 4096  # 819 tokens -> the floor
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (64 * 2**30 + 12 * 2**20, 2**36))
    assert memory.token_budget("auto", model, torch.device("cuda"), checkpointing=True) == 32768  # 51,200 -> 2^15


def test_auto_on_cuda_counts_what_comes_after_it_colocated_vllm_and_autocasts_weights(monkeypatch):
    """40 GiB free of 80 GiB: with a colocated vLLM taking 0.3 of the device (24 GiB), and bf16 autocast
    caching 2 bytes of each of the 1.25 M parameters, the quarter is of what those leave (the budget was
    sized as if vLLM's share and autocast's copy were free): 13,107 tokens, 8,192, not 16,384."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(512, 512, bias=False))
    model.config = Shape
    free, total = 40 * 2**30, 80 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    cuda = torch.device("cuda")
    alone = memory.token_budget("auto", model, cuda, checkpointing=True)
    later = memory.token_budget("auto", model, cuda, checkpointing=True, vllm_share=0.3, autocast=True)
    weights = 1024 * 1024 + 512 * 512
    assert alone == memory.cuda_budget(free, 12 * weights, 327_680) == 16384
    assert later == memory.cuda_budget(free, 12 * weights + int(0.3 * total) + 2 * weights, 327_680) == 8192


def test_auto_on_cuda_counts_the_chunked_heads_backward(monkeypatch):
    """The chunked LM head's backward accumulates an fp32 [V, H] gradient (4 bytes a head weight when the
    head trains) and multiplies with a bf16 copy of the head under autocast (2 more): counted as state."""
    class WithHead(torch.nn.Sequential):
        def get_output_embeddings(self):
            return self[1]

    model = WithHead(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(512, 512, bias=False))
    model.config = Shape
    weights, head = 1024 * 1024 + 512 * 512, 512 * 512
    free = 40 * 2**30 + 14 * weights + head  # 2^15 tokens of 327,680 bytes fit a quarter of it, less the head's
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 80 * 2**30))
    assert memory._head_backward_bytes(model, autocast=True) == 6 * head
    assert memory.cuda_budget(free, 14 * weights, 327_680) == 32768  # without the head's backward
    assert memory.token_budget("auto", model, torch.device("cuda"), checkpointing=True, autocast=True) == 16384
    model[1].weight.requires_grad_(False)  # a frozen head (LoRA): only autocast's bf16 copy
    assert memory._head_backward_bytes(model, autocast=True) == 2 * head
    assert memory._head_backward_bytes(model, autocast=False) == 0


def test_the_config_takes_auto_a_number_or_null_and_names_anything_else():
    base = dict(model="m", train_data="d.jsonl", output_dir="o", reward_funcs=["math_accuracy"])
    for ok in ("auto", 4096, None):
        TrainConfig(**base, max_tokens_per_micro_batch=ok).validate()
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch='lots' is not a number of tokens, auto"):
        TrainConfig(**base, max_tokens_per_micro_batch="lots").validate()
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch=0 must be at least 1"):
        TrainConfig(**base, max_tokens_per_micro_batch=0).validate()
