"""Constrained decoding in the engine: a request's tokens under its grammar (grammar.py).

`constrained_steps` replaces the engine's pick and stream for a request with a grammar (the
engine hands over after the prefill, so prefix reuse works as for any request). Per token:

- the pick applies the grammar's mask from a static device buffer (`SamplerKnobs.token_mask`,
  packed bits) in `sampler.sample`, so the pick stays capture-safe;
- the host advances the matcher with the picked token, launches the forward (which never needs
  the mask), and computes the next mask while the device runs it; the mask is copied into the
  buffer just before the pick. On a GPU the forward is asynchronous, so the two overlap; on a
  CPU the forward holds every core, and a helper thread for the mask measured slower than
  computing it in line (microseconds to a millisecond a token), so it runs in line there too;
- a free grammar (`GrammarSpec.trigger`: `tool_choice: auto`, serve/tools.py) is not masked:
  each token is drawn from the unmasked logits and kept where the grammar allows it, else drawn
  again under the mask (`checked_pick`), so free text is the text without a grammar; its JSON
  steering starts after the trigger;
- jump-forward: the tokens the grammar forces (`Matcher.forced`, the only continuation) are
  appended without sampling and go through the step with the picked token, several per call;
- with speculative decoding (or a request's predicted output), the drafts are cut to the prefix
  the grammar accepts,
  and each verified row is masked by the grammar's state before it (`Matcher.masks`), so what
  is kept is exactly what constrained decoding would pick (greedy) or its distribution;
- a complete grammar ends the request at once with the end-of-text token, and a dead end (no
  allowed token) raises a GrammarError: the request ends with that error, never with garbage;
- after a thought (`--reasoning-parser`, grammar.py): a thought still running when
  `answer_reserve(budget)` tokens are left is ended, its `</think>` forced, so the answer has
  room (not with logprobs, which forced tokens would lack); the JSON steering below starts
  after the thought;
- in the last `closing_reserve(budget)` tokens of max_tokens, a JSON grammar allows only the
  tokens that end it soonest wherever it allows any (closing.Closing: a string's closing quote,
  `}` and `]`, separators, `null`), so an answer that would run out of tokens (an endless
  number, a deep recursion) ends as valid JSON, shorter, with finish_reason "stop" as the
  grammar completed; drafts are not proposed then.

Each token and each verify goes through the engine's own step, so its rows are the bits the
decode graph computes; forced tokens go through it too, several per call (`_forward`). Where the
engine captures graphs (a GPU: `engine.split_steps`, step/split.py), the forward and the masked
pick are replayed from graphs of their own, and the mask is computed while the forward's graph
runs (a request with logprobs: the forward's graph, the pick eager on its logits); elsewhere
the step's forward runs uncaptured and the pick eagerly: the same ops, the same tokens
(tests/test_split.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..sampling.params import SamplingParams
from ..sampling.sampler import Penalties, SamplerKnobs, apply_token_mask, sample
from ..speculative.drafting import accept
from ..step.split import SplitSteps, forward_logits, step_rows
from .grammar import GrammarError, Matcher


def closing_reserve(budget: int) -> int:
    """The last tokens of a budget in which JSON is steered to close: enough for a string's
    quote and a few levels of brackets, at most half of a short budget."""
    return min(CLOSING_TOKENS, budget // 2)


CLOSING_TOKENS = 24
LEVEL_TOKENS = 6  # tokens to close an open object or array: separator, key, value, bracket
# a thought (grammar.py, --reasoning-parser) still running when this many tokens of the budget
# are left is closed, its </think> forced, so that the answer the grammar holds has room
ANSWER_TOKENS = 64


def answer_reserve(budget: int) -> int:
    """The last tokens of a budget kept for the answer after a thought: at most half of it."""
    return min(ANSWER_TOKENS, budget // 2)


def _forward(engine, split: SplitSteps | None, ids: list[int], pos: int) -> torch.Tensor:
    """Logits (V,) after `ids` written from `pos`; the cache commits them. The picked token and
    the forced ones (jump-forward) go through the decode step, several per call: the model's
    own forward would dequantize packed weights on every call."""
    logits = forward_logits(engine.step, split, ids, pos)  # on a GPU: asynchronous
    engine.cache.commit(ids)
    return logits


class _Constrained:
    """One request's grammar state beside the engine: matcher, mask buffer, drafter."""

    def __init__(self, engine, prompt_ids: Sequence[int], params: SamplingParams, gen,
                 pen: Penalties | None = None):  # fmt: skip
        self.engine, self.params, self.gen, self.pen = engine, params, gen, pen
        self.matcher: Matcher = params.grammar.matcher()
        words = self.matcher.words.shape[1]
        # a free grammar (tool_choice auto): each pick is checked and masked only when refused
        self.free, self.masked = bool(params.grammar.spec.trigger), True
        # the ends a free text may stop at, the grammar's end of text or not (a model's other
        # end ids, stop_token_ids): where the grammar may end, never given to the matcher
        self.ends = set(engine.cfg.eos_token_ids) | set(params.stop_token_ids)
        # the captured forward and pick (step/split.py); with logprobs the pick is eager, on
        # the forward's logits buffer (read by the engine before the next forward)
        self.split = getattr(engine, "split_steps", None)
        self.picker = None
        # (penalties adjust the logits before the mask: the eager pick, not the captured one)
        if self.split is not None and self.split.words == words and params.logprobs is None \
                and pen is None:  # fmt: skip
            self.picker = self.split.pick_graph(params)
            self.gen = self.picker.generator  # the request's one stream of draws
        self.knobs = SamplerKnobs(engine.device).with_token_mask(words)
        self.knobs.load(params)
        self.unmasked = SamplerKnobs(engine.device)  # a free grammar's first draw: no mask
        self.unmasked.load(params)
        cuda = engine.device.type == "cuda"
        self.host = torch.empty(words, dtype=torch.int32, pin_memory=cuda)
        spec = engine.speculator_for(params)  # prompt lookup, or drafts from a prediction
        self.spec = spec
        self.drafter = spec.drafter(prompt_ids, params) if spec is not None else None
        # the chained mode (step/split.py): the picked token's forward runs behind the pick
        # (not for a free grammar: its first draw may be refused after the forward is launched)
        self.chained = self.picker is not None and self.split.chain and self.drafter is None \
            and not self.free  # fmt: skip
        # the captured pick's mask for a free grammar's unmasked draw
        self.ones = torch.full((words,), -1, dtype=torch.int32, pin_memory=cuda)
        self.eos = next(iter(engine.cfg.eos_token_ids), None)

    def forced(self, left: int, answer: int) -> list[int]:
        """Tokens to append without sampling: what the grammar forces, or, for a thought that
        would leave the answer fewer than `answer` tokens, its end (Qwen's thinking budget)."""
        m = self.matcher
        end = list(m.grammar.thought_end) if m.thinking else []
        if end and left <= answer + len(end):
            # not inside a character (a byte-level token may leave one open): a token later
            return end[: left - 1] if m.allowed_prefix(end) == len(end) else []
        return m.forced()[: left - 1]

    def closing(self, left: int, reserve: int) -> bool:
        """Steer to the end now? In the last `reserve` tokens plus a few per open object or
        array (each takes tokens to close), or when a number runs away."""
        m = self.matcher
        return left <= reserve + LEVEL_TOKENS * m.depth or m.runaway

    def next_mask(self, closing: bool = False) -> None:
        """Compute the mask after the consumed tokens into the host buffer (a free grammar:
        only where the JSON is being steered to its end)."""
        self.masked = not self.free or (closing and not self.matcher.waiting)
        if self.masked:
            self.host.copy_(self.matcher.fill(closing)[0])

    def pick(self, logits: torch.Tensor, pos: int) -> int:
        """The token at `pos` (chained: its forward is launched before the host reads it)."""
        if self.picker is not None:
            if logits is not self.split.logits:  # the prefill's
                self.split.logits.copy_(logits)
            draw = lambda mask: self._graph_draw(mask, pos)  # noqa: E731
        else:
            x = logits if self.pen is None else self.pen.apply(logits)
            draw = lambda mask: self._eager_draw(x, mask)  # noqa: E731
        tok = draw(self.host) if self.masked else self.checked_pick(draw)
        if self.free and tok in self.ends:
            return tok  # the end of the output (checked_pick): the matcher never sees it
        self.consume([tok])
        if self.drafter is not None:
            self.drafter.extend([tok])
        return tok

    def _graph_draw(self, mask: torch.Tensor | None, pos: int) -> int:
        self.picker.launch(self.ones if mask is None else mask)
        if self.chained:
            self.split.forwards[1].feed_picked(pos)
        return self.picker.token()  # the one host copy

    def _eager_draw(self, x: torch.Tensor, mask: torch.Tensor | None) -> int:
        if mask is None:
            return int(sample(x, self.params, self.gen, self.unmasked))  # the one host copy
        self.knobs.token_mask.copy_(mask, non_blocking=True)
        return int(sample(x, self.params, self.gen, self.knobs))

    def checked_pick(self, draw) -> int:
        """A free grammar's pick: `draw(None)` from the unmasked logits, kept if the grammar
        allows it (an end token where the grammar may end); else `draw(mask)` again under the
        mask. The two draws are a draw from the masked distribution: the first is kept with the
        allowed tokens' own probability, and the second is one of them in proportion."""
        tok = draw(None)
        m = self.matcher
        probe = m.grammar.lltok.eos_token if tok in self.ends else tok
        if m.allowed_prefix([probe]) == 1:
            return tok
        self.host.copy_(m.fill()[0])
        return draw(self.host)

    def consume(self, tokens) -> None:
        """Tokens that are output now: the matcher's, and the penalties' counts."""
        for t in tokens:
            self.matcher.consume(t)
            if self.pen is not None:
                self.pen.advance(t)

    def end(self) -> Iterator[tuple[int, None]]:
        """The grammar is complete: the end-of-text token, after which nothing may follow."""
        if self.eos is not None:
            yield self.eos, None  # the engine stops here (unless ignore_eos)
        raise GrammarError("structured output: the grammar is complete", None)

    def drafts(self, pos: int, left: int) -> list[int]:
        """Prompt-lookup drafts for after `pos`, cut to what the grammar accepts."""
        if self.drafter is None or self.params.logprobs is not None:
            return []
        room = self.engine.max_len - 1 - pos
        k = min(self.spec.cfg.num_speculative_tokens, left - 1, room)
        drafts = self.drafter.propose(k) if k > 0 else []
        return drafts[: self.matcher.allowed_prefix(drafts)]

    def verify(self, last: int, drafts: list[int], pos: int) -> list[int]:
        """One verify step of `drafts` after `last` (at `pos`), each row under its mask."""
        eng = self.engine
        masks = self.matcher.masks(drafts).to(eng.device)  # (k + 1, W)
        ids = [last, *drafts]
        rows = None if self.split is None else self.split.rows(ids, pos)
        if rows is None:
            rows = step_rows(eng.step, ids, pos)
        if self.pen is not None:  # each row as a plain step there would see it
            rows = self.pen.apply_rows(rows, drafts)
        logits = apply_token_mask(rows, masks)  # (k + 1, V)
        kept, tokens = accept(logits, torch.tensor(drafts, device=eng.device), self.params,
                              self.gen)  # fmt: skip
        out = torch.cat((kept.view(1), tokens)).tolist()  # the one host copy
        n, new = out[0], out[1 : out[0] + 2]
        eng.cache.commit([last, *new[:-1]])  # the last token and the kept drafts: final
        if n < len(drafts):
            eng.cache.truncate(pos + n + 1)  # the rejected drafts' slots emptied
        self.consume(new)
        self.drafter.extend(new)
        kept = len(new) - 1
        self.spec.stats.add(len(drafts), kept, self.drafter.from_prediction)
        self.spec._extra["speculative"] = self.spec.stats.as_dict()
        return new


def constrained_steps(
    engine, prompt_ids: Sequence[int], logits: torch.Tensor, params: SamplingParams, gen,
    budget: int, pen: Penalties | None = None,
) -> Iterator[tuple[int, torch.Tensor | None]]:  # fmt: skip
    """Up to `budget` (token, logits of its logprobs or None) from the prefill's `logits` on;
    the engine's loop makes the steps, stops and cancels between any two of them. `pen`: the
    request's logits adjustments, applied before the mask (forced tokens count as output)."""
    c = _Constrained(engine, prompt_ids, params, gen, pen)
    want_lp = params.logprobs is not None
    reserve, answer = closing_reserve(budget), answer_reserve(budget)
    c.next_mask(closing=budget <= reserve)  # (nothing written yet: depth 0)
    pos, left = len(prompt_ids), budget
    while left > 0:
        last = c.pick(logits, pos)
        yield last, logits if want_lp else None
        left -= 1
        forced: list[int] = []
        while left > 0:  # forced tokens first, else drafts: a forward only for what is left
            if c.matcher.done and not want_lp:  # only the end of text is left: no forward
                yield from c.end()
            forced = [] if want_lp else c.forced(left, answer)
            drafts = [] if forced or c.closing(left, reserve) else c.drafts(pos, left)
            if not drafts:
                break
            new = c.verify(last, drafts, pos)[:left]
            for t in new:
                yield t, None
            pos, left, last = pos + len(new), left - len(new), new[-1]
        if left == 0:
            return
        c.consume(forced)
        if forced and c.matcher.done:  # the forced tokens complete it: no forward for them
            yield from ((t, None) for t in forced)
            yield from c.end()
        if c.chained:  # `last` is in already; forced tokens take a forward of their own
            engine.cache.commit([last])
            logits = _forward(engine, c.split, forced, pos + 1) if forced else c.split.logits
        else:
            logits = _forward(engine, c.split, [last, *forced], pos)  # on a GPU: launched
        # the host's work while the device runs the forward; a dead end raises
        c.next_mask(closing=c.closing(left - len(forced), reserve))
        pos += 1 + len(forced)
        for t in forced:
            yield t, None
            left -= 1
        if c.drafter is not None and forced:
            c.drafter.extend(forced)
