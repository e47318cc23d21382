"""
The call-token tool: a function the model calls by writing one token in the middle of its
completion (a task's `call_tool=`, tasks:lookup's "?"); function tools in TRL's shape are
tools/functions.py's.

A `CallTool` is a function `fn(text, reference) -> str | None` and the token that ends a call.
When a row samples that token, engine/episodes.py asks tools/runtime.py's Responder for an
observation: `fn` gets the row's text so far (a runtime.Completion: every token of the episode,
earlier observations included, decoded as the rewards see text, with the model's turns and the
tool's observations told apart) and the prompt's reference (where a task keeps what its tool
knows), and returns the observation's text, or None: the episode ends there. The runtime writes it
into the row (the text itself, or the chat template's tool message).

A call token of "" means the end of the model's turn (the checkpoint's stop ids): the tool reads
the turn and answers a call in it, or returns None when the turn holds none (Qwen2.5's and Llama
3.1's chat formats end a tool-calling turn this way; tasks:chat_calc).
Tested by tests/test_episodes.py.
"""

from dataclasses import dataclass
from typing import Callable

from tools.runtime import ToolKind


@dataclass
class CallTool(ToolKind):
    fn: Callable[[str, str], "str | None"]  # (text so far, reference) -> observation or None
    call: str = ""  # the token that ends a call; "" = the end of the model's turn (stop ids)

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))

    def respond(self, text, reference, environment) -> "str | None":
        return self.fn(text, reference)  # a call-token tool keeps no environment

    def call_ids(self, tokenizer, stop_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The token ids that end a call: the call token, or the stop ids ("": the turn's end).
        One line when the call text is not one token of this tokenizer."""
        if not self.call:
            return tuple(stop_ids)
        ids = tokenizer.encode_text(self.call, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"the tool's call token {self.call!r} is {len(ids)} tokens for this "
                             "tokenizer; a call ends with one token (a special token of the "
                             "checkpoint, or \"\" for the end of the model's turn)")
        return tuple(ids)
