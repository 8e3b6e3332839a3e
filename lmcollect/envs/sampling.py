"""Hands out dataset prompts to env elements so that each group answers the same prompt sequence."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from lmcollect.envs.datasets import PromptDataset


@dataclass(frozen=True, slots=True)
class Draw:
    """One prompt drawn for a group: shared by the ``repeats`` elements of that group."""

    prompt_id: int
    """Unique (per env) id of this draw; trajectories with the same id form a GRPO group."""
    sample_index: int
    """Row index in the dataset."""
    sample: dict[str, Any]
    """The dataset row."""
    task_seed: int
    """Seed of the ``random.Random`` handed to ``Task.start`` (same for the whole group)."""


class GroupSampler:
    """Per-group queues of draws.

    Element ``e`` of group ``g = e // repeats`` takes, at its k-th reset, the group's k-th draw;
    the first element of the group to need a draw takes it from the dataset. Hence every prompt is
    answered exactly ``repeats`` times even when the group's dialogs end at different times.
    """

    def __init__(self, dataset: PromptDataset, *, num_groups: int, repeats: int, seed: int) -> None:
        self.dataset = dataset
        self.repeats = repeats
        self.num_groups = num_groups
        self.next_prompt_id = 0
        self.reseed(seed)

    def clear(self) -> None:
        """Forget pending draws: the next reset of every element starts a new draw."""
        self._queues: list[list[Draw]] = [[] for _ in range(self.num_groups)]
        self._offsets = [0] * self.num_groups
        self._generations = [0] * (self.num_groups * self.repeats)

    def reseed(self, seed: int) -> None:
        """Seed task randomness and restart the dataset order from ``seed``."""
        self.rng = random.Random(seed)
        self.dataset.set_seed(seed)
        self.clear()

    def _new_draw(self) -> Draw:
        index = self.dataset.next_index()
        draw = Draw(
            prompt_id=self.next_prompt_id,
            sample_index=index,
            sample=self.dataset[index],
            task_seed=self.rng.getrandbits(63),
        )
        self.next_prompt_id += 1
        return draw

    def draw_for(self, element: int) -> Draw:
        group = element // self.repeats
        queue = self._queues[group]
        k = self._generations[element] - self._offsets[group]
        if k == len(queue):
            queue.append(self._new_draw())
        draw = queue[k]
        self._generations[element] += 1
        lo = min(self._generations[group * self.repeats : (group + 1) * self.repeats])
        consumed = lo - self._offsets[group]
        if consumed > 0:  # every element of the group has taken these draws
            del queue[:consumed]
            self._offsets[group] = lo
        return draw

    def state_dict(self) -> dict[str, Any]:
        """RNG, prompt counter, dataset position and the draws groups have not all taken yet."""
        return {
            "rng": list(self.rng.getstate()),
            "next_prompt_id": self.next_prompt_id,
            "dataset": self.dataset.state_dict(),
            "queues": [[draw_state(d) for d in queue] for queue in self._queues],
            "offsets": list(self._offsets),
            "generations": list(self._generations),
        }

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raise if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        self._parsed_state(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rng, next_prompt_id, queues = self._parsed_state(state)  # everything checked before anything changes
        self.rng = rng
        self.next_prompt_id = next_prompt_id
        self.dataset.load_state_dict(state["dataset"])
        self.clear()
        if queues is not None:  # pending group draws: every element of a group answers the same prompt
            self._queues, self._offsets, self._generations = queues

    def _parsed_state(
        self, state: dict[str, Any]
    ) -> tuple[random.Random, int, tuple[list[list[Draw]], list[int], list[int]] | None]:
        version, internal, gauss = state["rng"]  # tolerate lists (e.g. after a JSON round trip)
        rng = random.Random()
        rng.setstate((version, tuple(internal), gauss))
        next_prompt_id = int(state["next_prompt_id"])
        self.dataset.check_state_dict(state["dataset"])
        if "queues" not in state:
            return rng, next_prompt_id, None
        queues = [[self.draw_from_state(d) for d in queue] for queue in state["queues"]]
        offsets = [int(x) for x in state["offsets"]]
        generations = [int(x) for x in state["generations"]]
        if (
            len(queues) != self.num_groups
            or len(offsets) != self.num_groups
            or len(generations) != len(self._generations)
        ):
            raise ValueError(
                f"the sampler state holds {len(queues)} group queues for {len(generations)} elements; this env has "
                f"{self.num_groups} groups of {self.repeats}: restore into an env built the same way."
            )
        return rng, next_prompt_id, (queues, offsets, generations)

    def draw_from_state(self, state: dict[str, Any]) -> Draw:
        """The :class:`Draw` that :func:`draw_state` described (its row read from the dataset)."""
        index = int(state["sample_index"])
        if not 0 <= index < len(self.dataset):
            raise ValueError(f"a draw of row {index} is outside this dataset of {len(self.dataset)} rows.")
        return Draw(int(state["prompt_id"]), index, self.dataset[index], int(state["task_seed"]))


def draw_state(draw: Draw) -> dict[str, int]:
    """A draw as plain ints (the row itself is looked up again from the dataset)."""
    return {"prompt_id": draw.prompt_id, "sample_index": draw.sample_index, "task_seed": draw.task_seed}
