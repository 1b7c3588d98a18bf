"""Tiny, locally built models: a character-level tokenizer and small random Qwen2 models (and, for
the tests of each architecture the fast decoder takes, Llama, Mistral, Qwen3 and SmolLM3 ones).

Used by the tests, the benchmarks and `scripts/build_default_policy.py`; nothing here
touches the network. The tokenizer maps one character to one token (no merges), so a
model's behaviour on arithmetic is not confounded by how numbers were split into tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, BOS, UNK]
# every printable ASCII character (space included) and newline: 95 + 1 characters
CHARACTERS = "".join(chr(c) for c in range(32, 127)) + "\n"
# GPT-2 byte-level alphabet: printable ASCII stands for itself, space is "Ġ", newline "Ċ"
_BYTE_LEVEL = {" ": "\u0120", "\n": "\u010a"}

# (hidden_size, num_layers, num_heads, intermediate_size); parameter counts with the
# 100-token character vocabulary and tied embeddings: tiny 0.54 M, 10m 9.47 M, 50m 52.5 M.
TINY_SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (128, 2, 4, 512),
    "10m": (384, 4, 6, 1536),
    "50m": (640, 8, 10, 2560),
}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of `CHARACTERS` (ids 4-99), plus `<pad>`, `<eos>`, `<bos>`, `<unk>` (ids 0-3).

    Encoding adds no special tokens and `decode(encode(s)) == s` for any string over
    `CHARACTERS`; characters outside it (non-ASCII, tab) are dropped.

    Why a byte-level BPE with no merges rather than a WordLevel model: transformers 5
    loads any folder whose config says `model_type: qwen2` with `Qwen2Tokenizer`, which
    rebuilds the backend as a byte-level BPE from the saved vocabulary and merges. Built
    this way, the tokenizer behaves identically before and after `save_pretrained` /
    `AutoTokenizer.from_pretrained`, under transformers 4 and 5 alike.
    """
    symbols = SPECIAL_TOKENS + [_BYTE_LEVEL.get(c, c) for c in CHARACTERS]
    vocab = {tok: i for i, tok in enumerate(symbols)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),  # each character is its own word
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
        padding_side="left",
    )


def build_qwen2(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 with tied embeddings sized to `tokenizer` (seeded: same seed, same weights)."""
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}: "
            "pick sizes with hidden_size = num_heads * head_dim"
        )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def build_tiny_model(size: str = "tiny", seed: int = 0) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """The named size from `TINY_SIZES` with the character tokenizer: `(model, tokenizer)`."""
    if size not in TINY_SIZES:
        raise ValueError(f"size={size!r} is not a named tiny size: use one of {sorted(TINY_SIZES)}")
    hidden, layers, heads, mlp = TINY_SIZES[size]
    tokenizer = build_char_tokenizer()
    model = build_qwen2(
        tokenizer, hidden_size=hidden, num_layers=layers, num_heads=heads, intermediate_size=mlp, seed=seed
    )
    return model, tokenizer


ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")


def build_tiny_architecture(kind: str, tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0,
                            **config) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """A random `kind` model (one of ARCHITECTURES) with the character tokenizer: 2 layers, hidden
    size 48, grouped-query attention (4 query heads on 2 key/value heads) of head size 16, which for
    Qwen3 is not hidden / heads (its queries are 64 wide, as Qwen3-0.6B's are 2,048 over a hidden size
    of 1,024), Qwen2's q/k/v biases, and SmolLM3's layers without RoPE (here the second). Every norm
    weight, Qwen3's per-head q/k norms included, is drawn at random around 1 (transformers starts
    them at 1, where a weight left out goes unseen). `config` overrides the config's fields.
    `(model, tokenizer)`, in eval mode."""
    import transformers

    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "smollm3": "SmolLM3"}
    if kind not in names:
        raise ValueError(f"kind={kind!r} is not one of {ARCHITECTURES}")
    tokenizer = tokenizer or build_char_tokenizer()
    fields = dict(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16 if kind == "qwen3" else 12,
                  max_position_embeddings=512, tie_word_embeddings=kind != "mistral",
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                  bos_token_id=tokenizer.bos_token_id)
    if kind == "mistral":
        fields["sliding_window"] = None
    if kind == "smollm3":
        fields["no_rope_layers"] = [1, 0]  # its second layer attends without positions (NoPE), as every 4th does
    cfg = getattr(transformers, names[kind] + "Config")(**{**fields, **config})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, names[kind] + "ForCausalLM")(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.3)
    return model.eval(), tokenizer


def save_tiny_model(path: str | os.PathLike, size: str = "tiny", seed: int = 0) -> Path:
    """Build a named tiny model and its tokenizer and `save_pretrained` both into `path`; returns the path."""
    model, tokenizer = build_tiny_model(size, seed)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def with_random_lora(model: torch.nn.Module, *, r: int = 4, alpha: float = 8.0, dropout: float = 0.0,
                     seed: int = 0) -> torch.nn.Module:
    """`model` with LoRA on every linear layer (PEFT wraps it in place) and random B matrices, in
    eval mode. PEFT starts B at 0, where every merged weight equals W and a test of the adapter's
    effect could not fail."""
    from grouprl.lora import add_adapter

    peft = add_adapter(model, r=r, alpha=alpha, dropout=dropout, target_modules="all-linear")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return peft.eval()
