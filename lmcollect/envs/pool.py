"""AsyncEnvPool: owns the sub-envs that an ``async_envs=True`` collector steps from its threads."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

from lmcollect.envs.protocol import EnvProtocol
from lmcollect.plumbing import ClosesOnExit

logger = logging.getLogger(__name__)


def _build(maker: Callable[[], EnvProtocol] | EnvProtocol, index: int) -> EnvProtocol:
    env = maker if isinstance(maker, EnvProtocol) else None
    if env is None:
        if not callable(maker):
            raise TypeError(
                f"env_makers[{index}] must be an env or a zero-argument callable returning one, "
                f"got {type(maker).__name__}."
            )
        env = maker()
    if not isinstance(env, EnvProtocol):
        raise TypeError(
            f"env_makers[{index}] built {type(env).__name__}, which lacks batch_size/reset/step; "
            "return an object implementing EnvProtocol."
        )
    return env


class AsyncEnvPool(ClosesOnExit):
    """A fixed set of independent sub-envs (each with its own ``batch_size``).

    The pool builds them (calling the makers in order) and shuts them down; the collector runs one
    thread per sub-env (policy call, then ``step``). A maker that fails closes the envs built so far;
    ``with AsyncEnvPool(...) as pool:`` closes them all on the way out.
    """

    def __init__(self, env_makers: Sequence[Callable[[], EnvProtocol] | EnvProtocol]) -> None:
        if isinstance(env_makers, (str, bytes)) or not isinstance(env_makers, Sequence) or not env_makers:
            raise ValueError(
                "AsyncEnvPool needs a non-empty list of envs or env factories, e.g. "
                "[lambda: ChatEnv(rows, batch_size=4)] * 2."
            )
        self._envs: list[EnvProtocol] = []
        try:
            for i, maker in enumerate(env_makers):
                self._envs.append(_build(maker, i))
        except BaseException:
            self.close()
            raise
        self._closed = False
        logger.debug("AsyncEnvPool built %d sub-envs", len(self._envs))

    @property
    def envs(self) -> list[EnvProtocol]:
        return list(self._envs)

    @property
    def num_envs(self) -> int:
        return len(self._envs)

    def __len__(self) -> int:
        return len(self._envs)

    def __getitem__(self, index: int) -> EnvProtocol:
        return self._envs[index]

    def __iter__(self) -> Iterator[EnvProtocol]:
        return iter(self._envs)

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed sub-env ``i`` with ``seed + i``; returns what the last sub-env's ``set_seed`` returned."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}.")
        out = seed
        for i, env in enumerate(self._envs):
            set_seed = getattr(env, "set_seed", None)
            if set_seed is None:
                raise TypeError(f"sub-env {i} ({type(env).__name__}) has no set_seed; it cannot be seeded.")
            out = set_seed(seed + i, static_seed=static_seed)
        return out

    def close(self) -> None:
        """Close every sub-env (once; errors are logged and the first one re-raised at the end)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        first_error: Exception | None = None
        for i, env in enumerate(self._envs):
            close = getattr(env, "close", None)
            if close is None:
                continue
            try:
                close()
            except Exception as e:  # keep closing the others
                logger.exception("Closing sub-env %d failed", i)
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def __repr__(self) -> str:
        return f"AsyncEnvPool(num_envs={self.num_envs}, envs={self._envs!r})"
