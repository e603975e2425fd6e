"""`org/name` from the Hugging Face Hub: which files a checkpoint needs, and fetching them.

Like vLLM, only what the engine reads is downloaded: the config and generation config, the
safetensors weights (the shards the index names, when there is one), and the tokenizer and chat
template files, into the ordinary Hugging Face cache with huggingface_hub's progress bars.
Pickle weights are never fetched. Offline (HF_HUB_OFFLINE=1, or the Hub unreachable) the answer
is one line saying what is missing and the command that fetches it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import CheckpointError

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # never read (checkpoint.py)


def is_offline() -> bool:
    flags = (os.environ.get(k, "") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(v.strip().upper() in ("1", "ON", "YES", "TRUE") for v in flags)


def select_files(repo_id: str, files: list[str], index: dict | None = None) -> list[str]:
    """The files of `repo_id` (its listing) that a checkpoint folder needs, weights last.

    `index` is the parsed safetensors index when the repo has one: then only its shards are
    weights (repos often carry a second, consolidated copy). Top-level files only.
    """
    top = [f for f in files if "/" not in f]
    wanted = [f for f in top if f in CONFIG_FILES + TOKENIZER_FILES]
    if "config.json" not in wanted:
        raise CheckpointError(f"{repo_id}: the repository has no config.json at its top level")
    if index is not None:
        shards = list(dict.fromkeys((index.get("weight_map") or {}).values()))
        missing = [s for s in shards if s not in top]
        if not shards or missing:
            raise CheckpointError(
                f"{repo_id}: {INDEX} names shard {missing[0] if missing else '(none)'} "
                "which the repository does not hold"
            )
        return wanted + [INDEX] + shards
    weights = sorted(f for f in top if f.endswith(".safetensors"))
    if weights:
        return wanted + weights
    pickles = [f for f in top if f.endswith(PICKLE_SUFFIXES)]
    ggufs = [f for f in top if f.endswith(".gguf")]
    if ggufs:
        why = f"holds GGUF files ({', '.join(ggufs[:3])}); download one and give its path"
    elif pickles:
        why = f"holds only pickle weights ({pickles[0]}), refused because loading them can run code"
    else:
        why = "holds no safetensors weights"
    raise CheckpointError(f"{repo_id}: the repository {why}")


def fetch_command(repo_id: str) -> str:
    patterns = " ".join(f"'{p}'" for p in ("*.json", "*.safetensors", "tokenizer.model", "*.jinja"))
    return f"hf download {repo_id} --include {patterns}"


def download(repo_id: str, cache_dir: Path) -> Path:
    """Fetch what `repo_id` needs into the Hugging Face cache; the snapshot folder."""
    where = f"no such local folder, and not in the Hugging Face cache ({cache_dir})"
    if is_offline():
        raise CheckpointError(
            f"{repo_id}: {where}, and HF_HUB_OFFLINE=1 forbids downloading it; fetch it on a "
            f"machine with network access (`{fetch_command(repo_id)}`) or unset HF_HUB_OFFLINE"
        )
    try:
        import huggingface_hub as hub
    except ImportError:
        raise CheckpointError(
            f"{repo_id}: {where}; downloading needs `pip install huggingface_hub`"
        ) from None
    try:
        files = hub.list_repo_files(repo_id)
        index = None
        if INDEX in files:
            index_path = hub.hf_hub_download(repo_id, INDEX, cache_dir=cache_dir)
            index = json.loads(Path(index_path).read_text())
        chosen = select_files(repo_id, files, index)
        print(f"downloading {repo_id}: {len(chosen)} files", flush=True)
        snap = hub.snapshot_download(repo_id, allow_patterns=chosen, cache_dir=cache_dir)
    except CheckpointError:
        raise
    except Exception as e:  # huggingface_hub and httpx raise many types; all end here
        raise CheckpointError(f"{repo_id}: {where}, and {_why(repo_id, e)}") from None
    return Path(snap)


def _why(repo_id: str, e: Exception) -> str:
    name = type(e).__name__
    first = str(e).strip().splitlines()[0] if str(e).strip() else name
    if name in ("RepositoryNotFoundError", "GatedRepoError"):
        return "the Hub has no such repository you can read (private or gated: `hf auth login`)"
    if name == "RevisionNotFoundError":
        return f"the Hub has no such revision ({first})"
    return (
        f"the Hugging Face Hub could not be reached ({name}: {first}); with network access run "
        f"`{fetch_command(repo_id)}`"
    )
