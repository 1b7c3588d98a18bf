"""`grouprl.lora`: the merged weights W' = W + s·BA (s = alpha / r) read by the fast decoder, the
vLLM sync and the checkpoint agree with each other, with PEFT's own merge, and with the formula,
and none of them touches the adapter or the base weights."""

import copy

import pytest
import torch

from grouprl.lora import (
    adapted_tied_embeddings,
    adapter_disabled,
    add_adapter,
    base_model,
    is_lora_layer,
    is_peft_model,
    merged_copy,
    merged_named_weights,
    merged_weight,
    mergeable,
)
from grouprl.tasks.testing import build_tiny_model, with_random_lora

R, ALPHA = 4, 8.0


def _lora(dropout: float = 0.0, seed: int = 0) -> torch.nn.Module:
    """The tiny model with LoRA on every linear layer and a non-zero B."""
    return with_random_lora(build_tiny_model()[0], r=R, alpha=ALPHA, dropout=dropout, seed=seed)


def _untied(config):
    config = copy.deepcopy(config)
    config.tie_word_embeddings = False
    return config


def _adapted(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in base_model(model).named_modules() if is_lora_layer(m)}


def test_peft_models_and_lora_layers_are_recognised():
    plain, _ = build_tiny_model()
    peft = _lora()
    assert is_peft_model(peft) and not is_peft_model(plain)
    assert base_model(plain) is plain and base_model(peft) is peft.get_base_model()
    assert not any(is_lora_layer(m) for m in plain.modules())
    adapted = _adapted(peft)
    # all-linear: the 7 projections of each of the 2 layers; the (tied) LM head is left alone
    assert len(adapted) == 2 * 7 and all(isinstance(m.base_layer, torch.nn.Linear) for m in adapted.values())
    assert not is_lora_layer(base_model(peft).lm_head)


def test_a_model_that_loaded_an_adapter_itself_is_not_a_peft_model(tmp_path):
    """transformers' own adapter support gives the model a `peft_config`, but no `disable_adapter`."""
    peft = _lora()
    peft.save_pretrained(tmp_path)
    plain, _ = build_tiny_model()
    plain.load_adapter(str(tmp_path))
    assert hasattr(plain, "peft_config") and not is_peft_model(plain)
    with adapter_disabled(plain):
        pass


def test_add_adapter_starts_as_the_base_model():
    """B = 0 at initialisation: the wrapped model computes exactly what the model did."""
    plain, _ = build_tiny_model()
    ids = torch.tensor([[5, 9, 14, 30, 2]])  # [1, 5]
    with torch.no_grad():
        want = plain(input_ids=ids).logits
        peft = add_adapter(plain, r=R, alpha=ALPHA, dropout=0.0, target_modules=["q_proj", "v_proj"])
        got = peft(input_ids=ids).logits
    assert torch.equal(got, want)
    assert sorted({n.rsplit(".", 1)[-1] for n in _adapted(peft)}) == ["q_proj", "v_proj"]
    assert all(p.requires_grad == ("lora_" in n) for n, p in peft.named_parameters())


def test_merged_weight_is_w_plus_scaled_ba():
    """W' = W + (alpha / r)·B·A, against the formula written out, for every adapted layer."""
    peft = _lora()
    for name, layer in _adapted(peft).items():
        W = layer.base_layer.weight  # [out, in]
        A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # [r, in], [out, r]
        got = merged_weight(layer)
        assert got.shape == W.shape and not got.requires_grad
        torch.testing.assert_close(got, W + (ALPHA / R) * B @ A, atol=1e-6, rtol=1e-6, msg=name)
        assert (got - W).abs().max() > 1e-2  # the adapter really changes the weight
    head = base_model(peft).lm_head
    assert merged_weight(head) is head.weight  # not a LoRA layer: its own weight


def test_merged_weight_matches_merged_copy_and_leaves_the_adapter_in_place():
    peft = _lora()
    before = {n: p.detach().clone() for n, p in peft.named_parameters()}
    merged = merged_copy(peft)
    assert not is_peft_model(merged) and not any(is_lora_layer(m) for m in merged.modules())
    weights = dict(merged.named_parameters())
    for name, layer in _adapted(peft).items():
        torch.testing.assert_close(merged_weight(layer), weights[f"{name}.weight"], atol=1e-6, rtol=0, msg=name)
    # the original still holds its adapter and its base weights, bit for bit
    assert is_peft_model(peft) and len(_adapted(peft)) == 2 * 7
    assert all(torch.equal(p, before[n]) for n, p in peft.named_parameters())
    ids = torch.tensor([[5, 9, 14, 30, 2, 40, 41]])  # [1, 7]
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, peft(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_merged_named_weights_are_the_merged_checkpoint():
    """The vLLM sync's weights: the merged model's parameters, under the base model's names."""
    peft = _lora()
    got = dict(merged_named_weights(peft))
    want = dict(merged_copy(peft).named_parameters())
    assert got.keys() == want.keys()
    assert not any(".lora_" in n or ".base_layer." in n for n in got)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], atol=1e-6, rtol=0, msg=name)
    plain, _ = build_tiny_model()
    assert [(n, t.data_ptr()) for n, t in merged_named_weights(plain)] == [
        (n, p.data_ptr()) for n, p in plain.named_parameters()]  # no adapter: the parameters themselves


def test_a_second_adapter_on_some_layers_only_merges_as_peft_runs_it():
    """Two active adapters, the second on q_proj and down_proj only: the merged weights and the fast
    decoder's logits are the PEFT model's own (summing every active adapter in every layer raised
    KeyError where the second has no weights)."""
    from peft import LoraConfig, get_peft_model

    from grouprl.rollout.llama_decoder import FastDecoder
    from grouprl.tasks.testing import build_tiny_architecture

    model, _ = build_tiny_architecture("llama")
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    peft.add_adapter("two", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    peft.base_model.set_adapter(["default", "two"])
    peft.eval()
    ids = torch.randint(4, 90, (2, 7), generator=g)
    with torch.no_grad():
        want = peft(input_ids=ids).logits[:, -1]
        got = FastDecoder(peft).start(ids, torch.ones_like(ids), 1, 2)
        merged = dict(merged_named_weights(peft))
        reference = merged_copy(peft)(input_ids=ids).logits[:, -1]  # PEFT's own merge
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(reference, want, atol=1e-5, rtol=0)
    theirs = merged_copy(peft).state_dict()
    assert merged.keys() <= theirs.keys() and all(torch.allclose(v, theirs[k], atol=1e-6) for k, v in merged.items())


@pytest.mark.parametrize("given, want", [("q_proj,v_proj", ["q_proj", "v_proj"]), ("q_proj", ["q_proj"]),
                                         ("all-linear", "all-linear"), (["k_proj"], ["k_proj"])])
def test_lora_target_modules_given_as_one_name_or_with_commas_is_a_list(given, want):
    """PEFT reads a string as a pattern for the whole module path, which "q_proj" never matches: the run
    failed after the model loaded."""
    from grouprl.config import TrainConfig

    cfg = TrainConfig(model="m", train_data="d", reward_funcs=["f"], lora_r=8, lora_target_modules=given)
    assert cfg.validate().lora_target_modules == want


def test_adapter_disabled_computes_the_base_model():
    plain, _ = build_tiny_model()
    peft = _lora()
    ids = torch.tensor([[5, 9, 14, 30, 2]])  # [1, 5]
    with torch.no_grad():
        base = plain(input_ids=ids).logits
        assert (peft(input_ids=ids).logits - base).abs().max() > 0.1
        with adapter_disabled(peft):
            torch.testing.assert_close(peft(input_ids=ids).logits, base, atol=1e-6, rtol=0)
            layer = next(iter(_adapted(peft).values()))
            assert merged_weight(layer) is layer.base_layer.weight  # disabled: W alone
        assert (peft(input_ids=ids).logits - base).abs().max() > 0.1  # enabled again on exit
        with adapter_disabled(plain):  # no adapter: nothing to disable
            assert torch.equal(plain(input_ids=ids).logits, base)


@pytest.mark.parametrize("dropout, want", [(0.0, True), (0.1, False)])
def test_mergeable_only_without_adapter_dropout(dropout, want):
    assert mergeable(_lora(dropout=dropout)) is want
    assert mergeable(build_tiny_model()[0])  # no LoRA layer at all


@pytest.mark.parametrize("targets, adapted", [(["q_proj", "lm_head"], ["lm_head"]),
                                              (["v_proj", "embed_tokens"], ["model.embed_tokens"]),
                                              ("all-linear", [])])
def test_adapters_on_tied_embeddings_are_found(targets, adapted):
    """The tiny model ties lm_head to embed_tokens: an adapter on either side would be merged into
    the shared weight (load_policy refuses it, tests/trainer/test_trainer.py); all-linear leaves
    the head out."""
    model, _ = build_tiny_model()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    peft = add_adapter(model, r=R, alpha=ALPHA, dropout=0.0, target_modules=targets)
    assert adapted_tied_embeddings(peft) == adapted


def test_lora_on_an_untied_lm_head_is_merged_into_the_export():
    """Untied embeddings: the adapted head is a weight of its own, merged like any other layer, and
    the merged model computes what the adapted one does."""
    tied, _ = build_tiny_model()
    untied = type(tied)(_untied(tied.config))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    peft = add_adapter(untied, r=R, alpha=ALPHA, dropout=0.0, target_modules=["q_proj", "lm_head"])
    assert adapted_tied_embeddings(peft) == []
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=g)
    head = base_model(peft).lm_head
    assert is_lora_layer(head)
    weights = dict(merged_named_weights(peft))
    torch.testing.assert_close(weights["lm_head.weight"], head.base_layer.weight + (ALPHA / R) * (
        head.lora_B["default"].weight @ head.lora_A["default"].weight), atol=1e-6, rtol=1e-6)
    ids = torch.tensor([[5, 9, 14, 30, 2, 40, 41]])  # [1, 7]
    with torch.no_grad():
        torch.testing.assert_close(merged_copy(peft)(input_ids=ids).logits, peft(input_ids=ids).logits,
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", [{"use_dora": True}, {"lora_bias": True}])
def test_dora_and_adapter_bias_are_not_merged_and_decode_through_the_adapters_forward(variant):
    """DoRA rescales each row of W + s·BA by a learned magnitude, and an adapter bias adds a term s·BA
    leaves out: neither is the merge the fast decoder and the vLLM sync read. They are not mergeable
    (the engine takes the generic path, the adapter's own forward: its greedy first tokens are the
    model's argmax), and merging one is an error that names it."""
    from peft import LoraConfig, get_peft_model

    from grouprl.rollout.engine import HFEngine
    from grouprl.rollout.llama_decoder import FastDecoder
    from grouprl.rollout.types import SamplingParams

    model, tok = build_tiny_model()
    peft = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear", **variant))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name or "lora_magnitude" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    peft.eval()
    assert not mergeable(peft) and not FastDecoder.supports(peft)
    with pytest.raises(ValueError, match="DoRA adapter, or one with its own bias"):
        merged_weight(next(iter(_adapted(peft).values())))
    from grouprl.config import TrainConfig
    from grouprl.distributed import DistContext
    from grouprl.rollout.factory import make_engine

    with pytest.raises(ValueError, match="use_vllm with a DoRA adapter, or one with its own bias"):  # before vLLM
        make_engine(TrainConfig(use_vllm=True), peft, tok, DistContext(), None)
    prompts = [tok("What is 1+2? ")["input_ids"], tok("Hi")["input_ids"]]
    out = HFEngine(peft, [tok.eos_token_id], tok.pad_token_id).generate(
        prompts, 1, SamplingParams(1, greedy=True, ignore_eos=True), torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = [int(peft(input_ids=torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    assert out.completion_ids[:, 0].tolist() == want
