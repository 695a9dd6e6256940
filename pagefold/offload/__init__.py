"""Offload tiers for the prefix cache: a host-memory tier and a disk tier below it.

``index.py`` is the connector's scheduler side (what each tier holds, LRU, the step's ops),
``store.py`` its worker side (the host tensors, the disk reads and writes), ``page_file.py``
the on-disk format (one file per page key, a CRC-32 per page row). See docs/OFFLOAD_FORMAT.md.
"""
