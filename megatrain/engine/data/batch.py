"""A micro-batch as the data side hands it to the trainer: numpy arrays, all (B, T).

The contract between the loaders (which build it) and the model and losses (which read it):
- tokens / labels: the inputs and the next tokens (int64);
- loss_mask: 1.0 where a label counts (response tokens of a fine-tune, not padding), else 0.0;
  None means every label counts;
- position_ids: each token's position (restarting at 0 for each packed document); None: 0..T-1;
- segment_ids: tokens attend only to earlier tokens of the same segment (a packed document);
  None: each row is one segment (plain causal attention);
- ref_logps: preference training (B,) float32, each row's reference log-probability summed over
  its loss tokens (rows come in pairs: chosen, rejected); None otherwise;
- token_type_ids: an encoder's (BERT) sentence A / B ids (int64); None: all 0;
- binary_labels: an encoder's (B,) sentence-order labels (int64: 1 when the two sentences were
  swapped); None without a binary head.
An encoder's labels are the original ids of the masked positions and its loss_mask marks them; its
padding is a segment of its own (segment_ids), so real tokens never attend to it.
An encoder-decoder (T5) row: tokens (B, S) are the encoder's input and labels / loss_mask (B, T) the
decoder's targets, with
- dec_tokens: the decoder's input (B, T): the start token, then the targets shifted right;
- enc_mask / dec_mask: 1 on real tokens, 0 on padding (B, S) and (B, T); None otherwise.
The loss of a step is the sum of its loss tokens' losses over the number of loss tokens in the whole
global batch, so packing, masking and micro-batching do not change what a document contributes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray | None = None
    position_ids: np.ndarray | None = None
    segment_ids: np.ndarray | None = None
    ref_logps: np.ndarray | None = None
    token_type_ids: np.ndarray | None = None
    binary_labels: np.ndarray | None = None
    dec_tokens: np.ndarray | None = None
    enc_mask: np.ndarray | None = None
    dec_mask: np.ndarray | None = None

    @classmethod
    def from_windows(cls, windows: np.ndarray) -> Batch:
        """(B, T+1) token windows: inputs are the first T, labels the last T."""
        windows = np.asarray(windows, dtype=np.int64)
        return cls(tokens=windows[:, :-1], labels=windows[:, 1:])

    @property
    def num_loss_tokens(self) -> int:
        if self.loss_mask is None:
            return int(self.labels.size)
        return int(np.count_nonzero(self.loss_mask))
