"""Evaluation that samples (evaluation.py): pass@k's unbiased estimator against brute force, maj@k's
vote by hand (answers read as math_accuracy reads them), samples the accuracy reward leaves unscored
left out by hand, then `Trainer.evaluate` on the tiny policy against the same numbers recomputed from
the scores it gave; the best checkpoint survives save_total_limit (in a run folder moved too) and loads at
the end; `grouprl eval` prints a table and writes eval.json."""

import itertools
import json
import math
from fractions import Fraction

import pytest
import torch
from safetensors.torch import load_file

from grouprl.cli import main
from grouprl.config import ConfigError, parse_eval_metric
from grouprl.evaluation import BestModel, SampledSums, majority_right, math_answer_key, pass_at_k
from grouprl.rewards.math import verify_math
from grouprl.trainer import Trainer
from tests.trainer.conftest import read_metrics


@pytest.mark.parametrize("n, c", [(5, 0), (5, 1), (5, 3), (6, 6), (8, 2)])
def test_pass_at_k_is_the_mean_over_every_k_subset(n, c):
    """The estimator equals the share of the C(n, k) subsets of the n samples holding a right one."""
    right = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(right, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_pass_at_k_by_hand_and_bad_arguments():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)/C(4,2): both picks miss the one right
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_majority_vote():
    # answers 7, 7, 9, None: 7 wins; the completions that said 7 are wrong
    assert majority_right(["7", "7", "9", None], [False, False, True, False]) is False
    assert majority_right(["9", "7", "7", "9"], [True, False, False, True]) is True  # a tie: 9 was seen first
    assert majority_right([None, None], [True, True]) is False  # no answer, no vote
    assert math_answer_key("so the sum is \\boxed{125}") == Fraction(125) and math_answer_key("no digits") is None


def test_the_vote_reads_each_answer_as_math_accuracy_does():
    """The key is the reward's reading: the <answer> tag, not numbers in the reasoning; a number's exact value."""
    assert math_answer_key("<think>6*7 = 42</think>\n<answer>41</answer>") == Fraction(41)
    assert math_answer_key("\\boxed{1,000}") == math_answer_key("1000") == Fraction(1000)
    assert math_answer_key("\\boxed{\\frac{1}{2}}") == math_answer_key("\\boxed{0.5}") == Fraction(1, 2)
    assert math_answer_key("\\boxed{x^2+1}") == "x**2 + 1"  # not a number: math-verify's expression


@pytest.mark.parametrize("texts, gold, want", [
    (["<think>x</think><answer>42</answer>"] * 3, "42", 1.0),  # R1 format: math-verify's whole-text parse read none
    (["<think>x</think><answer>42</answer>"] * 3 + ["<answer> 41 </answer>"], "42", 1.0),  # 42 wins 3 to 1
    (["<think>6*7 = 42</think>\n<answer>41</answer>"] * 2  # 41 wins 2 to 1 (the 42 in the reasoning is no vote)
     + ["<think>We need 6 times 7. 6*7 = 42.</think>\n<answer>42</answer>"], "42", 0.0),
    (["\\boxed{999}", "\\boxed{1,000}", "\\boxed{1000}", "\\boxed{999}", "\\boxed{1,000}"], "1000", 1.0),  # 3 of 5
])
def test_maj_at_k_votes_the_answers_the_reward_scored(texts, gold, want):
    sums = SampledSums([("maj", len(texts))])
    sums.add([verify_math(t, gold) for t in texts], texts)
    assert sums.result(sums.sums) == {f"maj@{len(texts)}": want}


def test_samples_the_accuracy_reward_leaves_unscored_are_left_out():
    """n = 4 samples per prompt, NaN where the reward gave None; by hand:
    A [1, 0, 0, 1] (answers 3 5 5 3): mean 1/2; pass@2 = 1 - C(2,2)/C(4,2) = 5/6; maj@2: 3 and 5 tie, 3 seen
      first and right: 1.
    B all unscored (a gold the reward cannot parse): in no metric.
    C [-, 0, 1, -] (answers 7 7 7 7): 2 scored: mean 1/2; pass@2 from n = 2, c = 1: 1; maj@2: only the
      second sample votes, 7, and it is wrong: 0.
    D [-, -, -, 1]: mean 1; pass@2 needs 2 scored samples: left out; maj@2: no scored vote among the
      first 2: left out.
    mean@2 = (1/2 + 1/2 + 1) / 3 = 2/3, pass@2 = (5/6 + 1) / 2 = 11/12, maj@2 = (1 + 0) / 2 = 1/2."""
    nan = math.nan
    sums = SampledSums([("greedy", 1), ("mean", 2), ("pass", 2), ("maj", 2)])
    sums.add([1.0, 0.0, 0.0, 1.0], ["\\boxed{3}", "\\boxed{5}", "\\boxed{5}", "\\boxed{3}"])
    sums.add([nan] * 4, ["\\boxed{1}"] * 4)
    sums.add([nan, 0.0, 1.0, nan], ["\\boxed{7}"] * 4)
    sums.add([nan, nan, nan, 1.0], ["\\boxed{9}"] * 4)
    assert sums.result(sums.sums) == pytest.approx({"mean@2": 2 / 3, "pass@2": 11 / 12, "maj@2": 1 / 2}, abs=1e-12)
    assert math.isnan(SampledSums([("pass", 2)]).result({"pass@2": 0.0, "pass@2/prompts": 0.0})["pass@2"])  # none


def right_unless_the_gold_is_unreadable(prompts, completions, answer, **kwargs):
    """1.0 for every completion, None (as math_accuracy for a gold it cannot parse) where the gold is no number."""
    return [1.0 if gold.isdigit() else None for gold in answer]


def test_a_prompt_the_accuracy_reward_cannot_score_is_left_out_of_every_accuracy(make_cfg, tmp_path):
    """4 prompts, the last with a gold the reward cannot read: greedy accuracy was 1 over the 3 scored, but
    mean@4 and pass@1 counted the fourth as wrong (0.75); all three are 1."""
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say numbers {i}: ", "answer": a}) + "\n"
                            for i, a in enumerate(["0", "1", "2", "?"])))
    cfg = make_cfg(reward_funcs=["tests.trainer.test_evaluation:right_unless_the_gold_is_unreadable"],
                   eval_data=str(data), eval_metrics=["greedy", "mean@4", "pass@1"], num_generations_eval=4,
                   max_completion_length=4)
    result = Trainer(cfg).evaluate()
    assert (result["num_samples"], result["accuracy"], result["mean@4"], result["pass@1"]) == (4, 1.0, 1.0, 1.0)


def test_eval_metric_names():
    assert parse_eval_metric("pass@8") == ("pass", 8) and parse_eval_metric("greedy") == ("greedy", 1)
    for bad in ("pass@0", "best@3", "pass8"):
        with pytest.raises(ConfigError, match="is not one of greedy, mean@k, pass@k, maj@k"):
            parse_eval_metric(bad)


def test_config_errors_name_the_fix(make_cfg):
    with pytest.raises(ConfigError, match="pass@8 needs at least 8 samples .* num_generations_eval=4"):
        make_cfg(eval_metrics=["pass@8"], num_generations_eval=4).validate()
    with pytest.raises(ConfigError, match="load_best_model_at_end needs metric_for_best_model"):
        make_cfg(load_best_model_at_end=True).validate()


SEEN: list[tuple[str, float]] = []


def last_digit_even(prompts, completions, **kwargs):
    """A 0/1 'accuracy' a random policy gets about half the time; records what it scored."""
    out = []
    for text in completions:
        digits = [ch for ch in text if ch.isdigit()]
        out.append(1.0 if digits and int(digits[-1]) % 2 == 0 else 0.0)
    SEEN.extend(zip(completions, out))
    return out


def test_evaluate_samples_and_matches_the_numbers_recomputed_by_hand(make_cfg, digits_data):
    """6 eval prompts x n = 4 samples: pass@2, mean@4, maj@3 equal the formulas applied to the scores
    and texts the reward function saw (in prompt order, 4 per prompt); greedy accuracy as before."""
    cfg = make_cfg(reward_funcs=["tests.trainer.test_evaluation:last_digit_even"], eval_data=str(digits_data),
                   max_eval_samples=6, eval_metrics=["greedy", "pass@2", "mean@4", "maj@3"], num_generations_eval=4,
                   eval_temperature=1.5, max_completion_length=8)
    trainer = Trainer(cfg)
    SEEN.clear()
    result = trainer.evaluate()
    greedy, sampled = SEEN[:6], SEEN[6:]
    assert len(sampled) == 24
    assert result["accuracy"] == pytest.approx(sum(s for _, s in greedy) / 6)
    groups = [sampled[i * 4:(i + 1) * 4] for i in range(6)]
    want_pass = sum(pass_at_k(4, sum(s > 0 for _, s in g), 2) for g in groups) / 6
    want_mean = sum(s for _, s in sampled) / 24
    want_maj = sum(majority_right([math_answer_key(t) for t, _ in g[:3]], [s > 0 for _, s in g[:3]])
                   for g in groups) / 6
    assert result["pass@2"] == pytest.approx(want_pass) and result["mean@4"] == pytest.approx(want_mean)
    assert result["maj@3"] == pytest.approx(want_maj)
    assert result["pass@2"] >= result["mean@4"] - 1e-12  # two tries are never worse than one
    again = trainer.evaluate()  # its own seeded stream: the same samples, and training's stream untouched
    assert again == result and torch.equal(trainer.generator.get_state(), Trainer(cfg).generator.get_state())


def test_evaluate_takes_what_load_prompts_reads(make_cfg, digits_data):
    """`trainer.evaluate(dataset)` with a DatasetDict (load_dataset without split=) scores its test
    split, as the eval set loaded from the same rows; a list of rows scores the same."""
    from datasets import Dataset, DatasetDict

    cfg = make_cfg(eval_data=str(digits_data), max_eval_samples=4)
    trainer = Trainer(cfg)
    want = trainer.evaluate()
    rows = [dict(r) for r in trainer.eval_ds]
    splits = DatasetDict({"train": Dataset.from_list([{"prompt": "unused ", "answer": "0"}]),
                          "test": Dataset.from_list(rows)})
    assert trainer.evaluate(splits) == want and trainer.evaluate(rows) == want


def test_the_best_checkpoint_is_kept_and_loaded_at_the_end(make_cfg, digits_data, tmp_path):
    """Evals every step, save_total_limit 1: the best eval's checkpoint survives later saves, is named in
    summary.json, and load_best_model_at_end puts its weights in the model."""
    cfg = make_cfg(eval_data=str(digits_data), max_eval_samples=8, eval_steps=1, max_steps=5, save_total_limit=1,
                   metric_for_best_model="reward_mean", load_best_model_at_end=True, learning_rate=3e-2)
    trainer = Trainer(cfg)
    summary = trainer.train()
    evals = {r["step"]: r["eval/reward_mean"] for r in read_metrics(cfg.output_dir) if "eval/reward_mean" in r}
    best_step = max((s for s in evals if s > 0), key=lambda s: (evals[s], -s))  # the first of equal values
    best = summary["best_checkpoint"]
    assert best["step"] == best_step and best["value"] == pytest.approx(evals[best_step])
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert f"step-{best_step:06d}" in ckpts and "step-000005" in ckpts and len(ckpts) <= 2
    weights = load_file(f"{best['checkpoint']}/trainable.safetensors")  # CPU tensors
    params = {k: p.detach().cpu() for k, p in trainer.model.named_parameters()}  # cuda:0 where there is one
    assert all(torch.equal(params[k], v) for k, v in weights.items())


def test_the_best_checkpoint_is_found_after_the_run_folder_moved(make_cfg, digits_data, tmp_path, monkeypatch):
    """Evals scripted so step 2 is the best (reward_mean 1, every other eval 0); save_total_limit 1. The run
    stops after step 2, its folder is moved, and it resumes to step 4: step 2's checkpoint survives steps 3 and
    4, summary.json names it in the new folder, and its weights load at the end. The step-2 state is written as
    before the fix (the record held the old folder's full path): such a record still reads."""
    def scripted_eval(self, dataset=None, batch_size=64):
        return {"accuracy": 0.5, "reward_mean": float(self.step == 2), "num_samples": 4}

    monkeypatch.setattr(Trainer, "evaluate", scripted_eval)
    kw = dict(eval_data=str(digits_data), eval_steps=2, max_steps=4, save_steps=1, save_total_limit=1,
              metric_for_best_model="reward_mean", load_best_model_at_end=True)
    first = Trainer(make_cfg(output_dir=str(tmp_path / "a"), **kw))
    first.train_step = lambda original=first.train_step: original() if first.step < 2 else 1 / 0
    with pytest.raises(ZeroDivisionError):
        first.train()  # stopped by a crash before step 3
    state_file = tmp_path / "a/checkpoints/step-000002/state.pt"
    state = torch.load(state_file, weights_only=False)
    assert state["best"]["step"] == 2
    state["best"]["checkpoint"] = str(tmp_path / "a/checkpoints/step-000002")  # the record an older version wrote
    torch.save(state, state_file)
    (tmp_path / "a").rename(tmp_path / "b")

    trainer = Trainer(make_cfg(output_dir=str(tmp_path / "b"), **kw))
    summary = trainer.train(resume=True)
    best = tmp_path / "b/checkpoints/step-000002"
    assert sorted(p.name for p in best.parent.iterdir()) == ["step-000002", "step-000004"]
    assert summary["best_checkpoint"] == {"step": 2, "metric": "reward_mean", "value": 1.0, "checkpoint": str(best)}
    assert json.loads((tmp_path / "b/summary.json").read_text())["best_checkpoint"] == summary["best_checkpoint"]
    weights = load_file(best / "trainable.safetensors")  # CPU tensors
    params = {k: p.detach().cpu() for k, p in trainer.model.named_parameters()}  # cuda:0 where there is one
    assert all(torch.equal(params[k], v) for k, v in weights.items())
    final = torch.load(tmp_path / "b/checkpoints/step-000004/state.pt", weights_only=False)
    assert final["best"] == {"step": 2, "metric": "reward_mean", "value": 1.0}  # no path to go stale


def test_an_unknown_best_metric_is_named(make_cfg, digits_data):
    """A rewards/NAME passes validation (the names come with the reward functions), and is named when they
    resolve, before any model loads; a result an eval does not report is named at that eval."""
    cfg = make_cfg(eval_data=str(digits_data), max_eval_samples=4, eval_steps=1, max_steps=1,
                   metric_for_best_model="rewards/no_such_reward")
    with pytest.raises(ConfigError, match="metric_for_best_model='rewards/no_such_reward' names no reward function: "
                                          r"the eval reports rewards/digit_fraction$"):
        Trainer(cfg)
    with pytest.raises(ConfigError, match="metric_for_best_model='pass@2' is not an eval result; they are accuracy"):
        BestModel("pass@2", True, str(digits_data)).update({"accuracy": 0.5, "seconds": 1.0}, 1)


def test_grouprl_eval_prints_a_table_and_writes_eval_json(tiny_model_dir, digits_data, tmp_path, capsys):
    code = main(["eval", "--model", str(tiny_model_dir), "--eval_data", str(digits_data), "--max_eval_samples", "4",
                 "--reward_funcs", "[tests.trainer.test_evaluation:last_digit_even]", "--eval_metrics",
                 "[greedy, pass@2]", "--num_generations_eval", "2", "--max_completion_length", "4",
                 "--output_dir", str(tmp_path / "ev")])
    out = capsys.readouterr().out
    written = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert code == 0 and set(written) >= {"accuracy", "pass@2", "reward_mean"} and written["num_samples"] == 4
    assert any(line.startswith("greedy") and f"{written['accuracy']:.4f}" in line for line in out.splitlines())
    assert any(line.startswith("pass@2 (n=2)") and f"{written['pass@2']:.4f}" in line for line in out.splitlines())
    assert not math.isnan(written["reward_mean"])
    assert (written["model"], written["eval_data"]) == (str(tiny_model_dir), str(digits_data))  # what was scored


def test_every_grouprl_eval_into_a_folder_is_kept_and_train_data_is_not_read(tiny_model_dir, digits_data, tmp_path,
                                                                              make_cfg):
    """Two evals into one folder: eval.json holds the latest, evals.jsonl both, in order (comparing
    checkpoints lost all but the last). The config's train_data does not exist: eval reads only
    eval_data, so it is not asked for."""
    cfg = make_cfg(eval_data=str(digits_data), train_data=str(tmp_path / "gone.jsonl"), output_dir=str(tmp_path / "ev"),
                   max_completion_length=4)
    path = tmp_path / "run.yaml"
    cfg.save_yaml(path)
    for n in (4, 2):
        assert main(["eval", str(path), "--max_eval_samples", str(n)]) == 0
    lines = [json.loads(line) for line in (tmp_path / "ev" / "evals.jsonl").read_text().splitlines()]
    assert [line["num_samples"] for line in lines] == [4, 2] and all("time" in line for line in lines)
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["num_samples"] == 2


def test_grouprl_eval_builds_no_reference_nor_teacher(tiny_model_dir, digits_data, tmp_path, make_cfg, monkeypatch):
    """A run trained with beta > 0 and a teacher is evaluated from its policy alone: no reference copy is
    made, and the teacher need not exist on the machine that evaluates (a teacher is often far larger)."""
    import grouprl.trainer

    made = []
    real = grouprl.trainer.Reference
    monkeypatch.setattr(grouprl.trainer, "Reference", lambda *a, **k: made.append(1) or real(*a, **k))
    cfg = make_cfg(eval_data=str(digits_data), output_dir=str(tmp_path / "ev"), max_completion_length=4, beta=0.04,
                   algorithm="on_policy_distill", teacher_model=str(tmp_path / "teacher-gone"))
    path = tmp_path / "run.yaml"
    cfg.save_yaml(path)
    assert main(["eval", str(path), "--max_eval_samples", "2"]) == 0
    assert made == [] and json.loads((tmp_path / "ev" / "eval.json").read_text())["num_samples"] == 2


def test_grouprl_eval_names_a_missing_eval_data_as_eval_data(tiny_model_dir, tmp_path, make_cfg, capsys):
    cfg = make_cfg(eval_data=str(tmp_path / "gone.jsonl"), output_dir=str(tmp_path / "ev"))
    path = tmp_path / "run.yaml"
    cfg.save_yaml(path)
    assert main(["eval", str(path)]) == 2
    err = capsys.readouterr().err
    assert "eval_data='" in err and "It holds the eval prompts" in err and "train_data" not in err
