"""Serving: a traced graph's pieces built for the first call, the background compile after it,
the sizes learnt from traffic, CUDA graphs, and eager first."""
