"""FP8 in the tools users train with: the Trainer callback, Accelerate loops (``prepare``), PEFT,
``hf_fp8.compile``, the FP8 state in checkpoints, fine-grained FP8 checkpoints in and out, the NaN guard
and the telemetry.

Imports ``hf_fp8.patching`` and everything below it; nothing below imports from here.
"""
