"""The model creator's sampling defaults: what a server request that leaves a field out gets.

Models ship recommended sampling settings: Qwen3's generation_config.json asks for temperature
0.6, top_p 0.95 and top_k 20, and llama.cpp's converter writes the same into a GGUF file as
`general.sampling.*`. vLLM's server applies them to every request that does not set the field
(`--generation-config auto`, its default: "Default sampling parameters have been overridden by
the model's Hugging Face generation config"), and llama.cpp's reads the GGUF keys the same
way. So does `serve` (`--generation-config auto | vllm | FOLDER`, vLLM's flag): a vLLM user who
moves here gets the answers the model's authors tuned for. `vllm` keeps OpenAI's defaults
(temperature 1, top_p 1, no top_k or min_p, no repetition penalty). The `run` CLI stays greedy
unless told otherwise, as before.

The fields are vLLM's: temperature, top_p, top_k, min_p and repetition_penalty (`do_sample` is
ignored, as vLLM ignores it). Two choices follow vLLM where it is arbitrary: a generation
config's `top_k` of 50 (transformers' own default, which vLLM's reading drops) is not applied,
and its `max_new_tokens` is not read (vLLM would cap every request's max_tokens with it; here a
request's max_tokens is its own).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# generation_config.json's keys, and llama.cpp's GGUF keys, for each field
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty"}  # fmt: skip
GGUF_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
             "top_k": "general.sampling.top_k", "min_p": "general.sampling.min_p",
             "repetition_penalty": "general.sampling.penalty_repeat"}  # fmt: skip
HF_TOP_K_DEFAULT = 50  # transformers' GenerationConfig default, dropped by vLLM's diff


@dataclass(frozen=True)
class SamplingDefaults:
    """Each field: the model's value, or None where it gives none (OpenAI's default stands)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_generation_config(cls, config: dict[str, Any]) -> SamplingDefaults:
        found = {f: config.get(k) for f, k in HF_KEYS.items()}
        if found["top_k"] == HF_TOP_K_DEFAULT:
            found["top_k"] = None
        return cls._checked(found)

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> SamplingDefaults:
        return cls._checked({f: metadata.get(k) for f, k in GGUF_KEYS.items()})

    @classmethod
    def _checked(cls, found: dict[str, Any]) -> SamplingDefaults:
        """Numbers only, in the ranges a request may set (a file's odd value is ignored, not
        fatal: the server's own default stands)."""
        ok = {
            "temperature": lambda v: v >= 0,
            "top_p": lambda v: 0 < v <= 1,
            "top_k": lambda v: float(v).is_integer() and v >= -1,
            "min_p": lambda v: 0 <= v <= 1,
            "repetition_penalty": lambda v: v > 0,
        }
        kept = {f: v for f, v in found.items() if isinstance(v, (int, float))
                and not isinstance(v, bool) and ok[f](v)}  # fmt: skip
        if "top_k" in kept:
            kept["top_k"] = int(kept["top_k"])
        return cls(**{f: float(v) if f != "top_k" else v for f, v in kept.items()})

    def given(self) -> dict[str, float | int]:
        """The fields the model sets."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}  # fmt: skip

    def over(self, request: Any) -> dict[str, float | int]:
        """Each field: the request's where it set it (pydantic's `model_fields_set`), else the
        model's, else the request model's own default (OpenAI's)."""
        sent = request.model_fields_set
        out = {}
        for f in fields(self):
            mine = getattr(self, f.name)
            value = getattr(request, f.name) if f.name in sent or mine is None else mine
            out[f.name] = 1.0 if f.name == "repetition_penalty" and value is None else value
        return out

    def describe(self) -> str:
        """'temperature 0.6, top_p 0.95, top_k 20', or '' when the model sets none."""
        return ", ".join(f"{k} {v:g}" for k, v in self.given().items())
