"""Write the T5 examples' data beside this file, deterministically (same bytes every run):

    python examples/data/make_t5_vocab.py

t5_pairs.jsonl     text-to-text pairs, {"input": ..., "target": ...}: short word lists to copy,
                   reverse or sort, so a small T5 fine-tune (examples/t5_finetune.yaml) visibly
                   learns the task (the loss counts the target's tokens only).
t5_wordpiece.json  a small WordPiece tokenizer (lower-cased): every word of corpus.jsonl and the
                   pairs whole, and characters for anything else, with BERT's specials [PAD] [UNK]
                   [CLS] [SEP] [MASK], T5's decoder start and end [BOS] [EOS], and the 100 sentinels
                   <extra_id_0>..<extra_id_99> that Megatron's T5 span corruption replaces masked
                   spans with (engine.data.masking.WordPieceVocab).

Needs the `tokenizers` package (the engine extra has it) for the vocabulary; the pairs are the
standard library's.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 0
PAIRS = 600
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[BOS]", "[EOS]"]
SENTINELS = [f"<extra_id_{i}>" for i in range(100)]
WORDS = ["cat", "dog", "fox", "owl", "bear", "hare", "wolf", "duck", "goat", "mole", "red", "blue",
         "green", "brown", "grey", "white", "river", "forest", "garden", "hill", "meadow"]  # fmt: skip
TASKS = ("copy", "reverse", "sort")


def pair(rng: random.Random) -> dict[str, str]:
    """One task on 3 to 6 words (repeats allowed): its input and its exact target."""
    task = rng.choice(TASKS)
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 6))]
    out = {"copy": words, "reverse": words[::-1], "sort": sorted(words)}[task]
    return {"input": f"{task}: {' '.join(words)}", "target": " ".join(out)}


def write_pairs() -> list[dict[str, str]]:
    rng = random.Random(SEED)
    pairs = [pair(rng) for _ in range(PAIRS)]
    (HERE / "t5_pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return pairs


def write_vocab(pairs: list[dict[str, str]]) -> None:
    """Every word of the texts whole (most frequent first), then every character alone and as a
    continuation (##c) for anything else: a WordPiece vocabulary built, not trained, so that each
    run writes the same bytes (tokenizers' trainer breaks frequency ties in no fixed order)."""
    from collections import Counter

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    texts = [json.loads(line)["text"] for line in (HERE / "corpus.jsonl").read_text().splitlines()]
    texts += [p["input"] for p in pairs] + [p["target"] for p in pairs]
    normalizer, splitter = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    words: Counter[str] = Counter()
    for text in texts:
        words.update(w for w, _ in splitter.pre_tokenize_str(normalizer.normalize_str(text)))
    chars = sorted({c for w in words for c in w})
    pieces = [*SPECIALS, *SENTINELS, *chars, *(f"##{c}" for c in chars)]
    pieces += [w for w, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])) if w not in pieces]
    tok = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, splitter, decoders.WordPiece()
    tok.add_special_tokens(SPECIALS + SENTINELS)
    (HERE / "t5_wordpiece.json").write_text(tok.to_str(pretty=False) + "\n")


def main() -> None:
    write_vocab(write_pairs())


if __name__ == "__main__":
    main()
