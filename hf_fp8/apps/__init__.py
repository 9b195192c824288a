"""What runs as a program: the ``hf-fp8`` command line (``cli``), the demo and its report, and the real
model and text it uses, from PyPI packages (``assets``).

The top of the house: may import any package of hf-fp8; nothing in hf-fp8 imports from here.
"""
