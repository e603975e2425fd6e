"""`lm_eval --model local-completions` against the server: an ARC-shaped task, fully offline.

The task is a local JSON-lines file in ARC's row shape, read through a task YAML with
`dataset_path: json`. lm-eval finds the tokenizer through the server's /tokenizer_info,
/tokenize and /detokenize (no transformers, no hub), sends token-id prompts with echo and
logprobs, and sums the continuation's logprobs. Every per-choice log-likelihood it logs must
equal the one computed here from the model's own logits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from expresslane.cli.serve import serving
from expresslane.engine import Engine
from expresslane.serve import create_app
from expresslane.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None,
    reason="lm_eval is not installed (pip install 'lm-eval[api]')",
)
CTX = 256
ROWS = [
    ("Which gas do plants take in?", ["oxygen", "carbon dioxide", "helium", "neon"], "B"),
    ("What melts ice fastest?", ["salt", "sand", "wood", "glass"], "A"),
    ("Which is a mammal?", ["shark", "trout", "whale", "eel"], "C"),
    ("What does a thermometer measure?", ["mass", "length", "time", "temperature"], "D"),
]
TASK = """\
task: tiny_arc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices.label.index(answerKey)}}}}"
doc_to_choice: "{{{{choices.text}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
"""


def reference(engine: Engine, tok: Tokenizer, context: str, cont: str) -> tuple[float, bool]:
    """What lm-eval should get: its own encoding of the pair, scored with our model's logits:
    (sum of the continuation's logprobs, whether every continuation token is the argmax)."""
    n = len(context) - len(context.rstrip())  # lm-eval moves trailing spaces to the continuation
    if n:
        context, cont = context[:-n], context[-n:] + cont
    whole = tok.encode(context + cont, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    with torch.inference_mode():
        lp = engine.model(torch.tensor([whole]))[0].float().log_softmax(-1)
    span = range(len(ctx), len(whole))
    return (
        sum(float(lp[i - 1, whole[i]]) for i in span),
        all(int(lp[i - 1].argmax()) == whole[i] for i in span),
    )


def test_lm_eval_local_completions_matches_engine(random_laneformer_dir, tmp_path):
    data = tmp_path / "arc.jsonl"
    with data.open("w") as f:
        for i, (q, texts, key) in enumerate(ROWS):
            f.write(
                json.dumps(
                    {
                        "id": f"q{i}",
                        "question": q,
                        "answerKey": key,
                        "choices": {"text": texts, "label": list("ABCD")},
                    }
                )
                + "\n"
            )
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_arc.yaml").write_text(TASK.format(data=data))
    engine = Engine.from_pretrained(
        str(random_laneformer_dir), device="cpu", dtype="float32", max_model_len=CTX, progress=False
    )
    tok = Tokenizer.from_dir(random_laneformer_dir)
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "OPENAI_API_KEY": "",
        "TOKENIZERS_PARALLELISM": "false",
    }
    with serving(create_app(engine, tok, served_model_name="tiny")) as url:
        args = [
            sys.executable,
            "-m",
            "lm_eval",
            "run",
            "--model",
            "local-completions",
            "--model_args",
            f"model=tiny,base_url={url}/v1/completions,max_length={CTX},"
            "num_concurrent=1,max_retries=1",
            "--tasks",
            "tiny_arc",
            "--include_path",
            str(tasks),
            "--output_path",
            str(tmp_path / "out"),
            "--log_samples",
        ]
        run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, textwrap.shorten(run.stderr[-3000:], 3000)
    assert "remote tokenizer" in run.stderr.lower()  # found through our /tokenizer_info
    samples = [
        json.loads(line)
        for p in (tmp_path / "out").rglob("samples_tiny_arc_*.jsonl")
        for line in p.read_text().splitlines()
    ]
    assert len(samples) == len(ROWS)
    for s in samples:
        pairs = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
        assert len(pairs) == 4
        for (context, cont), resp in zip(pairs, s["resps"], strict=True):
            ll, is_greedy = resp[0]  # logged as strings
            want_ll, want_greedy = reference(engine, tok, context, cont)
            assert float(ll) == pytest.approx(want_ll, abs=1e-3)
            assert (str(is_greedy) == "True") == want_greedy
