"""Model code: a family is declared once (`family.py`, `families.py`, `registry.py`); the shared decoder is
`llama.py`, sparse MLPs `moe.py`, RoPE `rope.py`, weight formats `linear.py` and `quantized.py`."""
