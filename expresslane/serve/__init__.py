"""The OpenAI-compatible HTTP server and the playground page: `expresslane serve MODEL`.

`create_app(engine, tokenizer, served_model_name, api_key)` builds the FastAPI app;
`attach(app, engine, tokenizer)` completes one created while the model was still loading.
`expresslane.cli.serve.serving(app)` runs one under uvicorn in a thread and yields its URL.
"""

from .server import attach, create_app

__all__ = ["attach", "create_app"]
