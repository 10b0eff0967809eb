"""The daemon (the ``server`` extra): an OpenAI-compatible HTTP front of one pool.

``app`` builds the FastAPI app and its route table (``state`` holds what its routes
share, and the route modules import it, never ``app``); each API family is a module or
package of its own (``openai`` for completions and chat, ``tokenize``); ``http`` is the
machinery they share; ``guard`` and ``fair_share`` admit connections and requests;
``errors`` turns the pool's typed errors into HTTP answers; ``metrics`` is ``/metrics``.
The server imports the pool, never the reverse.
"""

from modelpool.server.app import api_key_from_env, create_app
from modelpool.server.draining import DrainingServer

__all__ = ["DrainingServer", "api_key_from_env", "create_app"]
