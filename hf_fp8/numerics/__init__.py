"""FP8 arithmetic: which scale a cast uses and how amaxes become the next step's scales, the three GEMMs
of a linear layer (tensor-wise, row-wise and block-scaled) and the experts' grouped ones, the CPU's choice
of GEMM call, the amax all-reduce across ranks, and the GPU kernels behind the copies that no compiled
graph reaches.

Works on tensors and the recipe alone; imports nothing of hf-fp8 but the modules at its top level
(``formats``, ``recipe``).
"""
