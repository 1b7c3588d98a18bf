"""`grouprl preflight` / `Trainer.preflight`: the statistics against hand-worked numbers and brute
force, the report against the samples it came from, the command line end to end."""

import itertools
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from grouprl import preflight as P
from grouprl.cli import main
from grouprl.trainer import Trainer
from tests.distributed.launch import torchrun


def binary_reward(prompts, completions, **kwargs):
    """1 when the completion holds a digit: an accuracy-like reward of the tiny random policy."""
    return [float(any(c.isdigit() for c in text)) for text in completions]


def never(prompts, completions, **kwargs):
    return [0.0 for _ in completions]


# ---------------------------------------------------------------------- pure statistics
def test_predicted_zero_variance_hand_worked():
    """Three prompts, n = 4 binary scores each: k = 4, 1, 2 passes.

    G = 2 (unbiased, C(k,2)+C(4-k,2) over C(4,2) = 6): 6/6 = 1, (0+3)/6 = 1/2, (1+1)/6 = 1/3;
      mean (1 + 1/2 + 1/3)/3 = 11/18.
    G = 4 = n: only the all-equal prompt: 1, 0, 0; mean 1/3 (the observed share of all-equal groups).
    G = 8 > n (plug-in p^8 + (1-p)^8): 1, (1/4)^8 + (3/4)^8 = 6562/65536, 2 (1/2)^8 = 512/65536;
      mean (65536 + 6562 + 512) / (3 * 65536) = 72610/196608.
    """
    scores = torch.tensor([[1., 1., 1., 1.], [0., 1., 0., 0.], [1., 0., 0., 1.]])  # [B=3, n=4]
    predicted = P.predicted_zero_variance(scores, [2, 4, 8])
    assert predicted[2] == (pytest.approx(11 / 18, abs=1e-12), "unbiased")
    assert predicted[4] == (pytest.approx(1 / 3, abs=1e-12), "unbiased")
    assert predicted[8] == (pytest.approx(72610 / 196608, abs=1e-12), "plug-in")
    probs, _ = P.all_equal_probability(scores, 2)
    assert probs.shape == (3,) and probs.tolist() == pytest.approx([1, 1 / 2, 1 / 3], abs=1e-12)


def test_predicted_zero_variance_of_a_non_binary_reward():
    """Scores 0, .5, .5, 1 (n = 4) at G = 2: only the two 0.5s form an all-equal pair, 1 of the
    C(4,2) = 6 pairs: 1/6. A binary pass/fail view (score > 0: k = 3) would say (3 + 0)/6 = 1/2."""
    probs, estimator = P.all_equal_probability(torch.tensor([[0., .5, .5, 1.]]), 2)
    assert estimator == "unbiased" and probs.tolist() == pytest.approx([1 / 6], abs=1e-12)


@pytest.mark.parametrize("row", [[0, 0, 1, 2, 2, 2], [1, 1, 1, 1, 0, 2], [0, 1, 2, 0, 1, 2]])
def test_estimator_is_the_share_of_all_equal_subsets(row):
    """For G <= n the estimate is the share of the C(n, G) subsets of the n samples whose G scores
    are all equal, counted here by enumerating every subset."""
    scores = torch.tensor([row], dtype=torch.float32)  # [1, n=6]
    for G in range(1, 7):
        subsets = list(itertools.combinations(row, G))
        brute = sum(len(set(s)) == 1 for s in subsets) / len(subsets)
        assert P.all_equal_probability(scores, G)[0].item() == pytest.approx(brute, abs=1e-12)


def test_estimator_is_unbiased_and_the_plug_in_is_not():
    """Scores 0, 1, 2 with probabilities 1/2, 3/10, 1/5, n = 4 samples. Enumerating all 3^4 sample
    outcomes with their probabilities: the estimator's expectation is exactly sum_v p_v^G for
    G <= 4; beyond n the plug-in sum_v (k_v/n)^G overestimates it (convexity)."""
    p = {0: Fraction(1, 2), 1: Fraction(3, 10), 2: Fraction(1, 5)}
    outcomes = list(itertools.product(p, repeat=4))
    scores = torch.tensor(outcomes, dtype=torch.float32)  # [81, 4]
    weights = [math.prod(p[v] for v in o) for o in outcomes]
    for G in (1, 2, 3, 4, 6):
        probs, estimator = P.all_equal_probability(scores, G)  # [81]
        expected = sum(float(w) * q for w, q in zip(weights, probs.tolist()))
        true = float(sum(q ** G for q in p.values()))
        if G <= 4:
            assert estimator == "unbiased" and expected == pytest.approx(true, abs=1e-12)
        else:
            assert estimator == "plug-in" and expected > true + 1e-3


def test_difficulty_and_pass_counts():
    """Passes (score > 0, NaN = abstained is no pass) of 4 prompts, n = 3: 3, 0, 1, 1 -> one too
    easy, one too hard, two informative; histogram of passes 0..3: [1, 2, 0, 1]."""
    scores = torch.tensor([[1., .5, 2.], [0., -1., math.nan], [1., 0., math.nan], [0., 0., 3.]])  # [4, 3]
    passes = P.pass_counts(scores)
    assert passes.tolist() == [3, 0, 1, 1]
    assert P.difficulty(passes, 3) == {"too_easy": .25, "too_hard": .25, "informative": .5,
                                      "pass_count_histogram": [1, 2, 0, 1]}


def test_within_group_correlation_hand_worked():
    """One group of 3: a = 2, 0, 1 centres to 1, -1, 0; b = 1, 0, 0 to 2/3, -1/3, -1/3.
    r = (2/3 + 1/3 + 0) / sqrt(2 * 2/3) = sqrt(3)/2. Opposed rewards give -1; a reward constant
    within every group (a different constant per group) has no correlation (None). Group offsets
    do not count: a = (1, 0), (3, 2) and b = (1, 0), (1, 0) both centre to .5, -.5 per group: r = 1
    (centred on the batch mean instead it would be 1/sqrt(5))."""
    r = P.within_group_correlation(torch.tensor([[2., 0., 1.]]), torch.tensor([[1., 0., 0.]]))
    assert r == pytest.approx(math.sqrt(3) / 2, abs=1e-12)
    offset = P.within_group_correlation(torch.tensor([[1., 0.], [3., 2.]]), torch.tensor([[1., 0.], [1., 0.]]))
    assert offset == pytest.approx(1.0, abs=1e-12)
    a = torch.tensor([[1., 0.], [0., 1.]])  # [2, 2]
    assert P.within_group_correlation(a, 1 - a) == pytest.approx(-1.0, abs=1e-12)
    assert P.within_group_correlation(a, torch.tensor([[3., 3.], [5., 5.]])) is None


def test_length_stats_hand_worked():
    """Lengths 1, 2, 3, 4, 10: mean 4, p50 3, p90 at rank 0.9 * 4 = 3.6: 4 + 0.6 * (10 - 4) = 7.6;
    one of five truncated."""
    stats = P.length_stats(torch.tensor([1, 2, 3, 4, 10]), torch.tensor([False, False, False, False, True]))
    assert stats == pytest.approx({"mean": 4.0, "p50": 3.0, "p90": 7.6, "max": 10, "truncation_rate": 0.2})


def test_update_passes():
    """mu = 2, beta > 0, old log-probs: 2 * 3 + 1 + 1 = 8; with gradient checkpointing 2 * 4 + 2 = 10."""
    assert P.update_passes(1, False, False, False) == 3
    assert P.update_passes(2, True, True, False) == 8
    assert P.update_passes(2, True, True, True) == 10


def test_expected_sampling_rounds_hand_worked():
    """Dynamic sampling as the trainer runs it: whole rounds of B prompts until B groups taught.
    B = 2, each group teaching with probability 1/2, at most 3 rounds. Round 1 always runs and keeps
    0, 1, 2 groups with probability 1/4, 1/2, 1/4: round 2 runs with 3/4. After it fewer than 2 are
    kept when 0 + 0 (1/4 * 1/4), 0 + 1 (1/4 * 1/2) or 1 + 0 (1/2 * 1/4): 5/16, round 3's chance.
    E = 1 + 3/4 + 5/16 = 33/16, where 1/teaching said 2. B = 1 is a truncated geometric: sum of
    (1 - p)^r, r < max_rounds. No group ever teaching: every round runs; always: one."""
    assert P.expected_sampling_rounds(2, 0.5, 3) == pytest.approx(33 / 16, rel=1e-12)
    assert P.expected_sampling_rounds(1, 0.3, 4) == pytest.approx(1 + 0.7 + 0.7 ** 2 + 0.7 ** 3, rel=1e-12)
    assert P.expected_sampling_rounds(8, 0.0, 4) == 4.0 and P.expected_sampling_rounds(8, 1.0, 4) == 1.0


def _samples(per_func: dict[str, list[list[float]]], truncated: float = 0.0) -> P.Samples:
    total = sum(torch.tensor(v) for v in per_func.values())  # [B, n] weights 1
    N = total.numel()
    cut = int(truncated * N)
    return P.Samples({k: torch.tensor(v) for k, v in per_func.items()}, total, torch.full((N,), 5),
                     torch.tensor([True] * cut + [False] * (N - cut)), [total.shape[0]], [1.0], [0.5], 0.25)


def test_under_process_supervision_the_predictions_judge_groups_by_their_steps(make_cfg):
    """Every completion's steps average 2/3 (or 1/2) with unequal steps: training calls no group flat, but the
    predictions, made from the means, said every group of any size would be (1.0 where the observed share
    at G = n is 0). They now judge a group by its steps, as training does: each completion by `step_keys`."""
    from grouprl.core import zero_std_step_groups

    steps = [[1., 1., 0.], [1., 0., 1.], [0., 1., 1.], [1., 1., 0.], [1., 0.], [0., 1.], [1., 0.], [0., 1.],
             [1.], [1.], [1.], [1.], [1., 1.], [1.], [0.], [1.]]  # prompt 2's steps all 1: flat; prompt 3 not
    total = torch.tensor([sum(r) / len(r) for r in steps]).view(4, 4)
    s = P.Samples({"lines": total.clone()}, total, torch.full((16,), 5), torch.zeros(16, dtype=torch.bool), [4],
                  [1.0], [0.5], 0.25, zero_std_step_groups(steps, 4), P.step_keys(steps).view(4, 4))
    report = P.summarize(s, make_cfg(num_generations=4, prompts_per_step=4))
    assert report["total"]["zero_variance_share"] == 0.25  # prompt 2's group, observed as training judges it
    predicted = report["total"]["predicted_zero_variance_share"]
    assert predicted["4"] == 0.25  # the unbiased estimate at G = n is the observed share (from the means: 0.75)
    assert predicted["8"] == pytest.approx((1 + 0.75 ** 8 + 0.25 ** 8) / 4)  # plug-in: prompt 3's keys 1, 1, 0, 1


@pytest.mark.cpu_rules  # its update estimate is CPU's (checkpointing only over the budget)
def test_summary_and_recommendations_from_fixed_samples(make_cfg):
    """G = 4, four prompts, n = 4. acc passes 4, 0, 0, 1 times; `brevity` is 1 - acc (opposed).
    Total = acc + brevity = 1 everywhere: no group teaches. Per function: zero-variance share
    3/4 (the prompt with one pass varies); pass rates 5/16 and 11/16; too easy 1/4, too hard 1/2
    -> a prompt filter; temperature 0.7 with 3/4 too easy or hard -> raise it; 50 % truncated ->
    longer completions; r = -1 -> check the weights; n = G = 4 -> sample more to judge a larger G.
    Timing: 1 s for 16 completions, a step is 4 * 4 = 16: 1 s generate, 0.5 s rewards, update
    3 passes * 0.25 s; step 2.25 s, run 3 steps 6.75 s."""
    acc = [[1., 1., 1., 1.], [0., 0., 0., 0.], [0., 0., 0., 0.], [0., 1., 0., 0.]]
    s = _samples({"acc": acc, "brevity": [[1 - x for x in row] for row in acc]}, truncated=0.5)
    report = P.summarize(s, make_cfg(temperature=0.7, max_steps=3))
    assert report["rewards"]["acc"]["pass_rate"] == 5 / 16 and report["rewards"]["brevity"]["pass_rate"] == 11 / 16
    assert report["rewards"]["acc"]["zero_variance_share"] == 0.75
    assert report["total"]["teaching_share"] == 0.0 and report["total"]["mean"] == 1.0
    assert report["difficulty"] == {"reward": "acc", "too_easy": .25, "too_hard": .5, "informative": .25,
                                    "pass_count_histogram": [2, 1, 0, 0, 1]}
    assert report["correlations"] == [{"a": "acc", "b": "brevity", "r": pytest.approx(-1.0)}]
    timing = report["timing"]
    assert (timing["generate_step_s"], timing["reward_step_s"], timing["update_step_s"]) == (1.0, 0.5, 0.75)
    assert timing["step_s"] == 2.25 and timing["run_s"] == 6.75
    advice = " | ".join(r["advice"] for r in report["recommendations"])
    for expected in ("--samples 32", "filter the prompts", "raise temperature from 0.7",
                     "raise max_completion_length above 12", "check the weights of acc and brevity"):
        assert expected in advice
    assert all(r["reason"] for r in report["recommendations"])


def test_raise_g_is_recommended_when_more_samples_show_it_helps(make_cfg):
    """G = 2, n = 8 samples per prompt, each prompt passing once in 8. At G = 2 the observed groups
    (4 per prompt) are 1, 0, 0, 0 / 0, 0, 0, 0 ...: 3 of 4 all-equal, 25 % teach. Predicted at G = 8
    (unbiased, n = 8): (C(1,8) + C(7,8)) / C(8,8) = 0: every group teaches -> raise G; G = 4 is
    the first size that gains 10 points: (C(7,4) = 35) / 70 = 1/2 all-equal, 50 % teach."""
    s = _samples({"acc": [[1., 0., 0., 0., 0., 0., 0., 0.]] * 2})
    report = P.summarize(s, make_cfg(num_generations=2))
    assert report["total"]["zero_variance_share"] == 0.75
    assert report["total"]["predicted_zero_variance_share"]["4"] == pytest.approx(0.5)
    assert report["total"]["predicted_zero_variance_share"]["8"] == 0.0
    assert report["estimators"] == {"2": "unbiased", "4": "unbiased", "8": "unbiased", "16": "plug-in",
                                    "32": "plug-in"}
    assert report["recommendations"][0]["advice"] == "raise num_generations to 4"
    assert P.strict_failure(report, 0.9).endswith("that raise it (raise num_generations to 4), or lower the threshold")


def test_strict_failure_names_no_recommendations_when_none_were_given(make_cfg, tmp_path, monkeypatch, capsys):
    """G = 4, n = 8: two groups per prompt, 5 of 8 teach (62.5 %), above the recommendations' own bar
    (LOW_TEACHING), no prompt always or never solved: nothing is recommended. --strict 0.9 said "follow the
    recommendations above (a larger num_generations, a prompt filter)" under "recommendations: none"; it
    now says what raises the share, with the predictions: at G = 8 (unbiased, n = 8) no prompt's 8
    samples are all equal, so every group would teach."""
    acc = [[1., 1., 1., 1., 0., 1., 1., 1.], [0., 0., 0., 0., 1., 0., 0., 0.],
           [1., 0., 1., 0., 1., 1., 0., 0.], [1., 1., 1., 1., 1., 1., 1., 0.]]
    report = P.summarize(_samples({"acc": acc}), make_cfg(num_generations=4))
    assert report["total"]["teaching_share"] == 0.625 and report["recommendations"] == []
    failure = P.strict_failure(report, 0.9)
    assert "follow the recommendations" not in failure
    assert failure.startswith("only 62.5% of groups would teach (rewards not all equal at G=4), below --strict 0.9, "
                              "and nothing recommended above raises it (its advice starts below 50% of groups "
                              "teaching")
    assert ("What raises the share: a larger num_generations (predicted: 100% at G=8, ") in failure
    assert "at G=16, 32 plug-in estimates, which understate it)" in failure
    assert "by a prompt filter or other data (0% are always solved, 0% never); or lower --strict" in failure
    assert P.strict_failure(report, 0.6) is None
    # with advice above that raises the share, it points there, by name; advice on other things (a longer
    # max_completion_length) raises no share: the levers are named instead. PPO's flat groups teach too
    raise_g = {"advice": "raise num_generations to 8", "reason": "r", "raises_teaching_share": True}
    longer = {"advice": "raise max_completion_length above 256", "reason": "r"}
    advised = {**report, "recommendations": [longer, raise_g]}
    assert P.strict_failure(advised, 0.9).endswith("below --strict 0.9: follow the recommendations above that "
                                                  "raise it (raise num_generations to 8), or lower the threshold")
    assert P.strict_failure({**report, "recommendations": [longer]}, 0.9) == failure
    assert P.strict_failure({**report, "groups_carry_the_signal": False}, 0.9) is None
    # the command line prints it, under the report's "recommendations: none"
    monkeypatch.setattr(Trainer, "preflight", lambda self, *a: report)
    make_cfg().save_yaml(tmp_path / "run.yaml")
    assert main(["preflight", str(tmp_path / "run.yaml"), "--strict", "0.9"]) == 1
    out, err = capsys.readouterr()
    assert "recommendations: none" in out and f"grouprl preflight: error: {failure}" in err


# ---------------------------------------------------------------------- on the tiny policy
def test_preflight_report_matches_its_samples(make_cfg, tmp_path):
    """The report of a real preflight on the tiny policy agrees with the samples it drew: the
    observed zero-variance share at G is the share of all-equal groups (also with 8 samples per
    prompt: two groups each), the predicted share at G = n is the same number, pass rate and mean
    follow the scores. Existing checkpoints in output_dir are left alone."""
    cfg = make_cfg(reward_funcs=["tests.trainer.test_preflight:binary_reward",
                                 "tests.trainer.conftest:digit_fraction"], num_generations=4)
    ckpt = Path(cfg.output_dir) / "checkpoints" / "step-000001"
    ckpt.mkdir(parents=True)
    (ckpt / "marker").write_text("kept")
    trainer = Trainer(cfg)
    s = P.sample(trainer, 10)
    assert s.total.shape == (10, 4) and s.per_func["binary_reward"].shape == (10, 4)
    assert s.lengths.shape == (40,) and s.chunk_prompts == [4, 4, 2]
    report = P.summarize(s, cfg)
    flat = [len(set(row)) == 1 for row in s.total.tolist()]  # per group of 4
    assert report["total"]["zero_variance_share"] == sum(flat) / 10
    assert report["total"]["predicted_zero_variance_share"]["4"] == pytest.approx(sum(flat) / 10, abs=1e-12)
    binary = s.per_func["binary_reward"]
    assert report["rewards"]["binary_reward"]["pass_rate"] == pytest.approx(binary.mean().item())
    assert report["rewards"]["digit_fraction"]["mean"] == pytest.approx(s.per_func["digit_fraction"].mean().item())
    assert sum(report["difficulty"]["pass_count_histogram"]) == 10
    assert report["lengths"]["max"] <= cfg.max_completion_length

    more = P.sample(trainer, 3, samples_per_prompt=8)  # two groups of G = 4 per prompt
    assert more.total.shape == (3, 8) and more.chunk_prompts == [3]
    groups = more.total.view(6, 4).tolist()
    assert P.summarize(more, cfg)["total"]["zero_variance_share"] == sum(len(set(g)) == 1 for g in groups) / 6

    written = trainer.preflight(num_prompts=10)
    out = Path(cfg.output_dir)
    on_disk = json.loads((out / "preflight.json").read_text())
    assert on_disk["num_prompts"] == 10 and on_disk == json.loads(json.dumps(written))
    assert (out / "preflight.png").stat().st_size > 0 and (ckpt / "marker").read_text() == "kept"


def test_preflight_judges_groups_before_overlong_shaping_as_training_does(make_cfg, monkeypatch):
    """Every completion right and the overlong penalty different row by row: dynamic sampling drops
    every group (it judges the reward before shaping, the paper's accuracy), so preflight's share of
    groups that teach nothing is 1, not the 0 the shaped rewards would give."""
    import grouprl.scoring as scoring

    monkeypatch.setattr(scoring, "overlong_penalty", lambda lengths, *a: -0.01 * torch.arange(len(lengths)).float())
    cfg = make_cfg(algorithm="dapo", reward_funcs=["tests.trainer.conftest:always_one"], num_generations=4)
    s = P.sample(Trainer(cfg), 4)
    assert P.summarize(s, cfg)["total"]["zero_variance_share"] == 1.0


def test_cli_preflight_writes_the_report_and_strict_fails(make_cfg, tmp_path, capsys):
    """In-process CLI: the report is written and printed; `never` scores 0 everywhere, so no group
    teaches, and --strict (0.25) exits 1 naming the share; --prompts 0 and --samples 6 (not a
    multiple of G = 4) are refused before any model loads."""
    # checkpointing off: `auto` checkpoints every pass on CUDA, which adds a pass to the estimate below
    # (test_the_update_estimate_counts_checkpointing_as_the_device_runs_it); a lent H100 failed this test
    cfg = make_cfg(reward_funcs=["tests.trainer.test_preflight:never"], gradient_checkpointing=False)
    path = tmp_path / "run.yaml"
    cfg.save_yaml(path)
    assert main(["preflight", str(path), "--prompts", "4"]) == 0
    out = capsys.readouterr().out
    report = json.loads((Path(cfg.output_dir) / "preflight.json").read_text())
    assert report["num_prompts"] == 4 and report["total"]["teaching_share"] == 0.0
    assert "groups that teach at G=4: 0.0%" in out and "preflight.json" in out

    assert main(["preflight", str(path), "--prompts", "4", "--strict"]) == 1
    assert "only 0.0% of groups would teach" in capsys.readouterr().err
    assert main(["preflight", str(path), "--prompts", "4", "--strict", "0"]) == 0
    assert main(["preflight", "--strict", str(path), "--prompts", "4"]) == 1  # the file is not --strict's value
    assert "below --strict 0.25" in capsys.readouterr().err
    # PPO: the value head is the baseline, so flat groups teach too: the share informs, --strict passes
    assert main(["preflight", str(path), "--prompts", "4", "--strict", "--algorithm", "ppo"]) == 0
    out = capsys.readouterr().out
    assert "groups that teach at G=4: 0.0% (for information: the value head or the teacher" in out
    assert "raise num_generations" not in out and "filter the prompts" not in out
    report = json.loads((Path(cfg.output_dir) / "preflight.json").read_text())
    assert report["groups_carry_the_signal"] is False
    assert report["timing"]["update_forward_passes"] == 3 + 1  # one training pass (mu = 1) and the value pass

    assert main(["preflight", str(path), "--prompts", "0"]) == 2
    assert "--prompts 0: preflight needs at least one prompt" in capsys.readouterr().err
    assert main(["preflight", str(path), "--samples", "6"]) == 2
    assert "a multiple of num_generations=4" in capsys.readouterr().err
    assert main(["train", str(path), "--prompts", "4"]) == 2  # not a train option
    # a misspelt flag of preflight's own was matched against the fields alone, and sent to train's help:
    # "unknown option --prompt (did you mean 'chat_prompts'?); `grouprl train --help` lists every field"
    capsys.readouterr()
    for typo, meant in (("--prompt", "prompts"), ("--sample", "samples"), ("--strct", "strict")):
        assert main(["preflight", str(path), typo, "8"]) == 2
        assert (f"unknown option {typo} (did you mean {meant!r}?); `grouprl preflight --help` lists preflight's "
                "options and every field") in capsys.readouterr().err


def test_preflight_under_torchrun_rank_0_writes_the_whole_report(make_cfg, tmp_path):
    """2 processes (gloo): 10 prompts in chunks of 4, 4, 2, each chunk split over the ranks; the
    report covers all 10 prompts (40 completions), rank 0 alone prints it and writes the files."""
    cfg = make_cfg(num_threads=1)
    path = tmp_path / "run.yaml"
    cfg.save_yaml(path)
    proc = torchrun("-m", "grouprl", "preflight", str(path), "--prompts", "10", "--strict", "0")
    assert proc.stdout.count("preflight: 10 prompts x 4 completions") == 1
    report = json.loads((Path(cfg.output_dir) / "preflight.json").read_text())
    assert report["num_prompts"] == 10 and report["num_completions"] == 40
    assert sum(report["difficulty"]["pass_count_histogram"]) == 10
    assert sorted(p.name for p in Path(cfg.output_dir).iterdir()) == ["preflight.json", "preflight.png"]


@pytest.mark.cpu_rules
def test_the_update_estimate_counts_checkpointing_as_the_device_runs_it(make_cfg):
    """`gradient_checkpointing: auto` checkpoints every pass on CUDA and only a pass over the budget
    on CPU (grouprl/memory.py): with num_iterations 1, beta 0, the update is 3 forward passes on
    CPU and 4 on CUDA (the recompute); an explicit `false` is 3 on both."""
    acc = [[1., 0., 1., 0.], [0., 1., 0., 0.]]
    s = _samples({"acc": acc})
    passes = {(mode, dev): P.summarize(s, make_cfg(gradient_checkpointing=mode), torch.device(dev))
              ["timing"]["update_forward_passes"] for mode in ("auto", False) for dev in ("cpu", "cuda")}
    assert passes == {("auto", "cpu"): 3, ("auto", "cuda"): 4, (False, "cpu"): 3, (False, "cuda"): 3}


def test_fewer_prompts_than_processes_names_prompts_not_the_dataset(make_cfg):
    """Under torchrun with 2 ranks, `--prompts 1` is the problem (64 training prompts are plenty)."""
    from types import SimpleNamespace

    from grouprl.distributed import DistContext

    stages = SimpleNamespace(cfg=make_cfg(), dist=DistContext(rank=0, world_size=2), train_ds=list(range(64)))
    with pytest.raises(ValueError, match=r"--prompts 1 is fewer than the 2 processes .*use --prompts 2 or more"):
        P.sample(stages, 1)
    stages.train_ds = [0]
    with pytest.raises(ValueError, match="the training set has 1 prompts, fewer than the 2 processes"):
        P.sample(stages, 4)
