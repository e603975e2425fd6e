"""Drafts from a smaller model: vLLM's `{"method": "draft_model", "model": PATH}`, llama.cpp's
`--model-draft`.

The draft model runs in an engine of its own (`load_draft`: the target's device and context,
its own KV cache), and proposes its greedy continuation of the sequence so far, one token per
forward. Every proposal goes through that engine's `prefill`, whose prefix reuse does the
bookkeeping: the draft cache already holds the sequence up to the last verify, so a proposal
prefills only what is new (the tokens the target kept or chose since), then one token per draft;
the drafts the target rejected are cut off by the common prefix. Its rings keep no snapshot
(prefix.py): a proposal only ever extends the sequence, and a snapshot per token would cost a
copy of every ring.

The drafts are the draft model's argmax, a deterministic function of the sequence: the
speculative decoder's acceptance rule (drafting.accept, for a one-hot draft distribution) keeps
the target's output distribution exactly, and greedy output is plain greedy's, whatever the
draft model. Only the speed depends on it: how often the target agrees, and what a draft token
costs (`cost`: the draft's weight bytes over the target's, the share of a decode step one draft
token streams at batch 1), which the back-off (drafting.BackOff) counts with the verify's.

Decision: the draft and target must have the same vocabulary size (vLLM's check); a draft with
another tokenizer of the same size would give drafts that are rarely kept, never a wrong output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ConfigError


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (packed weights included): what a step streams."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def load_draft(engine_cls, path: str, target):
    """The draft model's engine (`engine_cls` is the caller's Engine: this layer cannot import
    it) for `target`'s device and context; a ConfigError when the vocabularies differ."""
    on_cpu = target.device.type == "cpu"
    dtype = "auto" if on_cpu else str(target.dtype).removeprefix("torch.")
    draft = engine_cls.from_pretrained(path, device=str(target.device), dtype=dtype,
                                       max_model_len=target.max_len, progress=False,
                                       capture=False)  # fmt: skip
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ConfigError(
            f"--speculative-config: the draft model has {draft.cfg.vocab_size} tokens in its "
            f"vocabulary and the model {target.cfg.vocab_size}: they must share a tokenizer"
        )
    draft.prefix.snapshot = None  # module docstring
    draft.draft_cost = weight_bytes(draft.model) / max(1, weight_bytes(target.model))
    return draft


class DraftModelDrafter:
    """The drafter interface (extend, propose, strong, from_prediction) over a draft engine."""

    from_prediction = False
    strong = False  # a back-off pause holds: the draft model's misses cost its forwards too

    def __init__(self, draft, prompt_ids: Sequence[int]):
        self.draft = draft
        self.seq: list[int] = list(prompt_ids)
        self.cost = getattr(draft, "draft_cost", 0.0)  # load_draft sets it

    def extend(self, tokens: Sequence[int]) -> None:
        self.seq.extend(tokens)

    @torch.inference_mode()
    def propose(self, k: int) -> list[int]:
        """The draft model's greedy next k tokens after the sequence."""
        out: list[int] = []
        for _ in range(max(0, k)):
            logits = self.draft.prefill(self.seq + out)
            out.append(int(logits.argmax()))
        return out
