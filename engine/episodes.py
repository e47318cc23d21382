"""
The rows of a rollout as episodes: the model acts, a tool answers inside the same row, the row goes
on. A plain rollout's row is an episode with no call in it.

A row is sampled tokens (the model's) and observation tokens (a tool's) interleaved, within one
completion budget. When a row samples one of the task's call ids, the tool gets the row's tokens so
far and returns the observation's ids, or None (the episode ends there). The sampler does not
restart the row: rollout.py's decode loop feeds [the call token; the observation] into that row's
own KV cache at its place, in one decode forward for all the rows answered at a sync, several
tokens a row (decode.Decoder.feed), samples the next token from its last logits, and decoding goes
on. No earlier token of the row is recomputed, and its prompt is still read once per group.

Rows holds each row as the decode loop (rollout.py) writes it, and the two pieces of its sync (the
loop's host sync):
- sync: the sync's host side. Each row that drew an end since the last sync (a call or a stop
  id; the loop flags them on the device) is cut just after its first one: the tokens it decoded
  past it are dropped. A stop ends the row; a call with turns left makes it wait for the tool; a
  call with no turns left (max_turns) ends it, not stopped. A row that reached the budget ends.
- observe: the tool answers the waiting rows (`respond`, one call per sync for all of them:
  train.py runs the task's tool there, with its timeout). An observation is written into the row,
  marked as not sampled (`sampled` False, logprob 0), and counts as a call (the row's `calls`). One
  that does not fit in the budget is rolled back, as TRL's tool loop rolls it back: the row ends
  at its call, stopped when the call token is a stop id (TRL's completion ends with its EOS).

Leaves out: the decoding itself (rollout.py, engine/decode.py), tools running concurrently with decoding
(they run at the sync, while the batch waits), stop strings (calls and stops are token ids).
Shapes: R rows, Tc the completion budget, k the rows a call reads or writes.
Tested by tests/test_episodes.py; benchmarked by tests/bench_rollout.py (a tool turn against
re-prefilling the row).
"""

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass
class Episodes:
    """What rollout.generate needs to run multi-turn rows."""
    respond: Callable[[list[tuple[int, list[int]]]], list]  # [(row, tokens so far)] -> ids | None
    call_ids: tuple[int, ...]  # the token ids that end a call (a task's call delimiter)
    max_turns: int = 1         # tool calls per row; a call beyond them ends the row


@dataclass
class Rows:
    """Each row of a rollout as the decode loop writes it: on the device its tokens, their
    logprobs and which the model sampled, (R, Tc); on the host, settled at the syncs, its
    length, its calls and whether it ended with a stop. Which rows go on is the loop's (its
    active rows: sync and observe say which leave). Row ids are the decode loop's
    (rollout.generate maps them to the caller's)."""
    tokens: Tensor        # (R, Tc) long; -1 where nothing was written
    logprobs: Tensor      # (R, Tc) float32; 0 on observations
    sampled: Tensor       # (R, Tc) bool; False on a tool's observation tokens
    length: list[int]     # each row's tokens so far (the first, drawn at fan-out, included)
    calls: list[int]      # tool calls whose whole observation is in the row
    stopped: list[bool]   # it ended with a stop id (or its tool ended the episode)

    @classmethod
    def empty(cls, R: int, Tc: int, device: torch.device) -> "Rows":
        tokens = torch.full((R, Tc), -1, dtype=torch.long, device=device)
        logprobs = torch.zeros(R, Tc, dtype=torch.float32, device=device)
        sampled = torch.ones(R, Tc, dtype=torch.bool, device=device)
        return cls(tokens, logprobs, sampled, [min(Tc, 1)] * R, [0] * R, [False] * R)

    def write(self, rows: Tensor, at: Tensor, tokens: Tensor, logprobs: Tensor) -> None:
        """Drawn tokens and their logprobs (k,) into rows (k,) at completion indices at (k,)."""
        self.tokens.index_put_((rows, at), tokens)
        self.logprobs.index_put_((rows, at), logprobs)

    def budget(self, active: list[int]) -> int:
        """Decode steps every active row still has room for."""
        return min(self.tokens.shape[1] - self.length[r] for r in active)

    def moved_on(self, active: list[int], steps: int) -> None:
        for r in active:
            self.length[r] += steps

    def unseen(self, r: int, steps: int) -> int:
        """Where active row r's tokens since the last sync begin, `steps` decode steps after it:
        its last steps + 1 tokens. The one before the steps is new for a row the tool answered
        at the last sync (the token it drew at its feed) and before the first sync (the fan-out's
        token); any other row's is its last token at the last sync, seen then and no call or stop
        (else the row was cut there): looking at it again finds nothing."""
        return self.length[r] - steps - 1

    def first_nan(self, active: list[int], steps: int) -> int | None:
        """The first completion index since the last sync where a row's logprob is NaN, or None.
        The draw gives a row NaN when its logits hold NaN or +inf, or are all -inf (engine/sampling.py):
        on the device no step looks at its logits; here, at the sync, one reduction over the
        steps since the last one finds them (one host copy)."""
        first = min(self.unseen(r, steps) for r in active)
        last = max(self.length[r] for r in active)
        bad = self.logprobs[:, first:last].isnan().any(0).nonzero()[:1, 0].tolist()  # (<= 1,)
        return first + bad[0] if bad else None

    def sync(self, active: list[int], steps: int, drew: list[int], stop_ids: tuple[int, ...],
             episodes: Episodes | None) -> tuple[list[int], list[tuple[int, int, list[int]]]]:
        """The sync (module docstring), `steps` decode steps after the last: active[i] for i in
        `drew` drew a call or a stop since then. Returns the rows that go on decoding, and those
        that wait for the tool: (row, its call's index, its tokens up to the call); the others
        end."""
        found = [active[i] for i in drew]
        call_ids = episodes.call_ids if episodes else ()
        ends = set(stop_ids) | set(call_ids)
        seen = self.tokens[found, :max(self.length[r] for r in found)].tolist() if found else []
        waiting = []
        for r, tokens in zip(found, seen):  # each row's first end among its new tokens
            j = next(j for j in range(self.unseen(r, steps), self.length[r]) if tokens[j] in ends)
            self.length[r] = j + 1  # what it decoded past the call or stop is dropped
            self.stopped[r] = tokens[j] in stop_ids  # a waiting row's, if its observation is cut
            if tokens[j] in call_ids and self.calls[r] < episodes.max_turns:
                waiting.append((r, j, tokens[:j + 1]))
        # A stop, a call with no turns left or the budget spent ends a row.
        cut = set(found)
        going = [r for r in active if r not in cut and self.length[r] < self.tokens.shape[1]]
        return going, waiting

    def observe(self, waiting: list[tuple[int, int, list[int]]], episodes: Episodes,
                vocab: int) -> list[tuple[int, list[int], int]]:
        """The tool answers the waiting rows (module docstring). Returns the rows to feed, which
        go on: (row, [its call token; the observation], the call's index); the others end."""
        observations = episodes.respond([(r, tokens) for r, _, tokens in waiting])
        feeds = []
        for (r, j, tokens), observation in zip(waiting, observations):
            if observation is None:  # the tool ended the episode (a turn with no call in it)
                self.stopped[r] = True
                continue
            bad = [t for t in observation if not (isinstance(t, int) and 0 <= t < vocab)]
            if bad:
                raise ValueError(f"the tool's observation has token id {bad[0]!r} outside the "
                                 f"vocabulary [0, {vocab})")
            room = self.tokens.shape[1] - self.length[r]  # the budget counts observation tokens too
            if len(observation) > room:  # rolled back: the row ends at its call, uncounted
                continue
            self.calls[r] += 1
            self.stopped[r] = False
            span = slice(self.length[r], self.length[r] + len(observation))
            self.tokens[r, span] = torch.tensor(observation, dtype=torch.long,
                                                device=self.tokens.device)
            self.logprobs[r, span] = 0.0
            self.sampled[r, span] = False
            self.length[r] += len(observation)
            if len(observation) < room:  # room for at least one more sampled token
                feeds.append((r, [tokens[j]] + observation, j))
        return feeds

    def cut(self, order: list[int]) -> tuple[Tensor, ...]:
        """The rows in `order`, each cut at its length: tokens (R, Tc) with 0 after the end, mask
        (R, Tc), logprobs 0 off the sampled tokens, stopped (R,) and sampled (R, Tc), on the
        device (Tc the longest row), as normal tensors (training may index them under
        autograd)."""
        device = self.tokens.device
        rows = torch.tensor(order, device=device)  # (R,)
        lengths = torch.tensor([self.length[r] for r in order], device=device)  # (R,)
        Tc = max(self.length)
        mask = torch.arange(Tc, device=device) < lengths[:, None]  # (R, Tc)
        tokens = self.tokens[rows, :Tc].masked_fill(~mask, 0)
        sampled = self.sampled[rows, :Tc] & mask
        logprobs = self.logprobs[rows, :Tc].masked_fill(~sampled, 0.0)
        stopped = torch.tensor([self.stopped[r] for r in order], device=device)
        with torch.inference_mode(False):  # generate runs in inference mode
            return tuple(t.clone() for t in (tokens, mask, logprobs, stopped, sampled))
