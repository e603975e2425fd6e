"""The sampling flags of `run` (and `bench`'s draw) and what they build: SamplingParams from the
flags, and the request's parts that come from files (--json-schema's grammar, --prediction's
tokens). A bad value is a ConfigError naming the flag (exit 2)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from ..errors import ConfigError, ExpressLaneError, RequestError
from ..sampling.params import SamplingParams, bad_word_ids, logit_bias_pairs
from ..speculative.prediction import check_prediction
from ..structured.grammar import GrammarCompiler, GrammarSpec
from ..tokenizer import Tokenizer


def add_draw_arguments(p: argparse.ArgumentParser) -> None:
    """How a token is drawn: `run`'s flags, and `bench --peer llama.cpp`'s."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def bench_draw(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """`bench`'s draw flags as SamplingParams fields (seed 0 unless given: the rounds draw the
    same tokens), () for greedy. Sampled rows need --peer llama.cpp, whose sampler runs in its
    own C (the other peers decode greedily)."""
    if args.temperature <= 0:
        return ()
    if args.peer != "llama.cpp" or args.speculative_config:
        raise ConfigError("--temperature > 0: with --peer llama.cpp only (the other peers and "
                          "--speculative-config decode greedily)")  # fmt: skip
    draw = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "min_p": args.min_p, "seed": 0 if args.seed is None else args.seed}  # fmt: skip
    try:
        SamplingParams(**draw)
    except RequestError as e:
        raise ConfigError(str(e)) from None
    return tuple(draw.items())


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    add_draw_arguments(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="prompt and output tokens' positive logits divided by it, others "
                   "multiplied (1: off)")  # fmt: skip
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="minus this times an output token's count, in [-2, 2]")  # fmt: skip
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="minus this once an output token appeared, in [-2, 2]")  # fmt: skip
    p.add_argument("--min-tokens", type=int, default=0,
                   help="no end of text or stop id before this many tokens")  # fmt: skip
    p.add_argument("--allowed-token-ids", default=None, metavar="IDS",
                   help="the only token ids to pick, comma-separated: '5,17'")  # fmt: skip
    p.add_argument("--bad-words", action="append", default=[], metavar="WORD",
                   help="a word never to complete, as vLLM's bad_words (repeatable)")  # fmt: skip
    p.add_argument(
        "--logit-bias",
        default=None,
        metavar="JSON",
        help="token id -> bias in [-100, 100], as OpenAI's: '{\"50\": -100}'",
    )


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        logprobs=getattr(args, "logprobs", None),
        # a parallel rank's namespace may predate these flags: their neutral values
        repetition_penalty=getattr(args, "repetition_penalty", 1.0),
        frequency_penalty=getattr(args, "frequency_penalty", 0.0),
        presence_penalty=getattr(args, "presence_penalty", 0.0),
        min_tokens=getattr(args, "min_tokens", 0),
        logit_bias=logit_bias_from(getattr(args, "logit_bias", None)),
        allowed_token_ids=allowed_ids_from(getattr(args, "allowed_token_ids", None)),
    )
    try:
        params.validate()
    except Exception as e:  # RequestError names the parameter; on the CLI it is a flag
        raise ConfigError(f"--{str(e).replace('_', '-')}") from None
    return params


def allowed_ids_from(text: str | None) -> tuple[int, ...]:
    """--allowed-token-ids's comma-separated ids (exit 2 naming the flag)."""
    if text is None:
        return ()
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise ConfigError(f"--allowed-token-ids {text!r}: expected token ids such as '5,17,20'")
    return tuple(int(p) for p in parts)


def with_tokenized(args, engine, tok: Tokenizer, params: SamplingParams) -> SamplingParams:
    """`params` with what needs the tokenizer or the engine: --bad-words' tokens, the
    --json-schema grammar, the --prediction's tokens; checked against the engine (exit 2)."""
    words = getattr(args, "bad_words", None) or []
    params = replace(params, bad_words=bad_word_ids(words, lambda w: tok.encode(w, False)))
    params = with_prediction(args, engine, tok, with_json_schema(args, engine, tok, params))
    try:
        params.validate()
        engine.check_sampling(params)
    except RequestError as e:  # names the field: the flag here
        raise ConfigError(f"--{str(e).replace('_', '-')}") from None
    return params


def logit_bias_from(text: str | None) -> tuple[tuple[int, float], ...]:
    """--logit-bias's JSON object as (token id, bias) pairs (exit 2 naming the flag)."""
    if text is None:
        return ()
    try:
        return logit_bias_pairs(json.loads(text))
    except (ValueError, RequestError) as e:  # RequestError names the field: the flag here
        why = str(e).removeprefix("logit_bias: ") if isinstance(e, RequestError) else "not JSON"
        raise ConfigError(f"--logit-bias: {why}; expected a JSON object such as "
                          "'{\"50\": -100}'") from None  # fmt: skip


def with_json_schema(args, engine, tok: Tokenizer, params: SamplingParams) -> SamplingParams:
    """`params` constrained to the --json-schema file's schema (compiled here, llguidance)."""
    path = getattr(args, "json_schema", None)
    if path is None:
        return params
    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--json-schema {path}: cannot read a JSON schema ({e})") from None
    try:
        spec = GrammarSpec.json_schema(schema, "--json-schema")
        grammar = GrammarCompiler(tok, engine.cfg.vocab_size).compile(spec)
    except ExpressLaneError as e:
        raise ConfigError(f"{path}: {e}") from None
    return replace(params, grammar=grammar)


def with_prediction(args, engine, tok: Tokenizer, params: SamplingParams) -> SamplingParams:
    """`params` with --prediction's file as token ids (speculative/prediction.py drafts them)."""
    path = getattr(args, "prediction", None)
    if path is None:
        return params
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prediction {path}: cannot read it as UTF-8 text ({e})") from None
    params = replace(params, prediction=tuple(tok.encode(text, False)))
    try:
        params.validate()
        check_prediction(params, engine.cfg.vocab_size, engine.predicts)
    except RequestError as e:  # names the field: the flag here
        raise ConfigError(f"--prediction: {str(e).removeprefix('prediction: ')}") from None
    return params
