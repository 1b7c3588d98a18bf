"""A trained reward model as a reward function: `reward_model(model=path)`.

Loads `AutoModelForSequenceClassification` (num_labels = 1) and its tokenizer from a local path and
scores prompt + completion in batches. With a chat template, the text is the template applied to the
prompt messages plus the completion as an assistant turn (a string prompt becomes one user message);
without one it is prompt text followed by completion text. The score is the model's single logit.
"""

from __future__ import annotations

from typing import Any

from .text import completion_text, prompt_messages, prompt_text


class RewardModelScorer:
    """Callable reward function wrapping a sequence-classification reward model."""

    in_process = True  # it holds a model (perhaps on the GPU): reward workers leave it in the trainer

    def __init__(self, model: str, *, batch_size: int = 8, max_length: int | None = None, device: str = "cpu"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.__name__ = "reward_model"
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForSequenceClassification.from_pretrained(model).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward_model: {model} has num_labels={self.model.config.num_labels}; a reward model "
                "outputs one score (num_labels=1)"
            )
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(f"reward_model: the tokenizer of {model} has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.max_length, self.device = batch_size, max_length, device
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))
        self._torch = torch

    def text(self, prompt: Any, completion: Any) -> str:
        if self.templated:
            messages = prompt_messages(prompt) + [{"role": "assistant", "content": completion_text(completion)}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt_text(prompt) + completion_text(completion)

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size], return_tensors="pt", padding=True,
                truncation=self.max_length is not None, max_length=self.max_length,
                # the template adds its own
                add_special_tokens=not self.templated,
            ).to(self.device)
            with self._torch.no_grad():
                logits = self.model(**enc).logits  # [b, 1]
            scores += logits[:, 0].float().tolist()
        return scores


def reward_model(
    model: str, batch_size: int = 8, max_length: int | None = None, device: str = "cpu"
) -> RewardModelScorer:
    """Factory: the reward function scoring completions with the reward model at path `model`."""
    return RewardModelScorer(model, batch_size=batch_size, max_length=max_length, device=device)
