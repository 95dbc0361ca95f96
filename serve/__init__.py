"""Serving: the default language model (``model``), the decoding engine (``engine``) and a transformers
logits processor (``hf``). The HTTP/MCP discovery endpoint is still to come."""
