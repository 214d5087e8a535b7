"""Write the examples' small data sets beside this file, deterministically (same bytes every run).

    python examples/data/make_data.py

corpus.jsonl  pretraining documents, {"text": ...}: short templated sentences a small byte-level
              model learns to continue within a few hundred steps.
chat.jsonl    fine-tuning chats, {"messages": [{"role", "content"}, ...]}: simple arithmetic,
              spelling, reversal and colour questions with exact answers, so a fine-tune visibly
              learns the task (the loss falls on the assistant turns only).
preferences.jsonl  preference pairs, {"prompt", "chosen", "rejected"}: the same questions, the right
              answer chosen and a wrong one rejected (kind dpo).

Only the standard library; tests/test_examples.py checks that this script reproduces the
committed files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 0
DOCUMENTS = 600
CHATS = 400
PAIRS = 300

ANIMALS = ["cat", "dog", "fox", "owl", "bear", "hare", "wolf", "duck", "goat", "mole"]
COLOURS = ["red", "blue", "green", "brown", "grey", "white", "black", "golden"]
PLACES = ["river", "forest", "garden", "hill", "meadow", "village", "lake", "barn"]
VERBS = ["walks to", "runs past", "sleeps near", "looks at", "hides behind", "swims across"]
TIMES = ["In the morning", "At noon", "In the evening", "At night", "After the rain"]
WORDS = ["apple", "river", "stone", "candle", "garden", "window", "pencil", "rocket", "lemon", "cloud"]
THINGS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "a lemon": "yellow",
          "a tomato": "red", "an orange": "orange", "a crow": "black"}  # fmt: skip


def _document(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(2, 4)):
        a, b = rng.sample(ANIMALS, 2)
        sentences.append(
            f"{rng.choice(TIMES)}, the {rng.choice(COLOURS)} {a} {rng.choice(VERBS)} the "
            f"{rng.choice(PLACES)}, and the {b} follows it."
        )
    return " ".join(sentences)


def _exchange(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        x, y = rng.randint(0, 50), rng.randint(0, 50)
        return f"What is {x} + {y}?", f"{x} + {y} = {x + y}."
    word = rng.choice(WORDS)
    if kind == 1:
        return f"Reverse the word {word}.", f"{word[::-1]}"
    if kind == 2:
        return f"Spell {word} in capitals.", f"{word.upper()}"
    thing = rng.choice(sorted(THINGS))
    return f"What colour is {thing}?", f"{thing[0].upper()}{thing[1:]} is {THINGS[thing]}."


def _chat(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    messages = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": "Answer briefly."})
    for _ in range(rng.randint(1, 2)):
        question, answer = _exchange(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def _preference(rng: random.Random) -> dict[str, str]:
    """A question, its right answer chosen and a plausible wrong one rejected."""
    question, answer = _exchange(rng)
    if "+" in answer:
        total = int(answer.rstrip(".").split("= ")[1])
        wrong = answer.replace(f"= {total}.", f"= {total + rng.choice([-2, -1, 1, 2])}.")
    elif " is " in answer:
        wrong = answer.rsplit(" is ", 1)[0] + f" is {rng.choice([c for c in COLOURS if c not in answer])}."
    else:
        wrong = answer[::-1] if answer[::-1] != answer else answer + answer
    return {"prompt": question, "chosen": answer, "rejected": wrong}


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    rng = random.Random(SEED)
    _write(HERE / "corpus.jsonl", [{"text": _document(rng)} for _ in range(DOCUMENTS)])
    _write(HERE / "chat.jsonl", [_chat(rng) for _ in range(CHATS)])
    # Its own generator: the files above keep their bytes.
    pairs = random.Random(SEED + 1)
    _write(HERE / "preferences.jsonl", [_preference(pairs) for _ in range(PAIRS)])


if __name__ == "__main__":
    main()
