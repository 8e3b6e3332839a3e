"""Dialog tasks for ChatEnv: the Task interface, single-turn scoring, arithmetic, guessing games and a calculator tool."""

from lmcollect.envs.tasks.arithmetic import arithmetic_dataset
from lmcollect.envs.tasks.base import (
    AsyncTask,
    OpeningTask,
    SingleTurnTask,
    StatefulTask,
    Task,
    TaskReply,
    respond_async,
)
from lmcollect.envs.tasks.comparison import comparison_dataset
from lmcollect.envs.tasks.guessing import GuessingGameTask, GuessingState, binary_search_player, guessing_game_dataset
from lmcollect.envs.tasks.shipped import SHIPPED_TASKS, ShippedTask, get_shipped_task
from lmcollect.envs.tasks.tool_calc import ToolCalcState, ToolCalcTask, tool_calc_dataset, tool_calc_player

__all__ = [
    "SHIPPED_TASKS",
    "AsyncTask",
    "GuessingGameTask",
    "GuessingState",
    "OpeningTask",
    "ShippedTask",
    "SingleTurnTask",
    "StatefulTask",
    "Task",
    "TaskReply",
    "ToolCalcState",
    "ToolCalcTask",
    "arithmetic_dataset",
    "binary_search_player",
    "comparison_dataset",
    "get_shipped_task",
    "guessing_game_dataset",
    "respond_async",
    "tool_calc_dataset",
    "tool_calc_player",
]
