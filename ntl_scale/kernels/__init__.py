"""Optional GPU kernels: per-shard math only (no collectives; nothing from :mod:`ntl_scale.parallel`).

``import ntl_scale`` imports these modules but never Triton: each imports it when a kernel is first
used. :mod:`ntl_scale.parallel` calls them and does the all-reduces around them.
"""
