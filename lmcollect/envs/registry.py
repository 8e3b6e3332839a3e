"""The one door for environments: every env a collector runs goes through :func:`as_env`, and named envs live here.

A collector's ``env`` argument may be

1. **an env**: an object following :class:`~lmcollect.envs.EnvProtocol` (``batch_size``,
   ``reset``, ``step``): a :class:`~lmcollect.envs.ChatEnv` over a :class:`~lmcollect.envs.Task`,
   an :class:`~lmcollect.agents.AgentEnv` driving an agent program, or your own class;
2. **a constructor** of one (a class or a function without arguments), called where the collector
   runs (inside its actor for a Ray collector, so nothing heavy is pickled);
3. **a name** ``"ecosystem:name"`` registered here: ``"lmcollect:arithmetic"`` and every other
   shipped task (see :data:`~lmcollect.envs.tasks.shipped.SHIPPED_TASKS`) are; an adapter for
   another library registers its names (:func:`register_env`) or a builder for all of them
   (:func:`register_ecosystem`, e.g. ``"torchrl:<class in torchrl.envs.llm>"``);
4. **an env of another library** that an adapter recognizes (:func:`register_ecosystem` with
   ``recognizes`` and ``wrap``): a torchrl ``EnvBase`` is wrapped in
   :class:`~lmcollect.compat.torchrl.TorchrlEnv` this way.

An ecosystem whose envs are prompt rows and a scoring task (reasoning-gym's generators) registers
``task``: ``task(name)`` gives a :class:`~lmcollect.envs.tasks.shipped.ShippedTask`, the recipe the
commands run (``lmcollect demo --env reasoning-gym:basic_arithmetic``; :func:`named_task`), and
:func:`make_env` builds a ChatEnv on it as it does for the shipped tasks.

:func:`make_env` builds a named env with keyword arguments (``make_env("lmcollect:comparison",
batch_size=8, repeats=4)``); an unknown name raises a ValueError listing the registered names.
A name may carry the env's own settings after ``?`` (``"reasoning-gym:basic_arithmetic?max_terms=2&max_digits=1"``:
the generator's config fields), so that a command line or a TOML config can set them too.
The adapters shipped with lmcollect (``lmcollect.compat``) register themselves on first use.
To add an environment library, write one module that calls :func:`register_ecosystem` (and, for
a few fixed names, :func:`register_env`) and import it before naming its envs.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmcollect.envs.chat_env import ChatEnv
from lmcollect.envs.tasks.shipped import SHIPPED_TASKS, ShippedTask, get_shipped_task

EnvFactory = Callable[..., Any]
"""``factory(**kwargs)``: a new env (following :class:`~lmcollect.envs.EnvProtocol`)."""

SHIPPED_ECOSYSTEM = "lmcollect"
_BUILTIN_ADAPTERS = (
    "lmcollect.compat.torchrl",
    "lmcollect.compat.reasoning_gym",
    "lmcollect.compat.skyrl_gym",
    "lmcollect.compat.openenv",
    "lmcollect.compat.verifiers",
)  # same layer; imported on first use: they register themselves
_HOW_TO_REGISTER = (
    "register one with lmcollect.envs.register_env('ecosystem:name', factory), or pass an env object or "
    "constructor as env= (see lmcollect.envs.registry)"
)


@dataclass(frozen=True)
class Ecosystem:
    """What an adapter registers for an outside environment library."""

    name: str
    """The prefix of its names (``"torchrl"``)."""
    recognizes: Callable[[object], bool] | None = None
    """Whether an object is one of its envs (then :func:`as_env` wraps it)."""
    wrap: Callable[[Any], Any] | None = None
    """Its env -> an lmcollect env."""
    build: Callable[..., Any] | None = None
    """``build(name, **kwargs)``: its env called ``name`` (the part after the colon), as an lmcollect env."""
    task: Callable[..., ShippedTask] | None = None
    """``task(name)``: its env called ``name`` as prompt rows and a scoring task (what the commands run)."""


_FACTORIES: dict[str, EnvFactory] = {}
_ECOSYSTEMS: dict[str, Ecosystem] = {}
_builtins_loaded = False


def register_env(name: str, factory: EnvFactory, *, replace: bool = False) -> None:
    """Register ``factory`` under ``name`` (``"ecosystem:name"``); ``replace=True`` replaces a registered one."""
    _split(name)  # refuses a name without its ecosystem
    if not callable(factory):
        raise TypeError(f"register_env({name!r}): factory must be callable (**kwargs -> env), got {factory!r}.")
    if name in _FACTORIES and not replace:
        raise ValueError(f"register_env: {name!r} is registered already; pass replace=True to replace it.")
    _FACTORIES[name] = factory


def register_ecosystem(
    name: str,
    *,
    recognizes: Callable[[object], bool] | None = None,
    wrap: Callable[[Any], Any] | None = None,
    build: Callable[..., Any] | None = None,
    task: Callable[..., ShippedTask] | None = None,
) -> None:
    """Register an outside library: how to recognize and wrap its env objects, and/or how to build
    any of its envs by name (``build(name, **kwargs)``, or ``task(name)``: a
    :class:`~lmcollect.envs.tasks.shipped.ShippedTask` that :func:`shipped_task_env` builds);
    registering a name again replaces it."""
    if not name or ":" in name:
        raise ValueError(f"register_ecosystem: the name is a prefix without a colon (e.g. 'torchrl'), got {name!r}.")
    if (recognizes is None) != (wrap is None):
        raise TypeError(f"register_ecosystem({name!r}): pass recognizes and wrap together.")
    if recognizes is None and build is None and task is None:
        raise TypeError(f"register_ecosystem({name!r}): pass recognizes and wrap, or build, or task.")
    _ECOSYSTEMS[name] = Ecosystem(name, recognizes, wrap, build, task)


def registered_envs() -> list[str]:
    """Every name :func:`make_env` builds: the registered names and ``"<ecosystem>:*"`` for builders."""
    _load_builtin_adapters()
    wildcards = [f"{e.name}:*" for e in _ECOSYSTEMS.values() if e.build is not None or e.task is not None]
    return sorted(_FACTORIES) + sorted(wildcards)


def make_env(name: str, **kwargs: Any) -> Any:
    """The env registered as ``name`` (``"ecosystem:name"``), built with ``kwargs``."""
    _load_builtin_adapters()
    name, settings = split_settings(name)
    ecosystem, short = _split(name)
    if name in _FACTORIES:
        return _FACTORIES[name](**settings, **kwargs)
    registered = _ECOSYSTEMS.get(ecosystem)
    if registered is not None and registered.build is not None:
        return registered.build(short, **settings, **kwargs)
    if registered is not None and registered.task is not None:
        return shipped_task_env(registered.task(short, **settings), **kwargs)
    raise ValueError(
        f"unknown env {name!r}; registered: {', '.join(registered_envs())}. To add one, {_HOW_TO_REGISTER}."
    )


def named_task(name: str) -> ShippedTask:
    """The env called ``name`` as prompt rows and a scoring task (what ``lmcollect demo`` and
    ``collect`` run): ``"lmcollect:<task>"`` (or a bare shipped task name) and the names of an
    ecosystem registered with ``task`` (``"reasoning-gym:basic_arithmetic"``)."""
    if isinstance(name, str) and ":" not in name:
        return get_shipped_task(name)
    full = name
    name, settings = split_settings(name)
    ecosystem, short = _split(name)
    if ecosystem == SHIPPED_ECOSYSTEM:
        if settings:
            raise ValueError(f"{full!r}: lmcollect's shipped tasks take no settings; drop the '?...' part.")
        return get_shipped_task(short)
    _load_builtin_adapters()
    registered = _ECOSYSTEMS.get(ecosystem)
    if registered is None or registered.task is None:
        with_tasks = [SHIPPED_ECOSYSTEM, *sorted(e.name for e in _ECOSYSTEMS.values() if e.task is not None)]
        raise ValueError(
            f"{name!r} names no env that runs as prompts and a scoring task; such ecosystems: "
            f"{', '.join(with_tasks)}. Other envs run through the Python API (make_env, as_env)."
        )
    return registered.task(short, **settings)


def as_env(env: Any) -> Any:
    """What a collector runs for its ``env`` argument: a name built, a constructor called, an outside
    library's env wrapped; the result checked against :class:`~lmcollect.envs.EnvProtocol`."""
    if isinstance(env, str):
        env = make_env(env)
    elif isinstance(env, type) or (callable(env) and not hasattr(env, "batch_size")):
        env = env()  # a constructor
    env = _wrapped(env)
    if not (hasattr(env, "step") and hasattr(env, "reset") and hasattr(env, "batch_size")):
        raise TypeError(
            f"env must follow lmcollect.envs.EnvProtocol (batch_size, reset, step), got {type(env).__name__}; "
            f"or name a registered env ({', '.join(registered_envs())})."
        )
    return env


def _wrapped(env: Any) -> Any:
    _load_builtin_adapters()
    for ecosystem in _ECOSYSTEMS.values():
        if ecosystem.recognizes is not None and ecosystem.wrap is not None and ecosystem.recognizes(env):
            return ecosystem.wrap(env)
    return env


def _split(name: str) -> tuple[str, str]:
    ecosystem, colon, short = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not (ecosystem and colon and short):
        raise ValueError(
            f"an env name is 'ecosystem:name' (e.g. 'lmcollect:arithmetic'), got {name!r}; "
            f"registered: {', '.join(sorted(_FACTORIES))}."
        )
    return ecosystem, short


def split_settings(name: str) -> tuple[str, dict[str, Any]]:
    """``"ecosystem:name?key=value&..."`` as the name and its settings (values read as JSON where they
    parse: ``max_digits=1`` is an int, ``operators=["+"]`` a list, anything else a string)."""
    base, question, query = name.partition("?") if isinstance(name, str) else (name, "", "")
    if not question:
        return base, {}
    pairs = [part.partition("=") for part in query.split("&")]
    if any(not key or not equals for key, equals, _ in pairs):
        raise ValueError(
            f"env settings come after '?' as key=value pairs joined by '&' "
            f"(e.g. 'reasoning-gym:basic_arithmetic?max_terms=2&max_digits=1'), got {name!r}."
        )
    return base, {key: _setting(value) for key, _, value in pairs}


def settings_text(settings: dict[str, Any]) -> str:
    """``settings`` as a name's ``?key=value&...`` part (``""`` for none): :func:`split_settings` reads it back."""
    parts = [f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in settings.items()]
    return "?" + "&".join(parts) if parts else ""


def _setting(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _load_builtin_adapters() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in _BUILTIN_ADAPTERS:
            importlib.import_module(module)


# ---------------------------------------------------------------------- the shipped tasks
def shipped_task_env(
    task: ShippedTask,
    *,
    batch_size: int = 1,
    repeats: int = 1,
    rows: list[dict[str, Any]] | None = None,
    num_samples: int = 256,
    seed: int = 0,
) -> ChatEnv:
    """A :class:`ChatEnv` on a shipped task: its ``rows`` (default: ``num_samples`` generated with
    ``seed``), scored by its task, ``max_turns`` as the task sets."""
    return ChatEnv(
        task.make_rows(num_samples, seed=seed) if rows is None else rows,
        task=task.make_task(),
        batch_size=batch_size,
        repeats=repeats,
        max_turns=task.max_turns,
        seed=seed,
    )


def _register_shipped_tasks() -> None:
    for task in SHIPPED_TASKS.values():
        register_env(f"{SHIPPED_ECOSYSTEM}:{task.name}", _ShippedFactory(task))


@dataclass(frozen=True)
class _ShippedFactory:
    """``make_env("lmcollect:<task>", **kwargs)``: :func:`shipped_task_env` on that task (picklable)."""

    task: ShippedTask

    def __call__(self, **kwargs: Any) -> ChatEnv:
        return shipped_task_env(self.task, **kwargs)


_register_shipped_tasks()
