"""Real OpenEnv environments for the adapter's tests (importable by name, so tasks over them pickle), and a loopback server.

``GuessEnvironment``: reset draws a number 0..9 from the seed; each ``GuessAction`` is told
"higher"/"lower" (reward 0) or ends the episode (reward 1). ``CalculatorMcpEnvironment``: an
``MCPEnvironment`` with an ``add`` tool and a ``submit`` tool that ends the episode (reward 1 when
the submitted sum is right).
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    guess: int = Field(description="The guessed number")


class GuessObservation(Observation):
    hint: str = Field(default="", description="What the env says")


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._secret = 0
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._secret = random.Random(seed).randrange(10)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(hint="Guess my number from 0 to 9. Write only the number.", reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        if action.guess == self._secret:
            return GuessObservation(hint="right", reward=1.0, done=True)
        return GuessObservation(hint="higher" if action.guess < self._secret else "lower", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def guess_action(text: str) -> GuessAction:
    found = re.findall(r"-?\d+", text)
    return GuessAction(guess=int(found[-1]) if found else -1)


def hint_text(observation: GuessObservation) -> str:
    return observation.hint


def bisecting_guesser(history) -> str:
    """Binary search over the hints (a player that always finds the number in at most 4 guesses)."""
    low, high = 0, 9
    guess = None
    for message in history.messages:
        if message.role == "assistant":
            guess = int(message.content)
        elif message.role == "user" and guess is not None:
            low, high = (guess + 1, high) if message.content == "higher" else (low, guess - 1)
    return str((low + high) // 2)


class CalculatorMcpEnvironment(MCPEnvironment):
    """Two MCP tools: ``add(a, b)`` and ``submit(total)`` (ends the episode); the task: 17 + 25."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("calculator")
        self._submitted: int | None = None

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool
        def submit(total: int) -> str:
            """Submit the final answer."""
            self._submitted = total
            return "submitted"

        super().__init__(mcp)
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self._submitted = None
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(hint="What is 17 + 25? Use the add tool, then submit the total.", reward=0.0)

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(await super().step_async(action, timeout_s=timeout_s, **kwargs))  # what the server calls

    def _scored(self, obs: Observation) -> Observation:
        if self._submitted is not None:
            obs.done, obs.reward = True, float(self._submitted == 42)
        return obs

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return GuessObservation(hint="use the tools", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def calculator_player(history) -> str:
    """Calls add(17, 25), then submit(<the result>)."""
    results = [m.content for m in history.messages if m.role == "tool"]
    if not results:
        return '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'
    return f'<tool_call>\n{{"name": "submit", "arguments": {{"total": {int(results[-1])}}}}}\n</tool_call>'


@contextmanager
def served(
    env_cls: type, action_cls: type, observation_cls: type, *, max_sessions: int, timeout_s: float = 20.0
) -> Iterator[str]:
    """``env_cls`` behind OpenEnv's own app on 127.0.0.1 (uvicorn in a thread); yields its base URL, stops it after."""
    import uvicorn

    app = create_app(env_cls, action_cls, observation_cls, env_name="test", max_concurrent_envs=max_sessions)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="openenv-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not (server.started and server.servers):
        if time.monotonic() > deadline or not thread.is_alive():
            raise TimeoutError(f"the OpenEnv test server did not start within {timeout_s}s")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        assert not thread.is_alive(), f"the OpenEnv test server did not stop within {timeout_s}s"
