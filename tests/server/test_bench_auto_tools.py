"""bench/auto_tools.py's request against a real uvicorn: an `auto` answer's figures, each call
it returns valid against its tool's schema; its main exits 2 on bad arguments."""

from __future__ import annotations

from serverkit import NAME

from expresslane.bench import auto_tools


def test_an_auto_request_reports_its_answer(server):
    rows = [auto_tools.ask(server.url, q, 24, 0.9, seed, model=NAME)
            for q in auto_tools.ASKS[:2] for seed in range(2)]  # fmt: skip
    for r in rows:
        assert r["tps"] > 0 and 1 <= r["tokens"] <= 24 and len(r["hash"]) == 12
        assert r["valid"] and r["finish"] in ("stop", "length", "tool_calls")
        assert r["calls"] == 0 or r["opened"]


def test_bad_arguments_exit_2(capsys):
    assert auto_tools.main(["--max-tokens", "0"]) == 2
    assert "--max-tokens" in capsys.readouterr().err


def test_a_convention_gets_its_template_and_parser(tmp_path):
    """--convention mistral|llama3: a template that renders the tools and asks for that
    convention's calls, read as that convention (serve/tools.py), and its parser named."""
    from expresslane.serve.tools import plan_tools
    from expresslane.tokenizer.chat import _compile_template, chat_template_from

    assert auto_tools.serve_flags("hermes", str(tmp_path)) == ()
    for convention, parser in auto_tools.PARSER.items():
        flags = auto_tools.serve_flags(convention, str(tmp_path))
        assert flags[2:] == ("--tool-call-parser", parser)
        template = chat_template_from(flags[1])  # as serve reads it
        text = _compile_template(template).render(
            messages=[{"role": "user", "content": "hi"}],
            tools=auto_tools.TOOLS,
            add_generation_prompt=True,
        )
        assert "get_weather" in text and text.endswith("<|im_start|>assistant\n")
        plan = plan_tools({"tools": auto_tools.TOOLS}, template, parser)
        assert plan.native and plan.style == convention
    assert auto_tools._opened('  {"name": "x"', "llama3") and not auto_tools._opened(
        "a {", "llama3"
    )
    assert auto_tools._opened("Sure [TOOL_CALLS] [", "mistral")
