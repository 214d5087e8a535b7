"""T5's pipeline split rank (`parallelism.pipeline_split_rank`, Megatron's
pipeline_model_parallel_split_rank): the first decoder stage. Pure; a layout carries it as its
pipeline_layers (encoder stages first, megatrain.plan.stacks), so the planner's stage costs and the
engine's stages (megatrain.engine.parallel.pipeline_t5) cut the model at the same place.

- Given: resolve_layout turns it into pipeline_layers, the encoder's layers spread over stages
  [0, split) and the decoder's over [split, pp) (stacks.even_counts); pipeline_layers given beside it
  must put the boundary there.
- Not given: the layout's own boundary: where pipeline_layers, else an even split of every layer
  (which stacks' rules require to fall between two stages), put the encoder's end; for stacks of
  equal depth, pp // 2.
"""

from __future__ import annotations

from typing import Any

from megatrain.plan.stacks import even_counts, spec_decoder_layers, stage_layer_range


class SplitError(ValueError):
    """No stage boundary at the encoder's end (a layout the T5 rules refuse)."""


def layout_split_rank(num_layers: int, num_decoder_layers: int, layout: Any) -> int | None:
    """The first decoder stage of `layout` (None for pp = 1): the stage whose first layer, the
    encoder's and decoder's layers numbered end to end, is the decoder's first."""
    pp = layout.pp
    if pp == 1:
        return None
    total = num_layers + num_decoder_layers
    for stage in range(1, pp):
        if stage_layer_range(total, pp, stage, layout.pipeline_layers)[0] == num_layers:
            return stage
    raise SplitError(
        f"no pipeline stage starts at the decoder's first layer ({num_layers} encoder layers, "
        f"pp={pp}, pipeline_layers={layout.pipeline_layers})"
    )


def split_pipeline_layers(spec: Any, par: Any) -> tuple[int, ...] | None:
    """The pipeline_layers a spec's layout takes: parallelism.pipeline_layers as given, or for a
    pipeline_split_rank alone (arch t5, pp > 1, room for it) the encoder's layers over the stages
    before it and the decoder's over the rest; None otherwise (an even split)."""
    if par.pipeline_layers is not None:
        return tuple(par.pipeline_layers)
    split, pp, m = par.pipeline_split_rank, par.pp, spec.model
    if split is None or m.arch != "t5" or not 0 < split < pp:
        return None
    encoder, decoder = m.num_layers, spec_decoder_layers(m)
    if encoder < split or decoder < pp - split:
        return None  # (split_rank_problems says why)
    return (*even_counts(encoder, split), *even_counts(decoder, pp - split))


def split_rank_problems(spec: Any, layout: Any) -> list[dict[str, str]]:
    """The rules parallelism.pipeline_split_rank breaks, each naming it: arch t5 only, pp > 1, a
    stage in [1, pp), each stack at least a layer per stage, and the layout's boundary there."""
    par = spec.parallelism
    split = getattr(par, "pipeline_split_rank", None)  # (parallelism: auto has none)
    if split is None:
        return []
    field, m, pp = "parallelism.pipeline_split_rank", spec.model, layout.pp
    why = None
    if m.arch != "t5":
        why = f"{field} is only for model.arch t5 (its first decoder stage); this is {m.arch}"
    elif pp == 1:
        why = f"{field}={split} needs parallelism.pp > 1 (one stage holds both stacks)"
    elif split >= pp:
        why = f"{field}={split} must be a stage in [1, parallelism.pp={pp}) (the first decoder stage)"
    elif m.num_layers < split or spec_decoder_layers(m) < pp - split:
        why = (
            f"{field}={split} puts the encoder's {m.num_layers} layers on {split} stages and the "
            f"decoder's {spec_decoder_layers(m)} on {pp - split}: every stage needs a layer"
        )
    elif layout.virtual_stages == 1 and layout.pipeline_layers is not None:
        try:
            found = layout_split_rank(m.num_layers, spec_decoder_layers(m), layout)
        except SplitError:
            found = None  # (stacks' rules say why the boundary falls inside a stage)
        if found is not None and found != split:
            why = (
                f"{field}={split} disagrees with parallelism.pipeline_layers="
                f"{list(layout.pipeline_layers)}, whose first decoder stage is {found}"
            )
    return [] if why is None else [{"field": field, "message": why}]
