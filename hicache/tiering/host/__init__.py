"""The host tier (L2): pages between device and host memory. Backups (device -> host), load-back
(host -> device by each pool's hit rule), host eviction, the extra pools' host copies on nodes
and the reads a hit rule asks for (``pool.py``), and the peek at the device and host hits. It
imports only ``common/``; ``l3/`` builds on it (host pages are what L3 writes and fills).
"""
