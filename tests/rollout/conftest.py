import pytest

from grouprl.tasks.testing import build_tiny_model
from tests.trainer.conftest import digits_data, make_cfg, tiny_model_dir  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def model_and_tok():
    """The tiny Qwen2 (seed 3) in eval mode and its character tokenizer."""
    model, tok = build_tiny_model("tiny", seed=3)
    return model.eval(), tok


def short_prompts(tok) -> list[list[int]]:
    """Eight prompts of 1 to 13 tokens (left padding and rows of every length)."""
    texts = ["What is 1+2? ", "x", "Hi there", "abc", "7*8=", "Hello, world", "q", "zz top"]
    return [tok(t)["input_ids"] for t in texts]
