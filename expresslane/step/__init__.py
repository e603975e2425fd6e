"""The decode step and its peers: the static step (`graph.py`: CUDA graph or compiled), the fused
GPU kernels' step (`fused.py`), the packed CPU step (`packed.py`, `packed_verify.py`) and its C
kernels' binding (`native.py`), the thread count (`threads.py`)."""
