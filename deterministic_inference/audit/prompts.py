"""Prompts of the audit: fixed targets, and random company generated from a seeded RNG.

Everything here is a pure function of the audit seed, so two audits send the same request contents.
"""

from __future__ import annotations

import random

TARGET_PROMPTS = (
    "Explain in two sentences why the sky looks blue during the day.",
    "Write a short haiku about a lighthouse in the fog.",
    "Once upon a time, in a village at the edge of a great forest,",
)

_WORDS = (
    "river mountain quiet engine paper window garden silver number station bridge winter lantern "
    "music harbor forest letter market signal orange valley pocket thunder candle mirror planet "
    "kitchen ladder meadow copper whisper island shadow feather compass velvet circle morning "
    "anchor basket canyon desert falcon glacier hollow jacket kettle lemon marble needle orchard"
).split()


def random_prompt(rng: random.Random, words: int) -> str:
    """A prompt of `words` random words, ending with a full stop."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(words, 1))).capitalize() + "."


def long_text(seed: int, chars: int) -> str:
    """A deterministic text of at least `chars` characters made of sentences of random words."""
    rng = random.Random(f"detinf-audit-long-text-{seed}")
    sentences: list[str] = []
    length = 0
    while length < chars:
        sentence = random_prompt(rng, rng.randint(6, 14))
        sentences.append(sentence)
        length += len(sentence) + 1
    return " ".join(sentences)
