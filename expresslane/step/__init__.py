"""The decode step and its peers. `protocol.py` says what a step is (S tokens in, (S, V) logits
out, the pick on the device) and holds the reference (the model's forward); the peers are the
packed CPU step (`packed.py`) with its C kernels' binding (`native.py`) and the fused GPU step
(`fused.py`); `choose.py` picks one; `graph.py` runs it on static buffers (`DecodeGraph(step,
width)`: decode, and the verify of speculative decoding); `threads.py` the thread count."""
