"""Triton kernels for the paged INT2 cache: quantize-on-write, split-K decode attention, dequant.

Import the submodules directly (``rotkv.kernels.write``, ``.decode``, ``.dequant``); they need
``triton``. ``rotkv.kernels.reference`` holds their pure-PyTorch references and runs anywhere.
"""
