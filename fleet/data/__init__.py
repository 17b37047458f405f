"""Data: datasets from local files, device-owned image folders, non-IID partitions, domain shifts."""
