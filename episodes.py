"""
Multi-turn rollouts: the model acts, a tool answers inside the same row, the row goes on.

A row is an episode: sampled tokens (the policy's) and observation tokens (a tool's) interleaved,
within one completion budget. When a row samples one of the task's call ids, the tool gets the
row's tokens so far and returns the observation's ids, or None (the episode ends there). The
sampler does not restart the row: rollout.py's decoder prefills [the call token; the observation]
into that row's own KV cache at its position, in one forward for all the rows answered at a check
(Decoder.extend), samples the next token from its last logits, and decoding goes on. No earlier
token of the row is recomputed, and its prompt is still read once per group.

The loop is rollout.py's decode loop with each row at its own length:
1. Decode every active row for up to `check_every` steps (fewer when a row's budget runs out
   first; on the CPU, where a check costs no sync, until a row samples a call). Until the first
   tool turn the rows move in lockstep, exactly as rollout._decode moves them (the same steps,
   kernels and draws: a rollout with no call is the same rollout); after it, each row writes and
   attends at its own index.
2. The check (the only host sync): each active row's new sampled tokens are scanned for its first
   call or stop id. A call with turns left: the row is cut back to just after it (the tokens it
   decoded past the call are dropped) and waits for the tool. A stop: the row ends. A call with no
   turns left (max_turns): the row ends there, not stopped.
3. The tools answer (`respond`, one call per check for all waiting rows: train.py runs the task's
   tool there, with its timeout). An observation is written into the row, marked as not sampled
   (policy False, logprob 0); one that reaches the budget ends the row there. A call counts (the
   row's turns and `calls`) once its whole observation is in the row.
4. Finished rows leave the batch; the answered rows are extended and draw their next token.

Leaves out: tools running concurrently with decoding (they run at the check, while the batch
waits), stop strings (calls and stops are token ids).
Shapes: R rows, N active rows, Tc the completion budget.
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


def decode_episodes(decoder, out_tokens: Tensor, out_logprobs: Tensor, policy: Tensor,
                    draw: Callable[[Tensor], tuple[Tensor, Tensor]], stop_ids: tuple[int, ...],
                    check_every: int, episodes: Episodes, vocab: int) -> dict:
    """Decode the rows as episodes (the module docstring's steps 1-4), filling out_tokens,
    out_logprobs and policy (Tc, R) in place; row ids are the decoder's (rollout.generate maps them
    to the caller's). Returns stats and each row's final `lengths`, `stopped` and `calls`."""
    new, R = out_tokens.shape
    device = out_tokens.device
    length = [1] * R      # each row's tokens so far (its first was sampled at fan-out)
    scanned = [0] * R     # how many of them were looked at for a call or a stop
    calls = [0] * R
    stopped = [False] * R
    lockstep = True       # every active row at the same length (no tool turn yet)
    host = device.type == "cpu"  # a check is free here; on a GPU it is a sync, so it waits
    calls_t = torch.tensor(episodes.call_ids, dtype=torch.long, device=device)
    ends = set(episodes.call_ids) | set(stop_ids)  # what a check looks for
    tokens = out_tokens[0].clone()  # (N,) each active row's last token, fed next
    clock = decode_steps = row_steps = compactions = turns = 0
    while True:
        rows = decoder.layout.rows  # the active rows' ids
        # 1. Decode up to the next check (rollout._decode's schedule), within every row's budget.
        steps = min(check_every - (clock + 1) % check_every, min(new - length[r] for r in rows))
        for _ in range(steps):
            at = [length[r] - 1 for r in rows]  # each row's index of the token it feeds
            logits = decoder.step(tokens, clock if lockstep else at)  # (N, V)
            tokens, logprobs = draw(logits)  # (N,)
            index = (torch.tensor(at, device=device) + 1, decoder.rows)
            out_tokens.index_put_(index, tokens)
            out_logprobs.index_put_(index, logprobs)
            for r in rows:
                length[r] += 1
            clock += 1
            decode_steps += 1
            row_steps += len(rows)
            if host and torch.isin(tokens, calls_t).any():
                break  # a row called: on the CPU the check costs nothing, decoding past it does
        # 2. The check: each row's first call or stop among its new sampled tokens.
        seen = out_tokens[:max(length[r] for r in rows), decoder.rows].T.tolist()  # (N, <= Tc)
        keep, waiting = [], []
        for i, r in enumerate(rows):
            j = next((j for j in range(scanned[r], length[r]) if seen[i][j] in ends), None)
            if j is None:  # nothing yet: on, unless the budget is spent
                scanned[r] = length[r]
                if length[r] < new:
                    keep.append(i)
                continue
            length[r] = j + 1  # what it decoded past the call or stop is dropped
            if seen[i][j] in episodes.call_ids and calls[r] < episodes.max_turns:
                waiting.append((i, r, j))
            else:  # a stop, or a call with no turns left: the row ends
                stopped[r] = seen[i][j] in stop_ids
        # 3. The tools answer the waiting rows.
        answers = episodes.respond([(r, seen[i][:j + 1]) for i, r, j in waiting]) if waiting else []
        feeds = []
        for (i, r, j), observation in zip(waiting, answers):
            if observation is None:  # the tool ended the episode (a turn with no call in it)
                stopped[r] = True
                continue
            bad = [t for t in observation if not (isinstance(t, int) and 0 <= t < vocab)]
            if bad:
                raise ValueError(f"the tool's observation has token id {bad[0]!r} outside the "
                                 f"vocabulary [0, {vocab})")
            room = new - length[r]  # the budget counts observation tokens too
            # A call counts (a row's turns, the stats) once its whole answer is in the row; one
            # the budget cuts ends the row, uncounted.
            calls[r] += len(observation) <= room
            part = observation[:room]
            span = slice(length[r], length[r] + len(part))
            out_tokens[span, r] = torch.tensor(part, dtype=torch.long, device=device)
            out_logprobs[span, r] = 0.0
            policy[span, r] = False
            length[r] += len(part)
            scanned[r] = length[r]
            if len(observation) < room:  # room for at least one more sampled token
                keep.append(i)
                feeds.append((r, [seen[i][j]] + part, j))
        # 4. Finished rows leave; the answered rows are extended and draw their next token.
        if not keep:
            break
        keep.sort()
        if len(keep) < len(rows):
            decoder.drop(keep, filled=max(length[rows[i]] for i in keep) - 1)
            compactions += 1
        place = {r: i for i, r in enumerate(decoder.layout.rows)}
        last = torch.tensor([length[r] - 1 for r in decoder.layout.rows], device=device)
        tokens = out_tokens[last, decoder.rows]  # (N,) each row's last token
        if feeds:
            if lockstep:
                decoder.plain_linears()
            lockstep = False
            turns += len(feeds)
            logits = decoder.extend([place[r] for r, _, _ in feeds], [f for _, f, _ in feeds],
                                    [j for _, _, j in feeds])  # (k, V)
            drawn, logprobs = draw(logits)  # (k,)
            ids = torch.tensor([r for r, _, _ in feeds], device=device)
            at = torch.tensor([length[r] for r, _, _ in feeds], device=device)
            out_tokens.index_put_((at, ids), drawn)
            out_logprobs.index_put_((at, ids), logprobs)
            tokens[torch.tensor([place[r] for r, _, _ in feeds], device=device)] = drawn
            for r, _, _ in feeds:
                length[r] += 1
            row_steps += len(feeds)
    return dict(decode_steps=decode_steps, row_steps=row_steps, compactions=compactions,
                tool_turns=turns, lengths=length, stopped=stopped, calls=calls)
