"""A process reward model (PRM) as a step-reward function: `process_reward_model(model=path, ...)`.

The completion is split into steps on `step_delimiter` (process.py's `split_steps`). The PRM reads
the prompt and the steps and gives each step the probability p that it is good, read at one token
per step, the way the published PRMs are used:

- `AutoModelForTokenClassification` (one linear head of labels per token): p is the softmax
  probability of label `good_label` (the sigmoid of the logit when num_labels = 1);
- `mlp_head`, Qwen2.5-Math-PRM's layout (architectures `Qwen2ForProcessRewardModel`, whose modeling
  code lives on the Hub): the backbone (`AutoModel`) under a two-layer head, score =
  Sequential(Linear(h, h), ReLU, Linear(h, 2)), loaded from the checkpoint's score.0 / score.2
  weights, so no remote code runs; p as for a token-classification head;
- a causal LM (Math-Shepherd): p = softmax over the logits of `good_token` and `bad_token` of the
  next-token prediction (over the whole vocabulary when `bad_token` is None).

`kind: auto` reads the checkpoint's architectures. Whatever the kind, a checkpoint whose weights do
not fit it (a head it lacks, or a head it has that the kind does not read: a Qwen2.5-Math-PRM loaded
as token_classification) is an error: transformers would initialise the missing head at random and
only print a load report, and the step rewards would be noise.

Where it is read: with a `step_tag`, the delimiter after each step is replaced by the tag (kept
after it with `keep_delimiter`), so the scored text is "step₁<tag>step₂<tag>" (Qwen2.5-Math-PRM:
step_tag "<extra_0>", step_delimiter "\\n\\n"; Math-Shepherd: step_tag " ки", keep_delimiter true), and
p is read at the token holding the tag's last character. Without a tag the completion is scored as
is, at the token holding each step's last character: its delimiter, the step-separator token.
Token positions come from the PRM tokenizer's offset mapping (a fast tokenizer is required).

Text: with a chat template (and `use_chat_template`), the prompt messages plus the scored
completion as the assistant turn, the way reward_model does; else prompt text + completion.
The reward is p (`reward="prob"`), 2p − 1 (`"signed"`) or log p (`"log"`). Each completion's value
is a list of (CharOffset(step end), reward) pairs; use it with advantage_estimator: process.
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Any

from .text import completion_text, prompt_messages, prompt_text
from .process import CharOffset, split_steps

KINDS = ("auto", "token_classification", "mlp_head", "causal_lm")
REWARDS = ("prob", "signed", "log")


class ProcessRewardModel:
    """Callable step-reward function wrapping a PRM (module docstring)."""

    in_process = True  # it holds a model (perhaps on the GPU): reward workers leave it in the trainer

    def __init__(self, model: str, *, step_delimiter: str = "\n", step_tag: str | None = None,
                 keep_delimiter: bool = False, kind: str = "auto", good_label: int = 1,
                 good_token: str | int = "+", bad_token: str | int | None = "-", reward: str = "prob",
                 batch_size: int = 8, device: str = "cpu", use_chat_template: bool = True):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

        self.__name__ = "process_reward_model"
        if kind not in KINDS:
            raise ValueError(f"process_reward_model: kind={kind!r} is not one of {KINDS}")
        if reward not in REWARDS:
            raise ValueError(f"process_reward_model: reward={reward!r} is not one of {REWARDS}")
        if not step_delimiter:
            raise ValueError("process_reward_model: step_delimiter is empty; steps need a delimiter, e.g. '\\n'")
        config = AutoConfig.from_pretrained(model)
        if kind == "auto":
            archs = config.architectures or []
            if any(a.endswith("ForTokenClassification") for a in archs):
                kind = "token_classification"
            elif any(a.endswith("ForProcessRewardModel") for a in archs):
                kind = "mlp_head"
            elif any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
                kind = "causal_lm"
            else:
                raise ValueError(f"process_reward_model: cannot tell what {model} is from its architectures "
                                 f"{archs}; set kind: token_classification, mlp_head or causal_lm")
        self.kind = kind
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        if not self.tokenizer.is_fast:
            raise ValueError(f"process_reward_model: the tokenizer of {model} is not a fast tokenizer; "
                             "the step positions need its offset mapping (tokenizer.json)")
        loader = {"token_classification": AutoModelForTokenClassification, "mlp_head": _mlp_head_class(config),
                  "causal_lm": AutoModelForCausalLM}[kind]
        loaded, info = loader.from_pretrained(model, config=config, output_loading_info=True)
        _check_loaded(model, kind, loaded, info)
        self.model = loaded.to(device).eval()
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if self.tokenizer.pad_token is None:
            raise ValueError(f"process_reward_model: the tokenizer of {model} has no pad, eos or unk token")
        if kind != "causal_lm":
            labels = self.model.config.num_labels
            if labels > 1 and not 0 <= good_label < labels:
                raise ValueError(f"process_reward_model: good_label={good_label} but {model} has {labels} labels")
            self.label_ids = None
        else:
            self.label_ids = [self._token_id(good_token, "good_token")]
            if bad_token is not None:
                self.label_ids.append(self._token_id(bad_token, "bad_token"))
        self.good_label = good_label
        self.step_delimiter, self.step_tag, self.keep_delimiter = step_delimiter, step_tag, keep_delimiter
        self.reward, self.batch_size, self.device = reward, batch_size, device
        self.templated = use_chat_template and bool(getattr(self.tokenizer, "chat_template", None))
        self._torch = torch

    def _token_id(self, token: str | int, name: str) -> int:
        if isinstance(token, int):
            return token
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"process_reward_model: {name}={token!r} is {len(ids)} tokens for this tokenizer; "
                             "give a single token (or its id)")
        return ids[0]

    def scored_text(self, prompt: Any, completion: Any) -> tuple[str, list[int], list[int]]:
        """(text the PRM reads, the character in it at which each step is read, the steps' exclusive
        character ends in the completion)."""
        text = completion_text(completion)
        ends = split_steps(text, self.step_delimiter)
        content, marks, start = "", [], 0
        for e in ends:
            step = text[start:e]
            if self.step_tag is not None:
                body = step.removesuffix(self.step_delimiter)
                content += body + self.step_tag
                marks.append(len(content) - 1)
                content += step[len(body):] if self.keep_delimiter else ""
            else:
                content += step
                marks.append(len(content) - 1)
            start = e
        if self.templated:
            messages = prompt_messages(prompt) + [{"role": "assistant", "content": content}]
            full = self.tokenizer.apply_chat_template(messages, tokenize=False)
            offset = full.rfind(content)
            if offset < 0:
                raise ValueError("process_reward_model: the chat template changed the completion's text, so its "
                                 "steps cannot be located; set use_chat_template: false")
        else:
            full, offset = prompt_text(prompt) + content, len(prompt_text(prompt))
        return full, [offset + m for m in marks], ends

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[list]:
        torch = self._torch
        items = [self.scored_text(p, c) for p, c in zip(prompts, completions)]
        out: list[list] = []
        for start in range(0, len(items), self.batch_size):
            chunk = items[start:start + self.batch_size]
            enc = self.tokenizer([t for t, _, _ in chunk], return_tensors="pt", padding=True, padding_side="right",
                                 return_offsets_mapping=True, add_special_tokens=not self.templated)
            offsets = enc.pop("offset_mapping").tolist()  # [b, L] (start, end) characters of each token
            with torch.no_grad():
                logits = self.model(**enc.to(self.device)).logits.float()  # [b, L, C] or [b, L, V]
            for row, (_, marks, ends) in enumerate(chunk):
                n = int(enc["attention_mask"][row].sum())
                token_ends = list(itertools.accumulate((e for _, e in offsets[row][:n]), max))  # [n]
                at = [min(_last_covering(offsets[row][:n], token_ends, m), n - 1) for m in marks]  # [K]
                probs = self._good_prob(logits[row, at]).tolist()  # [K]
                out.append([(CharOffset(e), self._map(p)) for e, p in zip(ends, probs)])
        return out

    def _good_prob(self, logits):  # [K, C] -> [K]
        if self.label_ids is not None:
            return logits[:, self.label_ids].softmax(-1)[:, 0] if len(self.label_ids) == 2 \
                else logits.softmax(-1)[:, self.label_ids[0]]
        if logits.shape[-1] == 1:
            return logits[:, 0].sigmoid()
        return logits.softmax(-1)[:, self.good_label]

    def _map(self, p: float) -> float:
        if self.reward == "signed":
            return 2.0 * p - 1.0
        if self.reward == "log":
            return math.log(max(p, 1e-12))
        return p


def _check_loaded(model: str, kind: str, loaded: Any, info: dict[str, Any]) -> None:
    """Refuse a checkpoint whose weights do not fit the kind: what it lacks transformers initialises at
    random (with only a load report), and a head it has that the kind ignores means another layout.
    Keys under the backbone's prefix that nothing reads (old rotary buffers) do not count."""
    prefix = f"{loaded.base_model_prefix}."
    missing = sorted(info.get("missing_keys", ()))
    foreign = sorted(k for k in info.get("unexpected_keys", ()) if not k.startswith(prefix))
    mismatched = sorted(str(k) for k in info.get("mismatched_keys", ()))
    if missing or foreign or mismatched:
        raise ValueError(f"process_reward_model: the weights of {model} do not fit kind={kind!r} "
                         f"({type(loaded).__name__}): missing {missing[:4]}, unexpected {foreign[:4]}"
                         + (f", wrong shape {mismatched[:4]}" if mismatched else "")
                         + "; scoring would use randomly initialised weights. Set kind to the checkpoint's "
                         "layout (Qwen2.5-Math-PRM, architectures *ForProcessRewardModel: mlp_head; a linear "
                         "token head: token_classification; an LM's good/bad tokens: causal_lm)")


def _mlp_head_class(config: Any) -> type:
    """A transformers model class for Qwen2.5-Math-PRM's layout: `model` (the backbone `AutoModel` builds
    from the config) and `score` = Sequential(Linear(h, h), ReLU, Linear(h, num_labels)), as its Hub code
    (and vLLM's Qwen2ForProcessRewardModel) define it; `from_pretrained` then reads the checkpoint's
    weights, sharded or not, and reports what did not fit."""
    from torch import nn
    from transformers import AutoModel, PreTrainedModel
    from transformers.modeling_outputs import TokenClassifierOutput

    class MlpHeadPRM(PreTrainedModel):
        config_class = type(config)
        base_model_prefix = "model"

        def __init__(self, config: Any):
            super().__init__(config)
            self.model = AutoModel.from_config(config)
            h = config.hidden_size
            self.score = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, config.num_labels))
            self.post_init()

        def forward(self, input_ids: Any = None, attention_mask: Any = None, **kwargs: Any) -> TokenClassifierOutput:
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [b, L, h]
            return TokenClassifierOutput(logits=self.score(hidden))  # [b, L, num_labels]

    return MlpHeadPRM


def _first_covering(token_ends: list[int], char: int) -> int:
    """Index of the first token whose exclusive end lies past ``char``: the token that holds it.
    ``token_ends`` is a running maximum, so added special tokens' (0, 0) offsets keep it sorted."""
    return bisect.bisect_right(token_ends, char)


def _last_covering(offsets: list, token_ends: list[int], char: int) -> int:
    """The last token holding ``char``: a character of several bytes (an emoji, a CJK or maths symbol) may
    be split over byte tokens that share its offsets, and the model has read it whole only at the last
    of them (the first was read before the step's end was seen)."""
    k = _first_covering(token_ends, char)
    while k + 1 < len(offsets) and offsets[k + 1][0] <= char < offsets[k + 1][1]:
        k += 1
    return k


def process_reward_model(model: str, step_delimiter: str = "\n", step_tag: str | None = None,
                         keep_delimiter: bool = False, kind: str = "auto", good_label: int = 1,
                         good_token: str | int = "+", bad_token: str | int | None = "-", reward: str = "prob",
                         batch_size: int = 8, device: str = "cpu", use_chat_template: bool = True
                         ) -> ProcessRewardModel:
    """Factory: the step-reward function scoring each step with the PRM at path `model`."""
    return ProcessRewardModel(model, step_delimiter=step_delimiter, step_tag=step_tag,
                              keep_delimiter=keep_delimiter, kind=kind, good_label=good_label,
                              good_token=good_token, bad_token=bad_token, reward=reward,
                              batch_size=batch_size, device=device, use_chat_template=use_chat_template)
