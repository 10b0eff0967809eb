"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/tags``...),
translated onto the daemon's paths: ``request`` turns a chat or generate body into the
chat or completion body that ``core.generation_body`` reads, ``answer`` writes Ollama's NDJSON
lines and objects with their measured durations, ``api`` puts both on the generation
walk (load and unload requests included), ``models`` says what ``/api/tags``, ``/api/ps``
and ``/api/show`` list, and ``routes`` wires them. Errors on these routes have Ollama's
shape, ``{"error": "..."}`` (``server.errors.error_response``)."""
