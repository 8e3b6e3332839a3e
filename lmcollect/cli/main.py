"""Entry point of the `lmcollect` command: subcommands, each configured by a typed dataclass."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any, Callable, Sequence

# Heavy imports (torch, ray, transformers) happen inside the commands so `--help` stays instant.


@dataclasses.dataclass(kw_only=True)
class QuickstartConfig:
    """A short collection run with the tiny offline model."""

    model: str | None = None
    """A local model folder (default: the tiny model, built offline on first use)."""
    num_envs: int = 8
    """Dialogs collected side by side."""
    num_batches: int = 3
    """Batches to collect."""
    max_new_tokens: int = 24
    """Token budget of one answer."""
    seed: int = 0
    """Seed of envs and sampling."""


def run_quickstart(config: QuickstartConfig) -> int:
    import time

    from lmcollect.collectors import LLMCollector
    from lmcollect.data import keys
    from lmcollect.data.turns import flatten_turns
    from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset
    from lmcollect.models import ModelSpec, load_model_and_tokenizer
    from lmcollect.policies import TransformersPolicy

    model, tokenizer = load_model_and_tokenizer(config.model or ModelSpec(size="tiny"))
    env = ChatEnv(arithmetic_dataset(256, seed=config.seed), reward_fn=MathAnswerReward(), batch_size=config.num_envs)
    policy = TransformersPolicy(model, tokenizer, max_new_tokens=config.max_new_tokens, temperature=1.0)
    collector = LLMCollector(
        env,
        policy=policy,
        dialog_turns_per_batch=config.num_envs,
        total_dialog_turns=config.num_envs * config.num_batches,
        track_policy_version=True,
    )
    collector.set_seed(config.seed)
    start, turns, batch = time.perf_counter(), 0, None
    for batch in collector:
        turns += batch.numel()
    elapsed = time.perf_counter() - start
    turn = flatten_turns(batch)[0]
    print(f"collected {turns} dialog turns in {elapsed:.2f} s: {turns / elapsed:.1f} turns/s")
    print("sample dialog:")
    for message in turn[keys.HISTORY_FULL].messages:
        print(f"  [{message.role}] {message.content!r}")
    print(f"  reward={float(turn[keys.NEXT_REWARD]):.1f} policy_version={int(turn[keys.POLICY_VERSION])}")
    return 0


COMMANDS: dict[str, tuple[type, Callable[[Any], int]]] = {
    "demo": (QuickstartConfig, run_quickstart),
}


def add_dataclass_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """One --flag per dataclass field, with the field's docstring as help."""
    docs = _field_docs(config_cls)
    for field in dataclasses.fields(config_cls):
        flag = "--" + field.name.replace("_", "-")
        default = field.default if field.default is not dataclasses.MISSING else None
        kind = _arg_type(field.type)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=docs.get(field.name))
        else:
            parser.add_argument(flag, type=kind, default=default, help=f"{docs.get(field.name, '')} (default: {default})")


def _arg_type(annotation: Any) -> type:
    text = str(annotation)
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if text.startswith(name):
            return kind
    return str


def _field_docs(config_cls: type) -> dict[str, str]:
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(config_cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value).strip()
    return docs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmcollect", description="Collect LLM dialog turns for RL.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (config_cls, _) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=(config_cls.__doc__ or "").strip().splitlines()[0])
        add_dataclass_arguments(sub, config_cls)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config_cls, run = COMMANDS[args.command]
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)}
    return run(config_cls(**values))


if __name__ == "__main__":
    sys.exit(main())
