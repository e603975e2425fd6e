"""`org/name` not in the Hugging Face cache: which files are fetched, the download through a
mocked huggingface_hub, and the one-line answers offline or without network."""

from __future__ import annotations

import json
import shutil

import huggingface_hub
import pytest

from expresslane.__main__ import main
from expresslane.checkpoint import load_model, resolve_model_dir
from expresslane.errors import CheckpointError
from expresslane.hub import select_files

LISTING = [
    ".gitattributes",
    "README.md",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "consolidated.safetensors",  # a second copy of the weights in another layout
    "pytorch_model.bin",
    "original/params.json",
    "original/consolidated.00.pth",
    "onnx/model.onnx",
]
INDEX = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                        "b": "model-00002-of-00002.safetensors"}}  # fmt: skip


def test_selection_takes_config_tokenizer_and_the_indexed_shards_only():
    got = select_files("org/m", LISTING, INDEX)
    assert got == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_selection_without_an_index_takes_every_top_level_safetensors():
    files = ["config.json", "tokenizer.model", "model.safetensors", "pytorch_model.bin"]
    assert select_files("org/m", files) == ["config.json", "tokenizer.model", "model.safetensors"]


@pytest.mark.parametrize(
    "files,index,words",
    [
        (["config.json", "pytorch_model.bin"], None, ["pickle", "pytorch_model.bin"]),
        (["config.json", "m.Q4_K_M.gguf"], None, ["GGUF", "m.Q4_K_M.gguf", "give its path"]),
        (["model.safetensors"], None, ["no config.json"]),
        (["config.json", "model-1.safetensors"], {"weight_map": {"a": "model-2.safetensors"}},
         ["model-2.safetensors"]),
    ],
)  # fmt: skip
def test_selection_refuses_what_cannot_be_loaded(files, index, words):
    with pytest.raises(CheckpointError) as e:
        select_files("org/m", files, index)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return tmp_path / "hub"


def test_offline_is_one_line_saying_what_is_missing_and_how_to_get_it(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "list_repo_files", _never)
    with pytest.raises(CheckpointError) as e:
        resolve_model_dir("kogai/missing")
    msg = str(e.value)
    assert "\n" not in msg
    for word in ("kogai/missing", str(hub_cache), "HF_HUB_OFFLINE", "hf download kogai/missing"):
        assert word in msg


def test_offline_on_the_cli_exits_2(hub_cache, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["run", "kogai/missing", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HF_HUB_OFFLINE" in err[0]


def test_unreachable_hub_is_one_line(hub_cache, monkeypatch):
    def refuse(*a, **k):
        raise ConnectionError("[Errno 101] Network is unreachable\nmore detail")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", refuse)
    with pytest.raises(CheckpointError) as e:
        resolve_model_dir("kogai/missing")
    msg = str(e.value)
    assert "\n" not in msg and "could not be reached" in msg and "Network is unreachable" in msg
    assert "hf download kogai/missing" in msg


def test_download_fetches_the_selection_into_the_cache_then_reuses_it(
    hub_cache, monkeypatch, random_laneformer_dir
):
    calls = {}
    files = sorted(p.name for p in random_laneformer_dir.iterdir()) + ["pytorch_model.bin"]

    def snapshot_download(repo_id, allow_patterns, cache_dir):
        calls["snapshot"] = (repo_id, list(allow_patterns), str(cache_dir))
        snap = hub_cache / "models--kogai--tiny" / "snapshots" / "abc"
        snap.mkdir(parents=True)
        for f in allow_patterns:
            shutil.copy(random_laneformer_dir / f, snap / f)
        (snap.parents[1] / "refs").mkdir()
        (snap.parents[1] / "refs" / "main").write_text("abc")
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id: files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = load_model("kogai/tiny", device="cpu", progress=False)
    repo, patterns, cache = calls["snapshot"]
    assert (repo, cache) == ("kogai/tiny", str(hub_cache))
    assert "model.safetensors" in patterns and "config.json" in patterns
    assert "tokenizer.json" in patterns and "pytorch_model.bin" not in patterns
    assert model.cfg.num_lanes == 8
    monkeypatch.setattr(huggingface_hub, "list_repo_files", _never)  # now it is cached
    assert resolve_model_dir("kogai/tiny") == hub_cache / "models--kogai--tiny/snapshots/abc"
    assert json.loads((resolve_model_dir("kogai/tiny") / "config.json").read_text())


def _never(*a, **k):
    raise AssertionError("the hub must not be contacted")
