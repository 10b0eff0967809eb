"""A pool serving the embedded chat model, from a plain script.

    python examples/library.py

The first run prepares the model (about 30 s, once); the pool then loads it in a
few seconds and answers. Run by tests/e2e/test_examples.py, shown in the README.
"""

import asyncio

from modelpool import ModelPool, PoolConfig

# A chat model is asked with chat messages, which its chat template renders.
# A string is raw text, continued as it is: a chat model does not answer it.
QUESTION = [{"role": "user", "content": "Name the capital of France."}]


async def ask(pool: ModelPool) -> str:
    # asyncio: cancelling the task that awaits this stops the generation in the worker.
    result = await pool.agenerate(QUESTION, max_new_tokens=32)
    return result.text


def main() -> None:
    config = PoolConfig(model="embedded:smollm2-135m-instruct", workers=1, spares=0)
    with ModelPool(config) as pool:  # returns once the worker has loaded the model
        result = pool.generate(QUESTION, max_new_tokens=32, deadline_s=60)
        print(result.text)
        print(f"{result.completion_tokens} tokens in {result.latency_s:.2f} s")

        for chunk in pool.stream(QUESTION, max_new_tokens=8):  # text as it is generated
            print(chunk, end="", flush=True)
        print()

        # A string is raw text: a completion, here with the likeliest next token's logprob.
        completion = pool.generate("The capital of France is", max_new_tokens=1, logprobs=1)
        first = completion.logprobs[0] if completion.logprobs else None
        print(first.token if first else completion.text)

        print(asyncio.run(ask(pool)))


if __name__ == "__main__":
    main()
