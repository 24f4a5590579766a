"""The M* Python SDK against a running mesh (``mstar serve toy``), over REST or gRPC.

    python examples/sdk_example.py [--url http://127.0.0.1:8000 | grpc://127.0.0.1:50051] [--out DIR]

A mesh with API keys needs one: ``MStarClient(url, api_key=KEY)``; without it the clients send
$MSTAR_API_KEY when set.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from mstar import AsyncMStarClient, InvalidArgument, MStarClient


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="http(s):// gateway or grpc(s):// conductor")
    p.add_argument("--out", type=Path, default=None, help="where to write speech.wav (default: a temp dir)")
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp())

    with MStarClient(args.url, timeout=30) as client:
        print("health:", client.health().status)
        print("models:", ", ".join(f"{m.name} (outputs: {', '.join(m.outputs)})" for m in client.models()))

        # Streaming: chunks as the model makes them (text, audio, captions, latents...).
        with client.generate("toy", "Hello, World.", stream=True, max_tokens=64) as stream:
            text = "".join(chunk.text for chunk in stream if chunk.name == "text")
        print("streamed text:", text, "| finish:", stream.final.finish_reason)

        # One-shot: a Result with every output folded by name.
        result = client.generate("toy", "abc")
        print("one-shot text:", result.text, "| usage:", result.usage.prompt_tokens, result.usage.completion_tokens)

        # Chat: OpenAI-style messages, the last user message is the prompt.
        reply = client.chat("toy", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
        print("chat:", reply.text)

        # Speech: PCM16 chunks into a WAV at their sample rate.
        speech = client.tts("toy", "Hello")
        path = speech.to_wav(out / "speech.wav")
        print(f"speech: {speech.duration_s:.2f} s at {speech.sample_rate_hz} Hz -> {path}")

        # Errors are typed and name the field at fault.
        try:
            client.generate("toy", "hi", max_tokens=0)
        except InvalidArgument as e:
            print(f"error: {type(e).__name__} field={e.field} status={e.status}")

    async def use_async() -> str:
        async with AsyncMStarClient(args.url, timeout=30) as client:
            return (await client.generate("toy", "async")).text

    print("async:", asyncio.run(use_async()))


if __name__ == "__main__":
    main()
