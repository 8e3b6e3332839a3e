"""The TensorDict keys of a collected dialog turn (torchrl-compatible names).

One dialog turn is a TensorDict with an empty batch size; a batch is a lazy stack of turns,
shaped (num_envs, T) or flat. Variable-length tensors are read padded with
``batch.get(TOKENS_FULL, as_padded_tensor=True, padding_side="right")``.
"""

from __future__ import annotations

# Chat histories (History objects, stored as non-tensor data).
HISTORY_PROMPT = ("history", "prompt")  # what the policy saw
HISTORY_RESPONSE = ("history", "response")  # the assistant message it wrote
HISTORY_FULL = ("history", "full")  # prompt + response

# Rendered text (str).
TEXT_PROMPT = ("text", "prompt")
TEXT_RESPONSE = ("text", "response")
TEXT_FULL = ("text", "full")

# Token ids (1-D int64 tensors; full == cat(prompt, response)).
TOKENS_PROMPT = ("tokens", "prompt")
TOKENS_RESPONSE = ("tokens", "response")
TOKENS_FULL = ("tokens", "full")

# Masks over TOKENS_FULL (1-D bool tensors).
ATTENTION_MASK = ("masks", "all_attention_mask")
ASSISTANT_MASK = ("masks", "all_assistant_mask")

# Carried by the collector into the next turn's observation (never in a collected turn): the
# previous turn's full history and its tokens exactly as the engine saw and generated them, so the
# policy builds the next prompt's tokens by appending to them instead of re-tokenizing the dialog.
HISTORY_PREFIX = ("history", "prefix")
TOKENS_PREFIX = ("tokens", "prefix")

# Log-probs of each response token under the policy that generated it (1-D float32).
LOG_PROBS_RESPONSE = ("log_probs", "response")

# What the trainer needs next to each sample (written by TransformersPolicy and VLLMPolicy).
# LOG_PROBS_RESPONSE holds the raw log-probs (the model's softmax at temperature 1, before top-p /
# top-k): what a trainer's forward pass recomputes, the ratio PPO / GRPO take. LOG_PROBS_SAMPLED,
# present only with SamplingConfig(sampled_log_probs=True), holds the log-probs of the distribution
# the token was actually drawn from (after temperature, top-k, top-p; 0 for greedy): the behaviour
# policy of off-policy / truncated-importance-sampling corrections of the sampler itself.
LOG_PROBS_SAMPLED = ("log_probs", "sampled")  # 1-D float32, like LOG_PROBS_RESPONSE
SAMPLING_TEMPERATURE = ("sampling", "temperature")  # float32 scalar; 0 = greedy
SAMPLING_TOP_P = ("sampling", "top_p")  # float32 scalar; 1 = off
SAMPLING_TOP_K = ("sampling", "top_k")  # int64 scalar; 0 = off
SAMPLING_MAX_NEW_TOKENS = ("sampling", "max_new_tokens")  # int64 scalar; the turn's token budget
SAMPLING_SAMPLED_LOG_PROBS = ("sampling", "sampled_log_probs")  # bool scalar: LOG_PROBS_SAMPLED is stored

# Bookkeeping written by the collector.
POLICY_VERSION = "policy_version"  # version that generated this turn (int64 scalar)
TRAJ_IDS = ("collector", "traj_ids")  # unique id of the trajectory (int64 scalar)
ENV_INDEX = ("collector", "env_index")  # which env slot produced the turn (int64 scalar)
TRAJ_MIN_VERSION = ("collector", "min_policy_version")  # oldest version in the trajectory so far
TRAJ_MAX_VERSION = ("collector", "max_policy_version")  # newest version in the trajectory so far
GROUP_ID = ("collector", "group_id")  # GRPO group key: unique across envs and collectors (-1: no group)
TOKEN_VERSIONS = (
    "collector",
    "token_versions",
)  # int64 [n_response]: version index of the weights that generated each token (continuous collection)
# int64 [n_response]: the oldest weight version that computed a key/value each token attended to. Equal
# to TOKEN_VERSIONS under kv_policy="recompute" (a push drops older keys/values: every token is the new
# weights' forward pass over its whole context); possibly older under "keep" (the context's keys/values
# were computed by older weights). Tokens where it differs from TOKEN_VERSIONS are off-policy in the
# context too: mask them, or correct with importance weights (see docs/continuous.md, "KV policy").
KV_VERSIONS = ("collector", "kv_versions")
PREFIX_MISMATCH = ("collector", "prefix_mismatch")
"""bool scalar (continuous collection): the turn's prompt reused its dialog's recorded tokens (prompt +
response of the previous turn, exactly as generated) and the chat template tokenizes the same
conversation differently (a reply cut by ``max_new_tokens`` or a stop string, tokens that merge
otherwise when re-encoded). The recorded tokens are what the model saw and what the turn holds."""
STEP_COUNT = "step_count"  # index of the turn within its trajectory (int64 scalar, 0-based)

# Written by the env's step under "next" (shape [1], as in torchrl).
REWARD = "reward"
DONE = "done"
TERMINATED = "terminated"
TRUNCATED = "truncated"
NEXT_REWARD = ("next", REWARD)
NEXT_DONE = ("next", DONE)
NEXT_TERMINATED = ("next", TERMINATED)
NEXT_TRUNCATED = ("next", TRUNCATED)
NEXT_HISTORY_PROMPT = ("next", "history", "prompt")

# Written by envs that draw prompts in groups (ChatEnv): the env's own draw counter; the collector
# turns it into GROUP_ID.
ENV_PROMPT_ID = ("env", "prompt_id")

# An observation may carry per-turn sampling settings (a dict of SamplingConfig fields: max_new_tokens,
# temperature, top_p, stop_strings; or that dict as JSON text) that its turn uses instead of the collector's
# (continuous collection; never in a collected turn: the turn records the settings used under ("sampling", ...)).
SAMPLING_OVERRIDES = ("sampling", "overrides")

# Partial reset mask passed to env.reset (bool, shape [B, 1]).
RESET = "_reset"

# What a policy must add to the env's observation.
POLICY_OUTPUT_KEYS = (HISTORY_RESPONSE, HISTORY_FULL, TOKENS_RESPONSE, LOG_PROBS_RESPONSE)
