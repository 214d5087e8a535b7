"""Write wordpiece.json beside this file: a small BERT WordPiece tokenizer (lower-cased, [PAD] [UNK]
[CLS] [SEP] [MASK] as BERT's) trained on corpus.jsonl, for the BERT example
(examples/bert_pretrain.yaml). Needs the `tokenizers` package (the engine extra has it).

    python examples/data/make_wordpiece.py
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def main() -> None:
    texts = [json.loads(line)["text"] for line in (HERE / "corpus.jsonl").read_text().splitlines()]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=128, special_tokens=SPECIALS, min_frequency=1)
    tok.train_from_iterator(texts, trainer)
    (HERE / "wordpiece.json").write_text(tok.to_str(pretty=False) + "\n")


if __name__ == "__main__":
    main()
