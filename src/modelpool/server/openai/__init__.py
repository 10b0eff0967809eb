"""OpenAI's completions and chat completions: ``request`` parses a body into a
:class:`~modelpool.server.openai.format.Job`, ``format`` builds the answer from the pool's
results, ``stream`` sends it as server-sent events."""
