"""Patching a model: the walk that converts its modules and its undo (``patch``), what a patched model
carries (``patch_state``), the hooks around its forward (``forward_hooks``), padding to 16, and when an
FP8 step ends (``step``).

Imports ``hf_fp8.backends`` (which build the FP8 modules), ``hf_fp8.layers``, ``hf_fp8.numerics`` and
the top level.
"""
