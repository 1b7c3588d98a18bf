"""Experiment trackers (trackers.py, `report_to`), with the real libraries offline: what a run wrote is
read back from wandb's offline run file, trackio's local database, TensorBoard's events and mlflow's
file store (its own client; skipped without mlflow or mlflow-skinny), and compared with metrics.jsonl.
A tracker that fails mid-run warns once and training goes on; one that cannot start is an error
before training (a ConfigError before any model loads where that can be told early); a missing
package is named with its extra; ranks other than 0 open nothing."""

import glob
import json
import logging
import math
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grouprl.config import ConfigError
from grouprl.runlog import RunLogger
from grouprl.trackers import TrackerError
from grouprl.trainer import Trainer
from tests.trainer.conftest import digit_fraction, read_metrics

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("wandb", reason="the wandb extra: pip install 'grouprl[wandb]'")
pytest.importorskip("trackio", reason="the trackio extra: pip install 'grouprl[trackio]'")


def wandb_records(run_file: str, wait_s: float = 60.0) -> list:
    """The protobuf records of a finished run's .wandb file, once wandb's service has written them.

    wandb-core buffers the file in 32 KiB blocks and writes a small run's records only when it closes
    the stream, which `run.finish()` asks for without waiting (measured with wandb 0.31: 7 bytes on
    disk after four logged steps, 2.4 KB after finish). On a loaded machine the test can read the file
    first and find only its header (CI once saw an empty history this way), so this waits, at most
    `wait_s`, for the run's last record, `exit`."""
    deadline = time.monotonic() + wait_s
    while True:
        out = _parse_wandb_file(Path(run_file).read_bytes())
        if (out and out[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def _parse_wandb_file(data: bytes) -> list:
    """A .wandb file: a 7-byte header, then 32 KiB blocks of chunks (a 7-byte head: checksum,
    length, type 1 full / 2 first / 3 middle / 4 last), as `wandb sync` reads it."""
    from wandb.proto import wandb_internal_pb2 as pb

    pos, block, out, buf = 7, 32768, [], b""
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
    kinds = [r.WhichOneof("record_type") for r in records]
    for row in rows:
        assert row["step"] in history, f"step {row['step']} not in the .wandb file's history: records {kinds}"
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


def test_a_tracker_that_fails_to_start_is_an_error_and_closes_the_others(tmp_path, monkeypatch):
    """wandb cannot start (a dead server; the real library, once set up in a process, keeps its
    settings, so the failure is injected): the run must not go on untracked. TensorBoard, started
    first, is closed."""
    from grouprl import trackers

    def unreachable(*args):
        raise ConnectionError("wandb.ai is unreachable")

    closed = []
    monkeypatch.setitem(trackers.OPENERS, "wandb", unreachable)
    monkeypatch.setattr(trackers.TensorBoard, "finish", lambda self: closed.append(self.name))
    with pytest.raises(TrackerError, match=r"report_to wandb failed to start \(ConnectionError: wandb.ai is "
                                           r"unreachable\); fix that, or drop wandb from report_to"):
        RunLogger(tmp_path / "r", report_to=("tensorboard", "wandb"), config={"a": 1})
    assert closed == ["tensorboard"]


def test_a_tracker_that_cannot_start_is_a_config_error_before_the_model_loads(make_cfg, monkeypatch,
                                                                              no_model_loading):
    """What can be told without starting the tracker: a file where TensorBoard's folder goes, a
    `WANDB_MODE` wandb refuses, mlflow's default sqlite store without SQLAlchemy (mlflow-skinny)."""
    import importlib.util

    cfg = make_cfg(report_to=["tensorboard"])
    Path(cfg.output_dir).mkdir(parents=True)
    (Path(cfg.output_dir) / "tensorboard").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"tensorboard writes .*tensorboard, but .*tensorboard is not a folder"):
        Trainer(cfg)

    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(ConfigError, match=r"report_to: wandb: WANDB_MODE='ofline' is not a mode wandb takes "
                                          r"\('online', 'offline', .*\): set it to offline .*, or unset it"):
        Trainer(make_cfg(report_to=["wandb"]))
    monkeypatch.setenv("WANDB_MODE", "offline")
    from grouprl.trackers import tracker_problems
    assert tracker_problems(["wandb"], cfg.output_dir) == []

    class OtherSettingRefused(ValueError):  # a validation error, as pydantic's, about another setting
        def errors(self):
            return [{"loc": ("api_key",), "msg": "invalid"}]

    import wandb

    for error in (OtherSettingRefused("api_key"), RuntimeError("wandb's own trouble")):
        with monkeypatch.context() as m:
            m.setattr(wandb, "Settings", lambda error=error, **kw: (_ for _ in ()).throw(error))
            assert tracker_problems(["wandb"], cfg.output_dir) == []  # not the mode's fault: wandb.init names it

    pytest.importorskip("mlflow", reason="the mlflow extra: pip install 'grouprl[mlflow]' (or mlflow-skinny)")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{cfg.output_dir}/mlflow.db")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    with pytest.raises(ConfigError, match=r"report_to: mlflow: .* needs the full mlflow package"):
        Trainer(make_cfg(report_to=["mlflow"]))


def test_ranks_other_than_0_open_no_tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    log = RunLogger(tmp_path / "r", report_to=("wandb", "tensorboard"), enabled=False)
    log.log(1, {"x": 1.0})
    log.close()
    assert log.trackers == [] and not (tmp_path / "r").exists()


def lambda_reward(prompts, completions, **kwargs):
    return digit_fraction(prompts, completions)


lambda_reward.__name__ = "<lambda>"  # what a lambda reward is called: '<' and '>' are refused in mlflow's keys


def mlflow_client(monkeypatch, tmp_path):
    """mlflow's client on a file store in tmp_path (MLflow 3 refuses the file store unless
    MLFLOW_ALLOW_FILE_STORE=true; its default, sqlite, needs the full `mlflow` package)."""
    pytest.importorskip("mlflow", reason="the mlflow extra: pip install 'grouprl[mlflow]' (or mlflow-skinny)")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "grouprl-test")
    return MlflowClient()


def mlflow_key(key: str) -> str:
    """The tracker's key mapping: '@' -> '_at_', any other character mlflow refuses -> '_'."""
    return re.sub(r"[^\w./\- ]", "_", key.replace("@", "_at_"))


def expected_mlflow_metrics(output_dir) -> dict:
    """{(mlflow key, step): value} of every finite scalar metrics.jsonl holds (what RunLogger reports)."""
    return {(mlflow_key(k), r["step"]): v for r in read_metrics(output_dir) for k, v in r.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def logged_mlflow_metrics(client, run_id: str) -> dict:
    return {(key, m.step): m.value for key in client.get_run(run_id).data.metrics
            for m in client.get_metric_history(run_id, key)}


def test_mlflow_gets_the_config_every_scalar_and_the_completions_table(make_cfg, digits_data, monkeypatch,
                                                                       tmp_path):
    """A run with evals (eval/pass@2) and a reward named '<lambda>': every scalar of metrics.jsonl is in
    the mlflow run at its step with its value, under a key mlflow accepts; every config field is a
    param (more than mlflow's 100 per batch); the completions table is an artifact every 2 steps."""
    client = mlflow_client(monkeypatch, tmp_path)
    cfg = make_cfg(report_to=["mlflow"], max_steps=4, log_completions_steps=2, num_logged_samples=3,
                   run_name="tiny-mlflow", reward_funcs=["tests.trainer.test_trackers:lambda_reward"],
                   eval_data=str(digits_data), max_eval_samples=4, eval_steps=2, eval_metrics=["greedy", "pass@2"],
                   num_generations_eval=2)
    Trainer(cfg).train()
    run_id = (Path(cfg.output_dir) / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.run_name == "tiny-mlflow" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "grouprl-test"

    expected, logged = expected_mlflow_metrics(cfg.output_dir), logged_mlflow_metrics(client, run_id)
    assert set(logged) == set(expected)
    for key, v in expected.items():
        assert logged[key] == pytest.approx(v, rel=1e-9), key
    keys = {k for k, _ in logged}
    assert {"eval/pass_at_2", "rewards/_lambda_/mean", "time/step", "reward/mean", "loss"} <= keys
    assert {s for k, s in logged if k == "eval/pass_at_2"} == {0, 2, 4}

    config = {**cfg.to_dict(), "meta/world_size": 1}
    params = run.data.params
    assert len(params) > 100 and set(config) <= set(params)
    assert params["learning_rate"] == str(cfg.learning_rate) and params["meta/world_size"] == "1"
    assert params["reward_funcs"] == str(cfg.reward_funcs)

    tables = sorted(f.path for f in client.list_artifacts(run_id, "completions"))
    assert tables == ["completions/step-000002.json", "completions/step-000004.json"]
    table = json.loads(Path(client.download_artifacts(run_id, tables[0], str(tmp_path / "dl"))).read_text())
    assert len(table["data"]) == 3
    assert {"prompt", "completion", "reward", "advantage", "length", "stop"} <= set(table["columns"])


@pytest.mark.parametrize("how", ["finished", "crashed", "crashed after logging step 3"])
def test_mlflow_resumed_run_continues_the_same_run(make_cfg, monkeypatch, tmp_path, how):
    """Resumed (`train(resume=True)`, in the same process as a notebook would) to step 4 after a run
    that finished at step 2, or one that raised after its step-2 checkpoint, before step 3 or after
    logging it (the resumed run computes step 3 again, and does not log it twice): one mlflow run (the id in
    output_dir/mlflow_run_id) reopened, steps 1-4 once each with metrics.jsonl's values, the first
    run's params (mlflow refuses to change a param), FINISHED. The crashed run must not stay the
    process's active mlflow run (the resumed tracker, or the user's next `start_run`, failed on it),
    and a user's own active run is left alone."""
    client = mlflow_client(monkeypatch, tmp_path)
    import mlflow

    cfg = make_cfg(report_to=["mlflow"], max_steps=4, save_steps=2)
    if how == "finished":
        Trainer(make_cfg(**{**cfg.__dict__, "max_steps": 2})).train()
    else:
        class Crash(Exception):
            pass

        trainer = Trainer(cfg)
        original = trainer.train_step

        crash_at = 2 if how == "crashed" else 3

        def crash():
            if trainer.step == crash_at:  # after the step-2 checkpoint, before step 3 or step 4
                raise Crash
            return original()

        trainer.train_step = crash
        with pytest.raises(Crash):
            trainer.train()
        assert mlflow.active_run() is None
    id_file = Path(cfg.output_dir) / "mlflow_run_id"
    run_id = id_file.read_text().strip()

    with mlflow.start_run(experiment_id=client.create_experiment("mine")) as mine:
        Trainer(cfg).train(resume=True)
        assert mlflow.active_run().info.run_id == mine.info.run_id
    assert id_file.read_text().strip() == run_id
    (run,) = client.search_runs([client.get_experiment_by_name("grouprl-test").experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == [1, 2, 3, 4]
    logged, expected = logged_mlflow_metrics(client, run_id), expected_mlflow_metrics(cfg.output_dir)
    if how == "crashed after logging step 3":  # mlflow keeps the interrupted run's step 3: the same but its timings
        logged, expected = ({k: v for k, v in d.items() if not (k[1] == 3 and k[0].startswith("time/"))}
                            for d in (logged, expected))
    assert logged == pytest.approx(expected, rel=1e-9)
    assert run.data.params["max_steps"] == ("2" if how == "finished" else "4")


def test_mlflow_accepts_every_metric_name_grouprl_logs(monkeypatch, tmp_path):
    """Each family of names metrics.jsonl can hold, logged in one batch (one refused name fails the
    batch): mlflow takes them, '@' as '_at_' and the characters it refuses as '_'."""
    from grouprl.trackers import Mlflow

    client = mlflow_client(monkeypatch, tmp_path)
    names = ["loss", "kl", "is/ratio_mean", "eval/accuracy", "eval/pass@4", "eval/maj@3", "rewards/digit_fraction/mean",
             "rewards/<lambda>/std", "component/<lambda>", "audit/<lambda>/mean", "time/step", "health/reward_gain_z",
             "multiturn/stop_max_turns_frac", "prompt_filter/skipped"]
    renamed = {"eval/pass@4": "eval/pass_at_4", "eval/maj@3": "eval/maj_at_3", "rewards/<lambda>/std":
               "rewards/_lambda_/std", "component/<lambda>": "component/_lambda_",
               "audit/<lambda>/mean": "audit/_lambda_/mean"}
    (tmp_path / "out").mkdir()
    tracker = Mlflow(tmp_path / "out", "names", {"learning_rate": 1e-3}, 0)
    tracker.log(1, {k: float(i) for i, k in enumerate(names)})
    tracker.finish()
    got = client.get_run(tracker.run_id).data.metrics
    assert got == {renamed.get(k, k): float(i) for i, k in enumerate(names)}


def test_mlflow_default_sqlite_store_without_sqlalchemy_names_the_fix(monkeypatch, tmp_path):
    """mlflow 3's default store, sqlite, needs SQLAlchemy, which mlflow-skinny lacks: the error names the
    full package and MLFLOW_TRACKING_URI (mlflow's own speaks of the model registry)."""
    import importlib.util

    from grouprl.trackers import Mlflow

    mlflow_client(monkeypatch, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"needs the full mlflow package: pip install 'grouprl\[mlflow\]'"):
        Mlflow(tmp_path, "x", {}, 0)


def test_mlflow_resume_of_a_run_the_store_lacks_is_an_error(monkeypatch, tmp_path):
    """output_dir/mlflow_run_id names a run the tracking store does not have (another store, a deleted
    run): an error naming the id and the fix, not a warning and a resumed run that logs nowhere."""
    mlflow_client(monkeypatch, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mlflow_run_id").write_text("0123456789abcdef0123456789abcdef\n")
    with pytest.raises(TrackerError, match=r"mlflow run 0123456789abcdef0123456789abcdef .* is not in the tracking "
                                           r"store .*delete .*mlflow_run_id"):
        RunLogger(out, resume_step=2, report_to=("mlflow",))


def test_a_tracker_run_id_is_written_whole_and_only_when_it_changes(tmp_path, monkeypatch):
    """It was truncated and rewritten at every start: a kill in between left an empty file, and wandb's next
    --resume failed ("Run ID cannot be empty"). Now it is renamed into place, and left alone when unchanged."""
    from grouprl import trackers

    path = tmp_path / "wandb_run_id"
    trackers._write_id(path, "abc123")
    assert path.read_text() == "abc123\n" and not list(tmp_path.glob(".*tmp"))
    written = path.stat().st_mtime_ns
    monkeypatch.setattr(type(path), "write_text", lambda *a, **k: pytest.fail("rewritten"))
    trackers._write_id(path, "abc123")
    assert path.stat().st_mtime_ns == written
