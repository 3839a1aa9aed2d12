"""`archc serve`: a compiled model behind an OpenAI-compatible HTTP API.

``engine`` gets the model's batch engine (``archc.runtime.batch.BatchEngine``); ``scheduler``
runs it, one loop batching every live request (continuous batching); ``protocol`` reads OpenAI's
requests and writes its answers; ``app`` is the HTTP surface (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``) and ``server`` runs it under
uvicorn; ``metrics`` keeps the Prometheus counters; ``errors`` shapes errors as OpenAI does."""
