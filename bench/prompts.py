"""Deterministic chat prompts of varied lengths for benchmarks (no data files needed)."""

from __future__ import annotations

import json
import random
from pathlib import Path

_TOPICS = [
    "the water cycle",
    "photosynthesis",
    "black holes",
    "the French Revolution",
    "compound interest",
    "how vaccines work",
    "the history of the printing press",
    "plate tectonics",
    "machine learning",
    "the rules of chess",
    "how bread rises",
    "the Roman Empire",
    "electric cars",
    "honey bees",
    "the immune system",
    "volcanoes",
    "the stock market",
    "climate change",
    "the human heart",
    "how airplanes fly",
    "the Great Wall of China",
    "recycling",
    "the solar system",
    "DNA",
]
_ASKS = [
    "Explain {t} to a ten-year-old.",
    "Write three short bullet points about {t}.",
    "What is the most surprising fact about {t}? Answer briefly.",
    "Give me a one-paragraph summary of {t}, then one question a student might ask about it.",
    "I am preparing a short class presentation about {t}. Suggest an outline with four parts, "
    "a catchy title, and one sentence describing what each part should cover so that the "
    "audience stays interested from start to finish.",
    "Compare {t} with something from everyday life and explain the comparison step by step.",
]
_SYSTEMS = [
    None,
    "You are a concise assistant.",
    "You are a patient teacher who uses simple words.",
]


def chat_prompts(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` conversations (lists of messages) with a spread of lengths."""
    rng = random.Random(seed)
    convs = []
    for i in range(n):
        topic = _TOPICS[i % len(_TOPICS)]
        msgs = []
        system = rng.choice(_SYSTEMS)
        if system:
            msgs.append({"role": "system", "content": system})
        msgs.append({"role": "user", "content": rng.choice(_ASKS).format(t=topic)})
        convs.append(msgs)
    return convs


def write_chat_jsonl(path: Path, convs: list[list[dict[str, str]]]) -> Path:
    """``convs`` as a job's JSONL input: one ``{"id": "p000000", "messages": [...]}`` a line."""
    with path.open("w") as f:
        for i, conv in enumerate(convs):
            f.write(json.dumps({"id": f"p{i:06d}", "messages": conv}) + "\n")
    return path
