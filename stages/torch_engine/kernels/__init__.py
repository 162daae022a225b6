"""The built-in engine's Triton kernels: decode attention over the batch
decoder's cache (``triton_decode``) and the decode step's skinny matmuls
(``triton_linear``). A host without Triton still imports both; the kernels
are built on first use."""
