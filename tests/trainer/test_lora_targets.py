"""lora_target_modules that PEFT would half ignore, or refuse in words that name neither the field nor the
fix: each entry must name at least one linear layer of the model, and the error lists the names there are."""

import re

import pytest

from grouprl.config import ConfigError
from grouprl.lora import base_model, is_lora_layer
from grouprl.policy import load_policy

LINEAR = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"


@pytest.mark.parametrize("targets, problem", [
    (["q_proj", "v_porj"], "'v_porj' names no module of the model"),  # PEFT adapted q_proj alone, silently
    (["q_porj"], "'q_porj' names no module of the model"),
    (["q_porj", "norm"], "'q_porj' names no module of the model; 'norm' names Qwen2RMSNorm, not a linear layer"),
    (["model"], "'model' names Qwen2Model, not a linear layer"),  # PEFT's message printed the whole model
])
def test_target_modules_that_name_no_linear_layer_are_refused_with_the_names_there_are(tiny_model_dir, targets,
                                                                                        problem):
    message = (f"lora_target_modules={targets!r}: {problem}. LoRA adapts linear layers, and this model's are "
               f"{LINEAR}: name some of them (q_proj,v_proj), or use all-linear")
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        load_policy(str(tiny_model_dir), lora_r=4, lora_target_modules=targets)


def test_target_modules_that_each_name_a_linear_layer_adapt_those(tiny_model_dir):
    model = load_policy(str(tiny_model_dir), lora_r=4, lora_target_modules=["q_proj", "self_attn.v_proj"])
    adapted = {name.split(".")[-1] for name, m in base_model(model).named_modules() if is_lora_layer(m)}
    assert adapted == {"q_proj", "v_proj"}
