"""Ask a running ``modelpool serve`` through the OpenAI client.

    pip install openai                 # not part of modelpool[server]
    modelpool serve &                  # the embedded model on 127.0.0.1:8000
    python examples/openai_client.py

``MODELPOOL_URL`` names another daemon (default http://127.0.0.1:8000/v1); with
``MODELPOOL_API_KEY`` set the daemon wants it, and this sends it.
"""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("MODELPOOL_URL", "http://127.0.0.1:8000/v1"),
    api_key=os.environ.get("MODELPOOL_API_KEY", "unused"),  # the daemon's key, if it has one
)
reply = client.chat.completions.create(
    model="smollm2",  # a daemon serves one model, whatever this says
    messages=[{"role": "user", "content": "Name the capital of France."}],
    max_tokens=32,
)
print(reply.choices[0].message.content)
