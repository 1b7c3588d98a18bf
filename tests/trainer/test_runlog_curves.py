"""curves.png: the eval panel shows the metric the run recorded and says which it is."""

import matplotlib.figure
import pytest

from grouprl.runlog import RunLogger


@pytest.mark.parametrize("evals, key, title", [
    ({"eval/accuracy": 0.5, "eval/pass@4": 0.9}, "eval/accuracy", "eval accuracy (greedy)"),
    ({"eval/pass@4": 0.9, "eval/mean@4": 0.4}, "eval/pass@4", "eval pass@4 (sampled)"),
    ({"eval/reward_mean": 0.2}, "eval/accuracy", "eval accuracy (greedy)"),  # none recorded: the panel says so
])
def test_the_eval_panel_plots_what_eval_metrics_recorded(tmp_path, monkeypatch, evals, key, title):
    drawn = {}

    def record(fig, *args, **kwargs):
        for ax in fig.axes:
            drawn[ax.get_title()] = [list(line.get_ydata()) for line in ax.get_lines()]

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    log = RunLogger(tmp_path, report_to=())
    log.log(1, {"reward/mean": 0.1})
    log.log(2, {"reward/mean": 0.3, **evals})
    log.plot_curves()
    assert drawn["reward (train)"] == [[0.1, 0.3]]
    assert drawn[title] == ([[evals[key]]] if key in evals else [])
    assert "eval accuracy (greedy)" not in drawn or title == "eval accuracy (greedy)"
