"""The `grouprl` command: train, eval, preflight and vllm-serve. `--help` prints this docstring after
its first paragraph.

    grouprl train                         the embedded default: the shipped policy learns addition
    grouprl train run.yaml --beta 0.04    a config file, with command-line overrides
    grouprl train run.yaml --resume       continue the run in output_dir from its latest checkpoint
    grouprl train run.yaml --resume auto  continue it if it has a checkpoint, else start it (a job a
                                          scheduler requeues runs the same command every time)
    grouprl eval run.yaml --model runs/x/checkpoints/step-000100/model
    grouprl eval --model runs/x/checkpoints/step-000100/model
                                          without a config file: the run's own runs/x/config.yaml
    grouprl preflight run.yaml [--prompts N] [--samples M] [--strict [SHARE]]
                                          sample the starting policy on N training prompts (64), M
                                          completions each (G; a multiple of G predicts larger G
                                          better), and report what GRPO would learn (preflight.py);
                                          --strict: exit 1 when fewer than SHARE (0.25) of groups teach
                                          (GRPO-style baselines; not with PPO or a teacher)
    grouprl train --help                  every config field with its documentation
    grouprl vllm-serve MODEL [--tensor-parallel-size K] [--host H] [--port P] [vLLM flags...]
                                          a vLLM server for vllm_mode: server (docs/vllm.md)

A first SIGTERM (preemption) or SIGINT (Ctrl-C) ends `grouprl train` after the current step with a
checkpoint, prints the command that continues the run, and exits with 128 + the signal's number
(143, 130); a second signal stops at once, without a checkpoint (one within 2 s of the first is
taken as the same request; signals.py).

Without a config file and without --model, --train_data, --eval_data or --reward_funcs, the
defaults are those of the embedded task (`grouprl.tasks.DEFAULT_TASK`); otherwise they are
`TrainConfig`'s own (cli_args.py turns the command line into a config).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

from grouprl.checkpoint import latest_checkpoint
from grouprl.cli_args import build_config, help_text, run_of_checkpoint
from grouprl.config import ConfigError, TrainConfig
from grouprl.config.io import absolute_paths
from grouprl.rewards import RewardFunctionError, SandboxUnavailableError
from grouprl.rollout.vllm_server import VLLMServerError
from grouprl.runlog import strict_json
from grouprl.signals import TrainingStopped, exit_code
from grouprl.trackers import TrackerError

USAGE = """grouprl train [CONFIG.yaml] [--field value ...] [--resume [auto]]
       grouprl eval  [CONFIG.yaml] [--field value ...]
       grouprl preflight [CONFIG.yaml] [--prompts N] [--samples M] [--strict [SHARE]] [--field value ...]
       grouprl vllm-serve MODEL [--tensor-parallel-size K] [--host H] [--port P] [vLLM flags ...]"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["vllm-serve"]:
        return vllm_serve(argv[1:])
    if argv[:1] in (["--version"], ["-V"]):
        from grouprl import __version__

        print(f"grouprl {__version__}")
        return 0
    parser = argparse.ArgumentParser(prog="grouprl", usage=USAGE, add_help=False)
    parser.add_argument("command", nargs="?", choices=("train", "eval", "preflight", "vllm-serve"))
    parser.add_argument("config", nargs="?")
    parser.add_argument("--resume", nargs="?", const=True, default=False)  # or "auto": resume if there is a checkpoint
    parser.add_argument("-h", "--help", action="store_true")
    checks = argparse.Namespace(prompts=64, samples=None, strict=None)
    if argv[:1] == ["preflight"]:  # its own options, taken first: `--prompts 8` must not become the config
        checks, argv = _preflight_options(argv)
    args, overrides = parser.parse_known_args(argv)
    if args.config is not None and args.config.startswith("--"):  # `grouprl train --beta 0`
        overrides.insert(0, args.config)
        args.config = None
    if isinstance(args.resume, str) and args.resume != "auto":  # `grouprl train --resume run.yaml`
        overrides.insert(0, args.resume)
        args.resume = True
    if args.config is None and overrides[:1] and overrides[0].endswith((".yaml", ".yml")):
        args.config = overrides.pop(0)  # `grouprl train --beta 0 run.yaml`: argparse left the file over
    if args.help or args.command is None:
        try:
            print(f"usage: {USAGE}\n\n{_help_body()}\n")
            if args.help:
                print(help_text(), flush=True)
        except BrokenPipeError:  # `grouprl train --help | head` stopped reading: not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 0 if args.help else 2
    notices = logging.getLogger("grouprl")  # grouprl's own notices: the sandbox in force, warnings
    if not any(isinstance(h, _StderrHandler) for h in notices.handlers):
        notices.addHandler(_StderrHandler(int(os.environ.get("RANK", "0") or 0)))
        notices.setLevel(logging.INFO)
    cfg = None
    try:
        run = run_of_checkpoint(overrides) if args.command == "eval" and args.config is None else None
        if run is not None:  # `grouprl eval --model RUN/checkpoints/step-N/model`: the run's own config
            args.config, overrides = str(run / "config.yaml"), ["--output_dir", str(run), *overrides]
        cfg = build_config(args.config, overrides, command=args.command,
                           options=PREFLIGHT_OPTIONS if args.command == "preflight" else ())
        if not (cfg.progress and sys.stderr.isatty()):
            _no_library_bars()
        if args.command == "train":
            return _train(cfg, resume=args.resume, again=resume_command(argv))
        if args.command == "preflight":
            return _preflight(cfg, checks.prompts, checks.samples, checks.strict)
        return _eval(cfg, found_config=None if run is None else args.config)
    except (ConfigError, ValueError, FileNotFoundError, SandboxUnavailableError, TrackerError) as e:
        print(f"grouprl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except VLLMServerError as e:
        print(f"grouprl {args.command}: error: {e}\nThe run stopped. Start the server again (grouprl vllm-serve), "
              f"then {_again(cfg, resume_command(argv), args.command)}", file=sys.stderr)
        return 1
    except RewardFunctionError as e:
        if e.__cause__ is not None:  # what the function raised, with its own frames (a worker's as a note)
            traceback.print_exception(e.__cause__, file=sys.stderr)
        print(f"grouprl {args.command}: error: {e}\nThe run stopped. Fix the reward function (or set reward_fallback "
              f"to score failures with a fixed value), then {_again(cfg, resume_command(argv), args.command)}",
              file=sys.stderr)
        return 1
    except Exception as e:  # out of memory in eval or preflight (train reports its own: _train)
        from grouprl.memory import is_out_of_memory, out_of_memory_advice

        if cfg is None or not is_out_of_memory(e):
            raise
        stage = "eval" if args.command == "eval" else "generate"  # preflight samples a step's groups
        print(f"grouprl {args.command}: error: {out_of_memory_advice(stage, cfg)}\nThe error: {_first_line(e)}\n"
              f"The run stopped; {_again(cfg, resume_command(argv), args.command)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # a second signal during training (StopNow), or Ctrl-C outside it
        signum = getattr(e, "signum", signal.SIGINT)
        hint = (f"; checkpoints written before are intact, and this continues from the latest:\n  "
                f"{resume_command(argv)}" if cfg is not None and latest_checkpoint(cfg.output_dir) is not None
                else f"; {_start_over(cfg, resume_command(argv))}")
        print(f"grouprl {args.command}: stopped at once by {signum.name}, without a checkpoint"
              f"{hint if args.command == 'train' else ''}", file=sys.stderr)
        return exit_code(signum)


def _again(cfg: TrainConfig | None, resume: str, command: str) -> str:
    """What to run once the cause of a stop is fixed: `resume`, the command that continues the run,
    when it wrote a checkpoint."""
    if command != "train":
        return "run the same command again."
    if cfg is not None and latest_checkpoint(cfg.output_dir) is not None:
        return f"continue from the latest checkpoint (the checkpoints written are intact):\n  {resume}"
    return _start_over(cfg, resume) + "."


def _start_over(cfg: TrainConfig | None, resume: str) -> str:
    """How to start again a run that wrote no checkpoint: the same command, unless it logged steps, whose
    metrics.jsonl makes a new run refuse the folder; then with --resume auto, which starts it over and
    keeps those rows aside (prepare_output_dir)."""
    if cfg is None or not (Path(cfg.output_dir) / "metrics.jsonl").is_file():
        return "the run wrote no checkpoint: run the same command again to start over"
    over = resume if re.search(r"--resume(=| )auto\b", resume) else f"{resume} auto"
    return (f"the run wrote no checkpoint, and it logged steps, kept aside in metrics.jsonl.lost when it starts "
            f"over with:\n  {over}")


def disk_full(error: BaseException) -> BaseException | None:
    """The error that says a write found no space (ENOSPC, or EDQUOT: a quota) in `error`'s chain, or
    None: an OSError; or safetensors' error, which quotes the OS's ("(os error 28)"). torch's file
    writer reports no errno: written through a Python file, its error carries that file's OSError
    (checkpoint.write_loop_state)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return error
        if any(f"(os error {n})" in str(error) for n in (errno.ENOSPC, errno.EDQUOT)):
            return error
        error = error.__cause__ or error.__context__
    return None


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__


def _help_body() -> str:
    """This module's docstring without its first paragraph (which describes the module, not the command)."""
    return __doc__.strip().split("\n\n", 1)[1]


class _StderrHandler(logging.Handler):
    """Prints a record to the sys.stderr of the moment (not the one at import). Under torchrun the
    notices (INFO) come from rank 0 alone, once rather than once a rank; another rank's warnings are
    printed, marked with its rank."""

    def __init__(self, rank: int = 0):
        super().__init__(logging.INFO if rank == 0 else logging.WARNING)
        self.prefix = "grouprl: " if rank == 0 else f"grouprl (rank {rank}): "

    def emit(self, record: logging.LogRecord) -> None:
        print(f"{self.prefix}{record.getMessage()}", file=sys.stderr)


def _train(cfg: TrainConfig, *, resume: bool | str, again: str) -> int:
    """`again`: the command that continues this run, printed if a signal stops it."""
    from grouprl.data import DataError
    from grouprl.distributed import barrier, destroy_distributed, init_distributed
    from grouprl.memory import checkpoint_mode, is_out_of_memory, out_of_memory_advice
    from grouprl.trainer import Trainer
    from grouprl.training_state import prepare_output_dir

    ctx = init_distributed(cfg.ddp_timeout)  # under torchrun: one process group for the run (docs/distributed.md)
    trainer, stopped = None, None
    try:
        resume = prepare_output_dir(cfg, ctx, resume)  # a run's folder, --resume of none: before a model loads
        trainer = Trainer(cfg)
        try:
            summary = trainer.train(resume=resume)
        except TrainingStopped as e:  # every rank stopped after the same step
            stopped = e
        except ValueError as e:  # a fault while training (an environment's, a parser's): its traceback, exit 1
            if isinstance(e, (ConfigError, DataError)):  # not main's one-line "error:" of a wrong setting
                raise
            raise RuntimeError(f"the run stopped on {type(e).__name__} while training (the traceback above shows "
                               f"where): {e}") from e
        # every rank tears its process group down together: a gloo rank that left while rank 0 still
        # wrote the summary was seen to hang the other at exit (once in three full test runs)
        barrier(ctx)
    except Exception as e:
        if (full := disk_full(e)) is not None:  # the save's partial folder is gone (checkpoint.save_checkpoint)
            rank = f" (rank {ctx.rank})" if ctx.world_size > 1 else ""
            print(f"grouprl train: error{rank}: the disk is full: free space on the disk of output_dir="
                  f"{str(cfg.output_dir)!r} (checkpoints, logs), or on the one the error names\nThe error: "
                  f"{_first_line(full)}\nThe run stopped; {_again(cfg, again, 'train')}", file=sys.stderr)
            return 1
        if not is_out_of_memory(e):
            raise
        budget = trainer.updater.planner.budget(cfg) if trainer is not None else None
        advice = out_of_memory_advice(getattr(e, "grouprl_stage", None), cfg, budget=budget,
                                      checkpointing=checkpoint_mode(cfg.gradient_checkpointing, ctx.device))
        rank = f" (rank {ctx.rank})" if ctx.world_size > 1 else ""
        print(f"grouprl train: error{rank}: {advice}\nThe error: {_first_line(e)}\nThe run stopped; "
              f"{_again(cfg, again, 'train')}", file=sys.stderr)
        return 1
    finally:
        if trainer is not None:
            trainer.close()  # before the process group goes: vLLM tears its groups down with it
        trainer = None  # its DDP/FSDP wrappers hold the group: destroy_distributed collects them first
        destroy_distributed()
    if stopped is not None:
        if ctx.is_main:
            print(f"grouprl train: stopped by {stopped.reason} after step {stopped.step}; checkpoint "
                  f"{stopped.checkpoint}\ncontinue with:\n  {again}", file=sys.stderr)
        return stopped.code
    if ctx.is_main:
        print(_summary_text(summary, cfg.output_dir))
    return 0


def _no_library_bars() -> None:
    """Where the run shows no live bar (progress false, or output to a file), the libraries' bars go too:
    transformers' "Loading weights" and "Writing model shards", the hub's downloads, datasets' maps. In a
    job's log each is a line of carriage returns."""
    import datasets
    import huggingface_hub
    import transformers

    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
    datasets.utils.logging.disable_progress_bar()


def resume_command(argv: list[str]) -> str:
    """The command that continues this run: its own arguments with --resume, under torchrun with the
    launcher (one machine: its exact command; several: the flags each machine was started with)."""
    auto = any(a == "--resume=auto" or a == "--resume" and b == "auto" for a, b in zip(argv, [*argv[1:], ""]))
    args = shlex.join(argv if auto else [*[a for a in argv if a != "--resume"], "--resume"])  # auto resumes too
    world, local = os.environ.get("WORLD_SIZE", "1"), os.environ.get("LOCAL_WORLD_SIZE", "1")
    if world == "1":
        return f"grouprl {args}"
    if world == local:
        return f"torchrun --nproc-per-node {local} -m grouprl {args}"
    return f"torchrun <this run's flags, on every machine> -m grouprl {args}"


def _eval(cfg: TrainConfig, *, found_config: str | None = None) -> int:
    """`found_config`: the run's config.yaml, found from --model's checkpoint when no config file was given."""
    from grouprl.evaluation import accuracy_reward_name
    from grouprl.trainer import Trainer

    if not cfg.eval_data and not cfg.eval_fraction:
        raise ConfigError("grouprl eval needs an eval set: set eval_data (or eval_fraction)")
    from grouprl.data import load_prompts, reward_readers
    from grouprl.distributed import barrier, destroy_distributed, init_distributed

    ctx = init_distributed(cfg.ddp_timeout)
    if found_config is not None and ctx.is_main:
        print(f"config: {found_config} (the run that holds --model's checkpoint); eval.json goes to "
              f"{cfg.output_dir}", flush=True)
    trainer = None
    try:
        # eval reads no train_data (the eval set, loaded once under its own name, stands in for it), and logs
        # to no tracker (a run's wandb need not be on the machine that evaluates); nor does it draw training
        # prompts: a run trained with B=3 is evaluated on 2 ranks all the same. It samples from the policy
        # alone: no reference copy (beta) and no teacher (distillation), which need not be on that machine
        given = {}
        if cfg.eval_data:
            rows = load_prompts(cfg.eval_data, prompt_column=cfg.prompt_column, name="eval_data",
                                reward_funcs=reward_readers(cfg))
            given = {"train_dataset": rows, "eval_dataset": rows}
        trainer = Trainer(replace(cfg, report_to=[], prompts_per_step=cfg.prompts_per_step * ctx.world_size,
                                  beta=0.0, teacher_model=None, distill_coef=0.0, distill_reward_coef=1.0), **given)
        result = trainer.evaluate()
        accuracy = accuracy_reward_name(cfg.accuracy_reward, trainer.reward_names)
        barrier(ctx)  # every rank tears the process group down together, as _train does
    finally:
        if trainer is not None:
            trainer.close()
        trainer = None  # see _train
        destroy_distributed()
    if ctx.is_main:
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        where = absolute_paths({"model": cfg.model, "eval_data": cfg.eval_data, "train_data": cfg.train_data})
        scored = {"model": where["model"],  # which model, on what (absolute: evals run from any folder compare)
                  "eval_data": where["eval_data"] or f"{where['train_data']} (eval_fraction {cfg.eval_fraction})"}
        (out / "eval.json").write_text(strict_json({**scored, **result}, indent=2) + "\n")  # the latest
        with open(out / "evals.jsonl", "a") as f:  # every eval into this folder, in order: none is lost
            f.write(strict_json({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **scored, **result}) + "\n")
        print(_eval_table(result, cfg, accuracy))
        print(f"written to {out / 'eval.json'} (and appended to {out / 'evals.jsonl'})")
    return 0


def _eval_table(result: dict, cfg: TrainConfig, accuracy: str) -> str:
    """The eval metrics first (greedy accuracy as `greedy`), then rewards and lengths; `accuracy`: the
    reward function they are read from."""
    n = cfg.num_generations_eval
    first = [("greedy" if m == "greedy" else f"{m} (n={n})", result["accuracy" if m == "greedy" else m])
             for m in cfg.eval_metrics]
    rest = [(k, v) for k, v in result.items() if k.startswith("rewards/") or k in ("reward_mean", "length_mean")]
    width = max(len(k) for k, _ in first + rest)
    why = "" if cfg.accuracy_reward else " (the first reward function; accuracy_reward names another)"
    lines = [f"{result['num_samples']} prompts, accuracy reward {accuracy}{why}"]
    lines += [f"{k:<{width}}  {v:.4f}" for k, v in first + rest]
    return "\n".join(lines)


STRICT_SHARE = 0.25  # `--strict` alone: the share of groups that must teach
PREFLIGHT_OPTIONS = ("prompts", "samples", "strict")  # preflight's own flags, besides the config fields


def _preflight_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """`--prompts N`, `--samples M` and `--strict [SHARE]` (PREFLIGHT_OPTIONS) out of a preflight command
    line; the rest is left."""
    parser = argparse.ArgumentParser(prog="grouprl preflight", add_help=False, allow_abbrev=False)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int)
    parser.add_argument("--strict", type=float, nargs="?", const=STRICT_SHARE)
    return parser.parse_known_args([f"--strict={STRICT_SHARE}" if a == "--strict" and not _is_number(b) else a
                                    for a, b in zip(argv, [*argv[1:], ""])])  # `--strict run.yaml`: the default


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _preflight(cfg: TrainConfig, num_prompts: int, samples: int | None, strict: float | None) -> int:
    from grouprl.distributed import barrier, destroy_distributed, init_distributed
    from grouprl.preflight import check_counts, strict_failure, table
    from grouprl.trainer import Trainer

    check_counts(num_prompts, samples, cfg.num_generations)  # before a model loads
    if strict is not None and not 0 <= strict <= 1:
        raise ConfigError(f"--strict {strict}: the share of groups that must teach is between 0 and 1 "
                          "(default 0.25)")
    ctx = init_distributed(cfg.ddp_timeout)  # under torchrun every rank samples its share of the prompts
    trainer = None
    try:
        trainer = Trainer(replace(cfg, report_to=[]))  # preflight logs to no tracker
        report = trainer.preflight(num_prompts, samples)
        barrier(ctx)  # every rank tears the process group down together, as _train does
    finally:
        if trainer is not None:
            trainer.close()
        trainer = None  # see _train
        destroy_distributed()
    if ctx.is_main:
        print(table(report))
        out = Path(cfg.output_dir)
        print(f"written to {out / 'preflight.json'} and {out / 'preflight.png'}")
    failure = None if strict is None else strict_failure(report, strict)
    if failure is not None:
        if ctx.is_main:
            print(f"grouprl preflight: error: {failure}", file=sys.stderr)
        return 1
    return 0


def vllm_serve(argv: list[str]) -> int:
    """Run vLLM's OpenAI server with grouprl's weight-update extension. This process becomes the
    server (exec): a signal to it stops the server. Flags it does not know go to vLLM (`--dtype`,
    `--data-parallel-size`, `--enforce-eager`, ...)."""
    from grouprl.policy import ADAPTER_CONFIG, check_model_source, resolve_model_path
    from grouprl.rollout.vllm_server import serve_command

    parser = argparse.ArgumentParser(prog="grouprl vllm-serve", description=vllm_serve.__doc__)
    parser.add_argument("model", help="the model the trainer starts from, named as `train` names it: a folder, "
                        "builtin:default_policy, a .gguf file, or a hub id")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other nodes (a private network: "
                        "the server's /collective_rpc runs code the extension defines)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--weight-transfer", choices=("auto", "gloo", "nccl", "file"), default="auto",
                        help="how the trainer's weights arrive: vLLM's weight-transfer engine in memory (auto: nccl "
                        "with a GPU, gloo without) or only as files (file); the trainer's vllm_weight_transfer: "
                        "auto follows it")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="serve LoRA adapters up to this rank, loaded at run time: a trainer with lora_r > 0 "
                        "(and vllm_lora_sync: adapter, the default) then sends only its adapter each step")
    args, extra = parser.parse_known_args(argv)
    try:
        folder, gguf_file = check_model_source(args.model, None, None)
        model = resolve_model_path(folder)
    except (ConfigError, ValueError) as e:
        print(f"grouprl vllm-serve: error: {e}", file=sys.stderr)
        return 2
    if gguf_file is not None or (Path(model) / ADAPTER_CONFIG).is_file():  # vLLM reads no GGUF, and leaves an
        model = _plain_model_folder(model, gguf_file)  # adapter out: the trainer's start, as a plain folder
    if not any(f == "--dtype" or f.startswith("--dtype=") for f in extra) and _checkpoint_dtype(model) == "float32":
        print("grouprl vllm-serve: the checkpoint is float32 and vLLM samples it in its default dtype (bfloat16 or "
              "float16), while the trainer computes in float32 unless it autocasts to bf16: pass --dtype float32 to "
              "sample in the trainer's precision (otherwise the importance-sampling correction absorbs the "
              "mismatch; see is/* in the metrics)", file=sys.stderr)
    cmd, env = serve_command(model, host=args.host, port=args.port,
                             tensor_parallel_size=args.tensor_parallel_size, extra=tuple(extra),
                             weight_transfer=args.weight_transfer, lora_rank=args.lora_rank)
    os.execve(cmd[0], cmd, env)


def _plain_model_folder(folder: str, gguf_file: str | None) -> str:
    """The trainer's start as vLLM can serve it, with its tokenizer, written once as a safetensors folder
    in the temporary directory: a GGUF model dequantized by transformers, as the trainer loads it (found
    again by the file's path, size and time); with no `gguf_file`, a folder holding a PEFT adapter, which
    vLLM would leave out, as its base with the adapter merged (policy.load_policy; found again by its
    adapter_config.json)."""
    import hashlib
    import tempfile

    from grouprl.checkpoint import save_model_folder
    from grouprl.config import TrainConfig
    from grouprl.policy import ADAPTER_CONFIG, load_policy, policy_tokenizer

    file = Path(folder, gguf_file or ADAPTER_CONFIG).resolve()
    stat = file.stat()
    key = hashlib.sha256(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    name = file.stem if gguf_file else file.parent.name
    out = Path(tempfile.gettempdir()) / f"grouprl-vllm-serve-{name}-{key}"
    if not (out / "COMPLETE").is_file():
        what = "vLLM reads no GGUF file: dequantizing" if gguf_file else "vLLM would leave the adapter out: merging"
        print(f"grouprl vllm-serve: {what} {file.parent if gguf_file is None else file} to {out} (once)",
              file=sys.stderr)
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        save_model_folder(load_policy(folder, gguf_file=gguf_file), work)
        policy_tokenizer(TrainConfig(model=folder, gguf_file=gguf_file)).save_pretrained(work)
        (work / "COMPLETE").write_text("1\n")
        try:
            work.rename(out)  # renamed into place only complete: a folder there is never replaced
        except OSError:  # another vllm-serve of the file finished first (its server may be reading it)
            if not (out / "COMPLETE").is_file():  # not a finished folder: what an older version left
                shutil.rmtree(out, ignore_errors=True)
                with contextlib.suppress(OSError):  # (another server's, clearing the same leftover, may win)
                    work.rename(out)
            shutil.rmtree(work, ignore_errors=True)  # when ours did not go in
    return str(out)


def _checkpoint_dtype(model: str) -> str | None:
    """The dtype a local checkpoint's config.json declares (None if it says none or is not local)."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    declared = json.loads(config.read_text())
    return declared.get("dtype") or declared.get("torch_dtype")


def _summary_text(summary: dict, output_dir: str) -> str:
    seconds = summary["train_seconds"]
    lines = [f"done: {summary['steps']} steps in {seconds:.{0 if seconds >= 10 else 1}f} s of training"]
    before, after = summary.get("eval_before"), summary.get("eval_after")
    if before and after:
        gain = 100 * (after["accuracy"] - before["accuracy"])
        lines.append(f"greedy eval accuracy: {100 * before['accuracy']:.1f}% -> "
                     f"{100 * after['accuracy']:.1f}% ({gain:+.1f} points)")
    lines.append(f"written to {output_dir}: {folder_listing(Path(output_dir))}")
    return "\n".join(lines)


def folder_listing(folder: Path) -> str:
    """What `folder` holds, as named in the last line of a run: files, then folders (with a slash),
    each sorted; hidden entries (temporary files) left out."""
    entries = [p for p in folder.iterdir() if not p.name.startswith(".")]
    files = sorted(p.name for p in entries if not p.is_dir())
    return ", ".join(files + sorted(f"{p.name}/" for p in entries if p.is_dir()))
