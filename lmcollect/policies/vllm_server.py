"""A policy that generates through a vLLM server: :class:`VLLMServerPolicy` (the engine is
:class:`~lmcollect.engines.served.VLLMServerEngine`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lmcollect.engines.sampling import SamplingConfig
from lmcollect.engines.served import VLLMServerEngine, check_server_config, serve_command
from lmcollect.engines.vllm.common import checkpoint_eos_token_ids
from lmcollect.policies.vllm_policy import VLLMPolicy

__all__ = ["VLLMServerPolicy", "serve_command"]

logger = logging.getLogger(__name__)


class VLLMServerPolicy(VLLMPolicy):
    """A :class:`VLLMPolicy` whose engine is a vLLM server: same output layout, same log-probs.

    Prompts are rendered and tokenized here (token-exact multi-turn dialogs, see
    :func:`lmcollect.policies.outputs.answer_prompts`) and sent as token ids; the server returns the
    generated ids and their raw log-probs, one request per prompt, many at once. The server must
    run VLLMPolicy's engine settings: ``--logprobs-mode raw_logprobs`` (checked when the server
    shows its configuration) and the checkpoint's ``--dtype`` (:func:`serve_command` gives all of
    them). Weight pushes (``vLLMUpdater``) go through ``policy.engine`` and need the server's
    control endpoints (off by default: ``VLLMServer(control_endpoints=True)``), its control token
    (``control_token=server.control_token``) and ``--worker-extension-cls`` (see
    :class:`VLLMServerEngine`). Generation alone needs neither endpoints nor token.

    Args:
        base_url: the server's root URL, e.g. ``"http://127.0.0.1:8000"``.
        model: the served model's name; None: the server's only model.
        tokenizer: a local folder with the model's tokenizer, chat template and generation config;
            None: the folder the server loaded the model from (a server on this machine).
        sampling: sampling parameters; keyword arguments override its fields.
        max_concurrent_requests: completion requests in flight at once.
        timeout_s: longest one HTTP call may take, all of it.
        check_server: read the server's configuration (``/server_info``, a control endpoint;
            skipped when the server does not show it to this policy) and refuse a server whose
            log-probs are not raw.
        control_token: the server's control token, sent on control calls only (weight pushes,
            ``/server_info``); None: none.

    Example::

        server = VLLMServer(model_path, control_endpoints=True)  # generates server.control_token
        policy = VLLMServerPolicy(server.url, control_token=server.control_token, temperature=1.0, max_new_tokens=64)
        collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=64,
                                 weight_updater=vLLMUpdater(), track_policy_version=True)
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        tokenizer: str | Path | None = None,
        sampling: SamplingConfig | None = None,
        max_concurrent_requests: int = 64,
        timeout_s: float = 600.0,
        check_server: bool = True,
        control_token: str | None = None,
        **sampling_kwargs: Any,
    ) -> None:
        engine = VLLMServerEngine(
            base_url,
            model=model,
            max_concurrent_requests=max_concurrent_requests,
            timeout_s=timeout_s,
            control_token=control_token,
        )
        folder = Path(tokenizer if tokenizer is not None else engine.model_root)
        if not folder.is_dir():
            raise ValueError(
                f"the server at {engine.base_url} loaded its model from {str(folder)!r}, which is not a folder here; "
                "pass tokenizer=<a local folder with the model's tokenizer and generation config>."
            )
        if check_server:
            config = engine.server_config()
            if config is None:
                logger.info(
                    "the vLLM server at %s does not show its configuration to this policy (control endpoints off, "
                    "or no control_token); its log-probs mode is not checked",
                    engine.base_url,
                )
            else:
                check_server_config(config, folder, engine.base_url)
        super().__init__(folder, sampling=sampling, engine=engine, **sampling_kwargs)
        if engine.eos_token_ids is None:  # the folder's tokenizer is loaded now: no second load for them
            engine.eos_token_ids = checkpoint_eos_token_ids(folder, self.tokenizer)
        self._owns_engine = True  # built here: close() stops its request threads (the server keeps running)
        self.base_url = engine.base_url


# ---------------------------------------------------------------------------------- launching a server
