"""Storage layout, quantizers and attention kernels over the packed KV cache.

``layout`` fixes the packed format; ``contract`` the :class:`Backend` record of functions
every backend fills in; ``reference`` holds one pure-PyTorch reference per kernel (the
oracle of tests, benchmarks and calibration); ``torch_backend`` (with the fused C++ kernel
of ``cpu_ext``) and the Triton backend (``triton_backend`` over ``triton_quant``,
``triton_attention`` and ``triton_dequant``, imported only when chosen) implement the same
functions over the same layout; ``backend.select`` picks one record per device.
"""
