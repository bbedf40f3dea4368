"""Storage layout, quantizers and attention kernels over the packed KV cache.

``layout`` fixes the packed format; ``reference`` holds one pure-PyTorch reference per
kernel (shared by tests and benchmarks); the ``torch`` and ``triton`` backends implement
the same functions over the same layout.
"""
