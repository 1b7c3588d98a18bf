"""Experiment trackers (trackers.py, `report_to`), with the real libraries offline: what a run wrote is
read back from wandb's offline run file, trackio's local database and TensorBoard's events, and
compared with metrics.jsonl. A tracker that fails mid-run warns once and training goes on; a missing
package is named with its extra; ranks other than 0 open nothing."""

import glob
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from grouprl.config import ConfigError
from grouprl.runlog import RunLogger
from grouprl.trainer import Trainer
from tests.trainer.conftest import read_metrics

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("wandb", reason="the wandb extra: pip install 'grouprl[wandb]'")
pytest.importorskip("trackio", reason="the trackio extra: pip install 'grouprl[trackio]'")


def wandb_records(run_file: str) -> list:
    """The protobuf records of a .wandb file: a 7-byte header, then 32 KiB blocks of chunks (a 7-byte
    head: checksum, length, type 1 full / 2 first / 3 middle / 4 last), as `wandb sync` reads it."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, out, buf = Path(run_file).read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_wandb_offline_gets_config_every_scalar_and_the_completions_table(make_cfg, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = make_cfg(report_to=["wandb"], max_steps=4, log_completions_steps=2, num_logged_samples=3,
                   run_name="tiny-wandb")
    Trainer(cfg).train()
    rows = read_metrics(cfg.output_dir)
    (run_file,) = glob.glob(f"{cfg.output_dir}/wandb/offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
            history[int(items["_step"])] = items
    for row in rows:
        logged = history[row["step"]]
        assert float(logged["reward/mean"]) == pytest.approx(row["reward/mean"], rel=1e-6)
        assert float(logged["loss"]) == pytest.approx(row["loss"], rel=1e-6)
    assert ["completions/_type" in history[s] for s in (1, 2, 3, 4)] == [False, True, False, True]
    (run_rec,) = [r.run for r in records if r.WhichOneof("record_type") == "run"][:1]
    config = {u.key: json.loads(u.value_json) for u in run_rec.config.update}
    assert run_rec.display_name == "tiny-wandb" and config["learning_rate"] == cfg.learning_rate
    assert config["meta/world_size"] == 1 and config["reward_funcs"] == cfg.reward_funcs
    tables = sorted(glob.glob(f"{cfg.output_dir}/wandb/offline-run-*/files/media/table/completions_*.table.json"))
    table = json.loads(Path(tables[0]).read_text())
    assert len(table["data"]) == 3
    assert {"prompt", "completion", "reward", "rewards/digit_fraction", "advantage", "length", "stop"} <= set(
        table["columns"])


def test_trackio_writes_its_local_database(tiny_model_dir, digits_data, tmp_path):
    """Through `grouprl train --report_to [trackio]` in its own process (trackio reads TRACKIO_DIR at import)."""
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "store"), "TRACKIO_PROJECT": "grouprl-test",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "grouprl", "train", "--model", str(tiny_model_dir), "--train_data",
                    str(digits_data), "--reward_funcs", "[tests.trainer.conftest:digit_fraction]", "--num_generations",
                    "4", "--prompts_per_step", "2", "--micro_batch_size", "8", "--max_completion_length", "8",
                    "--max_steps", "3", "--log_completions_steps", "1", "--report_to", "[trackio]", "--run_name",
                    "tiny-trackio", "--output_dir", str(out), "--progress", "false"], env=env, check=True,
                   capture_output=True, timeout=300)
    read = ("import json; from trackio.sqlite_storage import SQLiteStorage as S; "
            "print(json.dumps({'logs': S.get_logs('grouprl-test', 'tiny-trackio'), "
            "'config': S.get_run_config('grouprl-test', 'tiny-trackio')}, default=str))")
    got = json.loads(subprocess.run([sys.executable, "-c", read], env=env, check=True, capture_output=True,
                                    text=True, timeout=120).stdout.strip().splitlines()[-1])
    rows = read_metrics(out)
    logged = {e["step"]: e for e in got["logs"]}
    for row in rows:
        assert logged[row["step"]]["reward/mean"] == pytest.approx(row["reward/mean"], rel=1e-6)
    assert any("completions" in e for e in got["logs"])
    assert got["config"]["max_steps"] == 3


def test_tensorboard_gets_the_table_as_text(make_cfg):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg(report_to=["tensorboard"], max_steps=2, log_completions_steps=1)
    Trainer(cfg).train()
    events = EventAccumulator(f"{cfg.output_dir}/tensorboard")
    events.Reload()
    assert "completions/text_summary" in events.Tags()["tensors"] and "reward/mean" in events.Tags()["scalars"]
    text = events.Tensors("completions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text.startswith("| prompt | completion | reward |")


def test_a_tracker_failing_mid_run_warns_once_and_training_goes_on(make_cfg, monkeypatch, caplog):
    from grouprl import trackers

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    real, calls = trackers.Wandb.log, []

    def disk_full(self, step, scalars):
        calls.append(step)
        if step >= 2:
            raise OSError(28, "No space left on device")
        real(self, step, scalars)

    monkeypatch.setattr(trackers.Wandb, "log", disk_full)
    cfg = make_cfg(report_to=["wandb", "tensorboard"], max_steps=4)
    with caplog.at_level(logging.WARNING, logger="grouprl.runlog"):
        Trainer(cfg).train()
    assert [r["step"] for r in read_metrics(cfg.output_dir)] == [1, 2, 3, 4]
    assert calls == [1, 2]  # dropped after its failure
    warned = [r.getMessage() for r in caplog.records if "report_to wandb failed" in r.getMessage()]
    assert len(warned) == 1 and "No space left on device" in warned[0] and "training goes on" in warned[0]


def test_a_missing_tracker_is_named_with_its_extra(make_cfg, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"report_to: mlflow is not installed: pip install 'grouprl\[mlflow\]'"):
        Trainer(make_cfg(report_to=["mlflow"]))


def test_ranks_other_than_0_open_no_tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    log = RunLogger(tmp_path / "r", report_to=("wandb", "tensorboard"), enabled=False)
    log.log(1, {"x": 1.0})
    log.close()
    assert log.trackers == [] and not (tmp_path / "r").exists()
