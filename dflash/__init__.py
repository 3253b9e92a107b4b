"""dflash: an LLM inference server for coding agents."""

__version__ = "0.1.0"
