"""Tokenising a client's text in the conductor without holding the GIL.

``tokenizers.Tokenizer.encode`` holds the GIL for the whole call (a 190,000-character prompt:
~0.1 s in which the conductor's event loop, hence every request's routing, stands still, even
from a worker thread); ``encode_batch`` releases it. The conductor reads long requests on a
worker thread (``Model.heavy_prompt``, ``conductor/server.py``), so there this keeps the loop
running. Short texts take ``encode`` (no batch overhead).
"""

from __future__ import annotations

from typing import Any

#: texts of more characters go through ``encode_batch`` (the GIL released)
BATCH_FROM_CHARS = 1024


def encode_ids(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    if len(text) < BATCH_FROM_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
