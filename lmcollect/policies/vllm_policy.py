"""A policy that generates with vLLM: prompts tokenized here, token ids in, tokens and raw log-probs out."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import torch
from tensordict import TensorDictBase
from transformers import AutoTokenizer

from lmcollect.engines.sampling import RequestSeeds, SamplingConfig, eos_token_ids, sampling_from_kwargs
from lmcollect.engines.vllm_common import (
    LOGPROBS_MODE,
    Completion,
    completion_of,
    engine_kwargs_for,
    import_vllm,
    sampling_params_kwargs,
)
from lmcollect.policies.outputs import Generation, answer_prompts, generate_triples

if TYPE_CHECKING:  # vllm is an optional extra and slow to import; VLLMEngine imports it when built
    from vllm import LLM, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


@runtime_checkable
class BatchEngineProtocol(Protocol):
    """What :class:`VLLMPolicy` needs from an engine: a local :class:`VLLMEngine`, Ray replicas
    (``VLLMReplicas``) or a vLLM server; a lockstep engine answering a whole batch per call.

    Weight updates reach every worker of every replica through the
    :class:`~lmcollect.engines.WorkerRpcEngine` methods (see ``lmcollect.engines.vllm_worker_ext``).
    Every method may be called from any thread, also concurrently: the engine serialises the calls.
    """

    def generate_tokens(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int] | None = None
    ) -> list[Completion]:
        """Engines may also take ``stop_token_ids=`` (extra ids that end a response), as :class:`VLLMEngine` does."""
        ...

    # lmcollect.engines.WorkerRpcEngine's methods (not inherited: that module imports this package)
    @property
    def num_replicas(self) -> int: ...

    def collective_rpc_each(
        self, method: str, args_per_replica: list[tuple], kwargs: dict[str, Any] | None = None
    ) -> list[Any]: ...

    def reset_prefix_cache(self) -> None: ...


class VLLMEngine:
    """An in-process ``vllm.LLM`` behind :class:`BatchEngineProtocol`; also the body of Ray replica actors.

    Any thread may call it, several at once: the engine is built on a thread of its own, and
    every call (generate, ``collective_rpc``, prefix-cache reset) runs there, one at a time, while
    the caller waits. vLLM's engine is not thread-safe (two overlapping ``generate`` calls corrupt
    its request bookkeeping), and its CPU kernels bind their OpenMP threads on the thread that
    built it; so ``LLMCollector.start()``, ``async_envs`` and Ray actors with several threads all
    work without care from the caller.

    On CPU, vLLM's default KV cache does not fit: pass ``engine_kwargs={"kv_cache_memory_bytes":
    1 << 30}`` (or set ``VLLM_CPU_KVCACHE_SPACE=1``, in GiB). With ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    the engine runs in this process (it starts several times faster); otherwise it spawns processes
    and the entry point needs an ``if __name__ == "__main__":`` guard.

    Keep at most one in-process engine per process: vLLM holds its parallel state in module
    globals, and tearing one engine down breaks any other. It also initialises torch.distributed's
    default group (world size 1, gloo) in this process. For several engines use Ray replicas
    (``lmcollect.ray.vllm_replicas``).

    Args:
        model_path: a local Hugging Face model folder (or anything ``vllm.LLM(model=...)`` takes).
        engine_kwargs: more ``vllm.LLM`` arguments, e.g. ``enforce_eager``, ``seed``,
            ``worker_extension_cls``; see :func:`engine_kwargs_for` for our defaults.
    """

    def __init__(self, model_path: str | Path, *, engine_kwargs: dict[str, Any] | None = None) -> None:
        vllm = import_vllm()
        self.model_path = str(model_path)
        kwargs = engine_kwargs_for(model_path, engine_kwargs)
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="lmcollect-vllm-engine")
        logger.info("starting vllm.LLM(model=%s, %s)", self.model_path, kwargs)
        self.llm: LLM = self._on_engine_thread(vllm.LLM, model=self.model_path, **kwargs)

    def _on_engine_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the engine's thread, after the calls queued before it."""
        return self._engine_thread.submit(fn, *args, **kwargs).result()

    def generate_tokens(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        seeds: list[int] | None = None,
        *,
        stop_token_ids: Sequence[int] = (),
    ) -> list[Completion]:
        """One completion per prompt (token ids), in order; ``seeds`` gives each request its own RNG;
        ``stop_token_ids`` end a response (kept as its last token) besides the model's eos."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts; pass one seed per prompt.")
        stops = {"stop_token_ids": list(stop_token_ids)} if stop_token_ids else {}
        params: SamplingParams | list[SamplingParams]
        if seeds is None:
            params = SamplingParams(**sampling_params_kwargs(sampling), **stops)
        else:
            params = [SamplingParams(**sampling_params_kwargs(sampling, seed=s), **stops) for s in seeds]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self._on_engine_thread(self.llm.generate, requests, params, use_tqdm=False)
        return [completion_of(out.outputs[0]) for out in outputs]

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method`` on every worker of the engine (see ``vllm.LLM.collective_rpc``)."""
        return self._on_engine_thread(self.llm.collective_rpc, method, args=args, kwargs=kwargs)

    @property
    def num_replicas(self) -> int:
        return 1

    def collective_rpc_each(
        self, method: str, args_per_replica: list[tuple], kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Like ``VLLMReplicas.collective_rpc_each``: one engine, so one tuple of arguments."""
        if len(args_per_replica) != 1:
            raise ValueError(f"this engine has one replica; got arguments for {len(args_per_replica)}.")
        return self.collective_rpc(method, args_per_replica[0], kwargs)

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks; needed after a weight update, or old activations are reused."""
        if not self._on_engine_thread(self.llm.reset_prefix_cache):
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?).")

    def ready(self) -> bool:
        """True (a cheap call that returns once the engine is built, e.g. through a Ray actor)."""
        return True


class VLLMPolicy:
    """Answers a batch of chat prompts with vLLM; same output layout as ``TransformersPolicy``.

    Prompt token ids are built here exactly as ``TransformersPolicy`` builds them (a multi-turn
    dialog's next prompt starts with the previous turn's tokens as generated, see
    :func:`lmcollect.policies.outputs.answer_prompts`) and sent to vLLM as token ids, so both see
    identical prompt tokens. The tokens are the truth; ``text`` entries are a rendering.
    Log-probs are those of the raw model (vLLM's ``logprobs_mode="raw_logprobs"``).
    ``SamplingConfig(sampled_log_probs=True)`` is refused: vLLM (0.32) picks one log-prob mode per
    engine, not per request, so it cannot return the raw and the sampled log-probs together.
    Weights live in the engine, so there is no ``.model``: weight updates go through
    ``policy.engine.collective_rpc`` and must be followed by :meth:`reset_prefix_cache`.

    Args:
        model_path: a local Hugging Face model folder (weights, config and tokenizer).
        sampling: sampling parameters; keyword arguments override its fields.
        engine_kwargs: ``vllm.LLM`` arguments for the in-process engine (see :class:`VLLMEngine`).
        engine: an already built engine instead (e.g. ``lmcollect.ray.vllm_replicas.VLLMReplicas``);
            exclusive with ``engine_kwargs``.
        stop_token_ids: more ids that end a response (kept as its last token), on top of the
            model's eos ids; e.g. to give a random model responses of varied length.

    Example::

        policy = VLLMPolicy(path, temperature=0.0, engine_kwargs={"kv_cache_memory_bytes": 1 << 30})
        td = policy(env.reset())
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        sampling: SamplingConfig | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        engine: BatchEngineProtocol | None = None,
        stop_token_ids: Collection[int] | None = None,
        **sampling_kwargs: Any,
    ) -> None:
        if engine is not None and engine_kwargs is not None:
            raise ValueError("pass either engine or engine_kwargs, not both: engine_kwargs only build a new engine.")
        self.sampling = sampling_from_kwargs(sampling, sampling_kwargs, owner=type(self).__name__)
        if self.sampling.sampled_log_probs:
            raise ValueError(
                "VLLMPolicy cannot store sampled log-probs (sampled_log_probs=True): vLLM sets logprobs_mode per "
                f"engine and this policy's engines return {LOGPROBS_MODE!r}, which ('log_probs', 'response') "
                "needs. Use TransformersPolicy for sampled log-probs, or set sampled_log_probs=False."
            )
        self.model_path = str(model_path)
        engine_kwargs = dict(engine_kwargs or {})
        self.tokenizer = AutoTokenizer.from_pretrained(engine_kwargs.get("tokenizer", self.model_path))
        self.stop_token_ids = engine_stop_token_ids(self.model_path, self.tokenizer)
        # the ids vLLM does not stop at by itself (its eos ids come from the model's config)
        self._extra_stop_ids = [int(i) for i in stop_token_ids or () if int(i) not in self.stop_token_ids]
        self.stop_token_ids += self._extra_stop_ids
        if self.sampling.seed is not None:
            engine_kwargs.setdefault("seed", self.sampling.seed)
        if engine is None:
            engine = VLLMEngine(model_path, engine_kwargs=engine_kwargs)
        self.engine: BatchEngineProtocol = engine
        self._request_seeds = RequestSeeds(self.sampling.seed)

    def set_seed(self, seed: int) -> None:
        """Draw the per-request sampling seeds from ``seed`` from now on (reproducible sampling;
        see :class:`~lmcollect.engines.sampling.RequestSeeds`)."""
        self._request_seeds.seed(seed)

    def rng_state(self) -> list | None:
        """The per-request seed stream's state (saved by a collector's ``state_dict``)."""
        return self._request_seeds.state()

    def set_rng_state(self, state: list | None) -> None:
        """Restore :meth:`rng_state` (None: unseeded, as before)."""
        self._request_seeds.set_state(state)

    def reset_prefix_cache(self) -> None:
        """Drop the engine's cached prefixes (call after every weight update)."""
        self.engine.reset_prefix_cache()

    def generate(
        self, prompts: Sequence[Sequence[int]] | Sequence[str]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Prompt tokens, response tokens and raw response log-probs for each prompt (token-id
        lists, or strings tokenized without special tokens)."""
        return generate_triples(self.tokenizer, self.generate_responses, prompts)

    def generate_responses(self, prompt_ids: list[list[int]]) -> list[Generation]:
        """One response per prompt (token ids), in order."""
        seeds = self._request_seeds.draw(len(prompt_ids), greedy=self.sampling.greedy)
        if self._extra_stop_ids:  # only then: engines without the option (a server) keep working
            completions = self.engine.generate_tokens(prompt_ids, self.sampling, seeds, stop_token_ids=self._extra_stop_ids)
        else:
            completions = self.engine.generate_tokens(prompt_ids, self.sampling, seeds)
        return [
            Generation(torch.tensor(c.tokens, dtype=torch.long), torch.tensor(c.log_probs, dtype=torch.float32))
            for c in completions
        ]

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        return answer_prompts(
            td, self.tokenizer, self.generate_responses, sampling=self.sampling, stop_token_ids=self.stop_token_ids
        )


def engine_stop_token_ids(model_path: str | Path, tokenizer: Any) -> list[int]:
    """The ids vLLM stops at: the generation config's eos ids plus the tokenizer's eos."""
    config_file = Path(model_path) / "generation_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    return eos_token_ids(config.get("eos_token_id"), tokenizer)
