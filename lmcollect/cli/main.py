"""Entry point of the `lmcollect` command: subcommands, each configured by a typed dataclass."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from lmcollect.cli.check_logprobs import CheckLogprobsConfig, run_check_logprobs
from lmcollect.cli.configs import (
    BenchConfig,
    CollectConfig,
    DemoConfig,
    UsageError,
    config_to_toml,
    read_config_file,
)
from lmcollect.cli.view import ViewConfig, run_view

# Heavy imports (torch, ray, transformers) happen inside the commands so `--help` stays instant.


def run_demo(config: DemoConfig) -> int:
    from lmcollect.cli.demo import run_demo as run

    return run(config)


def run_collect(config: CollectConfig) -> int:
    from lmcollect.cli.collect import run_collect as run

    return run(config)


def run_bench(config: BenchConfig) -> int:
    from lmcollect.cli.bench import run_bench as run

    return run(config)


COMMANDS: dict[str, tuple[type, Callable[[Any], int]]] = {
    "demo": (DemoConfig, run_demo),
    "collect": (CollectConfig, run_collect),
    "bench": (BenchConfig, run_bench),
    "check-logprobs": (CheckLogprobsConfig, run_check_logprobs),
    "view": (ViewConfig, run_view),
}


def add_dataclass_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """One --flag per dataclass field, with the field's docstring as help (Literal fields get choices)."""
    docs = _field_docs(config_cls)
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        flag = "--" + field.name.replace("_", "-")
        default = field.default if field.default is not dataclasses.MISSING else None
        kind, choices = _arg_type(hints[field.name])
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=docs.get(field.name))
        else:
            parser.add_argument(
                flag,
                type=kind,
                choices=choices,
                default=default,
                help=f"{docs.get(field.name, '')} (default: {default})",
            )


def _arg_type(annotation: Any) -> tuple[type, tuple[Any, ...] | None]:
    """(argparse type, choices or None) of a field annotation such as ``int``, ``str | None``, ``Literal[...]``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return type(args[0]), tuple(args)
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _arg_type(args[0])  # X | None: a flag of type X, absent means None
    return (annotation if annotation in (bool, int, float) else str), None


def _field_docs(config_cls: type) -> dict[str, str]:
    import ast
    import inspect
    import itertools
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(config_cls)))
    class_def = tree.body[0]
    assert isinstance(class_def, ast.ClassDef), "getsource of a class starts with its definition"
    docs = {}
    for node, nxt in itertools.pairwise(class_def.body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = str(nxt.value.value).strip()
    return docs


def add_config_file_arguments(parser: argparse.ArgumentParser) -> None:
    """--config FILE (TOML, the fields as keys; flags override it) and --print-config."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="read settings from a TOML file (keys: the fields of the flags "
        "below, e.g. max_steps = 10); flags given as well override it",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved settings as TOML and exit")


def build_parser(file_values: dict[str, dict[str, Any]] | None = None) -> argparse.ArgumentParser:
    """The parser; ``file_values[command]`` (read from --config) replace that command's defaults."""
    parser = argparse.ArgumentParser(prog="lmcollect", description="Collect LLM dialog turns for RL.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (config_cls, _) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=(config_cls.__doc__ or "").strip().splitlines()[0])
        add_dataclass_arguments(sub, config_cls)
        add_config_file_arguments(sub)
        sub.set_defaults(**(file_values or {}).get(name, {}))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    config_cls, run = COMMANDS[args.command]
    if args.config is not None:  # the file's values become the defaults; flags given still win
        try:
            file_values = read_config_file(args.config, config_cls, command=args.command)
        except UsageError as exc:
            parser.exit(2, f"lmcollect {args.command}: error: {exc}\n")
        parser = build_parser({args.command: file_values})
        args = parser.parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)}
    try:
        config = config_cls(**values)
    except (TypeError, ValueError) as exc:  # __post_init__ checks: a bad flag value
        parser.exit(2, f"lmcollect {args.command}: error: {exc}\n")
    if args.print_config:
        print(config_to_toml(config, command=args.command, docs=_field_docs(config_cls)), end="")
        return 0
    try:
        return run(config)
    except UsageError as exc:  # a missing model folder, a malformed prompt file, an unknown task...
        parser.exit(2, f"lmcollect {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
