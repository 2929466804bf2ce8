"""The target's runtime: model loading (``models``), the bundled model, the quantized CPU runtime and its
kernels, quantization, rope, attention and device-to-host transfers."""
