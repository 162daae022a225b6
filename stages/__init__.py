"""What each worker does: processor, encode, prefill, decode; media loaders;
model families; the engine. Nothing here imports NATS or NIXL."""
