"""The demo's text: sentences from a small seeded grammar, generated in code, and its tokens.

The grammar is the project's own: subjects, verbs and places drawn from fixed word lists by a
``random.Random(seed)``, so the same seed gives the same text on every machine, and nothing is
downloaded. Its regularities (agreement of "a"/"an", recurring phrases, sentence shape) are
what a character-level model learns in a few dozen steps, so the loss falls visibly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

__all__ = ["CharCorpus", "generate_text"]

_ADJECTIVES = ("quiet", "bright", "old", "small", "eager", "amber", "careful", "idle", "open")
_NOUNS = ("keeper", "engine", "otter", "lantern", "archive", "river", "owl", "gardener", "clock")
_VERBS = ("copies", "carries", "watches", "streams", "sorts", "mends", "counts", "follows")
_PLACES = ("the harbour", "the long hall", "an empty field", "the upper shelf", "the night market")
_TIMES = ("at dawn", "every evening", "while it rains", "before the bell", "in winter")


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _noun_phrase(rng: random.Random) -> str:
    if rng.random() < 0.5:
        adjective = rng.choice(_ADJECTIVES)
        return f"{_article(adjective)} {adjective} {rng.choice(_NOUNS)}"
    return f"the {rng.choice(_NOUNS)}"


def _sentence(rng: random.Random) -> str:
    subject = _noun_phrase(rng)
    text = f"{subject} {rng.choice(_VERBS)} {_noun_phrase(rng)}"
    if rng.random() < 0.6:
        text += f" in {rng.choice(_PLACES)}"
    if rng.random() < 0.4:
        text += f" {rng.choice(_TIMES)}"
    return text[0].upper() + text[1:] + "."


def generate_text(*, sentences: int, seed: int) -> str:
    """``sentences`` sentences of the grammar, one per line; deterministic in ``seed``."""
    if sentences < 1:
        raise ValueError(f"sentences must be >= 1, got {sentences}")
    rng = random.Random(seed)
    return "\n".join(_sentence(rng) for _ in range(sentences)) + "\n"


@dataclass(frozen=True)
class CharCorpus:
    """A text as character ids, and random training windows over it."""

    text: str
    alphabet: str  # sorted distinct characters; a character's id is its index here
    ids: torch.Tensor  # (len(text),) int64, CPU

    @classmethod
    def build(cls, *, sentences: int = 4000, seed: int = 0) -> CharCorpus:
        """The generated corpus of ``sentences`` sentences (about 45 characters each)."""
        text = generate_text(sentences=sentences, seed=seed)
        alphabet = "".join(sorted(set(text)))
        lookup = {char: index for index, char in enumerate(alphabet)}
        ids = torch.tensor([lookup[char] for char in text], dtype=torch.int64)
        return cls(text=text, alphabet=alphabet, ids=ids)

    @property
    def vocab_size(self) -> int:
        """Distinct characters (the model's vocabulary)."""
        return len(self.alphabet)

    def batch(
        self, generator: torch.Generator, *, batch: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``(batch, seq_len)`` int64: targets are shifted by one."""
        if seq_len + 1 > len(self.ids):
            raise ValueError(
                f"seq_len={seq_len} needs a corpus longer than {len(self.ids)} characters; "
                "lower --seq-len"
            )
        starts = torch.randint(0, len(self.ids) - seq_len - 1, (batch,), generator=generator)
        windows = torch.stack([self.ids[s : s + seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]

    def decode(self, ids: torch.Tensor) -> str:
        """Characters of ``ids`` (any shape, flattened)."""
        return "".join(self.alphabet[i] for i in ids.flatten().tolist())
