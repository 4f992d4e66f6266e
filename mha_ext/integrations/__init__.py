"""Adapters that put mha_ext's kernels behind other libraries' attention interfaces."""
