"""What each worker does: processor, encode, prefill, decode; media loaders;
model families; the engines (torch_engine/, the built-in one, and
vllm_engine/). Nothing here imports NATS or NIXL."""
