"""Prefill/decode disaggregation: a request's pages travel from a producer engine (it ran the
prefill) to a consumer engine (it decodes), byte-exact, attention pages and state checkpoints
alike, keyed by the prefix cache's hash chain.

``config.py`` is vLLM's ``--kv-transfer-config``; ``wire.py`` the messages (ZMQ multipart
frames, a CRC-32 per page row); ``index.py`` the connector's scheduler side (what a consumer
may load, what a producer exports); ``worker.py`` its worker side (the producer's outbox and
ZMQ server, the consumer's pulls); ``setup.py`` builds both from an engine's config. See
docs/KV_TRANSFER.md.
"""
