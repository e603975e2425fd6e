"""target_function: pick the code a chat answer means as its solution, before scoring.

A chat model answers a coding task with prose and fenced blocks: often a usage example or a
draft before the solution, sometimes an answer cut off by max_tokens. The steps, as the
serving-conventions doc (section 4.4) lays them out:

1. Fences are parsed in order: ``` or ~~~ (three or more), optional info string, closing fence
   of the same character and at least the same length. A last block with no closing fence runs
   to the end of the text. CRLF is read as LF.
2. A block is a candidate when its top-level code defines the entry point: `ast` finds a
   (async) function of that name in the module body; a block that does not parse counts when a
   line starts with `def NAME(` at column 0. A method of a class does not count.
3. Among candidates: ones that parse first, then Python-tagged ones (python, py, python3, no
   tag) before other tags, then the *last* one (models print a draft or example first). This
   is a policy choice; it changes scores slightly.
4. No candidate: the longest Python-tagged block (the later one on a tie), then the raw text.
5. `sanitize` keeps the chosen code's imports, functions, classes and the assignments they use,
   and drops other top-level statements (example calls, prints, asserts, `if __name__ == ...`
   blocks), like EvalPlus's sanitizer but lighter: unreachable functions are kept, and no
   tree-sitter. Code that does not parse loses trailing lines until it does (an answer cut off
   mid-statement); raw text starts at its first line that looks like code.
6. Optionally the task prompt's leading import lines are prepended when the code lacks them
   (`from typing import List`): a deviation from stock EvalPlus, recorded in the results.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

PYTHON_TAGS = {"", "python", "py", "python3", "py3", "python2", "ipython", "pycon"}
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})[ \t]*([^\n`]*)$")
_KEEP = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
)


@dataclass
class Block:
    lang: str  # first word of the info string, lower case ("" when none)
    code: str
    closed: bool  # False for a last block cut off before its closing fence


@dataclass
class Selection:
    code: str  # what is executed (sanitized, prompt imports added when asked)
    reason: str  # "target", "longest-block" or "raw-text"
    block: int | None  # index of the chosen block, None for the raw text
    blocks: int  # how many fenced blocks the answer has
    parses: bool  # the final code parses


def parse_blocks(text: str) -> list[Block]:
    """Every fenced block of a markdown text, in order; an unterminated last one included."""
    blocks: list[Block] = []
    fence, lang, body = None, "", []
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence, body = m.group(1), []
                info = m.group(2).strip().split()
                lang = info[0].lower().lstrip("{.").rstrip("}") if info else ""
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2):
            blocks.append(Block(lang, "\n".join(body), closed=True))
            fence = None
        else:
            body.append(line)
    if fence is not None:
        blocks.append(Block(lang, "\n".join(body), closed=False))
    return blocks


def _parse(code: str) -> ast.Module | None:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError):  # ValueError: null bytes in the source
        return None


def defines(code: str, name: str) -> tuple[bool, bool]:
    """(defines `name` at top level, parses): the test a candidate block must pass."""
    tree = _parse(code)
    if tree is not None:
        funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
        return any(isinstance(n, funcs) and n.name == name for n in tree.body), True
    pattern = rf"^(async\s+)?def\s+{re.escape(name)}\s*\("
    return re.search(pattern, code, flags=re.MULTILINE) is not None, False


def _trim_to_parse(code: str) -> str:
    """Drop trailing lines until the code parses (an answer cut off mid-statement)."""
    lines = code.rstrip().split("\n")
    for end in range(len(lines), 0, -1):
        if _parse("\n".join(lines[:end])) is not None:
            return "\n".join(lines[:end])
    return code


def _code_start(text: str) -> str:
    """Raw text that does not parse: start at its first line that looks like code."""
    if _parse(text) is not None:
        return text
    lines = text.split("\n")
    starts = ("def ", "async def ", "class ", "import ", "from ", "@")
    first = next((i for i, line in enumerate(lines) if line.startswith(starts)), 0)
    return "\n".join(lines[first:])


def _names_used(nodes: list[ast.AST]) -> set[str]:
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)}


def sanitize(code: str) -> str:
    """Keep imports, defs, classes and the assignments they use; drop other statements."""
    code = code.replace("\r\n", "\n")
    tree = _parse(code)
    if tree is None:
        code = _trim_to_parse(code)
        tree = _parse(code)
        if tree is None:
            return code
    lines = code.split("\n")
    defs = [
        n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    used = _names_used(defs)
    kept = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not _names_used(targets) & used:
                continue  # a top-level example such as `result = f(3)`
        if isinstance(node, _KEEP):
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            kept.append("\n".join(lines[start - 1 : node.end_lineno]))
    return "\n\n".join(kept) + "\n" if kept else ""


def prompt_imports(prompt: str) -> list[str]:
    """The import lines of a task prompt before its first definition."""
    out = []
    for line in prompt.replace("\r\n", "\n").split("\n"):
        if line.startswith(("def ", "class ", "async def ", "@")):
            break
        if line.startswith(("import ", "from ")):
            out.append(line.rstrip())
    return out


def select(text: str, entry_point: str, prompt: str | None = None) -> Selection:
    """The target_function step: the code of `text` to execute for task `entry_point`.

    With `prompt`, its leading import lines are prepended when the code lacks them.
    """
    text = text.replace("\r\n", "\n")
    blocks = parse_blocks(text)
    ranked = []
    for i, b in enumerate(blocks):
        hit, parses = defines(b.code, entry_point)
        if hit:
            ranked.append(((parses, b.lang in PYTHON_TAGS, i), i))
    if ranked:
        index, reason = max(ranked)[1], "target"
    else:
        python = [(len(b.code.strip()), i) for i, b in enumerate(blocks) if b.lang in PYTHON_TAGS]
        python = [p for p in python if p[0] > 0]
        index, reason = (max(python)[1], "longest-block") if python else (None, "raw-text")
    code = sanitize(blocks[index].code if index is not None else _code_start(text))
    if prompt is not None:
        missing = [line for line in prompt_imports(prompt) if line not in code.split("\n")]
        if missing:
            code = "\n".join(missing) + "\n\n" + code
    return Selection(code, reason, index, len(blocks), _parse(code) is not None)
