"""OpenAI's Responses API (``/v1/responses``), translated onto the chat path: ``request``
turns a body into the chat body that ``core.generation_body.parse_chat`` reads, ``format``
writes the response object and its streamed events, ``store`` keeps answers for
``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``."""
