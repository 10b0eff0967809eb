"""The job: what one generating request asks of the pool, whatever its API family.

Every family's parser makes one (``generation_body``, through OpenAI's chat or completion
body); the daemon's walk (``app._generate``) runs one pool request per
:meth:`Job.choices` entry, and the family writes the answer from the results::

    job = Job(prompts=["Hello"], params={"max_new_tokens": 8}, n=2, logprobs=1)
    results = [await pool.agenerate(prompt, **params) for _, prompt, params in job.choices()]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelpool.shared.protocol import Prompt, TokenIds
from modelpool.shared.tools import ToolPlan

# Seeds are kept below 2**63 (what the hf backend takes); n > 1 adds the choice's number.
SEED_LIMIT = 2**63
# Pool requests one HTTP request may start (prompts x best_of): each holds a queue slot.
MAX_CHOICES = 128


@dataclass
class Job:
    """What one completions or chat request asks of the pool.

    ``params`` are the pool kwargs shared by every choice. ``n`` choices are returned per
    prompt; ``best_of`` (>= n, completions only) are generated and the n with the highest
    summed logprob kept. ``logprobs`` is the number of alternatives per token the client
    wants, None for no logprobs; ``echo`` puts the prompt before the completion.
    """

    prompts: list[Prompt]
    params: dict[str, Any]
    n: int = 1
    best_of: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage on every streamed chunk (vLLM's option)
    logprobs: int | None = None
    echo: bool = False
    chat: bool = False
    tools: ToolPlan | None = None
    # Images replaced by a note for a model that reads none (server.images): the answer's
    # x-modelpool-images-omitted header.
    images_omitted: int = 0

    @property
    def runs_per_prompt(self) -> int:
        return max(self.n, self.best_of)

    def choices(self) -> list[tuple[int, Prompt, dict[str, Any]]]:
        """``(run index, prompt, pool kwargs)`` for each pool request, prompt by prompt.

        A request's ``seed`` seeds its first run; run k of a prompt gets ``seed + k``, so
        that n samples differ and the same request gives the same n answers again.
        """
        runs = []
        per_prompt = self.runs_per_prompt
        for prompt_index, prompt in enumerate(self.prompts):
            for number in range(per_prompt):
                params = dict(self.params)
                if number and "seed" in params:
                    params["seed"] = (params["seed"] + number) % SEED_LIMIT
                if self.best_of > self.n and params.get("logprobs") is None:
                    params["logprobs"] = 0  # ranking needs each token's logprob
                if self.echo and isinstance(prompt, TokenIds):
                    # The echoed text of a token-id prompt is its tokens' text.
                    params.setdefault("prompt_logprobs", self.logprobs or 0)
                runs.append((prompt_index * per_prompt + number, prompt, params))
        return runs
