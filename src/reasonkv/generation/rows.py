"""Each row's output as it is decoded: its tokens, when and why it ended (EOS, a stop string, the limit)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["Rows"]


class Rows:
    """The tokens each row has produced and which rows are still live.

    A finished row is fed padding from then on, which the cache neither stores nor evicts for.
    ``ended[i]`` is ``(time, evictions)`` when row ``i`` ended, read from ``clock`` when it did.
    """

    def __init__(
        self,
        batch: int,
        device: torch.device,
        tokenizer,
        eos: set[int],
        stop: list[str],
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.tokenizer, self.eos, self.stop, self.clock = tokenizer, eos, stop, clock
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.finish: list[str | None] = [None] * batch
        self.ended: list[tuple[float, int] | None] = [None] * batch
        self.alive = torch.ones(batch, dtype=torch.bool, device=device)

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def take(self, tokens: torch.Tensor, cache) -> None:
        """Append this step's token of every live row (the one host read of a step) and note which ended."""
        newly = []
        for i, token in enumerate(tokens.tolist()):
            if self.finish[i] is not None:
                continue
            self.tokens[i].append(token)
            if token in self.eos:
                self.finish[i] = "eos"
            elif self.stop and self._hit_stop(self.tokens[i]):
                self.finish[i] = "stop"
            if self.finish[i] is not None:
                self.alive[i] = False
                newly.append(i)
        if newly:
            now, evictions = self.clock(), cache.row_evictions.tolist()
            for i in newly:
                self.ended[i] = (now, evictions[i])

    def next_input(self, tokens: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next forward's ``[batch, 1]`` input ids and padding mask (None while every row is live)."""
        if all(f is None for f in self.finish):
            return tokens.unsqueeze(1), None
        return tokens.masked_fill(~self.alive, pad_id).unsqueeze(1), self.alive.unsqueeze(1)

    def close(self, now: float, cache) -> None:
        """Rows cut by the token limit end now, with the evictions they had."""
        evictions = cache.row_evictions.tolist()
        self.ended = [e or (now, evictions[i]) for i, e in enumerate(self.ended)]

    def text(self, i: int) -> str:
        """Row ``i``'s text: without its EOS token, cut after the first stop string."""
        if self.tokenizer is None:
            return ""
        tokens = self.tokens[i][:-1] if self.finish[i] == "eos" else self.tokens[i]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if self.finish[i] == "stop":
            ends = [text.find(s) + len(s) for s in self.stop if s in text]
            text = text[: min(ends)] if ends else text
        return text

    def _hit_stop(self, tokens: list[int]) -> bool:
        tail = self.tokenizer.decode(tokens[-(max(map(len, self.stop)) + 8) :], skip_special_tokens=True)
        return any(s in tail for s in self.stop)
