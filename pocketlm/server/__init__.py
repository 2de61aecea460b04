"""`pocket serve`: an OpenAI-compatible local API with continuous batching (see app.py).

Needs the ``serve`` extra (Starlette and uvicorn): ``pip install '.[serve]'`` in pocketlm's
folder.
"""
