"""llama.cpp as a decode peer: our weights as GGUF (F32, F16, Q8_0), run by llama-cpp-python.

The peer runs the very tensors our engine loaded: a Llama-family model (one lane) is written with
the gguf package's writer as llama.cpp's `llama` architecture (Q/K rows permuted to its RoPE
pairing, as its converter does), in F32 (bit-identical weights), F16 (rounded from them) or Q8_0
(gguf's quantizer); norms stay F32, as llama.cpp's converter leaves them. The vocabulary comes
from the checkpoint's tokenizer.json (byte-level BPE), or a GGUF checkpoint's own `tokenizer.*`
fields, or is made up (`t0`, `t1`, ...) for random weights; only ids are fed, so it needs to be
valid, not faithful.

As a peer of bench/peers.py (`llama.cpp=F32|F16|Q8_0`), it runs on the bench's model: the GGUF is
written to a temporary folder when the peer is built and removed when it is closed.

llama-cpp-python is optional (building it takes ~18 minutes on 2 cores:
`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python`); `available()` says whether it is
importable, and callers skip the peer with a note otherwise. Decode speed is measured as ours
is: a prompt is evaluated, then one greedy token per `eval`, median of the per-step times after
a warm-up; the thread count is the caller's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..gguf import find_gguf
from ..model import Laneformer
from ..step.threads import cpu_info
from .peers import PeerSetup, prompt_ids

TYPES = ("F32", "F16", "Q8_0", "Q4_1")
FILE_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_1": 3}  # llama.cpp LLAMA_FTYPE_*
LAYER = {  # ours (inside model.layers.{i}.) -> GGUF (inside blk.{i}.)
    "attention_norm.weight": "attn_norm.weight",
    "attention.wq.weight": "attn_q.weight",
    "attention.wk.weight": "attn_k.weight",
    "attention.wv.weight": "attn_v.weight",
    "attention.wo.weight": "attn_output.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
}


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def unsupported(model: Laneformer) -> str | None:
    """Why llama.cpp cannot run this model as `llama`, or None."""
    cfg = model.cfg
    if cfg.family != "llama" or cfg.model_type != "llama":
        return f"llama.cpp peer: only model_type llama is written (this is {cfg.model_type})"
    if cfg.rope_scaling is not None or cfg.attention_bias:
        return "llama.cpp peer: RoPE scaling and attention biases are not written"
    return None


def permute_for_llamacpp(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rotate-half rows (i, i + d/2) of each head -> adjacent rows (2i, 2i + 1) (its converter)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tensors(model: Laneformer) -> dict[str, torch.Tensor]:
    """GGUF name -> fp32 tensor in llama.cpp's layout, from a loaded Llama-family model."""
    cfg = model.cfg
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": state["model.tok_embeddings.weight"]}
    out["output_norm.weight"] = state["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_layers):
        for ours, theirs in LAYER.items():
            t = state[f"model.layers.{i}.{ours}"]
            t = t[0] if t.dim() == 3 else t  # (1, out, in): one lane
            if theirs == "attn_q.weight":
                t = permute_for_llamacpp(t, cfg.num_heads)
            elif theirs == "attn_k.weight":
                t = permute_for_llamacpp(t, cfg.num_kv_heads)
            out[f"blk.{i}.{theirs}"] = t.contiguous()
    return out


def _vocab(tokenizer_json: Path | None, size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, token types, merges) of a byte-level BPE tokenizer.json, or made up (one
    merge: llama.cpp refuses a BPE vocabulary without any)."""
    if tokenizer_json is None or not tokenizer_json.is_file():
        return [f"t{i}" for i in range(size)], [1] * size, ["t 0"]
    tj = json.loads(tokenizer_json.read_text())
    vocab = dict(tj["model"]["vocab"])
    special = {a["id"] for a in tj.get("added_tokens", []) if a.get("special")}
    for a in tj.get("added_tokens", []):
        vocab.setdefault(a["content"], a["id"])
    tokens = [""] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    types = [3 if i in special else 1 for i in range(len(tokens))]  # CONTROL / NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    return tokens, types, merges


def write_gguf(model: Laneformer, tokenizer_json: Path | None, out: Path, ggml_type: str) -> Path:
    """Write `model` as a llama.cpp GGUF of type F32, F16 or Q8_0 at `out`."""
    import gguf

    cfg = model.cfg
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("expresslane-peer")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(FILE_TYPES[ggml_type])
    if tokenizer_json is not None and find_gguf(tokenizer_json) is not None:
        _copy_tokenizer(w, find_gguf(tokenizer_json))
    else:
        tokens, types, merges = _vocab(tokenizer_json, cfg.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        if cfg.bos_token_id is not None:
            w.add_bos_token_id(cfg.bos_token_id)
        w.add_eos_token_id(cfg.eos_token_ids[0])
    qtype = gguf.GGMLQuantizationType[ggml_type]
    for name, t in gguf_tensors(model).items():
        a = t.numpy()
        if a.ndim == 1 or ggml_type == "F32":
            w.add_tensor(name, a.astype(np.float32))
        elif ggml_type == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _copy_tokenizer(w, source: Path) -> None:
    """The `tokenizer.*` fields of a GGUF file, as they are (SmolLM2's GGUF: its BPE vocab)."""
    import gguf

    for f in gguf.GGUFReader(str(source)).fields.values():
        if f.name.startswith("tokenizer."):
            sub = f.types[1] if len(f.types) > 1 else None
            w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)


def has_amx() -> bool:
    """Whether this CPU has AMX (Linux's flags), where llama.cpp's extra buffers crashed it."""
    return "amx_int8" in cpu_info("flags").split()


@contextlib.contextmanager
def without_extra_buffers():
    """On a CPU with AMX, llama.cpp without its extra buffer types (`use_extra_bufts`, llama's
    `--no-extra-bufts`): with them, llama-cpp-python 0.3.36 (GGML_NATIVE=ON or not) crashed
    with a segmentation fault in its first eval of SmolLM2's Q4_1 file on the VM's Xeon
    (2026-12-06), and ran without them. They hold the AMX and repacked layouts; the second
    serves Q4_0, IQ4_NL and Q8_0 on x86 (llama.cpp's repack.cpp), so on such a CPU those types'
    rows are llama.cpp without its repacking, and the rounds' notes say so."""
    from llama_cpp import llama as module

    if not has_amx():
        yield
        return
    default = module.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    module.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        module.llama_cpp.llama_model_default_params = default


def sampler_chain(draw: dict):
    """llama.cpp's own sampler chain for a draw (SamplingParams fields): top-k, top-p, min-p,
    temperature, then the distribution from the seed, in common/sampling.cpp's order. llama.cpp
    scales by the temperature after the truncations, transformers, vLLM and this engine before
    them: the same work, not the same distribution where top-p or min-p is set."""
    from llama_cpp import llama_cpp as C

    chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
    if draw.get("top_k", 0) > 0:
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_k(int(draw["top_k"])))
    if draw.get("top_p", 1.0) < 1.0:
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_p(draw["top_p"], 1))
    if draw.get("min_p", 0.0) > 0.0:
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_min_p(draw["min_p"], 1))
    C.llama_sampler_chain_add(chain, C.llama_sampler_init_temp(draw["temperature"]))
    C.llama_sampler_chain_add(chain, C.llama_sampler_init_dist(int(draw.get("seed", 0))))
    return chain


class LlamaCppPeer:
    """One GGUF loaded by llama-cpp-python, decoding one token per eval: greedily, or with
    llama.cpp's sampler chain for a draw."""

    def __init__(self, path: Path, threads: int, n_ctx: int, lora: tuple | None = None,
                 draw: dict | None = None):  # fmt: skip
        """`lora`: (adapter path, scale), applied by llama.cpp at run time. `draw`: the
        SamplingParams fields of a sampled draw (none: greedy)."""
        from llama_cpp import Llama

        extra = {"lora_path": str(lora[0]), "lora_scale": lora[1]} if lora else {}
        with without_extra_buffers():
            self.llm = Llama(
                model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False, **extra,
            )  # fmt: skip
        self.n_vocab = self.llm.n_vocab()
        self.draw = draw
        self.sampler = None

    def _free_sampler(self) -> None:
        if self.sampler is not None:
            from llama_cpp import llama_cpp as C

            C.llama_sampler_free(self.sampler)
            self.sampler = None

    def close(self) -> None:
        self._free_sampler()
        self.llm.close()  # now, not in __del__ at interpreter exit (llama.cpp is gone by then)

    def _next(self) -> int:
        """The token after the last eval: the argmax, or the sampler chain's draw."""
        if self.draw is None:
            return self._argmax()
        from llama_cpp import llama_cpp as C

        return int(C.llama_sampler_sample(self.sampler, self.llm._ctx.ctx, -1))

    def last_logits(self) -> np.ndarray:
        """The logits after the last eval (a view of llama.cpp's buffer)."""
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))

    def _argmax(self) -> int:
        return int(self.last_logits().argmax())

    def generate(self, prompt: list[int], n: int, warmup: int) -> dict:
        """n tokens decoded after the prompt (greedy, or drawn from a fresh chain seeded as
        asked): TTFT, median decode step, token ids."""
        self.llm.reset()
        if self.draw is not None:  # a fresh chain: its seed's draws from the start
            self._free_sampler()
            self.sampler = sampler_chain(self.draw)
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        tokens = [self._next()]
        ttft = time.perf_counter() - t0
        steps = []
        for _ in range(n + warmup - 1):
            t = time.perf_counter()
            self.llm.eval([tokens[-1]])
            tokens.append(self._next())
            steps.append(time.perf_counter() - t)
        med = statistics.median(steps[warmup:] or steps)
        return {
            "ttft_ms": ttft * 1e3,
            "prefill_tok_s": len(prompt) / ttft,
            "decode_tok_s": 1.0 / med,
            "ms_per_token": med * 1e3,
            "token_ids": tokens,
        }


class LlamaCppRunner:
    """The `llama.cpp=TYPE` peer: the bench's model as a GGUF of TYPE, greedy decode."""

    name = "llama.cpp"

    def __init__(self, setup: PeerSetup):
        t = setup.arg or "F32"
        if t not in TYPES:
            raise ValueError(f"llama.cpp={t}: expected one of {', '.join(TYPES)}")
        why = unsupported(setup.model)
        if why is not None:
            raise ValueError(why)
        self.setup, self.cfg, self.note = setup, setup.cfg, f"GGUF {t}, same weights"
        self.tmp = tempfile.TemporaryDirectory(prefix="expresslane-llamacpp-")
        ckpt = (setup.shared or {}).get("checkpoint")
        tok = (
            None
            if ckpt is None
            else Path(ckpt)
            if find_gguf(ckpt)
            else Path(ckpt) / "tokenizer.json"
        )
        path = write_gguf(setup.model, tok, Path(self.tmp.name) / f"{t}.gguf", t)
        draw = (setup.shared or {}).get("draw")
        self.peer = LlamaCppPeer(path, torch.get_num_threads(), n_ctx=setup.max_len, draw=draw)

    def measure(self, context: int) -> dict:
        s = self.setup
        prompt = prompt_ids(self.cfg.vocab_size, context, torch.device("cpu"))[0].tolist()
        row = self.peer.generate(prompt, s.decode_tokens, s.warmup_tokens)
        return {**row, "cuda_graph": False, "fused_kernels": False, "pdl": False}

    def close(self) -> None:
        self.peer.close()
        self.tmp.cleanup()


def llamacpp_peer(setup: PeerSetup) -> LlamaCppRunner:
    return LlamaCppRunner(setup)
