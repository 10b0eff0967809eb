"""What every API family of the daemon shares, and no family owns.

``job`` is what a generating request asks of the pool (:class:`~.job.Job`);
``generation_body`` parses OpenAI's chat and completion bodies into one, the form every
generating family reads its own into; ``fields`` holds the field checks every body
parser uses (the pooling and tokenizer routes' too); ``deadline`` a request's deadline;
``cost`` its cost against ``max_request_tokens``; ``served`` the model a request runs on,
resolved once; ``admission`` the admission and trace step every pool-running walk takes.
The families (``openai``, ``responses``, ``anthropic``, ``ollama``, the pooling and
tokenizer routes) import this package, never each other.
"""
