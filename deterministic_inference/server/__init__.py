"""OpenAI-compatible HTTP server over the engine (FastAPI app factory in `app.py`)."""
