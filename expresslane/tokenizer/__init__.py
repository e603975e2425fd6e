"""The text side: tokenizer files -> ids, chat templates, UTF-8-safe streaming, stop strings.

The engine deals only in token ids (docs/architecture.md, decision 6). This file owns everything
between text and ids: loading a Hugging Face tokenizer folder (`tokenizer.json` through the
`tokenizers` library, or a SentencePiece `tokenizer.model`), rendering chat templates the way
transformers does, turning a stream of ids back into text without ever emitting half a
character, and cutting generated text at stop strings.
"""

from .chat import LANEFORMER_CHAT_TEMPLATE, SPECIAL_TOKEN_KEYS
from .core import Tokenizer
from .stream import IncrementalDetokenizer, StopStringMatcher

__all__ = [
    "LANEFORMER_CHAT_TEMPLATE",
    "SPECIAL_TOKEN_KEYS",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "Tokenizer",
]
