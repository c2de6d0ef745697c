"""Designs only a GPU can judge, kept outside the package (not importable as ``ntl_scale.*``): ``lab/README.md``."""
