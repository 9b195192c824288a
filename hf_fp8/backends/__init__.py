"""FP8 backends: the interface (:mod:`.base`), one file or package per backend (:mod:`.native`,
:mod:`.te`), and the registry that chooses among them and walks their FP8 layers (:mod:`.registry`).

A backend builds the FP8 modules of a patch and ends its steps. Imports ``hf_fp8.layers``,
``hf_fp8.numerics`` and the top level; the patching above calls it.
"""
