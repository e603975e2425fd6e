"""From a request body to work for the engine, off the event loop.

Parsing and validating the JSON, rendering the chat template and tokenizing cost CPU in
proportion to the request (a 12 MB prompt once took 31 s to tokenize on the event loop, with
/health and every stream frozen meanwhile). So none of it runs on the loop: the handlers pass
the body to `Preparer.run`, whose few threads prepare it while the loop goes on answering.
`tokenizers` releases the GIL while it encodes a long text; template rendering is Python, which
hands the GIL back every few milliseconds.

A string prompt is measured before it is tokenized: when its length alone proves it longer than
the context (`Tokenizer.min_tokens`), it is refused without being encoded. `max_tokens` beyond
what the context leaves is a 400 in vLLM's words, unless the operator chose clamping
(`--clamp-max-tokens`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from ..engine import Engine
from ..errors import RequestError, TokenizerError
from ..sampling.params import SamplingParams, bad_word_ids
from ..step.threads import usable_cores
from ..structured.grammar import GrammarCompiler, GrammarSpec
from ..tokenizer import Tokenizer
from ..tokenizer.bounds import text_bytes
from . import messages as M
from . import protocol as P
from .formats import ChatFormat, CompletionFormat
from .guards import ServeLimits
from .jobs import ChoiceSpec
from .logprobs import TokenIds, TokenText
from .messages_out import MessageShape
from .offload import TokenizeOffload
from .responses import ResponsesRequest, ResponseStore, chat_body, renamed
from .responses_out import ResponseShape
from .structured import request_grammar
from .tools import ToolPlan, answer_grammar, plan_tools, prompt_messages

THREADS = min(4, usable_cores())


@dataclass
class Prepared:
    """A validated, tokenized generation request: the choices to run and how to answer."""

    specs: list[ChoiceSpec]
    prompt_tokens: int
    stream: bool
    include_usage: bool
    fmt: CompletionFormat | ChatFormat
    priority: int = 0  # the queue's order under --scheduling-policy priority (lowest first)
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats


class Preparer:
    """Turns request bodies into `Prepared` work (or a RequestError), on its own threads."""

    def __init__(
        self,
        engine: Engine,
        tok: Tokenizer,
        limits: ServeLimits,
        model_name: Callable[[str | None], str],
        rng: random.Random | None,
    ):
        self.engine, self.tok, self.limits = engine, tok, limits
        self.model_name, self.rng = model_name, rng
        self.text = TokenText(tok)
        self.grammars = GrammarCompiler(tok, engine.cfg.vocab_size)  # compiled ones cached
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="expresslane-prepare")
        self.offload = TokenizeOffload(tok)  # very long /tokenize texts: another process
        tok.min_tokens("")  # compute the tokenizer's length bound now, not on a first request

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the preparation threads (a body to prepare, a response to assemble)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.offload.shutdown()

    # --- checks ---------------------------------------------------------------------------
    def check_text(self, text: str, param: str) -> None:
        """Refuse a text whose length alone proves it longer than the context."""
        at_least, max_len = self.tok.min_tokens(text), self.engine.max_len
        if at_least >= max_len:
            raise RequestError(
                f"{param}: {text_bytes(text)} bytes of text are at least {at_least} tokens, "
                f"more than this model's maximum context length of {max_len} tokens",
                param=param,
            )

    def truncated(self, ids: list[int], keep: int | None, max_tokens: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last `keep` ids; -1: as many as the context holds
        beside `max_tokens` (or one token, when none was asked). Decided: vLLM's -1 keeps the
        whole context, which then leaves no room to generate."""
        if keep is None:
            return ids
        keep = self.engine.max_len - (max_tokens or 1) if keep == -1 else keep
        return ids[-keep:] if keep > 0 else ids

    def check_prompt(self, ids: list[int], param: str) -> None:
        try:
            self.engine.check_prompt(ids)
        except RequestError as e:
            msg = str(e).removeprefix("prompt: ")
            raise RequestError(f"{param}: {msg}", param=param) from None

    def max_tokens(self, asked: int | None, param: str, prompt_len: int) -> int:
        """The tokens a choice may generate: what was asked, if the context has room for it."""
        max_len = self.engine.max_len
        room = max_len - prompt_len
        if asked is None:
            return room
        if asked > room and not self.limits.clamp_max_tokens:
            raise RequestError(
                f"'{param}' is too large: {asked}. This model's maximum context length is "
                f"{max_len} tokens and your request has {prompt_len} input tokens "
                f"({asked} > {max_len} - {prompt_len}).",
                param=param,
            )
        return min(asked, room)

    def token_text(self, req: P._SamplingRequest) -> TokenText:
        """How logprobs name tokens: their text (cached), or vLLM's "token_id:N"."""
        return TokenIds(self.tok) if req.return_tokens_as_token_ids else self.text

    def priority(self, priority: int) -> int:
        """vLLM's rule: a priority other than 0 needs --scheduling-policy priority."""
        if priority and self.limits.scheduling_policy != "priority":
            msg = ("priority: this server serves in arrival order (fcfs); start it with "
                   "--scheduling-policy priority to order requests")  # fmt: skip
            raise RequestError(msg, param="priority")
        return priority

    def check_n(self, n: int) -> None:
        if n > self.limits.max_n:
            msg = f"n: {n} choices are more than this server allows ({self.limits.max_n})"
            raise RequestError(msg, param="n")

    def grammar(self, spec: GrammarSpec | None, chat: P.ChatCompletionRequest | None = None):
        """A structured output's compiled grammar (cached by hash); a chat answer's lets a thinking
        model think first (--reasoning-parser) unless Qwen3's enable_thinking is false."""
        off = chat is None or (chat.chat_template_kwargs or {}).get("enable_thinking") is False
        if spec is not None and not off and self.limits.reasoning_parser:
            spec = replace(spec, think=self.limits.reasoning_parser)
        return None if spec is None else self.grammars.compile(spec)

    def prediction(self, req: P._SamplingRequest) -> tuple[int, ...]:
        """The predicted output's token ids (no special tokens: it stands for the answer's
        text); a text longer than the context is refused as a prompt would be."""
        if req.prediction is None:
            return ()
        text = req.prediction.text()
        self.check_text(text, "prediction")
        return tuple(self.tok.encode(text, False))

    def sampling(
        self,
        req: P._SamplingRequest,
        max_tokens: int,
        logprobs: int | None,
        choice: int,
        grammar=None,
        prediction: tuple[int, ...] = (),
        kept: tuple[int, ...] = (),
    ) -> SamplingParams:
        seed = req.seed
        if seed is None and self.rng is not None:
            seed = self.rng.randrange(2**63)
        if seed is not None and choice:  # the n choices of one request differ, reproducibly
            seed = (seed + choice) % 2**63
        vocab = self.engine.cfg.vocab_size
        bad = [t for t in req.stop_token_ids or [] if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab})",
                param="stop_token_ids",
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            **self.limits.sampling_defaults.over(req),  # the model's where the request is silent
            seed=seed,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            kept_special_ids=kept,  # a tool call's markers (tools.ToolPlan.kept)
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            grammar=grammar,
            allowed_token_ids=tuple(req.allowed_token_ids or ()),
            bad_words=bad_word_ids(req.bad_words or [], lambda w: self.tok.encode(w, False)),
            logit_bias=req.bias_pairs(),
            min_tokens=req.min_tokens or 0,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            prediction=prediction,
        )
        params.validate()
        self.engine.check_sampling(params)
        return params

    # --- the routes' work -----------------------------------------------------------------
    def completion(self, body: bytes) -> Prepared:
        req: P.CompletionRequest = P.parse(P.CompletionRequest, body)
        model = self.model_name(req.model)
        self.check_n(req.n)
        before, after = (len(a) for a in self.tok.special_affixes)
        prompts: list[tuple[str | None, list[int], tuple[int, int]]] = []
        keep = req.truncate_prompt_tokens
        for p in req.prompts():
            if isinstance(p, str):
                if keep is None:  # truncated, a text longer than the context is fine
                    self.check_text(p, "prompt")
                ids = self.tok.encode(p, req.add_special_tokens)
                added = (before, after) if req.add_special_tokens else (0, 0)
            else:  # token ids are used as given: no BOS is added (lm-eval's offsets rely on it)
                ids, added = p, (0, 0)
            cut = self.truncated(ids, keep, req.max_tokens)
            if len(cut) < len(ids):  # what is left is echoed as its ids decode, as vLLM does
                p, ids, added = cut, cut, (0, 0)
            self.check_prompt(ids, "prompt")
            prompts.append((p if isinstance(p, str) else None, ids, added))
        grammar = self.grammar(request_grammar(req.model_extra))
        prediction = self.prediction(req)
        specs = []
        for i, (_, ids, _) in enumerate(prompts):
            max_tokens = self.max_tokens(req.max_tokens, "max_tokens", len(ids))
            for j in range(req.n):
                params = self.sampling(req, max_tokens, req.logprobs, j, grammar, prediction)
                echo_lp = req.echo and req.logprobs is not None
                specs.append(
                    ChoiceSpec(
                        i * req.n + j,
                        ids,
                        params,
                        req.stop_strings(),
                        echo_lp,
                        include_stop=req.include_stop_str_in_output,
                        prompt_logprobs=req.prompt_logprobs,
                    )
                )
        echo, added = {}, {}
        if req.echo:
            for sp in specs:
                text, ids, extra = prompts[sp.index // req.n]
                echo[sp.index] = text if text is not None else self.tok.decode(ids)
                added[sp.index] = extra
        contexts = {sp.index: sp.prompt_ids for sp in specs}  # what the text was decoded after
        fmt = CompletionFormat(model, self.token_text(req), echo, req.logprobs is not None, added,
                               contexts, req.skip_special_tokens)  # fmt: skip
        prompt_tokens = sum(len(ids) for _, ids, _ in prompts)
        return Prepared(specs, prompt_tokens, req.stream, req.include_usage, fmt,
                        self.priority(req.priority), req.continuous_usage)  # fmt: skip

    def chat(self, body: bytes) -> Prepared:
        req: P.ChatCompletionRequest = P.parse(P.ChatCompletionRequest, body)
        model = self.model_name(req.model)
        self.check_n(req.n)
        plan = plan_tools(req.model_extra or {}, self.template(req), self.limits.tool_call_parser,
                          self.tok)  # fmt: skip
        spec = answer_grammar(plan, request_grammar(req.model_extra), req, self.engine.grammars)
        grammar = self.grammar(spec, req)
        asked = req.max_completion_tokens or req.max_tokens
        ids = self.truncated(self.chat_prompt(req, plan), req.truncate_prompt_tokens, asked)
        self.check_prompt(ids, "messages")
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        max_tokens = self.max_tokens(req.max_completion_tokens or req.max_tokens, param, len(ids))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prediction = self.prediction(req)
        specs = [
            ChoiceSpec(
                j,
                ids,
                self.sampling(
                    req, max_tokens, logprobs, j, grammar, prediction, plan.kept if plan else ()
                ),
                req.stop_strings(),
                include_stop=req.include_stop_str_in_output,
                prompt_logprobs=req.prompt_logprobs if j == 0 else None,  # once: a shared prompt
            )  # fmt: skip
            for j in range(req.n)
        ]
        fmt = ChatFormat(model, self.token_text(req), req.n, req.logprobs,
                         plan if plan and plan.parses else None, self.chat_echo(req),
                         self.limits.reasoning_parser, req.include_reasoning)  # fmt: skip
        return Prepared(specs, len(ids), req.stream, req.include_usage, fmt,
                        self.priority(req.priority), req.continuous_usage)  # fmt: skip

    def responses(self, body: bytes, store: ResponseStore) -> tuple[Prepared, ResponseShape]:
        """A Responses API request, prepared as the chat request it becomes (responses.py)."""
        req: ResponsesRequest = P.parse(ResponsesRequest, body)
        chat, conversation = chat_body(req, store)
        try:
            prep = self.chat(chat)
        except RequestError as e:
            raise renamed(e) from None
        return prep, ResponseShape(req, prep.fmt.model, conversation)

    def messages(self, body: bytes, count: bool = False) -> tuple[Prepared, MessageShape]:
        """An Anthropic Messages request, prepared as the chat request it becomes (messages.py);
        `count`: /v1/messages/count_tokens, where max_tokens may be left out."""
        req: M.MessagesRequest = P.parse(M.MessagesRequest, M.counted(body) if count else body)
        try:
            prep = self.chat(M.chat_body(req))
        except RequestError as e:
            raise M.renamed(e) from None
        return prep, MessageShape(prep.fmt.model)

    def chat_echo(self, req: P.ChatCompletionRequest) -> str:
        """vLLM's chat `echo`: the text of a trailing message of the answer's role (assistant),
        which the answer then begins with; '' otherwise."""
        last = req.messages[-1]
        if not req.echo or last.role != "assistant":
            return ""
        return last.for_template().get("content") or ""

    def template(self, req: P.ChatCompletionRequest) -> str:
        """The chat template's source a request renders with ('' when there is none)."""
        try:
            return self.tok._template(req.model_extra.get("tools") if req.model_extra else None)
        except TokenizerError:
            return ""

    def chat_prompt(self, req: P.ChatCompletionRequest, plan: ToolPlan | None = None) -> list[int]:
        """Render the chat template; a trailing assistant message is continued, not closed."""
        try:
            messages = [m.for_template() for m in req.messages]
        except ValueError as e:
            raise RequestError(f"messages: {e}", param="messages") from None
        messages, tool_kwargs = prompt_messages(messages, plan)
        cont = req.continue_final_message
        if cont is None:
            cont = messages[-1]["role"] == "assistant"
        extra = {"documents": req.documents, **(req.chat_template_kwargs or {}), **tool_kwargs}
        text = self.render(
            messages,
            add_generation_prompt=req.add_generation_prompt and not cont,
            continue_final_message=cont,
            **extra,  # vLLM's `documents` for RAG templates (Command-R's, Granite's)
        )
        if req.truncate_prompt_tokens is None:  # truncated, a longer text is fine
            self.check_text(text, "messages")
        # The template writes its own special tokens (BOS included): add none when encoding.
        return self.tok.encode(text, add_special_tokens=False)

    def render(self, messages: list[dict], **kwargs: Any) -> str:
        try:
            return self.tok.apply_chat_template(messages, **kwargs)
        except TokenizerError as e:
            raise RequestError(f"messages: {e}", param="messages") from None

    def tokenize(self, body: bytes) -> dict:
        """vLLM's /tokenize (llama.cpp's field names too). No length check: lm-eval tokenizes
        texts longer than the context and truncates them itself."""
        req: P.TokenizeRequest = P.parse(P.TokenizeRequest, body)
        if req.messages is not None:
            try:
                messages = [m.for_template() for m in req.messages]
            except ValueError as e:
                raise RequestError(f"messages: {e}", param="messages") from None
            text = self.render(messages, add_generation_prompt=req.add_generation_prompt)
            add = False
        else:
            text = req.prompt if req.prompt is not None else req.content
            if text is None:
                raise RequestError("prompt: required (or messages)", param="prompt")
            add = next(
                (v for v in (req.add_special_tokens, req.add_special) if v is not None), True
            )
        strs = bool(req.return_token_strs)
        done = self.offload.encode(text, add, strs) if self.offload.wants(text) else None
        if done is not None:
            count, ids, pieces = done
        else:
            ids = self.tok.encode(text, add_special_tokens=add)
            count, pieces = len(ids), [self.tok.id_to_piece(i) for i in ids] if strs else None
        out = {"count": count, "max_model_len": self.engine.max_len, "tokens": ids}
        if strs:
            out["token_strs"] = pieces
        return out

    def detokenize(self, body: bytes) -> dict:
        req: P.DetokenizeRequest = P.parse(P.DetokenizeRequest, body)
        vocab = self.tok.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"tokens: {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens"
            )
        return {"prompt": self.tok.decode(req.tokens)}
