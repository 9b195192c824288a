"""The native FP8 modules and their state: ``Fp8Linear`` / ``Fp8Conv1D`` and the MoE experts module,
the scaling state each keeps (``Fp8Scaled``) and reports (``LayerScaling``), frozen weights stored in FP8,
FSDP2's FP8 all-gather of weights, and which modules of a model convert and why (``selection``, with
the recognition of norms).

Imports ``hf_fp8.numerics`` and the top level; nothing here knows of patching, backends or trainers.
"""
