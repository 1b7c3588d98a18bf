"""The in-memory weight transfer's pieces that need no server: the bucket plan both sides cut alike,
and the weight source's metadata against what it yields (LoRA merged). The transfer itself runs
against a vLLM server in test_vllm_server.py."""

from __future__ import annotations

import pytest
import torch

from grouprl.lora import add_adapter
from grouprl.rollout.weight_transfer import bucket_plan

NAMES = ["model.embed_tokens.weight",
         "model.layers.0.attn.q.weight", "model.layers.0.attn.k.weight", "model.layers.0.mlp.up.weight",
         "model.layers.1.attn.q.weight", "model.layers.1.attn.k.weight", "model.layers.1.mlp.up.weight",
         "model.layers.10.attn.q.weight", "model.norm.weight", "lm_head.weight"]


@pytest.mark.parametrize("bucket", [1, 50, 100, 250, 10_000])
def test_buckets_cover_every_tensor_once_in_order_and_never_split_a_layer(bucket):
    sizes = [40, 30, 30, 30, 20, 20, 20, 60, 4, 40]
    plan = bucket_plan(NAMES, sizes, bucket)
    assert [i for a, b in plan for i in range(a, b)] == list(range(len(NAMES)))
    layer = [n.split(".")[2] if n.startswith("model.layers.") else n for n in NAMES]
    for a, b in plan[1:]:
        assert layer[a] != layer[a - 1]  # a cut falls between layers only
    for a, b in plan[:-1]:
        assert sum(sizes[a:b]) >= bucket  # a bucket closes only once it is full


def test_buckets_by_hand():
    sizes = [40, 30, 30, 30, 20, 20, 20, 60, 4, 40]
    assert bucket_plan(NAMES, sizes, 1) == [(0, 1), (1, 4), (4, 7), (7, 8), (8, 9), (9, 10)]
    assert bucket_plan(NAMES, sizes, 100) == [(0, 4), (4, 8), (8, 10)]  # 130, 120, 44
    assert bucket_plan(NAMES, sizes, 10**9) == [(0, 10)]
    assert bucket_plan([], [], 8) == []


def test_the_policy_source_declares_what_it_yields_with_lora_merged(tiny_model_dir):
    pytest.importorskip("vllm")
    from grouprl.policy import load_policy
    from grouprl.rollout.vllm import checkpoint_weights
    from grouprl.rollout.weight_transfer import PolicySource

    model = add_adapter(load_policy(str(tiny_model_dir)), r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # B != 0: the merge changes the weights
    source = PolicySource(model, checkpoint_weights)
    meta, pairs = source.metadata(), list(source)
    assert [(m.name, m.dtype, m.shape) for m in meta] == [(n, t.dtype, tuple(t.shape)) for n, t in pairs]
    assert not any("lora" in m.name or "base_layer" in m.name for m in meta)
    base = dict(model.get_base_model().named_parameters())
    q = next(n for n, _ in pairs if n.endswith("q_proj.weight"))
    sent = dict(pairs)[q]
    assert not torch.equal(sent, base[q.replace("q_proj.weight", "q_proj.base_layer.weight")])  # W + BA, not W
