"""A lower bound on a text's token count, from its length alone: over-long prompts refused early.

Tokenizing a 12 MB prompt only to learn that it does not fit an 8k context costs half a minute
of CPU and gigabytes of memory. Every token of a tokenizer covers at most `B` bytes of the text
(its longest vocabulary piece, counted in the bytes of text it stands for), so a text of `n`
bytes has at least `n / B` tokens, provided the tokenizer keeps every byte of the text: no
normalizer or pre-tokenizer that deletes or shrinks characters (BERT's whitespace splitting,
Unicode composition, SentencePiece's whitespace collapsing). The bound is only given for
tokenizer.json pipelines made of parts known to keep the text (byte-level BPE as in Llama 3 and
SmolLM2, Metaspace or Prepend/Replace as in Llama 2); for anything else it is 0, and the full
tokenization decides.
"""

from __future__ import annotations

import json
import re

BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# The parts of a tokenizer.json pipeline that never drop or shrink the text they are given.
KEEPING_NORMALIZERS = {"Prepend", "Replace", "Sequence"}
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation",
                          "UnicodeScripts", "Sequence"}  # fmt: skip
BOUNDED_MODELS = {"BPE", "Unigram"}  # an unknown piece stands for one character (<= 4 bytes)


def _keeps_text(part: dict | None, allowed: set[str]) -> bool:
    if part is None:
        return True
    kind = part.get("type")
    if kind not in allowed:
        return False
    if kind == "Sequence":
        children = part.get("normalizers") or part.get("pretokenizers") or []
        return all(_keeps_text(c, allowed) for c in children)
    if part.get("behavior") == "Removed":  # Split / Punctuation that drop the matches
        return False
    if kind == "Replace":  # only a literal replacement that does not shorten the text
        pattern = (part.get("pattern") or {}).get("String")
        return pattern is not None and len(part.get("content", "").encode()) >= len(
            pattern.encode()
        )
    return True


def max_text_bytes_per_token(hf_tokenizer) -> int | None:
    """The most bytes of text one token can stand for, or None when no such bound holds.

    `hf_tokenizer` is a `tokenizers.Tokenizer`. Byte-level vocabularies spell one text byte per
    character; others spell text, with "▁" for a space and "<0xNN>" for one byte. Added tokens
    are matched in the raw text, so they count their UTF-8 length.
    """
    config = json.loads(hf_tokenizer.to_str())
    model = config.get("model") or {}
    if model.get("type") not in BOUNDED_MODELS:
        return None
    if not _keeps_text(config.get("normalizer"), KEEPING_NORMALIZERS):
        return None
    pre = config.get("pre_tokenizer")
    if not _keeps_text(pre, KEEPING_PRE_TOKENIZERS):
        return None
    byte_level = "ByteLevel" in json.dumps(pre) or "ByteLevel" in json.dumps(config.get("decoder"))
    added = {i: t.content for i, t in hf_tokenizer.get_added_tokens_decoder().items()}
    longest = 4
    for i in range(hf_tokenizer.get_vocab_size(with_added_tokens=True)):
        if i in added:
            n = len(added[i].encode())
        else:
            piece = hf_tokenizer.id_to_token(i) or ""
            if byte_level:
                n = len(piece)
            elif BYTE_PIECE.fullmatch(piece):
                n = 1
            else:
                n = len(piece.replace("\u2581", " ").encode())
        longest = max(longest, n)
    return longest


def text_bytes(text: str) -> int:
    """UTF-8 length without building the encoded copy when the text is ASCII."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
