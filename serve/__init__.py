"""Serving: the default language model (``model``) with its LoRA adapter merged (``adapter``), the decoding engine
(``engine``, on the shared-prefix ``decoder``), the retrieval pre-filter (``prefilter``, over ``tooltrie.retrieval``),
and the HTTP/MCP discovery endpoint (``server``: a ``service`` whose ``worker`` thread drives the engines; ``access``,
``policy``, ``mcp_tools``, ``schema``, ``limits``, ``errors``, ``metrics``). The Hugging Face and vLLM adapters are in
``tooltrie.integrations``."""

from tooltrie.extras import require_extra

require_extra("model", "torch", "transformers", "jinja2")  # say what to install, before any module of serving fails
