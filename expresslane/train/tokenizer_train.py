"""Train a Llama-2-style byte-fallback BPE tokenizer and save it as a Hugging Face tokenizer folder.

The layout follows laneformer.md 12.1: `<unk>`=0, `<s>`=1, `</s>`=2, the 256 byte tokens
`<0x00>`..`<0xFF>` at ids 3..258, then the learned pieces. Spaces become "▁" with a dummy prefix
(the normalizer of Llama 2's tokenizer.json), digits are split one by one, and the vocab size is a
multiple of the lane count so that a vocab-parallel head splits it evenly. The folder loads with
`expresslane.tokenizer.Tokenizer.from_dir` and with transformers' `AutoTokenizer`.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.trainers import BpeTrainer

from ..errors import TokenizerError
from ..tokenizer import LANEFORMER_CHAT_TEMPLATE

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIALS = (UNK, BOS, EOS)
BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))
NUM_RESERVED = len(SPECIALS) + len(BYTE_TOKENS)  # 259: ids below this are fixed by convention

# English prose for the tiny tokenizer, beside the Python source read from the stdlib.
_TINY_PROSE = """\
The quick brown fox jumps over the lazy dog. A latency-first engine decodes one request at a
time, as fast as the memory system allows. Tokens per second per request is the number that
matters. Each lane holds a slice of every layer, and the delayed exchange hides communication.
User: What is the capital of France? Assistant: The capital of France is Paris.
Numbers such as 2024, 3.14159 and 1,000,000 are split into single digits.
"""
_TINY_MODULES = ("textwrap", "bisect", "colorsys")


def _llama_pipeline(tokenizer: HFTokenizer) -> None:
    """Give `tokenizer` Llama 2's normalizer and decoder, plus word and digit splitting."""
    # Prepend + Replace is what Llama 2's tokenizer.json does: the dummy prefix is added to each
    # text segment between special tokens (the "legacy" behaviour, same as SentencePiece).
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    # Pieces never span a word start (SentencePiece's split_by_whitespace) and digits stand
    # alone (split_digits), so the BPE trainer learns the same kind of pieces Llama 2 has.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("▁", behavior="merged_with_next"),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )


def _learn(texts: Iterable[str], num_learned: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Run the BPE trainer; return its learned pieces (alphabet, then merged) and its merges."""
    scratch = HFTokenizer(models.BPE(unk_token=UNK, byte_fallback=True, fuse_unk=True))
    _llama_pipeline(scratch)
    trainer = BpeTrainer(
        vocab_size=len(SPECIALS) + num_learned,
        special_tokens=list(SPECIALS),
        # Rare characters beyond this many fall back to byte tokens, as in Llama 2.
        limit_alphabet=num_learned,
        show_progress=False,
    )
    scratch.train_from_iterator(texts, trainer)
    model = json.loads(scratch.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    reserved = set(SPECIALS) | set(BYTE_TOKENS)
    pieces = [piece for piece, _ in by_id if piece not in reserved]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    return pieces[:num_learned], merges


def _build(pieces: list[str], merges: list[tuple[str, str]], vocab_size: int) -> HFTokenizer:
    """Assemble the final tokenizer with the fixed ids first and padding up to `vocab_size`."""
    names = list(SPECIALS) + list(BYTE_TOKENS) + pieces
    # BPE never produces a piece that no merge builds, so padding entries stay unused.
    names += [f"<unused{i}>" for i in range(vocab_size - len(names))]
    vocab = {name: i for i, name in enumerate(names)}
    tokenizer = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=UNK, byte_fallback=True, fuse_unk=True)
    )
    _llama_pipeline(tokenizer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    # Llama 2's post-processor: `tokenizer(text)` starts with <s>, in transformers 5 as well,
    # which takes add_bos_token from tokenizer.json rather than from tokenizer_config.json.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, 1)]
    )
    return tokenizer


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _save(tokenizer: HFTokenizer, out_dir: Path, model_max_length: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": LANEFORMER_CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", specials)


def round_vocab_size(vocab_size: int, lanes: int) -> int:
    """The smallest multiple of `lanes` that is >= `vocab_size`."""
    return -(-vocab_size // lanes) * lanes


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | Path,
    lanes: int = 8,
    model_max_length: int = 4096,
) -> Path:
    """Train a byte-fallback BPE on `texts` and save a tokenizer folder; return its path.

    The vocab size is rounded up to a multiple of `lanes`; if the corpus is too small for that
    many merges, unused `<unusedN>` entries fill the rest, so the size is always exact.
    """
    if lanes < 1:
        raise TokenizerError(f"train_tokenizer: lanes must be >= 1, got {lanes}")
    size = round_vocab_size(vocab_size, lanes)
    if size <= NUM_RESERVED:
        raise TokenizerError(
            f"train_tokenizer: vocab_size must exceed {NUM_RESERVED} (3 special tokens + 256 byte "
            f"tokens), got {vocab_size}"
        )
    pieces, merges = _learn(texts, size - NUM_RESERVED)
    out = Path(out_dir)
    _save(_build(pieces, merges, size), out, model_max_length)
    return out


def tiny_corpus() -> list[str]:
    """A few KB of Python source and English text, always available offline."""
    sources = [inspect.getsource(__import__(name)) for name in _TINY_MODULES]
    return [_TINY_PROSE] + [src[:6000] for src in sources]


def train_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Path:
    """A test-sized tokenizer (vocab 512 by default), trained in milliseconds."""
    return train_tokenizer(tiny_corpus(), vocab_size, out_dir)
