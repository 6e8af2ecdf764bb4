"""A small text corpus generated on the spot (no download) and next-character training windows.

The corpus is made of sentences drawn from a tiny grammar with a fixed seed: it has enough structure
(words, agreement, punctuation) for the loss to fall visibly within a few hundred steps on a CPU.
"""

from __future__ import annotations

import random

import torch
from torch.utils.data import Dataset

_SUBJECTS = ("the cat", "a dog", "my friend", "the old sailor", "every child", "the engineer", "a small bird")
_VERBS = ("sees", "likes", "follows", "builds", "paints", "remembers", "finds")
_OBJECTS = ("the river", "a red house", "the long road", "some bread", "the quiet town", "a paper boat")
_ENDINGS = ("today", "at night", "in the rain", "with care", "again", "before dawn")


def make_corpus(num_chars: int, seed: int = 0) -> str:
    """About ``num_chars`` characters of generated English-like text, the same for the same seed."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_chars:
        sentence = (
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}."
        )
        sentence = sentence[0].upper() + sentence[1:] + " "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:num_chars]


class CharWindows(Dataset):
    """Byte-level windows: inputs ``text[i:i+T]``, targets shifted by one (``text[i+1:i+T+1]``)."""

    def __init__(self, text: str, seq_len: int) -> None:
        self.data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        self.seq_len = seq_len
        if len(self.data) <= seq_len:
            raise ValueError(f"the corpus has {len(self.data)} bytes, not more than seq_len={seq_len}")

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = self.data[start : start + self.seq_len + 1]
        return window[:-1], window[1:]
