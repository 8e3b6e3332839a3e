"""reasoning-gym: its procedural generators as prompt rows, its own scorers as rewards, its names as ``"reasoning-gym:<name>"``.

reasoning-gym (``pip install 'lmcollect[reasoning-gym]'``) generates questions with reference
answers from seeded generators (``basic_arithmetic``, ``leg_counting``, ... and ``composite``,
a weighted mix) and scores an answer with each generator's ``score_answer(answer, entry)``.
This module turns a generator into lmcollect's pieces and nothing more:

* :func:`reasoning_gym_rows`: the generator's entries as dataset rows (``"prompt"``, and the
  entry's ``"question"``, ``"answer"`` and ``"metadata"`` for scoring);
* :class:`ReasoningGymReward`: a picklable ``fn(history, sample)`` that extracts the reply's answer
  (the last ``<answer>...</answer>``, else the whole reply) and returns the generator's own score;
* :class:`ReasoningGymTask`: that score as a task, with ``attempts`` tries per question (a wrong
  answer is told its score and may try again);
* :func:`reasoning_gym_env`: a :class:`~lmcollect.envs.ChatEnv` of both (GRPO groups with ``repeats``);
* the ``"reasoning-gym"`` ecosystem of :mod:`lmcollect.envs.registry`: ``make_env("reasoning-gym:leg_counting",
  batch_size=8, repeats=4)``, and ``lmcollect demo --env reasoning-gym:basic_arithmetic``
  (:func:`reasoning_gym_task`).

lmcollect keeps the chat template, the tokens, the log-probs and the policy versions; the
generator only writes questions and scores answers. reasoning-gym is imported on first use.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcollect.compat.extras import import_extra
from lmcollect.data.history import History
from lmcollect.envs.chat_env import ChatEnv
from lmcollect.envs.registry import register_ecosystem, settings_text
from lmcollect.envs.tasks.base import SingleTurnTask, TaskReply
from lmcollect.envs.tasks.shipped import ShippedTask

if TYPE_CHECKING:  # reasoning-gym is an optional extra
    from reasoning_gym.dataset import ProceduralDataset

ECOSYSTEM = "reasoning-gym"
ANSWER_FORMAT = "Answer the question. Put your final answer between <answer> and </answer>."
"""The system message of each row (the answer format :class:`ReasoningGymReward` reads first)."""
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _reasoning_gym() -> Any:
    return import_extra("reasoning_gym", extra="reasoning-gym", who="reasoning-gym envs")


def create_generator(name: str, *, seed: int = 0, size: int = 256, **config: Any) -> ProceduralDataset:
    """reasoning-gym's generator ``name`` with ``seed``, ``size`` and its config fields (``config``)."""
    reasoning_gym = _reasoning_gym()
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
    except ValueError as exc:
        if "not registered" not in str(exc):
            raise
        known = ", ".join(sorted(reasoning_gym.factory.DATASETS))
        raise ValueError(f"reasoning-gym has no generator {name!r}; its generators: {known}.") from exc


def reasoning_gym_rows(
    generator: ProceduralDataset, num_samples: int | None = None, *, answer_format: str | None = ANSWER_FORMAT
) -> list[dict[str, Any]]:
    """The first ``num_samples`` entries of ``generator`` (default: all of them) as dataset rows.

    ``"prompt"`` is the question, after ``answer_format`` as a system message (None: the bare
    question); ``"question"``, ``"answer"`` (None where the generator has no single reference) and
    ``"metadata"`` are the entry's, for :class:`ReasoningGymReward`.
    """
    count = len(generator) if num_samples is None else num_samples
    if count < 1:
        raise ValueError(f"num_samples must be >= 1, got {count}.")
    rows = []
    for index in range(count):
        entry = generator[index]
        question = entry["question"]
        prompt: Any = question
        if answer_format:
            prompt = [{"role": "system", "content": answer_format}, {"role": "user", "content": question}]
        rows.append({"prompt": prompt, "question": question, "answer": entry["answer"], "metadata": entry["metadata"]})
    return rows


def extract_answer(text: str) -> str:
    """The reply's answer: the content of its last ``<answer>...</answer>``, else the whole reply (stripped)."""
    tagged = _ANSWER_RE.findall(text)
    return (tagged[-1] if tagged else text).strip()


@dataclass(frozen=True)
class ReasoningGymReward:
    """``fn(history, sample)``: ``generator.score_answer(answer, entry)`` on the last assistant message.

    The answer is :func:`extract_answer`'s; the entry is rebuilt from the row's ``"question"``,
    ``"answer"`` and ``"metadata"`` (a composite generator routes it by its ``source_dataset``).
    Picklable: it goes to collector actors with the env.
    """

    generator: Any
    """The reasoning-gym generator (a ``ProceduralDataset``) whose ``score_answer`` scores."""

    def __call__(self, history: History, sample: Mapping[str, Any]) -> float:
        missing = [key for key in ("question", "answer", "metadata") if key not in sample]
        if missing:
            raise KeyError(f"the row has no {missing}: build reasoning-gym rows with reasoning_gym_rows().")
        reply = history.last("assistant")
        entry = {"question": sample["question"], "answer": sample["answer"], "metadata": sample["metadata"]}
        return float(self.generator.score_answer(extract_answer("" if reply is None else reply.content), entry))


@dataclass(frozen=True)
class ReasoningGymTask:
    """The generator's score as a task: up to ``attempts`` answers per question.

    Each answer gets its score as its reward; the dialog ends at a full score (1.0) or after
    ``attempts`` answers, and a lower score before that is told to the model ("Your answer scored
    0.25 out of 1. Try again."), so the next prompt extends the dialog the model has seen.
    """

    reward: ReasoningGymReward
    """Scores each answer."""
    attempts: int = 1
    """Answers allowed per question (1: single-turn)."""

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"attempts must be an int >= 1, got {self.attempts!r}.")

    @property
    def max_turns(self) -> int:
        return self.attempts

    def start(self, sample: Mapping[str, Any], rng: random.Random) -> Mapping[str, Any]:
        return sample

    def respond(self, state: Mapping[str, Any], history: History) -> TaskReply:
        score = self.reward(history, state)
        num_answers = sum(m.role == "assistant" for m in history.messages)
        if score >= 1.0 or num_answers >= self.attempts:
            return TaskReply(reward=score, done=True)
        return TaskReply(reward=score, done=False, env_message=f"Your answer scored {score:.2f} out of 1. Try again.")


def reasoning_gym_env(
    generator: str | ProceduralDataset,
    *,
    batch_size: int = 1,
    repeats: int = 1,
    num_samples: int = 256,
    seed: int = 0,
    rows: list[dict[str, Any]] | None = None,
    answer_format: str | None = ANSWER_FORMAT,
    attempts: int = 1,
    **config: Any,
) -> ChatEnv:
    """A :class:`ChatEnv` on a reasoning-gym generator (one answer per question, or ``attempts``), scored by its ``score_answer``.

    ``generator``: a name (built with ``seed``, ``num_samples`` entries and ``config``, e.g.
    ``min_terms=2``) or a generator object (its own seed and size; ``composite`` included).
    ``rows`` replaces the generated rows (from :func:`reasoning_gym_rows`); ``seed`` also seeds the
    prompt order; ``repeats`` answers per prompt make the GRPO groups; ``attempts`` answers per
    question (see :class:`ReasoningGymTask`).
    """
    if isinstance(generator, str):
        generator = create_generator(generator, seed=seed, size=num_samples, **config)
    elif config:
        raise TypeError(f"reasoning_gym_env: config fields {sorted(config)} go with a generator name, not an object.")
    if rows is None:
        rows = reasoning_gym_rows(generator, min(num_samples, len(generator)), answer_format=answer_format)
    task = ReasoningGymTask(ReasoningGymReward(generator), attempts)
    return ChatEnv(rows, task=task, batch_size=batch_size, repeats=repeats, max_turns=attempts, seed=seed)


@dataclass(frozen=True)
class _RowMaker:
    """``make_rows(num_samples, seed=seed)`` of a named generator (picklable)."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)

    def __call__(self, num_samples: int, *, seed: int) -> list[dict[str, Any]]:
        return reasoning_gym_rows(create_generator(self.name, seed=seed, size=num_samples, **self.config))


@dataclass(frozen=True)
class _TaskMaker:
    """``make_task()``: the single-turn task scored by the generator's ``score_answer`` (picklable)."""

    generator: Any

    def __call__(self) -> SingleTurnTask:
        return SingleTurnTask(ReasoningGymReward(self.generator))


def reasoning_gym_task(name: str, **config: Any) -> ShippedTask:
    """The generator ``name`` as the commands run an env (``lmcollect demo --env reasoning-gym:<name>``):
    rows made with the run's seed, replies scored by its ``score_answer``, one turn per dialog.
    ``config``: the generator's fields (``--env 'reasoning-gym:basic_arithmetic?max_terms=2'``)."""
    scorer = create_generator(name, seed=0, size=1, **config)
    return ShippedTask(
        name=f"{ECOSYSTEM}:{name}{settings_text(config)}",  # the name rebuilds it (in a collector actor)
        description=f"reasoning-gym's {name} generator, scored by its own score_answer",
        make_rows=_RowMaker(name, dict(config)),
        make_task=_TaskMaker(scorer),
        has_reference_answers=scorer[0]["answer"] is not None,
    )


register_ecosystem(ECOSYSTEM, build=reasoning_gym_env, task=reasoning_gym_task)
