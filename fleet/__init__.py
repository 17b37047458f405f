"""fleet: elastic, memory-budgeted personalization of neural networks on edge devices."""

__version__ = "0.1.0"
