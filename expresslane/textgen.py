"""Token ids -> streamed text: incremental UTF-8-safe detokenization and stop strings.

The engine deals in token ids only (docs/architecture.md, decision 6); this is the text side
shared by the CLI and the server. A stop string ends generation (the engine's generator is
closed, which frees it at once) and is never emitted, nor anything after it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace

from .engine import Engine
from .generation import Step
from .sampling.params import SamplingParams
from .tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


def stream_text(
    engine: Engine,
    tok: Tokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    stop: Sequence[str] = (),
    cancel: threading.Event | None = None,
    include_stop: bool = False,
) -> Iterator[tuple[str, Step]]:
    """Yield (new text, step) per generated token; text may be '' while bytes are pending.
    A step that a stop string ended names it (`stop_string`); `include_stop` keeps it in the
    text (vLLM's include_stop_str_in_output)."""
    # vLLM's default hides special tokens (a sampled <|endoftext|> that is no stop id for this
    # model would otherwise show up in the text); spaces_between_special_tokens changes nothing
    # here: these decoders, like vLLM's fast detokenizer, put no space between added tokens.
    detok = IncrementalDetokenizer(tok, params.skip_special_tokens, prompt_ids,
                                   params.kept_special_ids)  # fmt: skip
    matcher = StopStringMatcher(list(stop), include_stop)
    params = with_tokenizer_eos(engine, tok, params)
    stops = engine.stop_ids(params)
    steps = engine.generate_steps(prompt_ids, params, cancel)
    try:
        for n, step in enumerate(steps, 1):
            special = step.token in stops and step.finish_reason == "stop"
            text = "" if special else detok.push(step.token)
            if step.finish_reason:
                text += detok.flush()
            emit, stopped = matcher.push(text, armed=n > params.min_tokens)  # vLLM's rule
            if stopped:
                step.finish_reason = engine.stats.finish_reason = "stop"
                step.stop_string = matcher.hit
                yield emit, step
                return
            if step.finish_reason:
                emit += matcher.flush()
            yield emit, step
    finally:
        steps.close()


def with_tokenizer_eos(engine: Engine, tok: Tokenizer, params: SamplingParams) -> SamplingParams:
    """`params` that also stop at the tokenizer's end ids the model's config does not name (a
    tokenizer_config.json EOS, GGUF end markers), as vLLM adds the tokenizer's EOS."""
    if params.ignore_eos:
        return params
    extra = tuple(t for t in tok.eos_ids if t not in engine.stop_ids(params))
    return replace(params, stop_token_ids=params.stop_token_ids + extra) if extra else params


def generate_text(
    engine: Engine,
    tok: Tokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    stop: Sequence[str] = (),
    cancel: threading.Event | None = None,
) -> Iterator[tuple[str, list[int]]]:
    """Like stream_text, yielding (text, [token id]) pairs for simple callers."""
    for text, step in stream_text(engine, tok, prompt_ids, params, stop, cancel):
        yield text, [step.token]
