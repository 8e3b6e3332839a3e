"""An agent written with the `openai` client (a calculator tool), collected by lmcollect and trained with GRPO.

Run: python examples/agent_calculator.py [--model PATH] [--steps 4] [--group-size 4] [--questions 2]
(``python``: the project's virtual environment; needs ``pip install 'lmcollect[agents]'``.)

The agent below knows nothing of lmcollect: it is the loop people write against any
OpenAI-compatible server (``chat.completions.create(..., tools=[...])``, run the tool calls, send
the results back, score the final answer). ``AgentEnv`` runs it once per dialog against its own
endpoint; each model call becomes one turn of a ``ContinuousLLMCollector`` (token-exact prompt and
response ids, log-probs, versions), the runs of one question form a GRPO group, and the trainer
pushes its weights after every step. With the default tiny model, trained from random weights,
the replies are noise (no tool call parses: the dialogs end after one call); pass ``--model`` a
local instruct model folder that writes Hermes tool calls (e.g. Qwen2.5-0.5B-Instruct) to see the
calculator used. ``lmcollect demo --task agent`` teaches the tiny model a short call format first.
"""
from __future__ import annotations

import argparse
import ast
import copy
import json
import operator
import random

import torch

from lmcollect.agents import AgentEnv
from lmcollect.collectors import ContinuousLLMCollector
from lmcollect.engines import TransformersEngine
from lmcollect.models import ModelSpec, get_model_path, load_model_and_tokenizer
from lmcollect.policies import SamplingConfig
from lmcollect.training.batch import GroupAdvantage, train_batch_from_turns
from lmcollect.training.trainer import GRPOConfig, GRPOLearner

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """The tool: integer arithmetic, nothing else (an error message for anything else)."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only integers, + - * and parentheses")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError) as exc:
        return f"error: {exc}"


def calculator_agent(context, row) -> float:
    """Ask the question with the calculator tool; answer tool calls (at most 3 rounds); 1.0 for the right number."""
    client = context.openai()  # openai.OpenAI(base_url=context.base_url, api_key=context.api_key)
    messages = [{"role": "system", "content": "Use the calculator tool, then answer with the number only."},
                {"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = client.chat.completions.create(model=context.model, messages=messages, tools=[CALCULATOR],
                                               max_tokens=48).choices[0].message
        if not reply.tool_calls:
            break
        messages.append(reply)
        for call in reply.tool_calls:
            expression = json.loads(call.function.arguments).get("expression", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))})
    return 1.0 if (reply.content or "").strip() == row["answer"] else 0.0


def questions(num: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 9)
        rows.append({"prompt": f"What is ({a} + {b}) * {c}?", "answer": str((a + b) * c)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local model folder (default: the tiny offline model)")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps (each followed by a push)")
    parser.add_argument("--group-size", type=int, default=4, help="agent runs per question (a GRPO group)")
    parser.add_argument("--questions", type=int, default=2, help="questions (groups) per training batch")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(args.model or get_model_path(ModelSpec(size="tiny")))
    dialogs = args.group_size * args.questions
    env = AgentEnv(questions(1024, seed=0), calculator_agent, batch_size=dialogs, repeats=args.group_size, seed=0)
    engine = TransformersEngine(copy.deepcopy(model), tokenizer)  # collects; the trainer's weights come by push
    collector = ContinuousLLMCollector(
        [env], engine=engine, tokenizer=tokenizer, sampling=SamplingConfig(max_new_tokens=48, temperature=1.0),
        dialog_turns_per_batch=dialogs,            # with groups: dialogs per batch (whole groups, every turn)
        postproc=GroupAdvantage(per_dialog=True),  # each run's reward, normalised in its group, on all its turns
        max_policy_lag=1, track_policy_version=True,
    )
    learner = GRPOLearner(model, GRPOConfig(lr=5e-4))
    with collector, engine:
        collector.update_policy_weights_(model)  # version 1
        for step in range(1, args.steps + 1):
            batch = collector.next()
            metrics = learner.train_step(train_batch_from_turns(batch, pad_token_id=tokenizer.pad_token_id))
            collector.update_policy_weights_(model)
            stats = env.stats
            print(f"step {step}: {batch.shape[0]} turns (model calls) of {dialogs} agent runs, "
                  f"mean reward {float(batch['next', 'reward'].sum()) / dialogs:.2f}, "
                  f"policy loss {metrics['loss/policy']:.3f}, version {collector.version_index()}, "
                  f"tool calls parsed {stats.tool_calls}, malformed {stats.tool_parse_errors}", flush=True)


if __name__ == "__main__":
    main()
