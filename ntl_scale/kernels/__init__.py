"""Optional GPU kernels. Nothing here is imported by ``import ntl_scale``; each module imports Triton lazily."""
