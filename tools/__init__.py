"""
A task's tools: what the model calls in the middle of its completion, and what they answer (the
observation, written into the same row). Two kinds, one runtime:

- tools/call_token.py: the call-token tool, `CallTool(fn, call)` (a task's `call_tool=`): the
  model writes one token (tasks:lookup's "?", or "" for the end of its turn) and `fn(text,
  reference)` answers with the observation's text.
- tools/functions.py: function tools in TRL's shape (a task's `tools=` and `environment_factory=`,
  as GRPOTrainer takes them): schemas for the chat template, the model's native calls parsed and
  dispatched, environments that keep a row's state.
- tools/runtime.py: what every tool goes through: the call with its timeout (and under tensor
  parallelism on the first rank alone), the model's mistakes (ToolError) told apart from the
  tool's failures (one line, the run stops), the observation written into the row as the prompt's
  format writes it, and the Completion a reward reads.

setup() is the one call train.py makes: the task's tools for the run (TaskTools), from which each
rollout starts its Responder (engine/episodes.py's respond). The package's public names are here:
`tools.CallTool`, `tools.ToolError`, `tools.Completion`; `tools.Tool` is the call-token tool's
former name, kept for task files written against it.
"""

import dataclasses

from tools import functions
from tools.call_token import CallTool
from tools.runtime import (Completion, Observation, Responder, TaskTools, ToolConfig, ToolError,
                           ToolFailure, ToolKind, call_tools, run_async, split_parts)

Tool = CallTool  # the former name: `tasks.Task(..., tool=tools.Tool(fn, call))` keeps running

__all__ = ["CallTool", "Completion", "Observation", "Responder", "TaskTools", "Tool", "ToolConfig",
           "ToolError", "ToolFailure", "ToolKind", "call_tools", "functions", "run_async",
           "setup", "split_parts"]


def setup(task, tokenizer, stop_ids: tuple[int, ...], cfg: ToolConfig, prompt_cfg=None,
          ranks=None) -> tuple[object, TaskTools | None, str]:
    """The task's tools for this run on this tokenizer: (the task, with an environment's
    get_reward among its rewards; its TaskTools, or None when it has no tool; a line for the first
    step, or ""). With --use_tools false nothing is called (no call ids), but a rollout still gets
    its environments and the rewards their messages. ranks: tp.ParallelGroups (None: one
    process)."""
    if task.call_tool is not None:
        call_ids = ()
        if cfg.use_tools:
            try:
                call_ids = task.call_tool.call_ids(tokenizer, stop_ids)
            except ValueError as e:
                raise ValueError(f"task {task.name}: {e}") from None
        return task, TaskTools(task, task.call_tool, tokenizer, call_ids, cfg, prompt_cfg,
                               ranks), ""
    if not task.tools and task.environment_factory is None:
        return task, None, ""
    variables = prompt_cfg.template_variables() if prompt_cfg else {}
    toolbox, note = functions.build(task, tokenizer, stop_ids, ranks.tp_size if ranks else 1,
                                    variables)
    if toolbox.reward:
        task = dataclasses.replace(task, rewards=[*task.rewards, (toolbox.reward, 1.0)])
    call_ids = tuple(stop_ids) if cfg.use_tools else ()  # a call ends the model's turn
    return task, TaskTools(task, toolbox, tokenizer, call_ids, cfg, prompt_cfg, ranks), note
