"""Patching a model: the walk that converts its modules and its undo (``patch``), what a patched model
carries (``patch_state``), the hooks around its forward (``forward_hooks``), padding to 16, when an FP8
step ends (``step``), and models sharded before patching: by tensor parallelism (``tensor_parallel``),
FSDP2 (``fsdp_first``) or DeepSpeed ZeRO (``zero``).

Imports ``hf_fp8.backends`` (which build the FP8 modules), ``hf_fp8.layers``, ``hf_fp8.numerics`` and
the top level.
"""
