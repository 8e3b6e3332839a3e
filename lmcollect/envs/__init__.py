"""Chat environments: prompt datasets, reward functions, tasks, ChatEnv, the async env pool and the env registry (the one door, see :mod:`lmcollect.envs.registry`)."""

from lmcollect.envs._td import PROMPT_ID, SAMPLE_INDEX
from lmcollect.envs.chat_env import ChatEnv, ChatEnvElement, RewardError
from lmcollect.envs.config import ChatEnvConfig
from lmcollect.envs.datasets import PromptDataset, row_to_history
from lmcollect.envs.pool import AsyncEnvPool
from lmcollect.envs.protocol import AsyncEnvProtocol, DialogFailed, EnvProtocol
from lmcollect.envs.registry import as_env, make_env, named_task, register_ecosystem, register_env, registered_envs
from lmcollect.envs.rewards import (
    ExactMatchReward,
    MathAnswerReward,
    RewardFn,
    as_reward_fn,
    extract_math_answer,
    parse_math_answer,
)
from lmcollect.envs.tasks import (
    SHIPPED_TASKS,
    AsyncTask,
    GuessingGameTask,
    OpeningTask,
    ShippedTask,
    SingleTurnTask,
    StatefulTask,
    Task,
    TaskReply,
    ToolCalcTask,
    arithmetic_dataset,
    binary_search_player,
    comparison_dataset,
    get_shipped_task,
    guessing_game_dataset,
    tool_calc_dataset,
    tool_calc_player,
)

__all__ = [
    "PROMPT_ID",
    "SAMPLE_INDEX",
    "SHIPPED_TASKS",
    "AsyncEnvPool",
    "AsyncEnvProtocol",
    "AsyncTask",
    "ChatEnv",
    "ChatEnvConfig",
    "ChatEnvElement",
    "DialogFailed",
    "EnvProtocol",
    "ExactMatchReward",
    "GuessingGameTask",
    "MathAnswerReward",
    "OpeningTask",
    "PromptDataset",
    "RewardError",
    "RewardFn",
    "ShippedTask",
    "SingleTurnTask",
    "StatefulTask",
    "Task",
    "TaskReply",
    "ToolCalcTask",
    "arithmetic_dataset",
    "as_env",
    "as_reward_fn",
    "binary_search_player",
    "comparison_dataset",
    "extract_math_answer",
    "get_shipped_task",
    "guessing_game_dataset",
    "make_env",
    "named_task",
    "parse_math_answer",
    "register_ecosystem",
    "register_env",
    "registered_envs",
    "row_to_history",
    "tool_calc_dataset",
    "tool_calc_player",
]
