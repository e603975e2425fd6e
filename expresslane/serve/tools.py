"""Tool calls: OpenAI's `tools` / `tool_choice` in, the model's calls out as `tool_calls`.

A template that takes `tools` (its source names them) renders them itself, and its convention
for calls is read from its text: Hermes `<tool_call>{...}</tool_call>` (Qwen, Hermes), Mistral
`[TOOL_CALLS] [...]`, or Llama 3.x's bare JSON `{"name": ..., "parameters": ...}`. A template
without tool support (SmolLM2's, the embedded model's) gets the generic prompt: a system
message listing the functions as JSON schemas and asking for Hermes-style calls, with
assistant calls and `role: "tool"` results written back as Hermes text (`<tool_call>`,
`<tool_response>`) in roles the template knows.

`tool_choice`: "none" renders no tools and parses nothing; "auto" parses the model's free
output by the convention, under a free grammar where it applies (auto_grammar); "required" and
a named function force the calls through a grammar (Lark with inline JSON schemas: `%json`),
so the arguments always parse and match the schema.

A marker the tokenizer keeps as one special token (Mistral's `[TOOL_CALLS]`, Llama's
`<|python_tag|>`, a Hermes model's `<tool_call>`) is that token in the grammars (`<[id]>`), as
the model was trained to write it, and it stays in the answer's text even where special tokens
are skipped (`ToolPlan.kept`): the answer is parsed by it. vLLM's parsers keep it by turning
`skip_special_tokens` off; here only the markers are kept, so no other special token shows.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import RequestError
from ..structured.closed import closed_objects
from ..structured.grammar import COMPACT, GrammarSpec

STYLES = ("hermes", "mistral", "llama3")
# vLLM's --tool-call-parser names for the conventions read here (serve's flag of that name)
TOOL_CALL_PARSERS = {"hermes": "hermes", "mistral": "mistral", "llama3_json": "llama3",
                     "llama4_json": "llama3"}  # fmt: skip
GENERIC_PROMPT = (
    "You may call functions to help with the user's request. The functions, as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one line per call, each exactly:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments object>}}\n</tool_call>'
)


def _bad(msg: str, param: str = "tools") -> RequestError:
    return RequestError(msg, param=param)


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its prompt, its grammar and its output."""

    functions: dict[str, dict]  # name -> the `function` object (name, description, parameters)
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None
    parallel: bool = True
    style: str = "hermes"
    native: bool = False  # the template renders the tools itself
    grammar: GrammarSpec | None = None
    tools: list[dict] = field(default_factory=list)  # as sent, for a native template
    specials: dict[str, int] = field(default_factory=dict)  # markers that are special tokens

    @property
    def parses(self) -> bool:
        return self.choice != "none" and bool(self.functions)

    @property
    def kept(self) -> tuple[int, ...]:
        """The special tokens the answer's text keeps: the markers it is parsed by."""
        return tuple(self.specials.values()) if self.parses else ()

    def marker(self, text: str) -> str:
        """A marker in Lark: its special token where the tokenizer has one, else its text."""
        return f"<[{self.specials[text]}]>" if text in self.specials else json.dumps(text)


def plan_tools(extra: dict, template: str, parser: str | None = None,
               tok=None) -> ToolPlan | None:  # fmt: skip
    """The ToolPlan of a request's `tools`, `tool_choice`, `parallel_tool_calls`, or None.
    `parser` (vLLM's --tool-call-parser) names the convention of a template that renders
    tools itself, instead of reading it from the template's text; the generic prompt asks for
    Hermes calls whatever it says. `tok`: the tokenizer, whose special tokens the markers may
    be (special_markers)."""
    tools, choice = extra.get("tools"), extra.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice: needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _bad("tools: must be a list of {type: 'function', function: {...}}")
    functions = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or t.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise _bad(f"tools[{i}]: must be {{type: 'function', function: {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise _bad(f"tools[{i}].function.name: required, 1-64 letters, digits, _ . -")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters: must be a JSON schema object")
        functions[name] = {**fn, "parameters": params}
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name")
        if named not in functions:
            raise _bad(f"tool_choice: no function named {named!r} in tools", "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice: expected none, auto, required or {type: 'function', "
                   "function: {name}}", "tool_choice")  # fmt: skip
    native = "tools" in template
    style = (TOOL_CALL_PARSERS[parser] if parser else template_style(template)) if native else \
        "hermes"  # fmt: skip
    plan = ToolPlan(functions, choice, named, extra.get("parallel_tool_calls") is not False,
                    style, native, tools=tools)  # fmt: skip
    plan.specials = special_markers(style, tok) if tok is not None else {}
    if choice in ("required", "named"):
        plan.grammar = call_grammar(plan)
    return plan


def template_style(template: str) -> str:
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "mistral": ("[TOOL_CALLS]",),
           "llama3": ("<|python_tag|>",)}  # fmt: skip


def special_markers(style: str, tok) -> dict[str, int]:
    """The convention's markers that the tokenizer encodes as one special token: text -> id."""
    found = {}
    for text in MARKERS[style]:
        ids = [i for i in tok.encode(text, False) if i in tok.special_ids]
        if len(ids) == 1 and tok.decode(ids) == text:
            found[text] = ids[0]
    return found


def call_grammar(plan: ToolPlan) -> GrammarSpec:
    """A Lark grammar for the forced calls: each call's arguments are the function's schema."""
    names = [plan.named] if plan.choice == "named" else list(plan.functions)
    key = "parameters" if plan.style == "llama3" else "arguments"
    schema = calls_schema(plan, names, key, COMPACT)
    many = plan.parallel and plan.choice == "required"
    if plan.style == "mistral":
        head = f'{plan.marker("[TOOL_CALLS]")} "["'
        body = f'start: {head} call ("," call)* "]"' if many else f'start: {head} call "]"'
    elif plan.style == "llama3":
        body = 'start: call (";" call)*' if many else "start: call"
    else:
        one = f'{plan.marker("<tool_call>")} "\\n" call "\\n" {plan.marker("</tool_call>")}'
        body = f'start: {one} ("\\n" {one})*' if many else f"start: {one}"
    return GrammarSpec("lark", f"{body}\ncall: %json {schema}\n", "tools")


def calls_schema(plan: ToolPlan, names: list[str], key: str, layout: dict) -> str:
    """The JSON schema (text) of one call to any of `names`: {"name": its name, `key`: its
    parameters' schema, objects closed}, written in llguidance's `layout`."""
    calls = [{"type": "object", "properties": {"name": {"const": n},
              key: closed_objects(plan.functions[n]["parameters"])}, "required": ["name", key],
              "additionalProperties": False} for n in names]  # fmt: skip
    return json.dumps({**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": layout})


SPACED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# where each convention's call opens (GrammarSpec.trigger): the JSON steering starts after it;
# "^": the call must begin the answer (after whitespace), the trigger then optional
TRIGGERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "^<|python_tag|>"}


def auto_grammar(plan: ToolPlan) -> GrammarSpec:
    """`tool_choice: auto`: any text that opens no call, or calls held to their functions'
    schemas, in JSON spaced as the convention writes it. Hermes and Mistral: text up to the
    marker, then the calls (`<tool_call>{...}</tool_call>`..., `[TOOL_CALLS] [{...}, ...]`);
    Llama 3: all text or all calls (`{...}; {...}`), a call being an answer that begins with
    `{` or the python tag. The free text never holds a marker spelled out in plain tokens, so
    the answer is parsed as it was written. Picks are checked against the grammar, not masked
    (structured/decoding.py), so free text costs a check a token."""
    key = "parameters" if plan.style == "llama3" else "arguments"
    lark = [f"call: %json {calls_schema(plan, list(plan.functions), key, SPACED)}",
            r"GAP: /[ \t\r\n]{1,4}/"]  # fmt: skip
    if plan.style == "llama3":
        tag = plan.marker("<|python_tag|>")
        more = ' (GAP? ";" GAP? call)*' if plan.parallel else ""
        lark += [f"start: TEXT | GAP? ({tag} GAP?)? call{more} GAP?",
                 r"TEXT: /(?s:.*)/ & ~/[ \t\r\n]*(\{|<\|python_tag\|>)(?s:.*)/"]  # fmt: skip
    else:
        opener = TRIGGERS[plan.style]
        lark.append(rf"TEXT: /(?s:.*)/ & ~/(?s:.*){_regex(opener)}(?s:.*)/")
        if opener in plan.specials:
            head = f"TEXT {plan.marker(opener)}"
        else:  # the text up to the first marker, as one lexeme
            head = "OPEN"
            lark.append(rf"OPEN: /(?s:.*){_regex(opener)}/ & ~/(?s:.*){_regex(opener)}(?s:.+)/")
        if plan.style == "mistral":
            more = ' ("," GAP? call)*' if plan.parallel else ""
            lark.append(f'start: TEXT | {head} GAP? "[" call{more} "]"')
        else:
            one = f"GAP? call GAP? {plan.marker('</tool_call>')}"
            more = f" (GAP? {plan.marker(opener)} {one})*" if plan.parallel else ""
            lark.append(f"start: TEXT | {head} {one}{more}")
    return GrammarSpec("lark", "\n".join(lark) + "\n", "tools", trigger=TRIGGERS[plan.style])


def _regex(text: str) -> str:
    """`text` literally inside a Lark /regex/."""
    return re.escape(text).replace("/", r"\/")


def answer_grammar(plan: ToolPlan | None, spec: GrammarSpec | None, req,
                   grammars: bool) -> GrammarSpec | None:  # fmt: skip
    """The grammar a chat answer runs under: the request's structured output (`spec`), or its
    forced calls' (the two together: a 400), or for `auto` the free grammar (auto_grammar) where
    nothing rules it out: a structured output, an engine without grammars (`grammars`), or
    masks of the request's own that a grammar could contradict (min_tokens, allowed_token_ids,
    bad_words: a 400 with a grammar)."""
    if plan is None or plan.choice == "none":
        return spec
    if plan.grammar is not None:
        if spec is not None:
            msg = f"{spec.param}: cannot be combined with tool_choice {plan.choice!r}"
            raise RequestError(msg, param=spec.param)
        return plan.grammar
    own = req.min_tokens or req.allowed_token_ids or req.bad_words
    if spec is not None or not grammars or own:
        return spec
    plan.grammar = auto_grammar(plan)  # its calls stream as written (tool_stream.py)
    return plan.grammar


def prompt_messages(messages: list[dict], plan: ToolPlan | None) -> tuple[list[dict], dict]:
    """(messages for the template, its extra arguments): the tools rendered natively or as the
    generic prompt; calls and results in the template's terms."""
    if plan is None or plan.choice == "none":
        return [_plain_calls(m) for m in messages], {}
    if plan.native:
        return [_native_calls(m) for m in messages], {"tools": plan.tools}
    listing = "\n".join(json.dumps({"type": "function", "function": f}) for f in
                        plan.functions.values())  # fmt: skip
    system = GENERIC_PROMPT.format(tools=listing)
    out = [_plain_calls(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".strip()}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}


def _native_calls(m: dict) -> dict:
    """OpenAI's calls as HF templates take them: arguments as an object, not a JSON string."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
        out.append({**c, "function": fn})
    return {**m, "tool_calls": out}


def _plain_calls(m: dict) -> dict:
    """Calls and results as Hermes text, for a template that knows neither."""
    if m.get("role") == "tool":
        body = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        return {"role": "user", "content": body}
    calls = m.get("tool_calls")
    if m.get("role") != "assistant" or not calls:
        return {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
    parts = [m.get("content") or ""]
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        args = fn.get("arguments") or {}
        # OpenAI keeps arguments as a string that need not parse (a model may write bad JSON);
        # such a call goes back as written, never as a 500
        raw = args if isinstance(args, str) and json_or_none(args) is None else json.dumps(
            json_or_none(args) if isinstance(args, str) else args)  # fmt: skip
        call = f'{{"name": {json.dumps(fn.get("name"))}, "arguments": {raw}}}'
        parts.append(f"<tool_call>\n{call}\n</tool_call>")
    return {"role": "assistant", "content": "\n".join(p for p in parts if p)}


# --- output ------------------------------------------------------------------------------------
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished output; no calls: (text, [])."""
    if plan.style == "mistral":
        head, sep, rest = text.partition("[TOOL_CALLS]")
        raw = json_or_none(rest) if sep else None
        found = raw if isinstance(raw, list) else []
        content = head
    elif plan.style == "llama3":
        raw = [json_or_none(p) for p in text.strip().removeprefix("<|python_tag|>").split(";")]
        found = raw if all(isinstance(r, dict) for r in raw) else []
        content = "" if found else text
    else:
        found = [json_or_none(m) for m in _HERMES.findall(text)]
        content = _HERMES.sub("", text).split("<tool_call>")[0]
    calls = [known_call(c, plan) for c in found]
    if not calls or None in calls:
        return text, []  # not a well-formed call: the text stays the answer
    return content.strip() or None, calls


def known_call(c: Any, plan: ToolPlan) -> dict | None:
    """A parsed call object as an OpenAI tool call (a new id, its arguments re-serialized), or
    None where it is not a call to one of the plan's functions."""
    if not isinstance(c, dict) or c.get("name") not in plan.functions:
        return None
    args = c.get("arguments", c.get("parameters", {}))
    return {"id": call_id(), "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(args)}}  # fmt: skip


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def json_or_none(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        return None
