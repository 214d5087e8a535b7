"""BERT against transformers' own BertForPreTraining / BertForMaskedLM: logits, every gradient, the
folder in and out (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatrain.engine.config import TransformerConfig
from megatrain.engine.interop.hf import export_model_hf, load_hf_model
from megatrain.engine.interop.hf_mapping_bert import bert_rules
from megatrain.engine.models.bert import BertModel

transformers = pytest.importorskip("transformers")

V, C, T = 100, 32, 16


def hf_config(**kw: object) -> object:
    fields = dict(
        vocab_size=V,
        hidden_size=C,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=T,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        type_vocab_size=2,
    )
    return transformers.BertConfig(**{**fields, **kw})


def ours_config(binary_head: bool = True, post_layernorm: bool = True) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=C,
        num_attention_heads=4,
        num_query_groups=4,
        ffn_hidden_size=64,
        seq_length=T,
        vocab_size=128,
        vocab_size_unpadded=V,
        position_embedding="learned",
        normalization="layernorm",
        activation="gelu",
        add_bias=True,
        tie_embeddings=True,
        norm_eps=1e-12,
        bidirectional=True,
        post_layernorm=post_layernorm,
        num_tokentypes=2,
        binary_head=binary_head,
        gelu_approximate="none",
    )


def copy_from_hf(model: BertModel, hf: torch.nn.Module) -> None:
    theirs = hf.state_dict()
    with torch.no_grad():
        ours = model.state_dict()
        for rule in bert_rules(model.config):
            ours[rule.name].copy_(rule.from_hf(*(theirs[n] for n in rule.hf)))


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (3, T), generator=g)
    types = (torch.arange(T) >= T // 2).long().expand(3, T).contiguous()
    attention = torch.ones(3, T, dtype=torch.long)
    attention[1, 11:] = 0  # a padded row
    masked = torch.rand(3, T, generator=g) < 0.3
    masked[:, 0] = False
    masked &= attention.bool()
    labels = torch.where(masked, torch.randint(0, V, (3, T), generator=g), torch.full_like(tokens, -100))
    return {
        "tokens": tokens,
        "types": types,
        "attention": attention,
        "labels": labels,
        "sop": torch.tensor([0, 1, 1]),
    }


@pytest.fixture(scope="module")
def pair() -> tuple[BertModel, object]:
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(hf_config()).eval()
    model = BertModel(ours_config()).eval()
    copy_from_hf(model, hf)
    return model, hf


def test_logits_equal_transformers_on_real_tokens(pair: tuple[BertModel, object]) -> None:
    model, hf = pair
    b = batch()
    theirs = hf(input_ids=b["tokens"], token_type_ids=b["types"], attention_mask=b["attention"])
    # Padding is a segment of its own: real tokens never attend to it (as transformers' mask).
    ours = model(b["tokens"], segment_ids=1 - b["attention"], token_type_ids=b["types"])
    real = b["attention"].bool()
    got, want = ours.mlm_logits[..., :V][real], theirs.prediction_logits[real]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.class_logits, theirs.seq_relationship_logits, atol=1e-5, rtol=1e-5)
    assert ours.mlm_logits[..., V:].abs().max() < 50  # padding rows exist and are finite


def test_every_gradient_equals_transformers(pair: tuple[BertModel, object]) -> None:
    model, hf = pair
    b = batch()
    model.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    theirs = hf(
        input_ids=b["tokens"],
        token_type_ids=b["types"],
        attention_mask=b["attention"],
        labels=b["labels"],
        next_sentence_label=b["sop"],
    ).loss
    mask = (b["labels"] != -100).float()
    ours = model.loss(
        b["tokens"],
        b["labels"].clamp_min(0),
        mask,
        segment_ids=1 - b["attention"],
        token_type_ids=b["types"],
        binary_labels=b["sop"],
    )
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    ours.backward()
    theirs.backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    for rule in bert_rules(model.config):
        mine = dict(model.named_parameters())[rule.name].grad
        if rule.name == "embed.weight":  # tied: the decoder's gradient is in the embedding's
            mine = mine[:V]
        want = rule.to_hf(mine) if rule.name != "embed.weight" else (mine,)
        for name, g in zip(rule.hf, want, strict=True):
            theirs_g = grads[name][: g.shape[0]]
            if rule.name == "embed.weight":
                # transformers' embedding has padding_idx=pad_token_id (0): a lookup of that row
                # sends it no gradient (Megatron's and ours do); every other row must agree.
                assert (b["tokens"] == 0).any()
                g, theirs_g = g[1:], theirs_g[1:]
            torch.testing.assert_close(g, theirs_g, atol=1e-5, rtol=1e-4)


def test_a_folder_loads_and_exports_back(pair: tuple[BertModel, object], tmp_path: Path) -> None:
    model, hf = pair
    hf.save_pretrained(tmp_path / "theirs")
    loaded, cfg = load_hf_model(tmp_path / "theirs")
    assert (
        isinstance(loaded, BertModel) and cfg.binary_head and cfg.post_layernorm and cfg.num_tokentypes == 2
    )
    b = batch()
    want = model(b["tokens"], token_type_ids=b["types"])
    got = loaded(b["tokens"], token_type_ids=b["types"])
    torch.testing.assert_close(got.mlm_logits[..., :V], want.mlm_logits[..., :V], atol=1e-5, rtol=1e-5)
    export_model_hf(loaded, tmp_path / "ours", dtype=torch.float32)
    back = transformers.BertForPreTraining.from_pretrained(tmp_path / "ours").eval()
    out = back(input_ids=b["tokens"], token_type_ids=b["types"])
    torch.testing.assert_close(out.prediction_logits, want.mlm_logits[..., :V], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.seq_relationship_logits, want.class_logits, atol=1e-5, rtol=1e-5)


def test_a_masked_lm_folder_has_no_binary_head(tmp_path: Path) -> None:
    torch.manual_seed(1)
    hf = transformers.BertForMaskedLM(hf_config()).eval()
    hf.save_pretrained(tmp_path)
    model, cfg = load_hf_model(tmp_path)
    assert not cfg.binary_head and model.heads.pooler is None
    tokens = torch.randint(0, V, (2, T))
    out = model(tokens)
    assert out.class_logits is None
    torch.testing.assert_close(out.mlm_logits[..., :V], hf(input_ids=tokens).logits, atol=1e-5, rtol=1e-5)


def test_pre_norm_bert_has_no_hugging_face_layout(tmp_path: Path) -> None:
    model = BertModel(ours_config(post_layernorm=False))
    assert "final_norm.weight" in model.state_dict() and "embed_norm.weight" not in model.state_dict()
    with pytest.raises(ValueError, match="post_layernorm"):
        export_model_hf(model, tmp_path)


def test_attention_is_bidirectional_and_stays_in_its_segment() -> None:
    torch.manual_seed(2)
    model = BertModel(ours_config()).eval()
    tokens = torch.randint(0, V, (1, T))
    base = model.hidden_states(tokens)
    later = tokens.clone()
    later[0, -1] = (later[0, -1] + 1) % V
    # A change at the last position reaches the first (bidirectional) ...
    assert (model.hidden_states(later)[0, 0] - base[0, 0]).abs().max() > 1e-4
    # ... but not across a segment boundary.
    seg = (torch.arange(T) >= T // 2).long()[None]
    a, b = model.hidden_states(tokens, segment_ids=seg), model.hidden_states(later, segment_ids=seg)
    torch.testing.assert_close(a[0, : T // 2], b[0, : T // 2])


def test_a_sequence_classifier_loads_and_exports_as_transformers_does(tmp_path: Path) -> None:
    torch.manual_seed(4)
    hf = transformers.BertForSequenceClassification(hf_config(num_labels=3)).eval()
    hf.save_pretrained(tmp_path / "theirs")
    model, cfg = load_hf_model(tmp_path / "theirs")
    assert not cfg.masked_lm and cfg.num_classes == 3 and model.heads.lm_transform is None
    b = batch()
    want = hf(input_ids=b["tokens"], token_type_ids=b["types"], attention_mask=b["attention"]).logits
    got = model(b["tokens"], segment_ids=1 - b["attention"], token_type_ids=b["types"])
    assert got.mlm_logits is None
    torch.testing.assert_close(got.class_logits, want, atol=1e-5, rtol=1e-5)
    export_model_hf(model, tmp_path / "ours", dtype=torch.float32)
    back = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "ours").eval()
    again = back(input_ids=b["tokens"], token_type_ids=b["types"], attention_mask=b["attention"]).logits
    torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5)


def test_a_classifier_starts_its_head_fresh_from_a_pretrained_folder(
    pair: tuple[BertModel, object], tmp_path: Path
) -> None:
    """A pre-training checkpoint holds no classifier: it starts from the seeded initial values (as
    transformers' from_pretrained starts one), the encoder and pooler from the folder."""
    import dataclasses

    _, hf = pair
    hf.save_pretrained(tmp_path)
    cfg = dataclasses.replace(ours_config(), masked_lm=False, num_classes=4)
    from megatrain.engine.interop.hf import load_hf_state
    from megatrain.engine.interop.hf_slices import hf_slices
    from megatrain.engine.materialize import MissingTensor

    state = load_hf_state(tmp_path, cfg)
    assert "heads.classifier.weight" not in state and "heads.pooler.weight" in state
    assert not any(k.startswith("heads.lm_") for k in state)
    with hf_slices(tmp_path, cfg) as weights:
        box = torch.empty(4, C)
        with pytest.raises(MissingTensor):
            weights.fill("heads.classifier.weight", (4, C), (0, 0), box)
        weights.fill("heads.pooler.weight", (C, C), (0, 0), torch.empty(C, C))


def test_a_bare_encoder_folder_loads_and_exports_as_one(tmp_path: Path) -> None:
    """transformers' BertModel (sentence-transformers' encoders): tensors without the "bert."
    prefix and no pre-training heads; its pooler is left unused."""
    torch.manual_seed(5)
    hf = transformers.BertModel(hf_config()).eval()
    hf.save_pretrained(tmp_path / "theirs")
    model, cfg = load_hf_model(tmp_path / "theirs")
    assert not cfg.masked_lm and not cfg.binary_head
    b = batch()
    want = hf(
        input_ids=b["tokens"], token_type_ids=b["types"], attention_mask=b["attention"]
    ).last_hidden_state
    got = model.hidden_states(b["tokens"], segment_ids=1 - b["attention"], token_type_ids=b["types"])
    real = b["attention"].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    export_model_hf(model, tmp_path / "ours", dtype=torch.float32)
    back = transformers.BertModel.from_pretrained(tmp_path / "ours", add_pooling_layer=False).eval()
    again = back(input_ids=b["tokens"], token_type_ids=b["types"]).last_hidden_state
    torch.testing.assert_close(
        again, model.hidden_states(b["tokens"], token_type_ids=b["types"]), atol=1e-5, rtol=1e-5
    )


def test_blended_bert_batches_keep_their_types_and_sentence_order_labels() -> None:
    import numpy as np

    from megatrain.engine.data.batch import Batch
    from megatrain.engine.data.gpt_dataset import concat_batches

    def part(k: int) -> Batch:
        ones = np.full((1, 4), k, dtype=np.int64)
        return Batch(tokens=ones, labels=ones, token_type_ids=ones % 2, binary_labels=np.array([k % 2]))

    both = concat_batches([part(1), part(2)])
    assert both.token_type_ids is not None and both.token_type_ids[:, 0].tolist() == [1, 0]
    assert both.binary_labels is not None and both.binary_labels.tolist() == [1, 0]
