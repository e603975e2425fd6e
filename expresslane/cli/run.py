"""`expresslane run MODEL --prompt TEXT`: one request, streamed to stdout.

Ends with one line of figures (prompt tokens, time to first token, decode tokens/s), or with
--json prints one JSON object instead (text, token_ids, prompt_tokens, cached_tokens,
ttft_ms, decode_tokens_per_s, ...). MODEL defaults to the embedded model.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..assets import SUMMARY, has_trained_model, model_path
from ..bench.ceiling import bytes_per_token
from ..checkpoint import load_config, resolve_device, resolve_model_dir
from ..engine import Engine
from ..errors import ConfigError, ExpressLaneError
from ..parallel import launch
from ..sampling.params import SamplingParams
from ..speculative.drafting import MAX_SPECULATIVE_TOKENS
from ..step.choose import default_decode
from ..step.split import STEP_TOKENS
from ..step.threads import ThreadGovernor, set_threads, threads_on
from ..textgen import stream_text
from ..tokenizer import Tokenizer
from ..tokenizer.chat import chat_template_from
from ..weights.packing import load_plan
from .interactive import chat_loop
from .model_flags import (
    add_lora_arguments,
    add_model_arguments,
    add_prefix_argument,
    lora_from_args,
    speculative_from_args,
)
from .sampling import add_sampling_arguments, sampling_from_args, with_tokenized

HELP = "generate from one prompt (or one chat message) and stream the text"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_lora_arguments(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="raw text prompt (BOS added as the tokenizer says)")
    src.add_argument("--chat", help="one user message, rendered with the chat template")
    src.add_argument("-i", "--interactive", action="store_true",
                     help="a conversation: each line read is a turn, earlier turns reused "
                     "from the KV cache (/reset, /exit)")  # fmt: skip
    add_sampling_arguments(p)
    add_prefix_argument(p)
    add_chat_template_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's logprob and the top N (0-20)")  # fmt: skip
    p.add_argument(
        "--json-schema",
        metavar="FILE",
        help="constrain the output to this JSON schema (a .json file; structured output)",
    )
    p.add_argument(
        "--prediction",
        metavar="FILE",
        help="the answer expected, mostly (a file being edited; OpenAI's Predicted Outputs): "
        "drafted and verified, so only the speed changes",
    )


def add_chat_template_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", metavar="FILE|TEMPLATE", default=None,
                   help="vLLM's flag: a Jinja chat template (a file, or the template in one "
                   "line) in place of the model's own")  # fmt: skip


def chat_template_arg(args: argparse.Namespace) -> str | None:
    """--chat-template's text, checked (a TokenizerError names a bad one: exit 2)."""
    source = getattr(args, "chat_template", None)
    return None if source is None else chat_template_from(source)


def load_engine(args: argparse.Namespace, tok: Tokenizer | None = None) -> tuple[Engine, Tokenizer]:
    # rank 0 of `serve --devices N` leads a parallel engine
    engine, tok = launch.load_lead_engine(args) if launch.in_launch() else _load_here(args, tok)
    template = chat_template_arg(args)
    if template is not None:
        tok.chat_templates = {"default": template}
    return engine, tok


def _load_here(args: argparse.Namespace, tok: Tokenizer | None) -> tuple[Engine, Tokenizer]:
    path = str(model_path(args.model))
    quantization = getattr(args, "quantization", None)
    device = resolve_device(args.device, load_config(resolve_model_dir(path)))  # auto: by size
    set_cpu_threads(path, str(device), args.dtype, quantization, getattr(args, "threads", None))
    engine = Engine.from_pretrained(
        path,
        device=str(device),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        decode=default_decode(device),
        compile=getattr(args, "compile", False),
        prefix_reuse=not getattr(args, "no_prefix_reuse", False),
        speculative=speculative_from_args(args),
        quantization=quantization,
        prefill_dtype=getattr(args, "prefill_dtype", "float32"),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        lora=lora_from_args(args),
    )
    return engine, tok or Tokenizer.from_dir(path)


def set_cpu_threads(path, device: str, dtype: str, quantization, threads: int | None) -> None:
    """On a CPU, the thread count for the bytes a step streams and the cores free now; set
    before loading, as compiled kernels are built for it (expresslane/step/threads.py)."""
    if resolve_device(device).type == "cpu":
        set_threads(_step_bytes(path, dtype, quantization), threads)


def _step_bytes(path, dtype: str, quantization) -> int:
    fmt = load_plan("cpu", dtype, quantization, path)[1] if quantization is None else None
    per_weight = 1 if quantization else 2 if fmt in ("bfloat16", "float16") else 4
    cfg = load_config(resolve_model_dir(path))
    return bytes_per_token(cfg, 1, dtype_bytes=per_weight)["weights"]


def thread_governor(args: argparse.Namespace, engine) -> ThreadGovernor | None:
    """serve's CPU thread count, revised per request (step/threads.py); none if it is fixed."""
    fixed = getattr(args, "threads", None) or getattr(args, "compile", False)
    if str(engine.device) != "cpu" or launch.in_launch() or fixed:
        return None
    path = str(model_path(args.model))
    return ThreadGovernor(_step_bytes(path, args.dtype, getattr(args, "quantization", None)))


def cpu_threads(engine) -> dict:
    """{"threads": N} on a CPU (what step/threads.py chose, or --threads), else {}."""
    n = threads_on(engine.device)
    return {} if n is None else {"threads": n}


def weight_formats(engine) -> dict:
    """{"weights": the formats the decode step reads}: e.g. "int8" or "q4_1+q8_0" for weights
    packed on a CPU (computed in fp32), else the model's dtype."""
    packed = getattr(engine.model, "packed", None)
    if packed is None:
        return {"weights": str(engine.dtype).removeprefix("torch.")}
    return {"weights": "+".join(sorted({m.fmt for m in packed.matrices}))}


def main(args: argparse.Namespace) -> int:
    speculative_from_args(args)  # a bad --speculative-config exits 2 before anything loads
    chat_template_arg(args)  # and a bad --chat-template
    lora_from_args(args)  # and bad --lora flags
    params = sampling_from_args(args)  # bad flags fail before any rank starts
    if getattr(args, "prediction", None) and launch.parallel_requested(args):
        raise ConfigError("--prediction: the parallel engine (--devices N) does not draft; "
                          "use one device")  # fmt: skip
    interactive = getattr(args, "interactive", False)  # a Namespace built in code: absent
    if interactive and (args.json or launch.parallel_requested(args)):
        raise ConfigError("--interactive: not with --json or --devices N")
    if launch.parallel_requested(args):  # --devices 0 is refused there
        return launch.run_parallel(args, generate_on_rank)
    tok = None
    if not interactive:  # one request: a cache its length (run_context), so its prompt first
        try:
            tok = run_tokenizer(args)
        except ExpressLaneError:  # the load below names it (after the model's own errors)
            tok = None
        else:
            args.max_model_len = run_context(args, tok)
    engine, tok = load_engine(args, tok)
    if interactive:
        params = with_tokenized(args, engine, tok, params)
        return chat_loop(engine, tok, params, sys.stdout, stop=tuple(args.stop))
    return generate_and_print(args, engine, tok, params, load_report(engine))


# A one-shot run's KV cache holds its prompt, --max-tokens and what a forward writes past its
# last token (speculation's drafts, at most MAX_SPECULATIVE_TOKENS, and a grammar's forced
# tokens, STEP_TOKENS), in whole blocks: SmolLM2's own context (8,192 slots, 377 MB in fp32) made
# a one-line answer touch a huge page of every layer's K and V, 120 MB and 0.2 s at load
# (BENCHMARKS.md). --max-model-len sets it; serve and --interactive keep the model's context.
RUN_AHEAD = MAX_SPECULATIVE_TOKENS + STEP_TOKENS
RUN_BLOCK = 256


def run_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """The model's tokenizer (its config read first: a bad model fails as the load would)."""
    path = str(model_path(args.model))
    load_config(resolve_model_dir(path))
    tok = Tokenizer.from_dir(path)
    template = chat_template_arg(args)
    if template is not None:
        tok.chat_templates = {"default": template}
    return tok


def run_context(args: argparse.Namespace, tok: Tokenizer) -> int | None:
    """--max-model-len, or the slots one request can fill (RUN_AHEAD), where that is less
    than the model's context (None: the model's)."""
    if args.max_model_len is not None:
        return args.max_model_len
    cfg = load_config(resolve_model_dir(str(model_path(args.model))))
    need = len(prompt_ids(args, tok)) + args.max_tokens + RUN_AHEAD
    need = -(-need // RUN_BLOCK) * RUN_BLOCK
    return need if need < cfg.max_position_embeddings else None


def prompt_ids(args: argparse.Namespace, tok: Tokenizer) -> list[int]:
    """--prompt's tokens, or --chat's message rendered by the chat template."""
    if args.chat is not None:
        text = tok.apply_chat_template([{"role": "user", "content": args.chat}])
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(args.prompt if args.prompt is not None else "def ")


def load_report(engine) -> dict | None:
    """Compilation, graph capture and the prefill warm-up happen at load, outside the time to
    first token: each is reported on its own (`--json`), in seconds."""
    names = ("compile_s", "capture_s", "warmup_s")
    out = {name: round(getattr(engine, name), 2) for name in names if getattr(engine, name, 0)}
    return out or None


def generate_on_rank(args: argparse.Namespace, engine, tok: Tokenizer, extra: dict) -> int:
    """One rank's part of `run --devices N` (launch.run_parallel calls it on every rank)."""
    return generate_and_print(args, engine, tok, sampling_from_args(args), extra)


def generate_and_print(
    args, engine, tok: Tokenizer, params: SamplingParams, extra: dict | None = None
) -> int:
    """Encode --prompt/--chat, stream the text (or collect it for --json), print the figures."""
    params = with_tokenized(args, engine, tok, params)
    if not args.json and args.model is None and has_trained_model():
        label_embedded_answer(args, params)
    pieces, token_ids, logprobs = [], [], []
    for piece, step in stream_text(engine, tok, prompt_ids(args, tok), params, args.stop):
        pieces.append(piece)
        token_ids.append(step.token)
        if step.logprob is not None:
            logprobs.append({"token": step.token, "logprob": step.logprob,
                             "top_logprobs": step.top_logprobs or []})  # fmt: skip
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    st = engine.stats
    extra = {**st.extra, **(extra or {})}  # e.g. the speculative decoding figures
    if args.json:
        print(
            json.dumps(
                {
                    "text": "".join(pieces),
                    "token_ids": token_ids,
                    "prompt_tokens": st.prompt_tokens,
                    "cached_tokens": st.cached_tokens,
                    "completion_tokens": st.generated_tokens,
                    "finish_reason": st.finish_reason,
                    "ttft_ms": round(st.ttft_s * 1e3, 3),
                    "prefill_tokens_per_s": round(st.prefill_tokens_per_s, 2),
                    "decode_tokens_per_s": round(st.decode_tokens_per_s, 2),
                    "device": str(engine.device),
                    **cpu_threads(engine),
                    "dtype": str(engine.dtype).removeprefix("torch."),  # of the activations
                    **weight_formats(engine),
                    "kv_cache_dtype": str(engine.cache.k[0].dtype).removeprefix("torch."),
                    **({"logprobs": logprobs} if params.logprobs is not None else {}),
                    **extra,
                }
            )
        )
    else:
        tail = "".join(f", {k}: {_show(v)}" for k, v in extra.items())
        print(
            f"\n[prompt tokens: {st.prompt_tokens}, time to first token: "
            f"{st.ttft_s * 1e3:.1f} ms, decode: {st.decode_tokens_per_s:.1f} tokens/s, "
            f"{st.generated_tokens} tokens, finish: {st.finish_reason}{tail}]"
        )
    sys.stdout.flush()
    return 0


def label_embedded_answer(args: argparse.Namespace, params: SamplingParams) -> None:
    """The first-contact path (no MODEL, e.g. `make run`): say what the embedded model is and
    what to expect, then label the answer. On stdout, which only rank 0 of a parallel run keeps."""
    knobs = ["greedy"] if params.greedy else [f"temperature {params.temperature:g}"]
    if not params.greedy:
        knobs += [f"top-k {params.top_k}"] if params.top_k > 0 else []
        knobs += [f"top-p {params.top_p:g}"] if params.top_p < 1 else []
        knobs += [f"min-p {params.min_p:g}"] if params.min_p > 0 else []
        knobs += [f"seed {params.seed}"] if params.seed is not None else []
    kind, text = ("chat", args.chat) if args.chat is not None else ("prompt", args.prompt or "def ")
    print(f"embedded model: {SUMMARY}")
    print(f"{kind} ({', '.join(knobs)}): {text}")
    print("answer:", flush=True)


def _show(value) -> str:
    if isinstance(value, dict):  # {"draft_tokens": 40, ...} -> "draft_tokens=40 ..."
        return " ".join(f"{k}={v}" for k, v in value.items())
    return str(value)
