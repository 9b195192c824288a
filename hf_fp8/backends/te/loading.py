"""Loading Transformer Engine, and whether this machine can run its FP8: each with the reason
and the way out when not."""

from __future__ import annotations

import torch

from hf_fp8.formats import gpu_has_fp8

__all__ = ["INSTALL_HINT", "load_te", "te_usable"]

INSTALL_HINT = (
    "install it with `pip install 'hf-fp8[te]'` (Transformer Engine for PyTorch; needs CUDA), or use "
    "backend='native', which needs nothing beyond PyTorch"
)


def load_te():
    """``transformer_engine.pytorch``, or a clear error saying why it cannot be used here."""
    try:
        import transformer_engine.pytorch as te
    except ImportError as err:
        raise ImportError(
            f"backend='te' needs Transformer Engine, which does not import ({err}); {INSTALL_HINT}"
        ) from None
    available, reason = te.is_fp8_available(return_reason=True)
    if not available:
        raise RuntimeError(
            f"backend='te': this machine cannot run Transformer Engine FP8 ({reason}); FP8 GEMMs need a GPU "
            "of compute capability >= 8.9 (Ada, Hopper, Blackwell). backend='native' runs the same FP8 "
            "numerics on any device, without the speed-up"
        )
    return te


def te_usable() -> tuple[bool, str]:
    """Whether ``backend="auto"`` should pick Transformer Engine, and why (not)."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    if not gpu_has_fp8():
        name = torch.cuda.get_device_name()
        return False, f"{name} has compute capability {torch.cuda.get_device_capability()}, FP8 needs >= 8.9"
    try:
        load_te()
    except (ImportError, RuntimeError) as err:
        return False, str(err)
    return True, "Transformer Engine imports and the GPU supports FP8"
