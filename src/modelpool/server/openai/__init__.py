"""OpenAI's completions and chat completions: ``api`` puts them on the daemon's generation
walk, their bodies parsed into a :class:`~modelpool.server.core.job.Job` by
``core.generation_body`` (the chat body every generating family reads its own into),
``format`` builds the answer from the pool's results, ``stream`` sends it as server-sent
events. Only the app's wiring imports this package."""
