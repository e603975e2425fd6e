"""serve/tool_stream.py against tools.parse_calls, the parse of the whole answer: every answer
split into pieces every way a stream may bring it gives the same calls and content, a forced
call's arguments stream as they are written, and a call that does not parse is never sent."""

from __future__ import annotations

import json
import random

import pytest

from expresslane.serve.tool_stream import CallStream, JsonEnd, merge_call_deltas
from expresslane.serve.tools import auto_grammar, parse_calls, plan_tools

F = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
     "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}  # fmt: skip
G = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}
TEMPLATES = {"hermes": "", "mistral": "tools [TOOL_CALLS]", "llama3": "tools <|python_tag|>"}

W = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
X = '{"name":"write_file","arguments":{"path":"a\\"}b.txt","text":"x {[\\n] } y"}}'
ANSWERS = {
    "hermes": [
        "Plain text, no call.", "  spaced  \n", "a < b <tool", "Hot <tool_call",
        f"<tool_call>\n{W}\n</tool_call>", f"Let me look.\n<tool_call>\n{W}\n</tool_call>",
        f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{X}\n</tool_call>",
        f"A <tool_call>{W}</tool_call> B", "<tool_call>\n{\"name\": \"nope\"}\n</tool_call>",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci", "<tool_call> not json",
        f"<tool_call>{W}</tool_call>\n<tool_call>\n{{\"name\": \"get_wea",
        f"<tool_call>{W}</tool_call> <tool_call> not json",
    ],
    "mistral": [
        "Just text.", f"[TOOL_CALLS] [{W}]", f"Sure [TOOL_CALLS][{W}, {X}]",
        "[TOOL_CALLS] oops", "[TOOL_CALLS] [{\"name\"",
    ],
    "llama3": [
        "Just text.", W, f"<|python_tag|>{W}", f"{W}; {X}", "{\"name\": \"x\"}",
        "  <|python", "<|not a tag",
    ],
}  # fmt: skip


def plan(style: str, choice="auto"):
    extra = {"tools": [F, G], "tool_choice": choice}
    return plan_tools(extra, template=TEMPLATES[style])


def streamed(p, pieces: list[str]) -> tuple[str, list[dict], list[list[dict]]]:
    """(content, whole calls, the deltas of each piece) of one stream."""
    s, content, calls, per_piece = CallStream(p), [], [], []
    for piece in pieces:
        text, deltas = s.push(piece)
        content.append(text)
        per_piece.append(deltas)
        for d in deltas:  # the openai client's way: a call by its index, arguments appended
            if "id" in d:
                calls.append({"id": d["id"], "name": d["function"]["name"], "arguments": ""})
            calls[d["index"]]["arguments"] += d["function"].get("arguments", "")
    content.append(s.finish())
    return "".join(content), calls, per_piece


def splits(text: str, rng: random.Random):
    yield [text]
    yield list(text)  # a character at a time
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("style", list(ANSWERS))
def test_every_split_gives_the_whole_answers_parse(style):
    p, rng = plan(style), random.Random(0)
    assert p.style == style
    for text in ANSWERS[style]:
        want_content, want = parse_calls(text, p)
        for pieces in splits(text, rng):
            content, calls, _ = streamed(p, pieces)
            got = [(c["name"], json.loads(c["arguments"])) for c in calls]
            assert got == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                           for c in want], (text, pieces)  # fmt: skip
            if want:
                assert content.strip() == (want_content or ""), (text, pieces)
            else:
                assert content == text, (text, pieces)  # the text whole, whitespace too


# answers a free grammar lets through (tools.auto_grammar): text, or calls that parse
HELD = {
    "hermes": ["Plain text.", f"Sure.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>{X}</tool_call>"],
    "mistral": ["Just [text].", f"Sure [TOOL_CALLS] [{W}, {X}]", f"[TOOL_CALLS][{W}]"],
    "llama3": ["Just text {x}.", f"<|python_tag|> {W} ; {X}", f"  {W}"],
}


@pytest.mark.parametrize("style", list(HELD))
def test_calls_held_by_the_free_grammar_stream_as_the_whole_answer_parses(style):
    p, rng = plan(style), random.Random(2)
    p.grammar = auto_grammar(p)
    for text in HELD[style]:
        want_content, want = parse_calls(text, p)
        assert want or "name" not in text
        for pieces in splits(text, rng):
            content, calls, _ = streamed(p, pieces)
            got = [(c["name"], json.loads(c["arguments"])) for c in calls]
            assert got == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                           for c in want], (text, pieces)  # fmt: skip
            assert content.strip() == (want_content or ""), (text, pieces)


# A call sent before the text breaks stays sent; the whole answer's parse makes it all text
# (vLLM's parsers do both the same way)
BROKEN_AFTER_A_CALL = [
    ("hermes", f"<tool_call>\n{W}\n</tool_call><tool_call>{{\"name\": \"no\"}}</tool_call>"),
    ("mistral", f"[TOOL_CALLS] [{W}] trailing"), ("mistral", f"[TOOL_CALLS] [{W}, {{\"name\""),
    ("llama3", f"{W} and text"),
]  # fmt: skip


@pytest.mark.parametrize(("style", "text"), BROKEN_AFTER_A_CALL)
def test_a_call_sent_before_the_text_breaks_stays_sent(style, text):
    p, rng = plan(style), random.Random(1)
    assert parse_calls(text, p)[1] == []
    for pieces in splits(text, rng):
        content, calls, _ = streamed(p, pieces)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris", "days": 2})], pieces  # fmt: skip
        assert content.strip() and content.strip() in text and "Paris" not in content


def test_a_forced_calls_arguments_stream_as_they_are_written():
    p = plan("hermes", {"type": "function", "function": {"name": "write_file"}})
    text = f"<tool_call>\n{X}\n</tool_call>"
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # three characters a token
    content, calls, per_piece = streamed(p, pieces)
    args = json.loads(X)["arguments"]
    assert content == "" and [c["name"] for c in calls] == ["write_file"]
    assert json.loads(calls[0]["arguments"]) == args
    first = next(i for i, d in enumerate(per_piece) if d)
    assert per_piece[first][0]["function"] == {"name": "write_file", "arguments": ""}
    arg_pieces = [d for ds in per_piece for d in ds if d["function"].get("arguments")]
    assert len(arg_pieces) >= len(json.dumps(args)) // 3 - 2  # piece by piece, not at the end
    last = max(i for i, d in enumerate(per_piece) if d)
    assert last < len(pieces) - 3  # nothing waits for `</tool_call>`


def test_a_forced_call_cut_short_stays_as_sent():
    p = plan("hermes", "required")
    content, calls, _ = streamed(p, ['<tool_call>\n{"name":"get_weather","arguments":{"ci'])
    assert content == "" and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == '{"ci'  # finish_reason `length` says why


def test_an_auto_call_is_sent_whole_once_it_closes():
    p = plan("hermes")
    _, calls, per_piece = streamed(p, ["<tool_call>\n", W[:20], W[20:], "\n</tool_call>"])
    assert [len(d) for d in per_piece] == [0, 0, 1, 0]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2}


def test_json_end_reads_strings_and_nesting():
    text = 'x{"a": "}\\"{", "b": [1, {"c": "]"}]} tail'
    scan = JsonEnd(1)
    for n in range(1, len(text)):
        scan.feed(text[:n])
    assert text[1 : scan.end] == text[1 : text.index(" tail")]
    assert json.loads(text[1 : scan.end]) == {"a": '}"{', "b": [1, {"c": "]"}]}


def test_merge_gathers_deltas_into_whole_calls():
    calls: list[dict] = []
    merge_call_deltas(calls, [{"index": 0, "id": "c0", "type": "function",
                               "function": {"name": "f", "arguments": ""}}])  # fmt: skip
    merge_call_deltas(calls, [{"index": 0, "function": {"arguments": '{"a"'}},
                              {"index": 1, "id": "c1", "type": "function",
                               "function": {"name": "g", "arguments": "{}"}}])  # fmt: skip
    merge_call_deltas(calls, [{"index": 0, "function": {"arguments": ": 1}"}}])
    assert calls == [
        {"id": "c0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "c1", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]


def test_responses_events_stream_calls_at_the_indices_of_the_final_output():
    """The Responses API's events from chat chunks with text, two calls in pieces and text after
    them: each item is added and done at the index it holds in the final output, the message
    before the first call, the text after the calls a message of its own."""
    import json as _json

    from expresslane.serve.responses import ResponsesRequest
    from expresslane.serve.responses_out import ResponseEvents, ResponseShape

    events = ResponseEvents(ResponseShape(ResponsesRequest(input="x"), "m", []))
    fn = lambda **f: {"function": f}  # noqa: E731
    chunks = [{"content": "Let me look."},
              {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               **fn(name="get_weather", arguments="")}]},
              {"tool_calls": [{"index": 0, **fn(arguments='{"city": ')}]},
              {"tool_calls": [{"index": 0, **fn(arguments='"Paris"}')}]},
              {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               **fn(name="get_time", arguments="{}")}]},
              {"content": " Done."}]  # fmt: skip
    frames = events.start()
    for d in chunks:
        frames += events.chunk({"delta": d, "finish_reason": None})
    frames += events.chunk({"delta": {}, "finish_reason": "tool_calls"})
    usage = {"prompt_tokens": 1, "completion_tokens": 9, "total_tokens": 10}
    final, closing = events.finish_events(usage, None)
    frames += closing
    data = [_json.loads(f.split("data: ", 1)[1]) for f in frames]
    out = final["output"]
    assert [o["type"] for o in out] == ["message", "function_call", "function_call", "message"]
    assert (
        out[0]["content"][0]["text"] == "Let me look." and out[3]["content"][0]["text"] == " Done."
    )
    assert _json.loads(out[1]["arguments"]) == {"city": "Paris"} and out[2]["arguments"] == "{}"
    for kind in ("response.output_item.added", "response.output_item.done"):
        seen = [(e["output_index"], e["item"]["id"]) for e in data if e["type"] == kind]
        assert seen == [(i, o["id"]) for i, o in enumerate(out)], kind
    pieces = [e["delta"] for e in data if e["type"] == "response.function_call_arguments.delta"]
    assert pieces == ['{"city": ', '"Paris"}', "{}"]
    assert [e["sequence_number"] for e in data] == list(range(len(data)))
