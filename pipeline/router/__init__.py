"""Cache-aware routing: which worker holds which prompt blocks (from the
KV events workers relay on NATS), where a hop that prefills is sent, and
what goes back to the shared queue when the worker it was sent to does
not take it."""
