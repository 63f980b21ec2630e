"""What turns files into weights: the unpackers of quantized checkpoints (AWQ, GPTQ,
compressed-tensors) into `QuantSpec`s, and `quantized.load_quantized` that reads a whole one."""
