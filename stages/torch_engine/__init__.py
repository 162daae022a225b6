"""The built-in engine: a checkpoint's Hugging Face model class run on torch
(CPU or CUDA), behind the ``HopEngine`` interface.

- ``hop_engine``: ``TorchHopEngine``, the engine as a hop sees it;
- ``engine``: ``TorchEngine``, encode / prefill / decode calls on the model,
  with ``sequence`` (a sequence and its KV cache), ``slots`` (which
  sequence runs in which row of the batch decoder and holds which blocks;
  growth and preemption), ``block_pool`` (the free blocks), ``sampling``
  (token selection), ``prefill_together`` (several prompts in one padded
  forward), ``metrics`` (the pool's);
- ``batch_decoder``: every running sequence in one forward over a paged KV
  cache; ``fused_decode`` and ``decode_attention``: its fused layer step
  and attention; ``kernels``: the Triton kernels;
- ``scheduler``: the engine thread and the continuous-batching decode loop;
  ``call_batcher`` and ``encode_batcher``: several requests in one call;
- ``settings``: ``DecodeSettings``, plain data read by the CLI and bridge;
- ``reference``: plain ``generate()``, the reference tests and benchmarks
  hold the engines to.

This package re-exports nothing, so that importing ``settings`` (or
``scheduler``) does not import torch; the modules that run the model do.
"""
