"""Weight formats and packing: fp32, bf16, fp16, int8 and GGUF blocks with their dequantized
reference (`quant.py`); packing a loaded model's weights for decode (`packing.py`)."""
