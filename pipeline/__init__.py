"""How messages move: NATS JetStream, the worker runtime, reply streams, the
bridge, configuration, the CLI, logging, metrics, the embedded nats-server."""
