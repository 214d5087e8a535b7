"""Write the shipped evaluation tasks' items beside this file, deterministically (same bytes every run).

    python examples/eval/make_tasks.py

Both are written for examples/data/corpus.jsonl's sentences ("In the evening, the golden wolf looks
at the meadow, and the cat follows it."), so a model pretrained on that corpus (`megatrain demo`)
scores visibly better than its initial weights, and lm-evaluation-harness can read them with no
network (each task's YAML names its items as a local JSON file):

corpus_mc.jsonl     200 multiple-choice items {"context", "choices", "answer"}: the sentence's ending
                    among three of the same length that break the corpus's pattern (task corpus_mc:
                    acc, acc_norm).
corpus_cloze.jsonl  200 cloze items {"context", "target"}: a sentence up to its last two words,
                    the target " follows it." (task corpus_cloze: acc, perplexity).

Only the standard library; tests/test_examples.py checks that this script reproduces the committed
files.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "data"))
from make_data import ANIMALS, COLOURS, PLACES, TIMES, VERBS  # noqa: E402

SEED = 1
ITEMS = 200
ENDING = "follows it."
# As long as the right ending, byte for byte: a model that has not learnt the corpus gains nothing
# from preferring short continuations (acc sums log-probabilities).
WRONG = ["carries it.", "ignores it.", "watches it.", "repeats it.", "forgets it.", "bothers it.",
         "outruns it."]  # fmt: skip


def _stem(rng: random.Random) -> str:
    a, b = rng.sample(ANIMALS, 2)
    time, colour, verb, place = rng.choice(TIMES), rng.choice(COLOURS), rng.choice(VERBS), rng.choice(PLACES)
    return f"{time}, the {colour} {a} {verb} the {place}, and the {b}"


def _choice_item(rng: random.Random) -> dict[str, object]:
    choices = [ENDING, *rng.sample(WRONG, 3)]
    rng.shuffle(choices)
    return {"context": _stem(rng), "choices": [f" {c}" for c in choices], "answer": choices.index(ENDING)}


def _cloze_item(rng: random.Random) -> dict[str, str]:
    return {"context": _stem(rng), "target": f" {ENDING}"}


def main() -> None:
    rng = random.Random(SEED)
    for name, make in (("corpus_mc.jsonl", _choice_item), ("corpus_cloze.jsonl", _cloze_item)):
        with open(HERE / name, "w") as f:
            for _ in range(ITEMS):
                f.write(json.dumps(make(rng)) + "\n")


if __name__ == "__main__":
    main()
