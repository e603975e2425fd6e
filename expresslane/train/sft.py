"""Instruction pairs mined from the corpus, for a short chat-tuning stage.

Every top-level function or method with a docstring in the *training* files gives one pair: the
request is the docstring's first paragraph plus the signature ("Write a Python function
`def name(args)` that ..."), or the bare signature when the docstring is missing; the answer is
the function's source. Pairs are rendered with the tokenizer's chat template (Laneformer-IT) and
the loss is taken on the answer tokens only, so the template's roles mean something.
"""

from __future__ import annotations

import ast
import random
import textwrap

import torch

from ..errors import ConfigError
from .data import IGNORE, ExampleSet

MAX_ANSWER_CHARS = 450  # about 200 tokens: request and answer fit one 256-token row


def mine_pairs(texts: list[str], seed: int = 0, limit: int | None = None) -> list[dict]:
    """(request, answer) dicts from the functions defined in `texts`, shuffled deterministically."""
    pairs = []
    texts = list(texts)
    random.Random(seed).shuffle(texts)  # files in random order, so a limit samples them all
    for text in texts:
        if limit and len(pairs) >= 2 * limit:
            break
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            src = ast.get_source_segment(text, node)
            if not src or len(src) > MAX_ANSWER_CHARS or node.name.startswith("__"):
                continue
            src = textwrap.dedent(" " * node.col_offset + src)
            sig = src.split(":\n", 1)[0].strip()
            if "\n" in sig or not sig.startswith(("def ", "async def ")):
                continue
            doc = ast.get_docstring(node)
            if doc:
                summary = " ".join(doc.split("\n\n")[0].split())
                request = f"Write a Python function `{sig}` that does this: {summary}"
            else:
                request = f"Write the Python function `{sig}`."
            pairs.append({"request": request, "answer": src.rstrip()})
    random.Random(seed).shuffle(pairs)
    return pairs[:limit] if limit else pairs


def encode_pairs(pairs: list[dict], tokenizer, seq_len: int, eos: int = 2) -> ExampleSet:
    """Chat rows of seq_len + 1 tokens; labels cover the answer and its `</s>`.

    The answer is encoded on its own and appended to the generation prompt's ids, exactly the
    ids the engine sees at inference (encoding the whole rendered chat would merge the prompt's
    final newlines with the answer's first characters into tokens the prompt never ends with).
    """
    inputs, labels = [], []
    pad = 0  # <unk>; padded positions carry no loss and come after every real one
    for p in pairs:
        prompt = tokenizer.encode_chat(
            [{"role": "user", "content": p["request"]}], add_generation_prompt=True
        )
        answer = tokenizer.encode(p["answer"], add_special_tokens=False) + [eos]
        full = prompt + answer
        if len(full) > seq_len + 1:
            continue
        lab = [IGNORE] * len(prompt) + answer
        fill = seq_len + 1 - len(full)
        ids, lab = full + [pad] * fill, lab + [IGNORE] * fill
        inputs.append(ids[:-1])
        labels.append(lab[1:])
    if not inputs:
        raise ConfigError(f"no instruction pair fits --seq-len {seq_len}; use a longer one")
    return ExampleSet(torch.tensor(inputs, dtype=torch.long), torch.tensor(labels))
