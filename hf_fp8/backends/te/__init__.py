"""Transformer Engine backend (:class:`TeBackend`): HF layers -> ``te.Linear`` / ``te.LayerNorm`` /
``te.RMSNorm``, and Llama-family decoder blocks -> ``te.LayerNormLinear`` (input norm + q/k/v) and
``te.LayerNormMLP`` (post-attention norm + gate/up/down with SwiGLU); each forward runs inside
``te.autocast`` with the recipe translated to TE's, the backward outside it.

Transformer Engine is optional: these modules import it only when the backend is used. Weights are
copied exactly; HF ``state_dict`` keys are kept through state-dict hooks (q/k/v split back out of the
fused weight, Conv1D weights transposed back, TE's pickled ``_extra_state`` left out), so a patched
model's ``save_pretrained`` loads into a plain model and a plain checkpoint loads into a patched one.
The delayed-scaling state of each layer (its ``fp8_meta``) is reported by role and saved by
:mod:`hf_fp8.integrations.checkpoint` without pickle.

One concern a file: :mod:`.loading` (importing TE, whether it runs here), :mod:`.recipes` (the recipe
as TE's), :mod:`.layers` (single layers), :mod:`.fused_blocks` (whole decoder blocks),
:mod:`.state_dict` (HF checkpoints), :mod:`.backend` (the class that puts them together).
"""

from hf_fp8.backends.te.backend import TeBackend, recomputes_activations
from hf_fp8.backends.te.loading import load_te, te_usable

__all__ = ["TeBackend", "load_te", "recomputes_activations", "te_usable"]
