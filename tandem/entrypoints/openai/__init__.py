"""The OpenAI-compatible HTTP server (``tandem serve``): FastAPI + uvicorn over ``AsyncLLM``."""
from tandem.entrypoints.openai.serve import add_serve_args, serve_main

__all__ = ["add_serve_args", "serve_main"]
