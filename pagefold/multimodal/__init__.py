"""Image inputs: decoding and processing on the engine side (``processor``), the plain-data
description a step message carries (``inputs``), and the runner's per-request encoder cache
and M-RoPE positions (``encoder_cache``)."""
