"""The official ``openai`` package against the M* gateway's OpenAI-compatible routes.

    pip install openai
    python examples/openai_example.py [--url http://127.0.0.1:8000] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import openai


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway")
    p.add_argument("--out", type=Path, default=None, help="where to write speech.wav (default: a temp dir)")
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp())
    # M* needs no key; the client insists on one.
    # a mesh with API keys (mstar serve --api-keys-file) needs one: $MSTAR_API_KEY; without keys any value works
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=os.environ.get("MSTAR_API_KEY", "unused"), timeout=30,
                           max_retries=0)

    print("models:", ", ".join(m.id for m in client.models.list()))

    reply = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "Hello, World."}],
                                           max_tokens=64)
    print("chat:", reply.choices[0].message.content, "| usage:", reply.usage.total_tokens)

    stream = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "Hello"}],
                                            stream=True, stream_options={"include_usage": True})
    parts = []
    for event in stream:
        if event.choices and event.choices[0].delta.content:
            parts.append(event.choices[0].delta.content)
        if event.usage:
            print("stream usage:", event.usage.completion_tokens)
    print("stream:", "".join(parts))

    speech = client.audio.speech.create(model="toy", input="Hello", voice="default", response_format="wav")
    path = out / "speech.wav"
    path.write_bytes(speech.content)
    print(f"speech: {len(speech.content)} bytes -> {path}")

    try:
        client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "Hi"}], n=2)
    except openai.BadRequestError as e:
        print(f"error: {e.status_code} param={e.param}")


if __name__ == "__main__":
    main()
