"""Dialog tasks for ChatEnv: the Task interface, single-turn scoring, arithmetic and guessing games."""
from lmcollect.envs.tasks.arithmetic import arithmetic_dataset
from lmcollect.envs.tasks.base import SingleTurnTask, Task, TaskReply
from lmcollect.envs.tasks.guessing import GuessingGameTask, GuessingState, binary_search_player, guessing_game_dataset
from lmcollect.envs.tasks.comparison import comparison_dataset
from lmcollect.envs.tasks.shipped import SHIPPED_TASKS, ShippedTask, get_shipped_task

__all__ = [
    "GuessingGameTask",
    "GuessingState",
    "SingleTurnTask",
    "Task",
    "TaskReply",
    "arithmetic_dataset",
    "guessing_game_dataset",
    "binary_search_player",
    "SHIPPED_TASKS",
    "ShippedTask",
    "comparison_dataset",
    "get_shipped_task",
]
