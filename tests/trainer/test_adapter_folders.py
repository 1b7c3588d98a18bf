"""A model folder holding a PEFT adapter (adapter_config.json), alone or beside the model it adapts: the
policy starts from the base model with that adapter merged in, as PEFT's `merge_and_unload` builds it,
whether or not lora_r adds a new adapter over it."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grouprl.config import ConfigError
from grouprl.lora import adapter_disabled, is_peft_model
from grouprl.policy import check_model_source, load_policy, policy_tokenizer
from grouprl.rollout.factory import vllm_start_folder
from grouprl.tasks.testing import with_random_lora
from grouprl.trainer import Trainer

IDS = torch.tensor([[5, 6, 7, 8, 9]])  # [1, 5]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """`adapter`: a PEFT adapter folder (base_model_name_or_path: the tiny model, with its tokenizer);
    `both`: the tiny model's folder with the adapter's files beside its own."""
    root = tmp_path_factory.mktemp("adapters")
    peft = with_random_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), r=4, alpha=8.0)
    peft.save_pretrained(root / "adapter")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, root / "adapter")
    shutil.copytree(tiny_model_dir, root / "both")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(root / "adapter" / name, root / "both")
    return {"adapter": root / "adapter", "both": root / "both"}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits  # [1, 5, V]


@pytest.fixture(scope="module")
def base_plus_adapter(tiny_model_dir, adapter_dirs) -> torch.Tensor:
    """PEFT's own recipe: the base model, the adapter loaded onto it, merged and unloaded."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return _logits(PeftModel.from_pretrained(base, adapter_dirs["adapter"]).merge_and_unload())


@pytest.mark.parametrize("folder", ["adapter", "both"])
def test_an_adapter_folder_loads_as_its_base_with_the_adapter_merged(adapter_dirs, base_plus_adapter, tiny_model_dir,
                                                                      folder):
    assert check_model_source(str(adapter_dirs[folder]), None, None) == (str(adapter_dirs[folder]), None)
    model = load_policy(str(adapter_dirs[folder]))
    assert not is_peft_model(model) and not hasattr(model, "peft_config")
    assert all(p.requires_grad for p in model.parameters())  # the whole model trains, as any loaded model
    assert torch.equal(_logits(model), base_plus_adapter)
    assert not torch.allclose(base_plus_adapter, _logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir)))


@pytest.mark.parametrize("folder", ["adapter", "both"])
def test_lora_over_an_adapter_folder_trains_a_new_adapter_on_base_plus_adapter(adapter_dirs, base_plus_adapter,
                                                                                folder):
    """The new adapter starts at B = 0, and disabling it (the reference policy) leaves base + adapter."""
    model = load_policy(str(adapter_dirs[folder]), lora_r=4)
    assert is_peft_model(model)
    assert torch.equal(_logits(model), base_plus_adapter)
    with adapter_disabled(model):
        assert torch.equal(_logits(model), base_plus_adapter)


def test_a_run_from_a_folder_with_model_and_adapter_trains_every_weight(make_cfg, adapter_dirs):
    cfg = make_cfg(model=str(adapter_dirs["both"]), max_steps=1, beta=0.04)
    trainer = Trainer(cfg)
    assert not trainer.ref.uses_adapter
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("folder", ["adapter", "both"])
def test_a_lora_run_over_an_adapter_folder_saves_no_adapter_that_names_a_wrong_base(make_cfg, adapter_dirs, folder):
    """Its new adapter was trained over base + the folder's adapter, which no folder on disk holds: an
    adapter/ would name the folder's base (missing the first adapter) or a deleted temporary folder (a
    review's finding). The checkpoint's model/, merged, is the trained policy."""
    cfg = make_cfg(model=str(adapter_dirs[folder]), max_steps=1, lora_r=4)
    trainer = Trainer(cfg)
    trainer.train()
    ckpt = Path(cfg.output_dir) / "checkpoints" / "step-000001"
    assert not (ckpt / "adapter").exists()
    with torch.no_grad():
        want = trainer.model(input_ids=IDS.to(trainer.dist.device)).logits.cpu()
    assert torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(ckpt / "model")), want, atol=1e-5)


def test_vllm_starts_from_the_merged_weights_of_an_adapter_folder(make_cfg, adapter_dirs, base_plus_adapter):
    """vLLM reads config.json and the model's weights and would leave the adapter out."""
    cfg = make_cfg(model=str(adapter_dirs["both"]))
    folder = vllm_start_folder(cfg, load_policy(cfg.model), rank=0)
    assert folder == str(Path(cfg.output_dir) / "vllm_start" / "rank-0")
    assert torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(folder)), base_plus_adapter, atol=0, rtol=0)


def test_an_adapter_folder_without_its_base_or_tokenizer_says_what_to_set(adapter_dirs, make_cfg, tmp_path):
    lost = shutil.copytree(adapter_dirs["adapter"], tmp_path / "lost")
    config = json.loads((lost / "adapter_config.json").read_text())
    (lost / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/no/such/base"}))
    with pytest.raises(ConfigError, match=f"model='{lost}' is a PEFT adapter folder for the base model '/no/such/base' "
                                          r"\(base_model_name_or_path in its adapter_config.json\), which cannot be "
                                          f"loaded: .*; or set base_model_name_or_path in {lost}/adapter_config.json"):
        check_model_source(str(lost), None, None)
    bare = shutil.copytree(adapter_dirs["adapter"], tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    base = config["base_model_name_or_path"]
    with pytest.raises(ConfigError, match=f"model='{bare}' is a PEFT adapter folder without tokenizer files: set "
                                          f"tokenizer to its base model's \\(tokenizer: {base}\\)"):
        policy_tokenizer(make_cfg(model=str(bare)))


def test_an_adapter_transformers_loaded_by_itself_is_refused(adapter_dirs, monkeypatch):
    """A hub id of an adapter: transformers loads base and adapter unmerged, with the base frozen."""
    import contextlib

    from grouprl import policy

    monkeypatch.setattr(policy, "_base_folder", lambda path, gguf_file: contextlib.nullcontext(path))
    with pytest.raises(ConfigError, match=f"model='{adapter_dirs['both']}' is a PEFT adapter: download it "
                                          r"\(hf download .*\) and set model to the folder it is in"):
        load_policy(str(adapter_dirs["both"]))


@pytest.mark.parametrize("folder", ["adapter", "both"])
def test_vllm_serve_of_an_adapter_folder_serves_the_merged_start(adapter_dirs, base_plus_adapter, folder, tmp_path,
                                                                 monkeypatch):
    """`grouprl vllm-serve <adapter folder>` handed vLLM the raw folder, which it would read without the
    adapter (a review's suspicion): it serves the trainer's start, the base with the adapter merged, written
    once as a plain folder with the tokenizer."""
    from grouprl import cli

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    served = []
    monkeypatch.setattr("grouprl.rollout.vllm_server.serve_command",
                        lambda model, **kw: served.append(model) or (["true"], {}))
    monkeypatch.setattr(cli.os, "execve", lambda *a: None)
    cli.vllm_serve([str(adapter_dirs[folder])])
    (model,) = served
    assert Path(model).parent == tmp_path and (Path(model) / "tokenizer_config.json").is_file()
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(model)), base_plus_adapter)
