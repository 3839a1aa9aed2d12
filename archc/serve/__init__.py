"""`archc serve`: a compiled model behind an OpenAI-compatible HTTP API.

``engine`` gets the model's batch engine (``archc.runtime.batch.BatchEngine``); ``scheduler``
runs it, one loop batching every live request (continuous batching); ``app`` is the HTTP surface
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``);
``metrics`` keeps the Prometheus counters; ``errors`` shapes errors as OpenAI does."""
