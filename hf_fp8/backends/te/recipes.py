"""hf-fp8's recipe as Transformer Engine's (``DelayedScaling``, ``Float8CurrentScaling``,
``Float8BlockScaling``), refusing with the reason what TE cannot do."""

from __future__ import annotations

from hf_fp8.recipe import Fp8Recipe

__all__ = ["to_te_recipe"]


def to_te_recipe(recipe: Fp8Recipe):
    """The Transformer Engine recipe object for ``recipe``; refuses what TE cannot do."""
    from transformer_engine.common.recipe import (
        DelayedScaling,
        Float8BlockScaling,
        Float8CurrentScaling,
        Format,
    )

    if recipe.fp8_all_gather:
        raise ValueError(
            "fp8_all_gather is built for the native backend's FSDP2 path; patch with backend='native', or "
            "leave fp8_all_gather off (TE modules are then all-gathered in their own dtype)"
        )
    if not recipe.forward_in_fp8:
        raise ValueError(
            "forward_in_fp8: false (forwards in high precision, backward GEMMs in FP8) has no Transformer "
            "Engine module; use backend='native', or forward_in_fp8: true"
        )
    if recipe.convert_lm_head == "backward":
        raise ValueError(
            "convert_lm_head: backward (the head's forward GEMM in high precision, its backward in FP8) has "
            "no Transformer Engine module; use backend='native', or convert_lm_head: true / false"
        )
    if recipe.head_scaling is not None:
        raise ValueError(
            f"head_scaling {recipe.head_scaling!r} (the output head scaled unlike the other layers) has no "
            "Transformer Engine recipe; use backend='native', or leave head_scaling unset"
        )
    if recipe.format == "e5m2":
        raise ValueError(
            "format 'e5m2' (E5M2 for every tensor) has no Transformer Engine recipe; use 'hybrid' or 'e4m3', "
            "or backend='native'"
        )
    fp8_format = Format.HYBRID if recipe.format == "hybrid" else Format.E4M3
    if recipe.scaling == "delayed":
        if recipe.interval != 1:
            raise ValueError(
                f"interval={recipe.interval}: Transformer Engine 2 recomputes delayed scales every step and "
                "has no interval; use interval: 1, or backend='native'"
            )
        return DelayedScaling(
            margin=recipe.margin,
            fp8_format=fp8_format,
            amax_history_len=recipe.amax_history_len,
            amax_compute_algo=recipe.amax_compute_algo,
        )
    if recipe.scaling not in ("current", "block"):
        raise ValueError(
            f"scaling {recipe.scaling!r} has no Transformer Engine recipe on Hopper; use backend='native', "
            "or scaling: block / current / delayed"
        )
    if recipe.margin != 0:
        raise ValueError(
            f"margin={recipe.margin}: Transformer Engine's {recipe.scaling} scaling has no margin; use "
            "margin: 0, or scaling: delayed"
        )
    if recipe.scaling == "current":
        return Float8CurrentScaling(fp8_format=fp8_format)
    return Float8BlockScaling()
