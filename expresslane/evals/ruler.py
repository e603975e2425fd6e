"""RULER-style synthetic long-context tasks: generated here, sized with the model's tokenizer.

The eleven tasks of the model card: NIAH single 1-3, multikey 1-3, multiquery, multivalue,
variable tracking (vt), common-words (cwe) and frequent-words (fwe) extraction, with RULER's
templates and answer prefixes (lm-eval's `ruler` tasks). Each sample is asked through chat with
greedy decoding: the question as the user message, the answer prefix as an assistant message
the server continues. Score: string match, as RULER's `string_match_all`: the share of the
expected strings found (case-insensitive) in the answer, averaged, times 100.

Length: a sample's length is the tokens of the whole chat prompt the server will see (chat
template, question, answer prefix; the model's tokenizer) plus the tokens reserved for the
answer, so that a sample of the model's context length fits it. (lm-eval's RULER counts the
question alone, without the chat template.) Each sample is filled to the largest length
<= the target, which lands within 2% of it. All randomness comes from
`random.Random(f"{seed}:{task}:{length}:{index}")`: same seed and tokenizer, same samples.

Deviations, on purpose: the essay haystack is synthetic prose (RULER uses Paul Graham's
essays, which no package ships), words and keys come from built-in lists (RULER uses
`wonderwords`), and haystacks made of distractor needles are topped up with filler words so
that they too reach the target within 2%.
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

WORDS = """
amber agile brave bright calm clever cosy crisp curious dusty eager early fancy fierce gentle giant
glossy golden grumpy happy hollow humble icy jolly keen lively lucky mellow misty modest narrow
noble odd pale patient polite proud quiet rapid rare rusty shiny silent silver sleepy smooth snowy
steady stormy sunny swift tame tidy tiny vivid warm wild witty young
| anchor apple badger basket beacon bottle bridge cactus camera candle canyon castle cloud comet
copper cradle dolphin dragon engine falcon feather forest garden glacier hammer harbor helmet
island jacket kettle ladder lantern lemon magnet meadow mirror monkey needle orchard otter palace
parrot pebble pencil pillow planet pocket puzzle rabbit river rocket saddle shadow shovel spider
spoon statue tiger tower tunnel violin wagon walnut window wizard
| admires borrows carries chases crafts defends describes draws finds follows guards hides holds
lifts measures mends notices opens paints polishes praises repairs rescues shapes sketches studies
throws trades visits watches
| quietly boldly slowly gladly rarely often calmly softly briskly warmly early later proudly gently
"""
ADJ, NOUN, VERB, ADV = (part.split() for part in WORDS.split("|"))
ESSAY = "The {j} {a} {v} the {b}.|Every {a} {v} a {j} {b} {d}.|Near the {a}, a {j} {b} waits {d}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {kind} afterwards.\n{context}\n"
    "What are all the special magic {kind} for {query} mentioned in the provided "
    "text?"
)
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following "
    "text.\n\n{context}\nQuestion: Find all variables that are assigned the value "
    "{value} in the text above."
)
VT_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, "
    "{n} variables are assigned the value {value}, they are:"
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than "
    "others. Memorize the ones that appear most often.\n{context}\nQuestion: What "
    "are the 10 most common words in the above list?"
)
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find "
    "the three most frequently appeared coded words. {context}\nQuestion: Do not "
    "provide any explanation. Please ignore the dots '....'. What are the three most "
    "frequently appeared words in the above coded text?"
)
FWE_PREFIX = (
    "Answer: According to the coded text above, the three most frequently appeared words are:"
)

# task -> (haystack, key type, value type, keys, values per key, keys asked)
NIAH = {
    "niah_single_1": ("repeat", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
}
TASKS = [*NIAH, "vt", "cwe", "fwe"]
TITLES = {
    **{t: "NIAH " + t[5:].replace("_", " ") for t in NIAH},
    "vt": "RULER variable tracking",
    "cwe": "RULER common words extraction",
    "fwe": "RULER frequent words extraction",
}
MAX_NEW = {**{t: 128 for t in NIAH}, "vt": 30, "cwe": 120, "fwe": 50}
Build = Callable[[int, int], tuple[str, list[str], str]]  # (units, pad words) -> sample


@dataclass
class Sample:
    task: str
    index: int
    target: int
    length: int  # input tokens + max_new_tokens, <= target
    input: str
    gen_prefix: str
    answers: list[str]
    max_new_tokens: int
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- random content
def _value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(ADJ)}-{rng.choice(NOUN)}"


def _distinct(rng: random.Random, kind: str, n: int, taken: set) -> list[str]:
    out = []
    while len(out) < n:
        v = _value(rng, kind)
        if v not in taken:
            taken.add(v)
            out.append(v)
    return out


def _essay_words(rng: random.Random, n: int) -> list[str]:
    """Synthetic prose, no digits or hyphens, so that no needle can occur in it by chance."""
    words: list[str] = []
    while len(words) < n:
        a, b, j, v, d = (rng.choice(x) for x in (NOUN, NOUN, ADJ, VERB, ADV))
        words += rng.choice(ESSAY.split("|")).format(a=a, b=b, j=j, v=v, d=d).split()
    return words[:n]


def _noise_words(n: int) -> list[str]:
    base = NOISE.split()
    return [base[i % len(base)] for i in range(n)]


def _insert(words: list[str], items: list[str], depths: list[float], sep: str = " ") -> str:
    """Insert `items` into `words` at sentence ends nearest to the given depths (0..1)."""
    ends = [0] + [i + 1 for i, w in enumerate(words) if w.endswith(".")]
    if ends[-1] != len(words):
        ends.append(len(words))
    at = sorted(ends[round(d * (len(ends) - 1))] for d in depths)
    out, prev = [], 0
    for pos, item in zip(at, items, strict=True):
        out += [*words[prev:pos], item]
        prev = pos
    return sep.join(out + words[prev:])


def _syllable_words(n: int, seed: int = 0) -> list[str]:
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        w = "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(3))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


# --------------------------------------------------------------------------------- builders
def _niah(task: str, rng: random.Random, target: int) -> tuple[Build, int]:
    hay, key_kind, kind, n_keys, n_values, n_query = NIAH[task]
    taken: set = set()
    keys = _distinct(rng, key_kind, n_keys, taken)
    values = {k: _distinct(rng, kind, n_values, taken) for k in keys}
    needles = [NEEDLE.format(kind=kind, key=k, value=v) for k in keys for v in values[k]]
    rng.shuffle(needles)
    depths = [rng.random() for _ in needles]
    asked = rng.sample(keys, n_query)
    answers = [v for k in asked for v in values[k]]
    query = ", ".join(asked[:-1]) + ", and " + asked[-1] if len(asked) > 1 else asked[0]
    template, noun = NIAH_TEMPLATE, kind
    prefix = f"The special magic {kind} for {query} mentioned in the provided text are"
    if n_query * n_values == 1:
        noun = kind[:-1]
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        prefix = f"The special magic {noun} for {query} mentioned in the provided text is"
    units = 4 * target  # a word or a line costs at least one token
    stream = _essay_words(rng, units) if hay == "essay" else None
    distractors = []
    if hay == "needle":
        units = target // 8 + 16  # a distractor line costs far more than 8 tokens
        dkeys = _distinct(rng, key_kind, units, taken)
        dvals = _distinct(rng, kind, units, taken)
        pairs = zip(dkeys, dvals, strict=True)
        distractors = [NEEDLE.format(kind=kind, key=k, value=v) for k, v in pairs]

    def build(n: int, pad: int) -> tuple[str, list[str], str]:
        if hay == "needle":
            lines = [*distractors[:n]]
            for needle, d in zip(needles, depths, strict=True):
                lines.insert(round(d * len(lines)), needle)
            context = "\n".join(lines + ([" ".join(_noise_words(pad))] if pad else []))
        else:
            words = stream[:n] if stream is not None else _noise_words(n)
            context = _insert(words, needles, depths)
        return template.format(kind=noun, context=context, query=query), answers, prefix

    return build, units


def _vt(rng: random.Random, target: int) -> tuple[Build, int]:
    names: list[str] = []
    while len(names) < 5:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        names += [] if name in names else [name]
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(len(names) - 1)
    ]
    depths = sorted(rng.random() for _ in chain)
    prefix = VT_PREFIX.format(n=len(names), value=value)

    def build(n: int, pad: int) -> tuple[str, list[str], str]:
        context = _insert(_noise_words(n), chain, depths)
        return VT_TEMPLATE.format(context=context, value=value), names, prefix

    return build, 4 * target


def _cwe(rng: random.Random, target: int) -> tuple[Build, int]:
    pool = ADJ + NOUN + [v[:-1] if v.endswith("s") else v for v in VERB]
    pool += _syllable_words(max(0, target // 2 - len(pool)))
    pool = sorted(set(pool))
    rng.shuffle(pool)
    common, uncommon = pool[:10], pool[10:]
    # RULER's repeats (30 and 3; 6 and 1 below 4096 tokens), and fewer for short targets
    rep_common, rep_rare = (30, 3) if target >= 4096 else (6, 1) if target >= 2048 else (3, 1)
    order_seed = rng.getrandbits(64)

    def listing(words: list[str], reps: int, rare: list[str], rare_reps: int, seed) -> str:
        items = words * reps + rare * rare_reps
        random.Random(seed).shuffle(items)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))

    ex_words = _syllable_words(20, seed=1)
    ex = listing(ex_words[:10], 3, ex_words[10:], 1, 7)
    example = f"{CWE_TEMPLATE.format(context=ex)} {CWE_PREFIX} {', '.join(ex_words[:10])}.\n\n"
    example = example if target >= 2048 else ""  # no room for the worked example

    def build(n: int, pad: int) -> tuple[str, list[str], str]:
        text = CWE_TEMPLATE.format(
            context=listing(common, rep_common, uncommon[:n], rep_rare, f"{order_seed}:{n}")
        )
        return example + text, common, CWE_PREFIX

    return build, len(uncommon)


def _fwe(rng: random.Random, target: int) -> tuple[Build, int]:
    vocab = ["...."] + [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(2000)
    ]
    zeta2, shuffle_seed = 1.6449340668482264, rng.getrandbits(64)

    def build(n: int, pad: int) -> tuple[str, list[str], str]:
        counts = [int(n * (k + 1) ** -2.0 / zeta2) for k in range(len(vocab))]
        for k in range(4, 0, -1):  # the three answers strictly ahead of the fourth word
            counts[k - 1] = max(counts[k - 1], counts[k] + 1)
        words = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
        random.Random(f"{shuffle_seed}:{n}").shuffle(words)
        return FWE_TEMPLATE.format(context=" ".join(words)), vocab[1:4], FWE_PREFIX

    return build, 4 * target


def builder(task: str, rng: random.Random, target: int) -> tuple[Build, int]:
    """The sample builder of `task` and the most haystack units it can take."""
    if task in NIAH:
        return _niah(task, rng, target)
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; expected one of {', '.join(TASKS)}")
    return {"vt": _vt, "cwe": _cwe, "fwe": _fwe}[task](rng, target)


# ------------------------------------------------------------------------------ generation
def _largest(fits: Callable[[int], bool], hi: int) -> int:
    """The largest n in [0, hi] with fits(n), assuming fits is monotone (0 if none)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def messages(text: str, gen_prefix: str) -> list[dict]:
    """The chat of one sample: the question, then the answer prefix for the model to continue."""
    return [{"role": "user", "content": text}, {"role": "assistant", "content": gen_prefix}]


def chat_counter(tokenizer) -> Callable[[str, str], int]:
    """Prompt tokens of a sample's chat, with a local Tokenizer."""
    return lambda text, prefix: len(
        tokenizer.encode_chat(messages(text, prefix), continue_final_message=True)
    )


def generate(
    task: str, target: int, index: int, seed: int, count_tokens: Callable[[str, str], int]
) -> Sample:
    """One sample of `task`, filled to the largest length <= target.

    `count_tokens(question, answer_prefix)` is the prompt length of the sample's chat.
    """
    rng = random.Random(f"{seed}:{task}:{target}:{index}")
    build, units = builder(task, rng, target)
    budget = target - MAX_NEW[task]

    def length(n: int, pad: int) -> int:
        text, _, prefix = build(n, pad)
        return count_tokens(text, prefix)

    if length(0, 0) > budget:
        raise ValueError(f"{task}: the empty prompt alone needs more than {target} tokens")
    hi = 1
    while hi < units and length(hi, 0) <= budget:
        hi = min(2 * hi, units)
    n = _largest(lambda k: length(k, 0) <= budget, hi)
    padded = NIAH.get(task, ("",))[0] == "needle"
    pad = _largest(lambda k: length(n, k) <= budget, 400) if padded else 0
    text, answers, prefix = build(n, pad)
    length, extra = count_tokens(text, prefix) + MAX_NEW[task], {"units": n, "pad": pad}
    return Sample(task, index, target, length, text, prefix, list(answers), MAX_NEW[task], extra)


def string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER's metric for one sample: the share of answers found in the prediction."""
    pred = re.sub(r"[\x00-\x1f]", "\n", prediction).strip().lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


# ------------------------------------------------------------------------------ the run
def run(ep, tasks: list[str], lengths: list[int], *, limit: int, seed: int = 0, progress=True):
    """Generate and ask every sample; returns ({task: {length: summary}}, per-sample rows)."""
    import sys

    from tqdm import tqdm

    from . import EvalError

    for length in lengths:
        if ep.max_len and length > ep.max_len:
            raise EvalError(f"--lengths {length}: longer than the model's context ({ep.max_len})")
    count = chat_counter(ep.tokenizer) if ep.tokenizer is not None else ep.count_chat_tokens
    client, results, rows = ep.client(), {}, []
    total = len(tasks) * len(lengths) * limit
    bar = tqdm(total=total, disable=not progress, file=sys.stderr, desc="RULER")
    for task in tasks:
        for length in lengths:
            scores = []
            for i in range(limit):
                try:
                    s = generate(task, length, i, seed, count)
                except ValueError as e:
                    raise EvalError(str(e)) from None
                chat = messages(s.input, s.gen_prefix)
                r = client.chat.completions.create(
                    model=ep.model, messages=chat, max_tokens=s.max_new_tokens, temperature=0.0
                )
                pred = r.choices[0].message.content or ""
                scores.append(string_match_all(pred, s.answers))
                row = {"task": task, "target": length, "index": i, "length": s.length}
                rows.append({**row, "answers": s.answers, "prediction": pred, "score": scores[-1]})
                bar.set_postfix_str(f"{task}@{length}: {100 * sum(scores) / len(scores):.1f}")
                bar.update()
            lens = [r["length"] for r in rows[-limit:]]
            mean = 100 * sum(scores) / len(scores)
            summary = {"score": mean, "min_length": min(lens), "max_length": max(lens)}
            results.setdefault(task, {})[str(length)] = {**summary, "samples": len(scores)}
    bar.close()
    return results, rows


def table(results: dict, lengths: list[int]) -> tuple[list[str], list[list]]:
    """Headers and rows shaped like the card's long-context table."""
    headers = ["Task", *[f"{n:,} tokens" for n in lengths], "Effective samples", "Setting"]
    setting = "expresslane ruler, chat, greedy"
    rows = []
    for task, by_len in results.items():
        scores = [f"{by_len[str(x)]['score']:.2f}" for x in lengths]
        rows.append([TITLES[task], *scores, min(v["samples"] for v in by_len.values()), setting])
    return headers, rows
