"""Hugging Face checkpoint folders -> (ModelConfig, Laneformer), and back.

Only safetensors are read (single file or sharded through model.safetensors.index.json); pickle
checkpoints are refused because unpickling can run arbitrary code. Laneformer keys are the
model's own parameter names; Llama-family keys (embed_tokens, q_proj, gate_proj, ...) are mapped
and their (out, in) matrices viewed as one lane (1, out, in). Shared and per-lane norms are told
apart by their keys (`.weight` (D,) vs `.scale` (L, D)). A model may also be a GGUF file (or a
folder holding one), read through expresslane/gguf/ under the same keys, or `org/name`: from the
Hugging Face cache, else downloaded (expresslane/hub.py).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode
from tqdm import tqdm

from .config import ModelConfig
from .errors import CheckpointError, ConfigError
from .gguf import find_gguf
from .hub import INDEX, PICKLE_SUFFIXES
from .model import Laneformer
from .rope import inv_frequencies
from .sampling.defaults import SamplingDefaults

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LLAMA_KEYS = {  # ours -> transformers' (inside model.layers.{i}.)
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",  # qwen3: per-head norms (head_dim,)
    "attention.k_norm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


# --- where the files are --------------------------------------------------------------------
def resolve_model_dir(name: str | os.PathLike) -> Path:
    """A local folder or GGUF file, or `org/name` from the Hugging Face cache (else downloaded)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        if find_gguf(path) is not None:
            return path
        raise CheckpointError(f"{path}: is a file; expected a checkpoint folder or a .gguf file")
    if str(name).count("/") == 1 and not str(name).startswith((".", "/", "~")):
        for hub in _hub_dirs():
            snap = _snapshot(hub / ("models--" + str(name).replace("/", "--")))
            if snap is not None:
                return snap
        from .hub import download

        return download(str(name), _hub_dirs()[0])
    raise CheckpointError(f"{name}: no such folder or file")


def _hub_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    dirs.append(home / "hub")
    return dirs


def _snapshot(repo: Path) -> Path | None:
    if not (repo / "snapshots").is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file() and (repo / "snapshots" / ref.read_text().strip()).is_dir():
        return repo / "snapshots" / ref.read_text().strip()
    snaps = sorted((repo / "snapshots").iterdir(), key=lambda p: p.stat().st_mtime)
    return snaps[-1] if snaps else None


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shard {missing[0]} which is not in {folder}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        return others
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{folder / pickles[0]}: pickle checkpoints are refused because loading them can "
            "execute arbitrary code; convert the weights to safetensors first"
        )
    raise CheckpointError(f"{folder}: no model.safetensors (or sharded index) found")


# --- config ---------------------------------------------------------------------------------
def load_config(folder: Path) -> ModelConfig:
    gguf = find_gguf(folder)
    if gguf is not None:  # the config is in the file's metadata
        from .gguf.config import model_config
        from .gguf.reader import read_header

        return model_config(read_header(gguf))
    cfg = ModelConfig.from_json(folder / "config.json")
    eos = generation_config(folder).get("eos_token_id")
    extra = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    if extra:
        merged = tuple(dict.fromkeys(list(cfg.eos_token_ids) + [int(e) for e in extra]))
        cfg = cfg.with_overrides(eos_token_ids=merged)
    return cfg


def generation_config(folder: Path) -> dict:
    """The folder's generation_config.json as a dict ({} where there is none, or it holds no
    object); invalid JSON is a ConfigError naming the file."""
    gen = Path(folder) / "generation_config.json"
    if not gen.is_file():
        return {}
    try:
        config = json.loads(gen.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{gen}: not valid JSON ({e})") from None
    return config if isinstance(config, dict) else {}


def sampling_defaults(path: Path) -> SamplingDefaults:
    """The model creator's sampling defaults (sampling/defaults.py): a GGUF file's
    `general.sampling.*` keys, else the generation_config.json of the folder (for a GGUF file,
    the one beside it, where the tokenizer files are looked for too); none where neither has
    any."""
    folder, gguf = Path(path), find_gguf(path)
    if gguf is not None:
        from .gguf.reader import read_header

        found = SamplingDefaults.from_gguf(read_header(gguf).metadata)
        if found.given():
            return found
        folder = gguf.parent
    return SamplingDefaults.from_generation_config(generation_config(folder))


def _reconcile_norms(cfg: ModelConfig, keys: set[str]) -> ModelConfig:
    """The checkpoint's keys decide shared vs per-lane norms (laneformer.md 3.3)."""
    if cfg.family != "laneformer":
        return cfg
    if "model.layers.0.attention_norm.scale" in keys and cfg.replicated_rmsn_scale:
        return cfg.with_overrides(replicated_rmsn_scale=False)
    if "model.layers.0.attention_norm.weight" in keys and not cfg.replicated_rmsn_scale:
        return cfg.with_overrides(replicated_rmsn_scale=True)
    return cfg


# --- names ----------------------------------------------------------------------------------
def hf_name(cfg: ModelConfig, name: str) -> str:
    """Our parameter name -> the checkpoint's key."""
    if cfg.family == "laneformer":
        return name
    name = name.replace("model.tok_embeddings.", "model.embed_tokens.")
    for ours, theirs in LLAMA_KEYS.items():
        name = name.replace(f".{ours}.", f".{theirs}.")
    return name


def to_hf_tensor(cfg: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """Llama keeps (out, in) matrices and (out,) biases; ours carry a leading lane axis of 1."""
    if cfg.family == "llama" and ".layers." in name and "norm" not in name:
        return t[0]
    return t


def from_hf_tensor(cfg: ModelConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    if cfg.family == "llama" and ".layers." in name and "norm" not in name:
        return t.unsqueeze(0)
    return t


class NoInit(TorchFunctionMode):
    """Skip random initialisation while building a module on meta (it is overwritten anyway).

    On meta tensors torch.nn.init goes through Python decompositions that import torch._dynamo,
    seconds per rank process at start-up.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in ("normal_", "uniform_", "kaiming_uniform_"):
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


# --- loading --------------------------------------------------------------------------------
Selector = Callable[[str, object, tuple], torch.Tensor]


def _whole(name: str, sl, shape: tuple) -> torch.Tensor:
    return sl[:]


def open_checkpoint(name: str | os.PathLike, overrides: dict | None = None):
    """(folder, config, open safetensors handles by file, file of each tensor name)."""
    folder = resolve_model_dir(name)
    cfg = load_config(folder)
    handles = {}
    gguf = find_gguf(folder)
    if gguf is not None:  # one file that reads like a safetensors handle (expresslane/gguf/)
        from .gguf.tensors import GGUFCheckpoint

        handles[gguf] = GGUFCheckpoint(gguf)
    for f in safetensors_files(folder) if gguf is None else []:
        try:
            handles[f] = safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
    where = {k: f for f, h in handles.items() for k in h.keys()}
    cfg = _reconcile_norms(cfg, set(where))
    if overrides:
        cfg = cfg.with_overrides(**overrides)
    return folder, cfg, handles, where


def load_model(
    name: str | os.PathLike,
    device: str = "auto",
    dtype: str = "auto",
    overrides: dict | None = None,
    progress: bool = True,
    unread: Callable[[ModelConfig], set[str]] | None = None,
) -> Laneformer:
    """Read a checkpoint folder into a Laneformer on `device` in `dtype`. `unread(cfg)`: our
    parameter names left unread, on the meta device, for a packer that takes them from the file
    as stored (packing.pack_gguf, pack_stored), so that they are never converted to fp32."""
    folder, cfg, handles, where = open_checkpoint(name, overrides)
    dev = resolve_device(device, cfg)
    dt = resolve_dtype(dtype, cfg, dev)
    with torch.device("meta"), NoInit():
        model = Laneformer(cfg)
    expected = dict(model.named_parameters())
    wanted = {hf_name(cfg, n): n for n in expected}
    missing = sorted(k for k in wanted if k not in where)
    if missing:
        raise CheckpointError(
            f"{folder}: missing tensor {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(
        k
        for k in where
        if k not in wanted and k not in ignorable and not k.endswith("rotary_emb.inv_freq")
    )
    if unexpected:
        raise CheckpointError(
            f"{folder}: unexpected tensor {unexpected[0]} "
            f"(not part of a {cfg.model_type} model with this config)"
        )
    state, skip = {}, unread(cfg) if unread else set()
    read = [(key, ours) for key, ours in wanted.items() if ours not in skip]
    bar = tqdm(read, desc="loading", unit="tensor", file=sys.stderr, disable=not progress or None)
    for key, ours in bar:
        state[ours] = read_tensor(
            cfg, handles[where[key]], key, ours, expected[ours].shape, where[key]
        ).to(device=dev, dtype=dt)
    # assign: the tensors read become the parameters of the meta-built model (nothing allocated
    # twice); its non-persistent RoPE buffer is computed here (fp32, laneformer.md 4.4)
    missing = model.load_state_dict(state, strict=False, assign=True).missing_keys
    assert set(missing) == skip, f"parameters neither read nor left unread: {missing}"
    model.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(dev)
    return model.eval()


def read_tensor(
    cfg, handle, key: str, ours: str, shape, file, select: Selector = _whole
) -> torch.Tensor:
    """Tensor `key` of an open file, checked against our parameter `ours` of the whole model's
    `shape`, in our layout; `select(ours, slice, full_shape)` picks the part to read (a rank's
    slices), by default all of it."""
    try:
        sl = handle.get_slice(key)
        hf_shape = tuple(sl.get_shape())
        want = tuple(to_hf_tensor(cfg, ours, torch.empty(shape, device="meta")).shape)
        if hf_shape != want:
            raise CheckpointError(
                f"{file}: tensor {key} has shape {list(hf_shape)}, expected "
                f"{list(want)} for this config"
            )
        t = select(ours, sl, hf_shape)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"{file}: cannot read tensor {key} ({e}); is the file truncated?"
        ) from None
    return from_hf_tensor(cfg, ours, t)


# `--device auto` keeps a model of at most this many weights on the CPU where a GPU exists
# (docs/architecture.md, "The device `auto` picks"): the embedded model (5.6 M) decoded at 154
# tok/s on the first GPU machine's CPU and 36 on its H200, whose first request pays Triton
# compiles and graph captures that a CPU step never has; a 135 M model goes to the GPU.
AUTO_CPU_MAX_PARAMETERS = 16_000_000


def parameter_count(cfg: ModelConfig) -> int:
    """The model's weights, counted on the meta device (nothing allocated)."""
    with torch.device("meta"), NoInit():
        return sum(p.numel() for p in Laneformer(cfg).parameters())


def resolve_device(device: str = "auto", cfg: ModelConfig | None = None) -> torch.device:
    """The device a flag names; `auto`: a GPU when there is one, unless `cfg` is a model small
    enough to be faster on the CPU (AUTO_CPU_MAX_PARAMETERS)."""
    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        small = cfg is not None and parameter_count(cfg) <= AUTO_CPU_MAX_PARAMETERS
        return torch.device("cpu" if small else "cuda")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(
            f"--device {device!r}: not a device name (cpu, cuda, cuda:1, ...)"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available on this machine")
    return dev


def resolve_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """auto = the checkpoint's dtype on a GPU, float32 on a CPU (bf16 GEMMs are slow there)."""
    if dtype == "auto":
        return DTYPES.get(cfg.dtype, torch.float32) if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected auto, bfloat16, float16 or float32")
    return DTYPES[dtype]


# --- saving ---------------------------------------------------------------------------------
def save_model(
    model: Laneformer,
    out_dir: str | os.PathLike,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write config.json and model.safetensors (sharded with an index past max_shard_bytes)."""
    cfg = model.cfg
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dt = DTYPES[dtype] if dtype else next(model.parameters()).dtype
    name = next(k for k, v in DTYPES.items() if v == dt)
    tensors = {
        hf_name(cfg, n): to_hf_tensor(cfg, n, p.detach()).to("cpu", dt).contiguous()
        for n, p in model.named_parameters()
    }
    (out / "config.json").write_text(
        json.dumps({**cfg.to_hf_dict(), "torch_dtype": name}, indent=2) + "\n"
    )
    shards, cur, size = [], {}, 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = t, size + nbytes
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return out
