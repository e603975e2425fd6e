"""Chat templates rendered the way transformers renders them (sandboxed jinja2).

Also the Laneformer-IT template of docs/laneformer.md 12.2, used by the tokenizers we train.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import TokenizerError

# Laneformer-IT chat format (laneformer.md 12.2; the real file was never seen, so this is
# the form inferred there). BOS choice: the template prints {{ bos_token }}, as the Llama 2 and
# Llama 3 chat templates do. Llama-2-style models see <s> at the start of every training
# sequence, and transformers' apply_chat_template(tokenize=True) encodes the rendered text with
# add_special_tokens=False, so a template without it would give chat prompts no BOS at all.
# The price: a rendered prompt must be encoded with add_special_tokens=False
# (Tokenizer.encode_chat does), or BOS appears twice.
LANEFORMER_CHAT_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
{%- set role = message['role'] %}
{%- if role == 'user' or role == 'assistant' %}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + message['content'] | trim + '</s>' }}
{%- elif role != 'system' %}
{{- raise_exception("Only 'user' and 'assistant' roles are supported, got '" + role + "'") }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# The named special tokens transformers passes to every chat template (special_tokens_map).
SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)  # fmt: skip
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # the marker transformers uses, same handling
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# ---------------------------------------------------------------------------- chat templates


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for rendering a prompt its body is output unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: jinja's own tojson escapes HTML characters, this one does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile like transformers: sandboxed, trim_blocks, lstrip_blocks, same globals."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def chat_template_from(source: str) -> str:
    """vLLM's --chat-template: a file's path, or the template itself in one line (it holds
    `{{` or `{%`); checked by compiling it, so a syntax error is named before the first
    request rather than in it."""
    path = Path(source).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"--chat-template {source}: not readable ({e})") from None
    elif "{{" in source or "{%" in source:
        text = source
    else:
        raise TokenizerError(f"--chat-template {source}: no such file, and not a template")
    try:
        _compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"--chat-template {source}: line {e.lineno}: {e.message}") from None
    return text


def _plain_messages(messages: Iterable[dict]) -> list[dict]:
    """Fresh plain copies, None values dropped, reasoning aliased: what transformers renders."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TokenizerError(f"chat messages must be dicts, got {message!r}")
        plain = {k: v for k, v in message.items() if v is not None}
        # Objects that are not JSON (images, arrays) become inert "<TypeName>" placeholders.
        message = json.loads(json.dumps(plain, default=lambda o: f"<{type(o).__name__}>"))
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(messages: list[dict], template: str) -> str:
    """Append the continue marker to the last message's text; return that text."""
    if not messages:
        raise TokenizerError("continue_final_message needs a non-empty conversation")
    if "content" not in template:
        raise TokenizerError("continue_final_message: the chat template never reads 'content'")
    final = messages[-1].get("content")
    if isinstance(final, str):
        messages[-1]["content"] = final + _CONTINUE_TAG
        return final
    for block in reversed(final if isinstance(final, list) else []):
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            text, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
            return text
    raise TokenizerError("continue_final_message: the final message has no text to continue")


def _cut_after_final_message(rendered: str, final: str) -> str:
    """Drop what the template put after the final message, keeping the open turn."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise TokenizerError(
            "continue_final_message: the chat template does not render the final message verbatim"
        )
    loc = rendered.rindex(tag)
    if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()  # the template trimmed the text, so trim our cut too
