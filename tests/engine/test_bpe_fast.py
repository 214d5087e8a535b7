"""The tiktoken twin of an HF byte-level BPE file encodes token for token as `tokenizers` does, and
every file it cannot replay exactly keeps the `tokenizers` path."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from megatrain.engine.data import HFTokenizer
from megatrain.engine.data.bpe_fast import fast_encoding

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ALPHABET = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789 .,;:'!?-_\n\t()[]{}äöüéçñ東京データмодельعربى😀\u00a0\r"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>"]


def _texts(rng: random.Random, n: int, words: int) -> list[str]:
    base = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 9))) for _ in range(800)]
    seps = [" ", "", "  ", "\n", "'s ", "'LL ", " 123", "\n\n", "\t", " \u00a0"]
    return ["".join(rng.choice(base) + rng.choice(seps) for _ in range(words)) for _ in range(n)]


def _train(pre: str, ignore_merges: bool = False) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if pre == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1500, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_texts(random.Random(0), 400, 150), trainer)
    return tok.to_str()


@pytest.fixture(scope="module")
def gpt2_json() -> str:
    return _train("gpt2")


def _hf_ids(tokenizer_json: str, texts: list[str], split_special: bool = False) -> list[list[int]]:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(tokenizer_json)
    hf.encode_special_tokens = split_special
    return [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]


@pytest.mark.parametrize(("pre", "ignore_merges"), [("gpt2", False), ("gpt2", True), ("llama3", False)])
def test_the_twin_encodes_as_tokenizers_does(pre: str, ignore_merges: bool) -> None:
    tokenizer_json = _train(pre, ignore_merges)
    fast = fast_encoding(tokenizer_json)
    assert fast is not None
    texts = [t + " <|endoftext|> x<|im_start|>y" for t in _texts(random.Random(1), 300, 120)]
    assert fast.encode_batch(texts) == _hf_ids(tokenizer_json, texts)
    # Some words merge to more than one token: the comparison exercises the merges, not a lookup.
    assert sum(map(len, fast.encode_batch(texts))) < 0.8 * sum(len(t.encode()) for t in texts)


def test_split_special_tokens_encodes_special_text_as_text(gpt2_json: str, tmp_path: Any) -> None:
    texts = ["a <|endoftext|> b", "<|im_start|>user"]
    fast = fast_encoding(gpt2_json, split_special_tokens=True)
    assert fast is not None and fast.encode_batch(texts) == _hf_ids(gpt2_json, texts, split_special=True)
    path = tmp_path / "tokenizer.json"
    path.write_text(gpt2_json)
    tok = HFTokenizer(str(path), split_special_tokens=True)
    assert tok.fast() is not None and tok.encode_batch(texts) == _hf_ids(gpt2_json, texts, split_special=True)
    assert tok.eod not in tok.encode(texts[0])


def _edited(tokenizer_json: str, edit: Any) -> str:
    spec = json.loads(tokenizer_json)
    edit(spec)
    return json.dumps(spec)


def _swap_two_merged_ids(spec: dict[str, Any]) -> None:
    vocab = spec["model"]["vocab"]
    a, b = ("".join(m.split(" ")) if isinstance(m, str) else "".join(m) for m in spec["model"]["merges"][5:7])
    vocab[a], vocab[b] = vocab[b], vocab[a]


REFUSED = {
    "a normalizer": lambda s: s.update(normalizer={"type": "NFKC"}),
    "a prefix space": lambda s: s["pre_tokenizer"].update(add_prefix_space=True),
    "byte fallback": lambda s: s["model"].update(byte_fallback=True),
    "merge ids out of order": _swap_two_merged_ids,
    "an added token with lstrip": lambda s: s["added_tokens"][0].update(lstrip=True),
    "an added token prefixing another": lambda s: s["added_tokens"][1].update(content="<|endoftext|>x"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_files_it_cannot_replay_keep_the_tokenizers_path(gpt2_json: str, name: str, tmp_path: Any) -> None:
    tokenizer_json = _edited(gpt2_json, REFUSED[name])
    assert fast_encoding(tokenizer_json) is None
    path = tmp_path / "tokenizer.json"
    path.write_text(tokenizer_json)
    texts = _texts(random.Random(2), 20, 40)
    tok = HFTokenizer(str(path))
    assert tok.fast() is None and tok.encode_batch(texts) == _hf_ids(tokenizer_json, texts)


def test_a_token_its_own_merges_do_not_make_is_refused() -> None:
    """Merges b+c, a+b, ab+c: HF leaves "abc" as [a, bc] (no a+bc merge); tiktoken, merging by the
    merged token's id, would make [abc]. The whole-vocabulary check catches it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_level))}
    for merged in ("bc", "ab", "abc"):
        vocab[merged] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("b", "c"), ("a", "b"), ("ab", "c")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer_json = tok.to_str()
    assert _hf_ids(tokenizer_json, ["abc"]) == [[vocab["a"], vocab["bc"]]]
    assert fast_encoding(tokenizer_json) is None
