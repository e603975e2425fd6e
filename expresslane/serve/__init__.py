"""The OpenAI-compatible HTTP server and the playground page: `expresslane serve MODEL`.

`create_app(engine, tokenizer, served_model_name, api_key)` builds the FastAPI app;
`attach(app, engine, tokenizer)` completes one created while the model was still loading.
`expresslane.cli.serve.serving(app)` runs one under uvicorn in a thread and yields its URL.

The server (and so fastapi) is imported on first use of these names, not with the package: the
`serve` command's arguments read `guards.ServeLimits`, and `expresslane bench` on a GPU image
without fastapi builds that parser too.
"""

__all__ = ["attach", "create_app"]


def __getattr__(name: str):
    if name in __all__:
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
