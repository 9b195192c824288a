"""FP8 backends: ``native`` (PyTorch ``torch._scaled_mm``, CPU and GPU) and, later, Transformer Engine."""
