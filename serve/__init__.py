"""Serving: the default language model (``model``), the decoding engine (``engine``), a transformers logits
processor (``hf``), and the HTTP/MCP discovery endpoint (``server``: a ``service`` whose ``worker`` thread drives
the engines; ``mcp_tools``, ``schema``, ``limits``, ``errors``, ``metrics``)."""
