"""Tokenizers whose tool-call markers are special tokens, as Mistral's `[TOOL_CALLS]`, Llama's
`<|python_tag|>` and some Hermes models' `<tool_call>` are: the embedded model's tokenizer with
its last vocabulary pieces given over to the markers (the same vocabulary size, so the embedded
model runs with it), and a chat template that renders `tools` in that convention.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from expresslane.assets import default_model_dir

# a template that takes `tools` and names its convention's marker (tools.template_style)
TEMPLATES = {
    "mistral": "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS] calls: [TOOL_CALLS]",
    "llama3": "Tools: {{ tools | tojson }} calls: <|python_tag|> or JSON",
    "hermes": "<tools>{{ tools | tojson }}</tools> calls: <tool_call>",
}
MARKERS = {"mistral": ["[TOOL_CALLS]"], "llama3": ["<|python_tag|>"],
           "hermes": ["<tool_call>", "</tool_call>"]}  # fmt: skip


def marker_tokenizer(out: Path, style: str) -> tuple[Path, dict[str, int]]:
    """A tokenizer folder at `out` for `style`, and its markers' ids (the vocabulary's last)."""
    src = default_model_dir()
    tj = json.loads((src / "tokenizer.json").read_text())
    vocab, ids = tj["model"]["vocab"], {}
    by_id = {i: piece for piece, i in vocab.items()}
    last = max(by_id)
    for k, marker in enumerate(MARKERS[style]):
        i = last - k
        gone = by_id[i]
        del vocab[gone]
        vocab[marker] = i
        # no merge may make or use the piece given over
        merges = [m.split(" ") if isinstance(m, str) else m for m in tj["model"]["merges"]]
        tj["model"]["merges"] = [m for m in merges if gone not in m and "".join(m) != gone]
        tj["added_tokens"].append({"id": i, "content": marker, "single_word": False,
                                   "lstrip": False, "rstrip": False, "normalized": False,
                                   "special": True})  # fmt: skip
        ids[marker] = i
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tj))
    for name in ("special_tokens_map.json", "config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    config = json.loads((src / "tokenizer_config.json").read_text())
    turns = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}\n{% endfor %}"
             "{% if tools %}" + TEMPLATES[style] + "{% endif %}assistant: ")  # fmt: skip
    config["chat_template"] = turns
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out, ids
