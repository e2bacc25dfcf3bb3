"""Weight-only quantization of decoder weights: codes and scales, and the linears that multiply by them."""
