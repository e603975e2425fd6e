"""ExpressLane: a latency-first, batch-1 inference engine for Laneformer (DTP) and Llama models."""

__version__ = "0.1.0"
