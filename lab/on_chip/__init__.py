"""The fused linear CE + NTL with the logits kept on chip (Triton kernels and their op): ``lab/README.md``."""
