"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``), translated
onto the chat path: ``request`` turns a body into the chat body that
``core.generation_body.parse_chat`` reads, ``stream`` writes the message and its streamed
events, ``api`` puts both on the daemon's generation walk. Errors on these routes have
Anthropic's shape (``server.errors.error_response``)."""
