"""Training data: a Python-source corpus with a manifest, and the token streams cut from it.

The corpus is this machine's own Python standard library (PSF-2.0), optionally plus installed PyPI
packages whose license metadata names a permissive license. Test folders are left out. Files are
deduplicated by content hash, ordered by (source, path), and split into train/validation *by
file* with a hash of the path, so the split is the same on every machine with the same files.
`manifest.json` records the Python version, every file's path, size, sha256 and split; its own
hash identifies the data a model was trained on.

Token streams: every file becomes `<s> tokens </s>`, concatenated in manifest order. Training
batches are random windows whose positions are a pure function of (seed, step), so a resumed or
data-parallel run sees exactly the batches a single uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import sysconfig
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
PERMISSIVE = ("MIT", "BSD", "Apache", "PSF", "Python Software Foundation", "ISC", "Unlicense")
MAX_FILE_BYTES = 400_000  # generated tables (e.g. unicode data) teach nothing about code
IGNORE = -100  # label of positions that carry no loss (prompt and padding in SFT)


@dataclass(frozen=True)
class SourceFile:
    source: str  # "stdlib" or a PyPI distribution name
    path: str  # posix path relative to the source's root
    sha256: str
    bytes: int
    split: str  # "train" or "val"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _split_of(source: str, path: str, val_fraction: float) -> str:
    h = int(hashlib.sha256(f"{source}/{path}".encode()).hexdigest()[:8], 16)
    return "val" if h % 10_000 < val_fraction * 10_000 else "train"


def package_source(name: str) -> tuple[Path, str]:
    """An installed distribution's root folder and its license, if permissive; else an error."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise ConfigError(f"--extra-package {name}: not installed in this environment") from None
    meta = dist.metadata
    lic = meta.get("License-Expression") or meta.get("License") or ""
    lic += " " + " ".join(c for c in (meta.get_all("Classifier") or []) if "License" in c)
    if not any(p.lower() in lic.lower() for p in PERMISSIVE):
        raise ConfigError(
            f"--extra-package {name}: license {lic.strip()!r} is not one of the "
            f"permissive licenses accepted ({', '.join(PERMISSIVE)})"
        )
    top = (dist.read_text("top_level.txt") or name).split()[0]
    return Path(dist.locate_file(top)), " ".join(lic.split())[:200]


def build_corpus(
    out_dir: str | Path, val_fraction: float = 0.05, extra_packages: tuple[str, ...] = ()
) -> dict:
    """Collect, deduplicate and split the corpus; write and return the manifest."""
    roots = [("stdlib", stdlib_root(), "PSF-2.0")]
    roots += [(name, *package_source(name)) for name in extra_packages]
    files, seen, dropped = [], set(), []
    for source, root, _ in roots:
        paths = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for p in paths:
            rel = p.name if root.is_file() else p.relative_to(root).as_posix()
            if SKIP_DIRS & set(rel.split("/")[:-1]) or not p.is_file():
                continue
            data = p.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            if digest in seen:
                dropped.append(f"{source}/{rel}")
                continue
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if len(data) == 0 or len(data) > MAX_FILE_BYTES:
                continue
            seen.add(digest)
            files.append(
                SourceFile(source, rel, digest, len(data), _split_of(source, rel, val_fraction))
            )
    manifest = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "sources": [{"name": s, "root": str(r), "license": lic} for s, r, lic in roots],
        "val_fraction": val_fraction,
        "excluded_dirs": sorted(SKIP_DIRS),
        "max_file_bytes": MAX_FILE_BYTES,
        "duplicates_dropped": dropped,
        "files": [asdict(f) for f in files],
    }
    body = json.dumps(manifest, sort_keys=True).encode()
    manifest["manifest_sha256"] = hashlib.sha256(body).hexdigest()
    for split in ("train", "val"):
        manifest[f"{split}_files"] = sum(f.split == split for f in files)
        manifest[f"{split}_bytes"] = sum(f.bytes for f in files if f.split == split)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def corpus_texts(manifest: dict, split: str) -> list[str]:
    """The files of one split, in manifest order, checked against their recorded hashes."""
    roots = {s["name"]: Path(s["root"]) for s in manifest["sources"]}
    texts = []
    for f in manifest["files"]:
        if f["split"] != split:
            continue
        root = roots[f["source"]]
        data = (root if root.is_file() else root / f["path"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != f["sha256"]:
            raise ConfigError(
                f"{root / f['path']}: changed since the manifest was written; rebuild the corpus"
            )
        texts.append(data.decode("utf-8"))
    return texts


# --- tokens ---------------------------------------------------------------------------------
def _hf_tokenizer(tokenizer_dir: Path):
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))


def encode_documents(
    texts: list[str], tokenizer_dir: Path, bos: int = 1, eos: int = 2
) -> np.ndarray:
    """`<s> text </s>` for every text, concatenated, as uint16."""
    tok = _hf_tokenizer(tokenizer_dir)
    out = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.append(np.asarray([bos, *enc.ids, eos], dtype=np.uint16))
    return np.concatenate(out) if out else np.zeros(0, np.uint16)


def token_file(data_dir: Path, manifest: dict, tokenizer_dir: Path, split: str) -> np.ndarray:
    """The split's token stream, cached under data_dir keyed by manifest and tokenizer hashes."""
    tok_hash = hashlib.sha256((Path(tokenizer_dir) / "tokenizer.json").read_bytes()).hexdigest()
    path = Path(data_dir) / f"tokens-{split}-{manifest['manifest_sha256'][:10]}-{tok_hash[:10]}.npy"
    if path.is_file():
        return np.load(path)
    arr = encode_documents(corpus_texts(manifest, split), tokenizer_dir)
    np.save(path, arr)
    return arr


def token_bytes(tokenizer_dir: Path) -> np.ndarray:
    """UTF-8 bytes each token id stands for (specials 0, byte tokens 1), for bits per byte."""
    tok = _hf_tokenizer(tokenizer_dir)
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    nbytes = np.zeros(tok.get_vocab_size(), dtype=np.int64)
    for piece, i in tok.get_vocab().items():
        if piece in special or re.fullmatch(r"<unused\d+>|<unk>|<s>|</s>", piece):
            nbytes[i] = 0
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", piece):
            nbytes[i] = 1
        else:
            nbytes[i] = len(piece.replace("\u2581", " ").encode())
    return nbytes


class TokenStream:
    """Random training windows and fixed validation windows over one token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if len(tokens) < seq_len + 2:
            raise ConfigError(
                f"token stream of {len(tokens)} tokens is shorter than --seq-len {seq_len} + 2"
            )
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len = seq_len

    def batch(self, step: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of `step`: inputs and targets, (rows, seq_len) each."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (rows,), generator=g)
        win = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])
        return win[:, :-1], win[:, 1:]

    def eval_windows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to n non-overlapping windows spread evenly over the stream (always the same)."""
        S = self.seq_len
        count = min(n, (len(self.tokens) - 1) // S)
        stride = ((len(self.tokens) - 1) // S) // count * S
        win = torch.stack([self.tokens[i * stride : i * stride + S + 1] for i in range(count)])
        return win[:, :-1], win[:, 1:]


class ExampleSet:
    """Fixed-length (input, label) rows, labels IGNORE where no loss applies (SFT pairs)."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor):
        self.inputs, self.labels = inputs, labels

    def batch(self, step: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randint(0, len(self.inputs), (rows,), generator=g)
        return self.inputs[idx], self.labels[idx]


@dataclass
class Prepared:
    manifest: dict
    tokenizer_dir: Path
    train: np.ndarray
    val: np.ndarray
    nbytes: np.ndarray  # UTF-8 bytes per token id


def prepare(
    data_dir: str | Path,
    vocab_size: int = 4096,
    lanes: int = 8,
    val_fraction: float = 0.05,
    extra_packages: tuple[str, ...] = (),
) -> Prepared:
    """Corpus manifest, tokenizer (trained on the train split) and both token streams, cached."""
    from .tokenizer_train import train_tokenizer

    data_dir = Path(data_dir)
    manifest = build_corpus(data_dir, val_fraction, extra_packages)
    tok_dir = data_dir / f"tokenizer-{vocab_size}-{manifest['manifest_sha256'][:10]}"
    if not (tok_dir / "tokenizer.json").is_file():
        tmp = tok_dir.with_name(tok_dir.name + ".tmp")
        train_tokenizer(
            corpus_texts(manifest, "train"), vocab_size, tmp, lanes=lanes, model_max_length=4096
        )
        tmp.rename(tok_dir)
    return Prepared(
        manifest,
        tok_dir,
        token_file(data_dir, manifest, tok_dir, "train"),
        token_file(data_dir, manifest, tok_dir, "val"),
        token_bytes(tok_dir),
    )
