"""`grouprl train | eval`.

    grouprl train                         the embedded default: the shipped policy learns addition
    grouprl train run.yaml --beta 0.04    a config file, with command-line overrides
    grouprl train run.yaml --resume       continue the run in output_dir from its latest checkpoint
    grouprl eval run.yaml --model runs/x/checkpoints/step-000100/model
    grouprl train --help                  every config field with its documentation
    grouprl vllm-serve MODEL [--tensor-parallel-size K] [--host H] [--port P] [vLLM flags...]
                                          a vLLM server for vllm_mode: server (docs/vllm.md)

Without a config file and without --model, --train_data, --eval_data or --reward_funcs, the
defaults are those of the embedded task (`grouprl.tasks.DEFAULT_TASK`); otherwise they are
`TrainConfig`'s own (cli_args.py turns the command line into a config).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import replace

from grouprl.cli_args import build_config, help_text
from grouprl.config import ConfigError, TrainConfig
from grouprl.rewards import RewardFunctionError, SandboxUnavailableError
from grouprl.rollout.vllm_server import VLLMServerError

USAGE = """grouprl train [CONFIG.yaml] [--field value ...] [--resume]
       grouprl eval  [CONFIG.yaml] [--field value ...]
       grouprl vllm-serve MODEL [--tensor-parallel-size K] [--host H] [--port P] [vLLM flags ...]"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["vllm-serve"]:
        return vllm_serve(argv[1:])
    parser = argparse.ArgumentParser(prog="grouprl", usage=USAGE, add_help=False)
    parser.add_argument("command", nargs="?", choices=("train", "eval"))
    parser.add_argument("config", nargs="?")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    if args.config is not None and args.config.startswith("--"):  # `grouprl train --beta 0`
        overrides.insert(0, args.config)
        args.config = None
    if args.help or args.command is None:
        try:
            print(f"usage: {USAGE}\n\n{__doc__.strip()}\n")
            if args.help:
                print(help_text(), flush=True)
        except BrokenPipeError:  # `grouprl train --help | head` stopped reading: not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 0 if args.help else 2
    notices = logging.getLogger("grouprl")  # grouprl's own notices: the sandbox in force, warnings
    if not any(isinstance(h, _StderrHandler) for h in notices.handlers):
        notices.addHandler(_StderrHandler())
        notices.setLevel(logging.INFO)
    try:
        cfg = build_config(args.config, overrides)
        if args.command == "train":
            return _train(cfg, resume=args.resume)
        return _eval(cfg)
    except (ConfigError, ValueError, FileNotFoundError, SandboxUnavailableError) as e:
        print(f"grouprl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except VLLMServerError as e:
        print(f"grouprl {args.command}: error: {e}\nThe run stopped; the checkpoints it wrote are intact. Start "
              "the server again (grouprl vllm-serve), then run again; --resume continues from the last checkpoint.",
              file=sys.stderr)
        return 1
    except RewardFunctionError as e:
        print(f"grouprl {args.command}: error: {e}\nThe run stopped; its checkpoints are intact. Fix the "
              "reward function (or set reward_fallback to score failures with a fixed value) and "
              "continue with --resume.", file=sys.stderr)
        return 1


class _StderrHandler(logging.Handler):
    """Prints a record to the sys.stderr of the moment (not the one at import)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"grouprl: {record.getMessage()}", file=sys.stderr)


def _train(cfg: TrainConfig, *, resume: bool) -> int:
    from grouprl.distributed import barrier, destroy_distributed, init_distributed
    from grouprl.trainer import Trainer

    ctx = init_distributed()  # under torchrun: one process group for the run (docs/distributed.md)
    trainer = None
    try:
        trainer = Trainer(cfg)
        summary = trainer.train(resume=resume)
        # every rank tears its process group down together: a gloo rank that left while rank 0 still
        # wrote the summary was seen to hang the other at exit (once in three full test runs)
        barrier(ctx)
    finally:
        if trainer is not None:
            trainer.close()  # before the process group goes: vLLM tears its groups down with it
        destroy_distributed()
    if ctx.is_main:
        print(_summary_text(summary, cfg.output_dir))
    return 0


def _eval(cfg: TrainConfig) -> int:
    from grouprl.trainer import Trainer

    if not cfg.eval_data and not cfg.eval_fraction:
        raise ConfigError("grouprl eval needs an eval set: set eval_data (or eval_fraction)")
    from grouprl.distributed import destroy_distributed, init_distributed

    ctx = init_distributed()
    trainer = None
    try:
        trainer = Trainer(replace(cfg, train_data=cfg.train_data or cfg.eval_data))
        result = trainer.evaluate()
    finally:
        if trainer is not None:
            trainer.close()
        destroy_distributed()
    if ctx.is_main:
        print(json.dumps(result, indent=2))
    return 0


def vllm_serve(argv: list[str]) -> int:
    """Run vLLM's OpenAI server with grouprl's weight-update extension. This process becomes the
    server (exec): a signal to it stops the server. Flags it does not know go to vLLM (`--dtype`,
    `--data-parallel-size`, `--enforce-eager`, ...)."""
    from grouprl.rollout.vllm_server import serve_command

    parser = argparse.ArgumentParser(prog="grouprl vllm-serve", description=vllm_serve.__doc__)
    parser.add_argument("model", help="checkpoint directory or hub id: the model the trainer starts from")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other nodes (a private network: "
                        "the server's /collective_rpc runs code the extension defines)")
    parser.add_argument("--port", type=int, default=8000)
    args, extra = parser.parse_known_args(argv)
    cmd, env = serve_command(args.model, host=args.host, port=args.port,
                             tensor_parallel_size=args.tensor_parallel_size, extra=tuple(extra))
    os.execve(cmd[0], cmd, env)


def _summary_text(summary: dict, output_dir: str) -> str:
    lines = [f"done: {summary['steps']} steps in {summary['train_seconds']:.0f} s of training"]
    before, after = summary.get("eval_before"), summary.get("eval_after")
    if before and after:
        gain = 100 * (after["accuracy"] - before["accuracy"])
        lines.append(f"greedy eval accuracy: {100 * before['accuracy']:.1f}% -> "
                     f"{100 * after['accuracy']:.1f}% ({gain:+.1f} points)")
    lines.append(f"written to {output_dir}: metrics.jsonl, summary.json, curves.png, checkpoints/")
    return "\n".join(lines)
