"""Drives a running `infer up` with the official `openai` Python client.

Usage: python3 openai_client.py BASE_URL   (e.g. http://127.0.0.1:8000/v1)

Prints one JSON object on stdout with what each call returned, for the Rust test in
tests/it/serve.rs to check: a greedy completion, a streamed completion, a streamed chat.
"""

import json
import sys

from openai import OpenAI


def main() -> None:
    client = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    completion = client.completions.create(
        model=model, prompt="1, 2, 3, 4, 5,", max_tokens=16, temperature=0
    )

    streamed_text = ""
    stream_usage = None
    for chunk in client.completions.create(
        model=model,
        prompt="1, 2, 3, 4, 5,",
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            streamed_text += chunk.choices[0].text
        if chunk.usage is not None:
            stream_usage = chunk.usage.model_dump()

    chat_text = ""
    chat_chunks = 0
    finish_reason = None
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=24,
        temperature=0,
        stream=True,
    ):
        chat_chunks += 1
        choice = chunk.choices[0]
        chat_text += choice.delta.content or ""
        finish_reason = choice.finish_reason or finish_reason

    print(
        json.dumps(
            {
                "model": model,
                "completion_text": completion.choices[0].text,
                "completion_usage": completion.usage.model_dump(),
                "streamed_text": streamed_text,
                "stream_usage": stream_usage,
                "chat_text": chat_text,
                "chat_chunks": chat_chunks,
                "chat_finish_reason": finish_reason,
            }
        )
    )


if __name__ == "__main__":
    main()
