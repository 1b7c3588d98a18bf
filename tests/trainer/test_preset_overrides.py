"""A preset's values under a config that changes what they mean: a preset's clip range taken over by
another loss type or ratio level is refused with the range to set; a run's resolved config.yaml
switched to another algorithm on the command line takes the new preset's values where it held the
old one's, and keeps what differed from it."""

import logging

import pytest

from grouprl.cli_args import build_config
from grouprl.config import ConfigError, TrainConfig
from grouprl.tasks import DEFAULT_TASK


@pytest.mark.parametrize("args, was, now, example", [
    (["--algorithm", "gspo", "--importance_sampling_level", "token"], "the length-normalised ratio of each completion",
     "the ratio of each token", "0.2 / 0.2 (grpo)"),
    (["--algorithm", "gmpo", "--loss_type", "clip"], "the log-ratio of each token", "the ratio of each token",
     "0.2 / 0.2 (grpo)"),
    (["--loss_type", "gmpo"], "the ratio of each token", "the log-ratio of each token", "0.4 / 0.4 (gmpo)"),
    (["--algorithm", "dapo", "--importance_sampling_level", "sequence"], "the ratio of each token",
     "the length-normalised ratio of each completion", "3e-4 / 4e-4 (gspo)"),
])
def test_a_presets_clip_range_under_another_ratio_is_refused_with_the_range_to_set(args, was, now, example):
    with pytest.raises(ConfigError) as e:
        build_config(None, args).validate()
    text = str(e.value)
    assert f"where they bound {was}" in text and f"they would bound {now}" in text and example in text


def test_cispos_range_under_the_clip_names_its_preset():
    """cispo's 1 / 4 bounds the importance weight to [0, 5], the same band on the same token ratio as
    the clip's, so the clip takes it as a band, and refuses it: 1 - epsilon = 0 is no lower clip."""
    with pytest.raises(ConfigError, match=r"epsilon=1.0, epsilon_high=4.0, from the cispo preset: clip ranges"):
        build_config(None, ["--algorithm", "cispo", "--loss_type", "clip"]).validate()


@pytest.mark.parametrize("algorithm, high", [("grpo", 0.1), ("dr_grpo", 0.1), ("gmpo", 0.1), ("dapo", 0.28),
                                             ("gspo", 4e-4)])
def test_an_epsilon_of_ones_own_keeps_a_symmetric_presets_range_symmetric(algorithm, high):
    """TRL's epsilon_high defaults to its epsilon: `--epsilon 0.1` alone gives 0.1 / 0.1 under a preset
    whose range is symmetric, not 0.1 / 0.2; a clip-higher preset (dapo, gspo) keeps its upper range."""
    cfg = build_config(None, ["--algorithm", algorithm, "--epsilon", "0.1"]).resolved()
    assert (cfg.epsilon, cfg.epsilon_high) == (0.1, high)


@pytest.mark.parametrize("algorithm, high", [("grpo", 0.1), ("dapo", 0.28)])
def test_an_epsilon_over_a_runs_config_keeps_its_symmetric_range_symmetric(tmp_path, algorithm, high):
    """A run's config.yaml holds its preset's range resolved (grpo: 0.2 / 0.2): `--epsilon 0.1` over it
    gives 0.1 / 0.1, as over the preset itself, not 0.1 / 0.2; dapo's 0.2 / 0.28 keeps its upper bound."""
    path = tmp_path / "config.yaml"
    build_config(None, ["--algorithm", algorithm]).resolved().save_yaml(path)
    cfg = build_config(str(path), ["--epsilon", "0.1"]).resolved()
    assert (cfg.epsilon, cfg.epsilon_high) == (0.1, high)
    assert build_config(str(path), ["--epsilon", "0.1", "--epsilon_high", "0.3"]).epsilon_high == 0.3


def test_a_bad_epsilon_of_ones_own_beside_a_presets_upper_bound_is_named_as_ones_own():
    """dapo keeps its 0.28 beside `--epsilon 1.5`: the error said both came "from the dapo preset"."""
    with pytest.raises(ConfigError, match=r"epsilon=1.5, epsilon_high=0.28, epsilon_high from the dapo preset: "):
        build_config(None, ["--algorithm", "dapo", "--epsilon", "1.5"]).validate()


def test_an_epsilon_of_ones_own_under_another_ratio_is_a_range_of_its_own():
    """grpo's range is symmetric, so `--epsilon 0.4` sets both bounds: under gmpo's log-ratio that is a
    range the user chose, accepted (the preset's 0.2 / 0.2 alone is refused there, above)."""
    cfg = build_config(None, ["--loss_type", "gmpo", "--epsilon", "0.4"]).validate()
    assert (cfg.epsilon, cfg.epsilon_high) == (0.4, 0.4)


@pytest.mark.parametrize("args", [
    ["--algorithm", "gspo", "--importance_sampling_level", "token", "--epsilon", "0.2", "--epsilon_high", "0.28"],
    ["--algorithm", "grpo", "--loss_type", "sapo"],  # the gate reads no epsilon
    ["--algorithm", "dapo", "--loss_type", "clip"],  # the preset's own loss type
    ["--algorithm", "grpo", "--loss_type", "cispo"],  # the same band on the same ratio, bounding the weight
    ["--loss_type", "gmpo", "--epsilon", "0.4", "--epsilon_high", "0.4"],
])
def test_a_range_of_its_own_or_an_unchanged_meaning_is_accepted(args):
    build_config(None, args).validate()


def test_a_resolved_config_switched_to_another_algorithm_trains_that_algorithm(tmp_path, caplog):
    """grpo's resolved config (every algorithm field set) with --algorithm dapo: dapo's values where
    the file held grpo's (ε_high, aggregation, β, dynamic sampling, overlong shaping and its window,
    the fifth of 20,480), a value that differed from grpo's kept (scale_rewards), a command-line value
    kept (epsilon_high), and the change logged."""
    resolved = TrainConfig(**{**DEFAULT_TASK, "max_completion_length": 20480, "scale_rewards": "batch",
                              "output_dir": str(tmp_path / "run")}).resolved()
    assert resolved.beta == 0.04 and resolved.overlong_cache_len == 4096
    resolved.save_yaml(tmp_path / "config.yaml")
    with caplog.at_level(logging.INFO, logger="grouprl.cli_args"):
        cfg = build_config(str(tmp_path / "config.yaml"), ["--algorithm", "dapo", "--epsilon_high", "0.3"]).validate()
    assert (cfg.algorithm, cfg.loss_agg, cfg.beta, cfg.dynamic_sampling, cfg.overlong_shaping) == (
        "dapo", "token-mean", 0.0, True, True)
    assert cfg.overlong_cache_len == 4096 and cfg.epsilon_high == 0.3 and cfg.scale_rewards == "batch"
    (line,) = [r.getMessage() for r in caplog.records if "--algorithm dapo" in r.getMessage()]
    assert "the fields at grpo's values take dapo's: loss_agg seq-mean-token-mean -> token-mean" in line
    assert "beta 0.04 -> 0.0" in line and "epsilon_high" not in line and "scale_rewards" not in line


def test_the_same_algorithm_on_the_command_line_changes_nothing(tmp_path):
    resolved = TrainConfig(**{**DEFAULT_TASK, "algorithm": "dapo", "epsilon_high": 0.3}).resolved()
    resolved.save_yaml(tmp_path / "config.yaml")
    assert build_config(str(tmp_path / "config.yaml"), ["--algorithm", "dapo"]).validate() == resolved.validate()


def test_a_file_of_ones_own_keeps_what_it_sets_and_a_split_clip_range_is_refused(tmp_path):
    """Only a resolved config is switched: a hand-written file's epsilon_high 0.2 under --algorithm dapo is
    the user's choice (dapo fills the rest). A resolved grpo config whose epsilon_high was changed keeps
    it while epsilon would become gspo's: a range of two presets, refused."""
    (tmp_path / "own.yaml").write_text("algorithm: grpo\nepsilon_high: 0.2\n")
    cfg = build_config(str(tmp_path / "own.yaml"), ["--algorithm", "dapo"]).resolved()
    assert (cfg.epsilon_high, cfg.loss_agg, cfg.dynamic_sampling) == (0.2, "token-mean", True)
    TrainConfig(**{**DEFAULT_TASK, "epsilon_high": 0.28}).resolved().save_yaml(tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match=r"epsilon_high=0.28 differs from grpo's .* give both epsilon and "
                                          r"epsilon_high on the command line"):
        build_config(str(tmp_path / "config.yaml"), ["--algorithm", "gspo"])
    assert build_config(str(tmp_path / "config.yaml"), ["--algorithm", "gspo", "--epsilon", "3e-4",
                                                        "--epsilon_high", "4e-4"]).validate().epsilon_high == 4e-4
