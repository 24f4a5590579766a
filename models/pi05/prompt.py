"""What π0.5 reads besides images: the robot state, written into the prompt as words.

The state is normalised to [-1, 1] with the checkpoint's statistics, cut into 256 bins
(``digitize`` on linspace(-1, 1, 257)[:-1], minus 1), one bin per state dimension as the robot reports
it, and written ``Task: {task}, State: {bins};\\nAction: ``; the PaliGemma SentencePiece tokenizer
encodes it after a BOS, and it is padded (or cut) to ``max_token_len`` tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mstar.models.tokens import encode_ids

BINS = 256


def discretize(state: np.ndarray) -> np.ndarray:
    """Normalised state -> bin per dimension (a value below -1 gives -1, as the references do)."""
    return np.digitize(state, bins=np.linspace(-1, 1, BINS + 1)[:-1]) - 1


def prompt_text(task: str, bins: np.ndarray) -> str:
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(map(str, bins.tolist()))};\nAction: "


class PromptTokenizer:
    """The checkpoint directory's PaliGemma tokenizer: ``tokenizer.json`` (tokenizers) or
    ``tokenizer.model`` (SentencePiece)."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        fast, spm = directory / "tokenizer.json", directory / "tokenizer.model"
        if fast.is_file():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(fast))
            bos = tok.token_to_id("<bos>")
            if bos is None:
                raise ValueError(f"{fast}: no <bos> token")
            self.bos_id = bos
            self._encode = lambda s: encode_ids(tok, s, add_special_tokens=False)
        elif spm.is_file():
            import sentencepiece

            sp = sentencepiece.SentencePieceProcessor(model_file=str(spm))
            self.bos_id = sp.bos_id()
            self._encode = lambda s: sp.encode(s)
        else:
            raise FileNotFoundError(f"missing file {fast} (or {spm}): the PaliGemma tokenizer")

    def encode(self, text: str) -> list[int]:
        """BOS + the text's tokens."""
        return [self.bos_id, *self._encode(text)]


def pad_tokens(ids: list[int], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, mask) of ``max_len``: padded with 0 after the prompt, or cut to ``max_len`` (as the
    references do)."""
    ids = ids[:max_len]
    tokens = torch.zeros(max_len, dtype=torch.int64)
    tokens[: len(ids)] = torch.tensor(ids, dtype=torch.int64)
    mask = torch.zeros(max_len, dtype=torch.bool)
    mask[: len(ids)] = True
    return tokens, mask
