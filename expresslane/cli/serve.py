"""`expresslane serve MODEL`: the OpenAI-compatible API and the playground, on one engine.

The server listens at once and loads the model in the background: `/health` answers 503 until
the engine is ready, then 200, and the playground's URL is printed. `--api-key` protects the
`/v1` routes, /tokenize and /detokenize (Bearer); health, metrics, /tokenizer_info and the page
stay open. MODEL
defaults to the embedded model (`make serve`). The limits (`--max-request-bytes`, `--max-queue`,
`--max-n`, `--clamp-max-tokens`, `--allowed-origins`) are described in docs/serving.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import ssl
import sys
import threading
import time
from pathlib import Path

from ..errors import ConfigError
from ..parallel import launch
from ..step.threads import threads_on
from .model_flags import (
    add_lora_arguments,
    add_model_arguments,
    add_prefix_argument,
    lora_from_args,
    speculative_from_args,
)
from .run import add_chat_template_argument, chat_template_arg, load_engine, thread_governor

HELP = "serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions) and playground"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_lora_arguments(p)
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[],
                   metavar="NAME=PATH",
                   help="vLLM's flag, one adapter: merged into the weights at load and served as "
                   "NAME (the base model is then not served; one server per adapter)")  # fmt: skip
    add_prefix_argument(p)
    add_chat_template_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) the API accepts; the first is reported (default: the "
        "model folder's name)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("EXPRESSLANE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize "
        "(env EXPRESSLANE_API_KEY)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed for requests that bring none (reproducible runs)",
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    add_limit_arguments(p)


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    from ..serve.guards import POOLING, ServeLimits
    from ..serve.tools import TOOL_CALL_PARSERS
    from ..structured.reasoning import PARSERS

    d = ServeLimits()
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=d.max_request_bytes,
        help=f"larger request bodies get 413 (default {d.max_request_bytes})",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=d.max_queue,
        help="requests being prepared or waiting for the engine; more get 503 with "
        f"Retry-After (default {d.max_queue})",
    )
    p.add_argument(
        "--max-n",
        type=int,
        default=d.max_n,
        help=f"most choices (n) one request may ask for (default {d.max_n})",
    )
    p.add_argument(
        "--clamp-max-tokens",
        action="store_true",
        help="clamp max_tokens to what the context leaves instead of answering 400 "
        "(for clients that retry a 400 forever, such as EvalPlus)",
    )
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"],
                   default=d.scheduling_policy,
                   help="fcfs: requests in arrival order (a priority other than 0 is a "
                   "400); priority: the lowest `priority` first, ties in arrival order "
                   "(vLLM's)")  # fmt: skip
    p.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                   help="split a thinking model's <think> reasoning from its answer: "
                   "`reasoning_content` / `reasoning` in chat answers (vLLM's flag)")  # fmt: skip
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                   help="vLLM's flag: the tool-call convention of a chat template that renders "
                   "tools (default: read from the template's text)")  # fmt: skip
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag, accepted for its command lines: tools and tool_choice "
                   "'auto' are always on here")  # fmt: skip
    p.add_argument("--pooling", choices=POOLING, default=d.pooling,
                   help="/v1/embeddings' vector: the last position's (default) or every "
                   "position's mean, normalised (llama.cpp's flag)")  # fmt: skip
    p.add_argument(
        "--root-path",
        default="",
        help="vLLM's flag: the path prefix a proxy serves this server under",
    )
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="vLLM's flag: no log line per HTTP request")  # fmt: skip
    for flag, what in (
        ("--ssl-keyfile", "vLLM's flag, with --ssl-certfile: serve HTTPS with this private key"),
        ("--ssl-certfile", "its certificate (chain), PEM"),
    ):
        p.add_argument(flag, default=None, metavar="FILE", help=what)  # fmt: skip
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="vLLM's flag: sampling defaults for requests that leave a field out: "
                   "auto, the model's own (its generation_config.json, a GGUF's "
                   "general.sampling.*); vllm, OpenAI's; or a folder's "
                   "generation_config.json")  # fmt: skip
    p.add_argument("--allowed-origins", type=_origins, default=(),
                   help="web origins allowed by CORS: a JSON list as vLLM takes it, or "
                   "comma-separated (default none)")  # fmt: skip
    p.add_argument("--allowed-headers", type=_origins, default=d.allowed_headers,
                   help="request headers a CORS preflight may ask for, as vLLM takes them "
                   '(default ["*"]: all; the OpenAI JS SDK sends x-stainless-*)')  # fmt: skip


def _origins(value: str) -> tuple[str, ...]:
    """A JSON list of strings (vLLM's form) or a comma-separated list: origins, headers."""
    if value.strip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list of strings ({e})") from None
        if not all(isinstance(o, str) for o in items):
            raise argparse.ArgumentTypeError("a JSON list of strings")
        return tuple(items)
    return tuple(o.strip() for o in value.split(",") if o.strip())


def limits_from(args: argparse.Namespace):
    from ..serve.guards import ServeLimits

    return ServeLimits(
        max_request_bytes=args.max_request_bytes,
        max_queue=args.max_queue,
        max_n=args.max_n,
        clamp_max_tokens=args.clamp_max_tokens,
        scheduling_policy=args.scheduling_policy,
        allowed_origins=tuple(args.allowed_origins),
        allowed_headers=tuple(args.allowed_headers),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        pooling=args.pooling,
        sampling_defaults=generation_defaults(args),
    )


def generation_defaults(args: argparse.Namespace):
    """vLLM's --generation-config: auto (the model's own: sampling/defaults.py), vllm (none:
    OpenAI's defaults), or a folder holding a generation_config.json."""
    from ..assets import model_path
    from ..checkpoint import sampling_defaults
    from ..sampling.defaults import SamplingDefaults

    source = getattr(args, "generation_config", "auto")
    if source == "vllm":
        return SamplingDefaults()
    if source == "auto":
        return sampling_defaults(model_path(args.model))
    folder = Path(source).expanduser()
    if not (folder / "generation_config.json").is_file():
        raise ConfigError(f"--generation-config {source}: expected auto, vllm, or a folder "
                          "holding a generation_config.json")  # fmt: skip
    return sampling_defaults(folder)


def _lora_module(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH")
    return name, path


def _port(value: str) -> int:
    port = int(value) if value.strip().isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: a port is an integer in [0, 65535]")
    return port


def check_address(host: str, port: int) -> None:
    """A ConfigError (exit 2) where the server could not listen: an unknown host, a port in use
    or not ours to take. Checked before the model loads, not left to uvicorn's exit code 3."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: {e.strerror}") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as e:
            raise ConfigError(
                f"--port {port}: cannot listen on {host}:{port} ({e.strerror})"
            ) from None


def check_tls(args: argparse.Namespace) -> None:
    """--ssl-keyfile and --ssl-certfile come together and load as a pair (exit 2 naming the
    problem), before the model loads rather than at uvicorn's first handshake."""
    key, cert = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    if key is None and cert is None:
        return
    if key is None or cert is None:
        raise ConfigError("--ssl-keyfile and --ssl-certfile: give both, or neither")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"--ssl-certfile {cert} / --ssl-keyfile {key}: cannot load them as "
                          f"a pair ({e.strerror or e})") from None  # fmt: skip


def model_card(args: argparse.Namespace) -> dict:
    """create_app's names: the served names, the aliases, and `root` (with an adapter merged:
    the base model's folder name, the adapter's parent)."""
    names, aliases = _names(args)
    root = _base_name(args) if getattr(args, "lora_modules", None) else names[0]
    return {"served_model_name": names, "aliases": aliases, "root": root}


def _base_name(args: argparse.Namespace) -> str:
    return os.path.basename(os.path.normpath(args.model)) if args.model else "expresslane"


def _names(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(names listed and reported, aliases also accepted: the model path as given). With
    --lora-modules the adapter's name alone: the merged weights are not the base model's."""
    modules = getattr(args, "lora_modules", None) or []
    if len(modules) > 1:
        why = "one adapter per server (merged into the weights at load); start one per adapter"
        raise ConfigError(f"--lora-modules: {why}")
    if modules and args.served_model_name:
        raise ConfigError("--served-model-name with --lora-modules: the adapter is merged into "
                          "the weights, so only its NAME is served")  # fmt: skip
    if modules:
        return [modules[0][0]], []
    if args.served_model_name:
        return args.served_model_name, []
    if args.model:  # the folder's name is reported; the path is accepted but never shown
        base = _base_name(args) or "expresslane"
        return [base], [args.model] if args.model != base else []
    return ["expresslane"], []


def _load(args: argparse.Namespace, app, server, failure: list) -> None:
    """Load the engine while the server already answers /health with 503."""
    from ..serve import attach

    try:
        engine, tok = load_engine(args)
        if hasattr(engine, "on_lost"):  # ranks on several hosts: a lost one ends this server
            engine.on_lost.append(lambda _: setattr(server, "should_exit", True))
        attach(app, engine, tok, thread_governor(args, engine))
    except BaseException as e:  # reported by main() after the server stops
        failure.append(e)
        server.should_exit = True
        return
    while not server.started and not server.should_exit:
        time.sleep(0.05)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    threads = threads_on(engine.device)
    on = f"{engine.device}" + (f" ({threads} thread{'s' * (threads > 1)})" if threads else "")
    tuned = app.state.service.limits.sampling_defaults.describe()  # as vLLM says it, once
    scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
    print(
        f"ExpressLane is ready: model {app.state.service.names[0]!r} on {on}, "
        f"context {engine.max_len} tokens\n"
        f"  playground:  {scheme}://{host}:{args.port}/\n"
        f"  OpenAI API:  {scheme}://{host}:{args.port}/v1"
        + (f"\n  sampling defaults from the model (--generation-config): {tuned}" if tuned else ""),
        file=sys.stderr,
        flush=True,
    )


def main(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    speculative_from_args(args)  # a bad --speculative-config exits 2 before the server starts
    chat_template_arg(args)
    check_address(args.host, args.port)
    check_tls(args)
    lora_from_args(args)
    _names(args)
    if launch.parallel_requested(args) and not launch.in_launch():
        return launch.launch(args, main)  # one process per device; rank 0 serves

    from ..serve import create_app

    if args.seed is not None:
        torch.manual_seed(args.seed)
    limits = limits_from(args)
    limits.validate()  # a ConfigError: one line and exit 2
    app = create_app(None, None, api_key=args.api_key, seed=args.seed, limits=limits,
                     **model_card(args))  # fmt: skip
    server = uvicorn.Server(uvicorn_config(app, args))
    failure: list[BaseException] = []
    loader = threading.Thread(target=_load, args=(args, app, server, failure), daemon=True)
    loader.start()
    server.run()
    if failure:
        raise failure[0]
    app.state.service.shutdown()
    return 0


def uvicorn_config(app, args: argparse.Namespace):
    """uvicorn's settings from serve's flags (vLLM's names where it has them)."""
    import uvicorn

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          timeout_keep_alive=30, ssl_keyfile=args.ssl_keyfile,
                          ssl_certfile=args.ssl_certfile, root_path=args.root_path,
                          access_log=not args.disable_uvicorn_access_log)  # fmt: skip


@contextlib.contextmanager
def serving(app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
    """Run `app` under uvicorn in a background thread (tests, notebooks); yields its base URL.

    Port 0 picks a free port. On exit the server stops and the engine thread is shut down.
    """
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start on {host}:{port}")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        app.state.service.shutdown()
