"""The embedded default (`grouprl train` with no config, what `make demo` runs) visibly learns."""

import json

from grouprl.cli import main


def test_embedded_default_lifts_held_out_accuracy_by_25_points(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["train", "--max_steps", "30", "--eval_steps", "0", "--output_dir", str(out),
                 "--progress", "false", "--report_to", "[]"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
    assert before < 0.5  # the shipped policy starts weak ...
    assert after - before >= 0.25, (before, after)  # ... and 30 GRPO steps lift it
    assert "greedy eval accuracy" in capsys.readouterr().out
