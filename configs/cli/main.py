"""The `toolgym` command line: argument parsing and dispatch only; each command's work is a
function in this package (rollout.py: envs, record, eval; recordings.py: replay, export, import;
view.py; serve.py; train.py), or a library call (`plot`: trainers/plots.py).

    toolgym train                                  # the CPU demo (configs/zorplex_tiny.toml)
    toolgym train sum_digits_tiny --set run.steps=20 --set trainer.optimizer.lr=3e-4
    toolgym train my_config.toml --print-config    # the resolved config, nothing runs
    toolgym train --resume runs/zorplex_tiny-20250101-120000
    torchrun --nproc_per_node=2 -m toolgym.configs.cli train zorplex_tiny
    toolgym plot runs/zorplex_tiny-20250101-120000
    toolgym train my.toml --env-module mypkg.bank_env  # or [env] module = "mypkg.bank_env"
    toolgym envs --env-module mypkg.bank_env
    toolgym record --env toolgym/Zorplex-v0 --env-kwargs '{"tier": "simple"}' --policy oracle \\
        --tasks 64 --group-size 4 --out runs/oracle.jsonl
    toolgym replay runs/oracle.jsonl --verify --limit 3
    toolgym eval --env toolgym/Zorplex-v0 --policy runs/ckpt/hf --tasks 64
    toolgym view runs/zorplex_tiny-20250101-120000   # or a recording; a page on 127.0.0.1:8765
    toolgym export runs/oracle.jsonl --out chat.jsonl  # OpenAI chat-messages JSONL
    toolgym import chat.jsonl --out demos.jsonl      # SFT data ([sft] source = "recording")
    toolgym serve --policy runs/x/final_model --record captures.jsonl  # OpenAI API on 127.0.0.1

A subcommand is a function `add_<name>(subparsers)` in `SUBCOMMANDS` that adds its parser and
sets `func` (args -> exit code). A command's modules (torch, gymnasium, uvicorn and the library
behind them) are imported inside `func` when it runs, not here: `toolgym --help` and a mistyped
argument answer without loading them.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console

from ...rollouts.types import PolicySampling, RolloutSettings

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer.json"


def _tokenizer(value: str) -> str:
    """A `--tokenizer` value: a tokenizer.json path, or a shipped tokenizer's name (`copy`)."""
    from ..load import tokenizer_file

    return str(tokenizer_file(value))


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f'expected a JSON object like \'{{"tier": "simple"}}\', got {text!r}'
        )
    return value


def _add_policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--env", required=True, help="a registered env id, e.g. toolgym/Zorplex-v0 (see `toolgym envs`)"
    )
    p.add_argument("--env-kwargs", type=_json_object, default={}, help="JSON object of env keyword arguments")
    _add_env_module_arg(p)
    p.add_argument("--policy", default="oracle", help="'oracle' or a Hugging Face checkpoint directory")
    p.add_argument(
        "--tokenizer", type=_tokenizer, default=str(DEFAULT_TOKENIZER), help="tokenizer.json (default: the shipped one)"
    )
    p.add_argument(
        "--chat-template",
        default="",
        help="render with this tokenizer_config.json's or .jinja file's chat template, or a shipped one's "
        "name (qwen2.5-style); default: plain ChatML",
    )
    oracle = p.add_argument_group("oracle knobs (with --policy oracle)")
    oracle.add_argument("--p-omit-tag", type=float, default=0.0, help="state the answer without the env's answer format")
    oracle.add_argument(
        "--p-skip-lookup", type=float, default=0.0, help="guess without calling tools (wrong)"
    )
    oracle.add_argument(
        "--p-malformed-call", type=float, default=0.0, help="per call: a malformed call first"
    )
    oracle.add_argument(
        "--p-stop-early", type=float, default=0.0, help="stop one call short and guess (wrong)"
    )
    limits = p.add_argument_group("rollout limits and sampling (defaults: RolloutSettings', PolicySampling's)")
    for flag, (owner, field) in _SETTING_FLAGS.items():
        info = next(f for f in msgspec.structs.fields(owner) if f.name == field)
        kind, choices = _flag_type(info.type)
        limits.add_argument(
            flag, dest=field, type=kind, choices=choices, default=info.default, help=_SETTING_HELP.get(field)
        )
    limits.add_argument("--seed", type=int, default=0, help="sampling seed (and the task stream for record)")


def _chat_template(value: str) -> str:
    from ..load import chat_template_path  # lazy: see the module doc

    return chat_template_path(value)


def _add_env_module_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--env-module",
        dest="env_modules",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (it registers your envs with gymnasium); repeatable",
    )


# Flags that set a field of the one declaration of the rollout settings (RolloutSettings) and of the
# sampling (PolicySampling); each flag's type and default come from that field.
_SETTING_FLAGS: dict[str, tuple[type[msgspec.Struct], str]] = {
    "--max-turns": (RolloutSettings, "max_turns"),
    "--max-tokens-per-turn": (RolloutSettings, "max_tokens_per_turn"),
    "--max-tokens-per-episode": (RolloutSettings, "max_tokens_per_episode"),
    "--context-length": (RolloutSettings, "context_length"),
    "--timeout": (RolloutSettings, "episode_timeout_s"),
    "--observation-role": (RolloutSettings, "observation_role"),
    "--temperature": (PolicySampling, "temperature"),
    "--top-p": (PolicySampling, "top_p"),
    "--top-k": (PolicySampling, "top_k"),
}
_SETTING_HELP = {
    "context_length": "default: the model's",
    "episode_timeout_s": "wall-clock seconds per episode",
}


def _flag_type(annotation: Any) -> tuple[Any, list[Any] | None]:
    """(argparse type, choices) of a field's annotation: `int | None` -> int, a Literal -> its values."""
    options = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if typing.get_origin(annotation) is typing.Literal:
        options = [annotation]
    if typing.get_origin(options[0]) is typing.Literal:
        values = list(typing.get_args(options[0]))
        return type(values[0]), values
    return options[0], None


def _rollout_config(args: argparse.Namespace, group_size: int) -> Any:
    from ...rollouts.episode.config import EnvRolloutConfig  # lazy: see the module doc

    given = vars(args)

    def fields(owner: type[msgspec.Struct]) -> dict[str, Any]:
        return {field: given[field] for flag, (cls, field) in _SETTING_FLAGS.items() if cls is owner}

    return EnvRolloutConfig.build(
        RolloutSettings(group_size=group_size, **fields(RolloutSettings)),
        env_id=args.env,
        env_kwargs=args.env_kwargs,
        sampling=PolicySampling(**fields(PolicySampling)),
        seed=args.seed,
    )


def _oracle_config(args: argparse.Namespace) -> Any:
    from ...rollouts.scripted import OracleConfig  # lazy: see the module doc

    return OracleConfig(
        p_omit_tag=args.p_omit_tag,
        p_skip_lookup=args.p_skip_lookup,
        p_malformed_call=args.p_malformed_call,
        p_stop_early=args.p_stop_early,
    )


# ---- subcommands --------------------------------------------------------------------------------


def add_envs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "envs", help="list the registered envs (toolgym's, --env-module's) and their default arguments"
    )
    _add_env_module_arg(p)

    def run(args: argparse.Namespace) -> int:
        from .rollout import envs_command

        return envs_command(Console(), env_modules=args.env_modules)

    p.set_defaults(func=run)


def add_record(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("record", help="roll out a policy and append the episodes to a JSONL recording")
    _add_policy_args(p)
    p.add_argument("--tasks", type=int, required=True, help="number of task seeds (from the training stream)")
    p.add_argument("--group-size", type=int, default=1, help="episodes per task seed")
    p.add_argument("--out", required=True, help="recording file (appended to if it exists)")
    p.add_argument(
        "--start", type=int, default=None, help="first task index (default: after the file's last)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    def run(args: argparse.Namespace) -> int:
        from .rollout import record_command

        return record_command(
            Console(),
            _rollout_config(args, args.group_size),
            args.policy,
            _oracle_config(args),
            args.tokenizer,
            args.out,
            args.tasks,
            stream=args.seed,
            start=args.start,
            progress=not args.no_progress,
            env_modules=args.env_modules,
            chat_template=_chat_template(args.chat_template),
        )

    p.set_defaults(func=run)


def add_replay(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="show a recording as transcripts and a summary; --verify re-runs it")
    p.add_argument("file")
    p.add_argument("--verify", action="store_true", help="re-run every episode's actions in a fresh env")
    p.add_argument("--limit", type=int, default=None, help="show only the first K transcripts")
    p.add_argument("--summary-only", action="store_true", help="no transcripts")
    p.add_argument(
        "--tokenizer", type=_tokenizer, default=str(DEFAULT_TOKENIZER), help="the tokenizer the file was recorded with"
    )
    _add_env_module_arg(p)  # a recording imports nothing itself: --verify makes only these envs
    p.add_argument(
        "--rejudge",
        metavar="URL",
        help="ask this OpenAI-compatible judge the recorded judge's rubric again and report agreement",
    )
    p.add_argument("--judge-model", default=None, help="with --rejudge: its model (default: the one it lists)")
    p.add_argument(
        "--judge-key-env", default=None, help="with --rejudge: the NAME of the variable holding its API key"
    )
    p.add_argument("--judge-mode", choices=("episode", "group"), default=None, help="default: the recorded mode")
    p.add_argument(
        "--judge-cache", metavar="FILE", default=None, help="with --rejudge: its answers cache (default: the recorded one)"
    )

    def run(args: argparse.Namespace) -> int:
        from .recordings import rejudge_command, replay_command

        if args.rejudge:
            return rejudge_command(
                Console(), args.file, args.rejudge, args.judge_model, args.judge_key_env, args.judge_mode,
                args.judge_cache,
            )  # fmt: skip
        return replay_command(
            Console(),
            args.file,
            args.tokenizer,
            verify=args.verify,
            limit=args.limit,
            show=not args.summary_only,
            env_modules=args.env_modules,
        )

    p.set_defaults(func=run)


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a policy on the fixed held-out task seeds (greedy by default)")
    _add_policy_args(p)
    p.add_argument("--tasks", type=int, default=64, help="number of held-out task seeds")
    p.add_argument("--sample", action="store_true", help="sample with --temperature instead of greedy")
    p.add_argument("--samples-per-task", type=int, default=1, help="with --sample")
    p.add_argument("--examples", type=int, default=3, help="example transcripts to print")
    p.add_argument("--out", default=None, help="also write the metrics as JSON here")

    def run(args: argparse.Namespace) -> int:
        from ...rollouts.evaluation import EvalConfig
        from .rollout import eval_command

        config = EvalConfig(
            num_tasks=args.tasks,
            greedy=not args.sample,
            samples_per_task=args.samples_per_task,
            num_examples=args.examples,
        )
        return eval_command(
            Console(),
            _rollout_config(args, 1),
            args.policy,
            _oracle_config(args),
            args.tokenizer,
            config,
            args.out,
            env_modules=args.env_modules,
            chat_template=_chat_template(args.chat_template),
        )

    p.set_defaults(func=run)


def presets_help() -> str:
    """Every shipped preset (configs/*.toml) with the first line of its leading comment. Read
    here from the files, not through configs/load.py, so `--help` imports nothing heavy."""
    lines = ["presets:"]
    for path in sorted(Path(__file__).resolve().parents[1].glob("*.toml")):
        first = next((ln for ln in path.read_text().splitlines() if ln.startswith("#")), "# ")
        lines.append(f"  {path.stem:<30} {first.lstrip('# ').strip()}")
    return "\n".join(lines)


def add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="SFT warm start (optional) then RL from a TOML config; with no config, the CPU demo",
        description="Train from a TOML config file or a shipped preset name.",
        epilog=presets_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "config", nargs="?", default=None, help="a TOML file or preset name (default: zorplex_tiny)"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set rollout.group_size=4 (VALUE is TOML; repeatable)",
    )
    p.add_argument(
        "--resume", metavar="RUN_DIR", default=None, help="continue a run from its latest checkpoint"
    )
    _add_env_module_arg(p)  # added to env.module: written to config.toml, imported again on --resume
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")

    def run(args: argparse.Namespace) -> int:
        from ..load import ConfigDeprecationWarning, ConfigError, config_to_toml, load_config
        from ..run_dir import existing_run_config

        try:
            if args.resume is not None and args.config is not None:
                raise ConfigError("--resume", "give a CONFIG or --resume RUN_DIR, not both")
            spec = existing_run_config(args.resume) if args.resume is not None else args.config
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ConfigDeprecationWarning)
                config, _ = load_config(spec, args.overrides, args.env_modules)
            for warning in caught:  # one line each, naming the new key; other warnings as usual
                if issubclass(warning.category, ConfigDeprecationWarning):
                    print(f"warning: {warning.message}", file=sys.stderr)
                else:
                    warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
            if args.print_config:
                print(config_to_toml(config), end="")
                return 0
            from .train import train

            return train(config, resume=args.resume, progress=not args.no_progress)
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            return 2

    p.set_defaults(func=run)


def add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="write PNG curves (reward, accuracy, tag rate, entropy, KL) of a run")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/plots)")

    def run(args: argparse.Namespace) -> int:
        from ...trainers.plots import plot_run

        for path in plot_run(args.run_dir, args.out):
            print(path)
        return 0

    p.set_defaults(func=run)


def add_view(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "view",
        help="browse recordings in a local web page: episodes, token shading, comparison, run charts",
    )
    p.add_argument(
        "paths", nargs="+", metavar="PATH", help="a recording, or a run directory (its recordings and metrics)"
    )
    p.add_argument(
        "--tokenizer",
        type=_tokenizer,
        default=None,
        help="the tokenizer the files were recorded with (default: a run's final_model's, else the shipped one)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (0: any free one)")

    def run(args: argparse.Namespace) -> int:
        from .view import view_command, view_sources

        recordings, metrics, run_tokenizer = view_sources(args.paths)
        tokenizer = args.tokenizer or run_tokenizer or DEFAULT_TOKENIZER
        title = args.paths[0] if len(args.paths) == 1 else ""
        return view_command(Console(), recordings, tokenizer, metrics, args.host, args.port, title)

    p.set_defaults(func=run)


def add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a recording as OpenAI chat-messages JSONL (tools, tool_calls)")
    p.add_argument("file", help="a recording")
    p.add_argument("--out", required=True, help="the JSONL file to write ('-': stdout)")
    p.add_argument("--no-tools", action="store_true", help="do not make the envs to read their tools")
    p.add_argument(
        "--observation-role",
        choices=["user", "tool"],
        default="user",
        help="the role of env replies that answer no tool_calls (default: user)",
    )
    p.add_argument("--no-metadata", action="store_true", help="messages (and tools) only")
    _add_env_module_arg(p)

    def run(args: argparse.Namespace) -> int:
        from .recordings import export_command

        return export_command(
            Console(),
            args.file,
            args.out,
            tools=not args.no_tools,
            observation_role=args.observation_role,
            metadata=not args.no_metadata,
            env_modules=args.env_modules,
        )

    p.set_defaults(func=run)


def add_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import", help="turn OpenAI chat-messages JSONL into a recording for SFT (not token-exact)"
    )
    p.add_argument("file", help="chat-messages JSONL: one {\"messages\": [...], \"tools\": [...]} per line")
    p.add_argument("--out", required=True, help="the recording to write (appended to if it exists)")
    p.add_argument("--tokenizer", type=_tokenizer, default=str(DEFAULT_TOKENIZER), help="tokenizer.json to tokenize with")

    def run(args: argparse.Namespace) -> int:
        from .recordings import import_command

        return import_command(Console(), args.file, args.out, args.tokenizer)

    p.set_defaults(func=run)


def add_judge_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "judge-data",
        help="turn a recording into chat-messages JSONL that trains a judge model: each episode's "
        "judge question and the env's own verdict as the answer",
    )
    p.add_argument("file", help="a recording (e.g. `toolgym record` of a noisy oracle)")
    p.add_argument("--criterion", required=True, help="the criterion's prompt, as [judge.criteria] will give it")
    p.add_argument("--out", required=True, help="the chat-messages JSONL to write (`toolgym import` makes it a recording)")
    p.add_argument(
        "--final-reply", action="store_true", help="show the env's last reply (often its verdict) to the judge"
    )
    p.add_argument("--max-transcript-chars", type=int, default=20000, help="as judge.max_transcript_chars")
    p.add_argument(
        "--group-size",
        type=int,
        default=0,
        help='N > 0: rows of N episodes each in a random order, asked as judge.mode = "group" asks, '
        'answered {"scores": [...]} (a ranking judge); 0 (default): one episode a row',
    )

    def run(args: argparse.Namespace) -> int:
        from .recordings import judge_data_command

        if args.group_size < 0:
            raise ValueError(f"--group-size must be >= 0, got {args.group_size}")
        return judge_data_command(
            Console(), args.file, args.criterion, args.out, args.final_reply, args.max_transcript_chars,
            args.group_size,
        )  # fmt: skip

    p.set_defaults(func=run)


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a checkpoint as an OpenAI-compatible API (chat/completions, tools) that captures "
        "each conversation token-exactly",
    )
    p.add_argument("--policy", required=True, help="a Hugging Face checkpoint directory")
    p.add_argument(
        "--tokenizer", type=_tokenizer, default=str(DEFAULT_TOKENIZER), help="tokenizer.json (default: the checkpoint's, else the shipped one)"
    )
    p.add_argument("--chat-template", default="", help="as for `toolgym eval` (default: plain ChatML)")
    p.add_argument("--host", default="127.0.0.1", help="address (default: this machine only; there is no auth)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    p.add_argument("--max-tokens-per-turn", type=int, default=256, help="a request's max_tokens cap and default")
    p.add_argument("--max-n", type=int, default=16, help="the largest n a request may ask for")
    p.add_argument("--record", default=None, help="append every captured conversation to this recording")

    def run(args: argparse.Namespace) -> int:
        from ...rollouts.endpoint.server import EndpointConfig
        from .serve import serve_command

        config = EndpointConfig(
            host=args.host, port=args.port, max_tokens_per_turn=args.max_tokens_per_turn, max_n=args.max_n
        )
        chat_template = _chat_template(args.chat_template)
        return serve_command(Console(), args.policy, args.tokenizer, chat_template, config, args.record)

    p.set_defaults(func=run)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_train,
    add_eval,
    add_record,
    add_replay,
    add_envs,
    add_plot,
    add_view,
    add_export,
    add_import,
    add_judge_data,
    add_serve,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="toolgym", description="Train LLM policies on multi-turn tool use with RL."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import gymnasium
    import torch.distributed as dist

    from ...rollouts.recording.format import RecordingError

    # A process group this command makes (train/eval join one) is closed when it ends: NCCL warns
    # of leaked resources at exit otherwise. One made before (a caller's, a test's) is theirs.
    owns_group = dist.is_available() and not dist.is_initialized()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a directory given as a file, a file as the output folder, no permission
        where = f"{exc.filename}: " if exc.filename is not None else ""
        print(f"toolgym {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except (RecordingError, ValueError, gymnasium.error.Error) as exc:
        print(f"toolgym {args.command}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
